"""``sandloop`` command line (typer + rich): one module per command group, no logic of its own.

    common.py   the typer apps, consoles, exit codes, the program rule, result printing
    run.py      run, agent, doctor, reap, languages
    session.py  session create|ls|run|cell|cp|rm
    snapshots.py  session pause|resume|fork|snapshot|snapshots|snapshot-rm|from-snapshot
    shell.py      session shell (an interactive terminal inside), session expose (a port forward)
    serve.py    serve (HTTP API), mcp
    tokens.py   tokens create|ls|revoke
    images.py   images build|name
    templates.py templates build|ls|show|rm|prune

Exit codes: the code's own exit code; 124 when the sandbox killed it for time; 125 when the
sandbox itself failed (no engine, no image, bad arguments); 2 for usage errors.
"""

from __future__ import annotations

import sys

from sandloop.cli import cluster, images, run, serve, session, shell, snapshots, templates, tokens  # noqa: F401 - they register their commands
from sandloop.cli.common import app

__all__ = ["app", "main"]


def main() -> None:
    from pydantic import ValidationError

    from sandloop.cli.common import EXIT_SANDBOX
    from sandloop.contract import SandboxError

    try:
        app()
    except SandboxError as exc:  # e.g. the backend cannot start (no engine, no cluster): no traceback
        print(f"sandloop: {exc}", file=sys.stderr)
        sys.exit(EXIT_SANDBOX)
    except ValidationError as exc:  # SANDLOOP_* read by Settings: say which and what is allowed
        problems = "; ".join(
            f"SANDLOOP_{'_'.join(str(p) for p in e['loc'][:1]).upper()}: {e['msg']}" for e in exc.errors()
        )
        print(f"sandloop: invalid setting: {problems}. See `sandloop --help` and docs/runtimes.md.", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()

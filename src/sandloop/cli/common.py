"""What every command shares: the typer apps, the consoles, exit codes, and how a program and a
result cross the command line (one rule for FILE / stdin / ``-c CODE``)."""

from __future__ import annotations

import json
import os
import shlex
import stat
import sys
from pathlib import Path
from typing import Any

import typer
from rich.console import Console
from rich.markup import escape

from sandloop.contract import ExecutionResult, SandboxError
from sandloop.notes import sandbox_notes

EXIT_TIMEOUT = 124
EXIT_SANDBOX = 125

app = typer.Typer(
    name="sandloop",
    help="Run LLM-written code in throwaway, hardened containers.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
images_app = typer.Typer(
    help="Build and inspect the runtime images (offline: no registry needed).", no_args_is_help=True
)
app.add_typer(images_app, name="images")
session_app = typer.Typer(
    help="Sessions: a persistent /workspace and a stateful Python interpreter.", no_args_is_help=True
)
app.add_typer(session_app, name="session")
tokens_app = typer.Typer(help="Bearer tokens for `sandloop serve` (stored hashed).", no_args_is_help=True)
app.add_typer(tokens_app, name="tokens")
cluster_app = typer.Typer(help="A Ray cluster of sandbox nodes (SANDLOOP_BACKEND=ray).", no_args_is_help=True)
app.add_typer(cluster_app, name="cluster")

err = Console(stderr=True, highlight=False)
out = Console(highlight=False)


def _fail(message: str, code: int = EXIT_SANDBOX) -> typer.Exit:
    err.print(f"[bold red]sandloop:[/] {message}", markup=True, soft_wrap=True)
    return typer.Exit(code)


_EXTENSIONS = {".py": "python", ".js": "node", ".mjs": "node", ".cjs": "node", ".sh": "bash", ".bash": "bash"}


def _program(file: Path | None, code: str | None, language: str | None) -> tuple[str, str, bool]:
    """One rule for every command that takes a program (`run`, `session run`, `session cell`):
    `-c CODE` is inline code; otherwise FILE is read, and '-' or no FILE reads the program from
    stdin. Returns (code, language, whether stdin was used for the program)."""
    if code is not None:
        if file is not None:
            raise _fail("give a FILE or -c CODE, not both", 2)
        return code, language or "python", False
    if file is None or str(file) == "-":
        return sys.stdin.read(), language or "python", True
    if not file.is_file():
        hint = f"; to run inline code, use -c {shlex.quote(str(file))}" if not file.exists() else " (not a file)"
        raise _fail(f"cannot read program {file}{hint}", 2)
    try:
        text = file.read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise _fail(f"cannot read program {file}: {getattr(exc, 'strerror', None) or exc}", 2) from None
    return text, language or _EXTENSIONS.get(file.suffix.lower()) or "python", False


def _program_stdin(input_file: Path | None, stdin_taken: bool) -> bytes | None:
    """The program's stdin: --stdin FILE, else what is piped or redirected into us (never a
    terminal), unless the program itself came from stdin."""
    if input_file is not None:
        try:
            return input_file.read_bytes()
        except OSError as exc:
            raise _fail(f"cannot read {input_file}: {exc.strerror}", 2) from None
    if stdin_taken:
        return None
    try:
        mode = os.fstat(sys.stdin.fileno()).st_mode
    except (OSError, ValueError, AttributeError):
        return None
    if stat.S_ISFIFO(mode) or stat.S_ISREG(mode):
        return sys.stdin.buffer.read()
    return None


_CODE_OPTION = typer.Option("-c", "--code", help="Inline code instead of a FILE (as python -c).")


def _exit_for(result: ExecutionResult) -> typer.Exit:
    """The program's exit code; 124 when the sandbox killed it for time."""
    if result.timed_out:
        return typer.Exit(EXIT_TIMEOUT)
    return typer.Exit(result.exit_code if 0 <= result.exit_code <= 255 else 1)


def _print_result(result: ExecutionResult, as_json: bool) -> None:
    """The program's streams to ours (or the whole result as JSON); the sandbox's notes on stderr."""
    from sandloop.present import result_json, stream_bytes

    if as_json:
        body = result_json(result)
        body.pop("artifacts", None)  # saved as files by `session cell`, not printed
        print(json.dumps(body, indent=2))
        return
    sys.stdout.buffer.write(stream_bytes(result, "stdout"))
    sys.stdout.flush()
    sys.stderr.buffer.write(stream_bytes(result, "stderr"))
    sys.stderr.flush()
    for note in sandbox_notes(result):
        if not note.startswith("the program ran and printed nothing"):
            err.print(f"[yellow]sandloop:[/] {escape(note)}", soft_wrap=True)
    for attempt in result.egress[:20]:  # what the program reached, or tried to
        verdict = "[green]allowed[/]" if attempt.allowed else "[red]refused[/]"
        note = f" - {escape(attempt.note)}" if attempt.note else ""
        err.print(
            f"[dim]sandloop egress:[/] {verdict} {attempt.method} {escape(attempt.host)}:{attempt.port} "
            f"({attempt.bytes_out} B out, {attempt.bytes_in} B in){note}",
            soft_wrap=True,
            markup=True,
            highlight=False,
        )
    if len(result.egress) > 20:
        err.print(f"[dim]sandloop egress:[/] {len(result.egress) - 20} more (--json lists them all)")


SECRET_HELP = (
    "NAME=ENVVAR@host[,host]: the program sees a placeholder in $NAME; the egress proxy sends the value "
    "of your $ENVVAR in its place to those hosts only (which --allow must list). Repeatable."
)


def parse_secrets(specs: list[str] | None) -> dict[str, Any]:
    """``--secret NAME=ENVVAR@host[,host]`` options as ``Secret``s, the values read from this
    process's environment (never from the command line, where ps would show them)."""
    from sandloop.contract.egress import Secret

    out: dict[str, Any] = {}
    for spec in specs or []:
        name, eq, rest = spec.partition("=")
        envvar, at, hosts = rest.partition("@")
        if not (name and eq and envvar and at and hosts):
            raise _fail(
                f"--secret {spec!r}: write NAME=ENVVAR@host[,host], e.g. GITHUB_TOKEN=GH_TOKEN@api.github.com", 2
            )
        value = os.environ.get(envvar)
        if not value:
            raise _fail(f"--secret {name}: the environment variable {envvar} is not set (export it first)", 2)
        try:
            out[name] = Secret(value, hosts=[h for h in hosts.split(",") if h])
        except SandboxError as exc:
            raise _fail(f"--secret {name}: {exc}", 2) from None
    return out

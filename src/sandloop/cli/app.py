"""``sandloop`` command line (typer + rich).

Exit codes: the code's own exit code; 124 when the sandbox killed it for time; 125 when the
sandbox itself failed (no engine, no image, bad arguments); 2 for usage errors.
"""

from __future__ import annotations

import json
import os
import shlex
import stat
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Literal

import typer
from rich.console import Console
from rich.table import Table

from sandloop import languages
from sandloop.contract import ExecutionResult, SandboxError, SandboxLimits
from sandloop.notes import sandbox_notes

if TYPE_CHECKING:
    from sandloop.sessions import Session

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

err = Console(stderr=True, highlight=False)
out = Console(highlight=False)

_EXTENSIONS = {".py": "python", ".js": "node", ".mjs": "node", ".cjs": "node", ".sh": "bash", ".bash": "bash"}


def _fail(message: str, code: int = EXIT_SANDBOX) -> typer.Exit:
    err.print(f"[bold red]sandloop:[/] {message}", markup=True, soft_wrap=True)
    return typer.Exit(code)


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


@app.command()
def run(
    file: Annotated[Path | None, typer.Argument(help="Program to run; '-' or nothing reads it from stdin.")] = None,
    code: Annotated[str | None, _CODE_OPTION] = None,
    language: Annotated[
        str | None,
        typer.Option("-l", "--language", help="python, node, bash (default: from the file extension, else python)."),
    ] = None,
    timeout: Annotated[
        float, typer.Option("-t", "--timeout", help="Wall-clock seconds before the sandbox kills the run.")
    ] = 30,
    memory: Annotated[str, typer.Option("--memory", help="Memory ceiling, e.g. 256m, 1g.")] = "256m",
    cpus: Annotated[float, typer.Option("--cpus", help="CPU share.")] = 0.5,
    network: Annotated[
        bool, typer.Option("--network/--no-network", help="Give the sandbox a network (off by default).")
    ] = False,
    runtime: Annotated[str, typer.Option("--runtime", help="runc, or runsc (gVisor).")] = "runc",
    input_file: Annotated[
        Path | None,
        typer.Option(
            "--stdin",
            help="File whose content is the program's stdin. Without it, what is piped into sandloop is the "
            "program's stdin, unless the program itself came from stdin.",
        ),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the whole result as JSON on stdout.")] = False,
) -> None:
    """Run a program in a fresh sandbox: `sandloop run hello.py`, `echo 'print(6*7)' | sandloop run`."""
    from sandloop.runner import configure, run_code
    from sandloop.settings import Settings

    configure(Settings(pool_size=0))  # one run per process: a warm pool would only cost containers

    source, lang, stdin_taken = _program(file, code, language)
    stdin_data = _program_stdin(input_file, stdin_taken)
    try:
        limits = SandboxLimits(memory=memory, cpus=cpus, network=network, runtime=runtime)
        result = run_code(source, lang, timeout, limits=limits, stdin=stdin_data)
    except SandboxError as exc:
        if as_json:
            print(json.dumps({"code": exc.code, "message": str(exc)}))
        raise _fail(str(exc)) from None
    _print_result(result, as_json)
    raise _exit_for(result)


@app.command()
def doctor(
    smoke: Annotated[bool, typer.Option("--smoke/--no-smoke", help="Also run print(1) on each runtime.")] = True,
) -> None:
    """Check the engine, the runtimes and the images, and say how to fix what is missing."""
    from sandloop.checks import healthy, run_checks
    from sandloop.runner import default_root

    colour = {"ok": "green", "missing": "red", "off": "yellow", "failed": "red"}
    checks = run_checks(default_root(), smoke=smoke)
    table = Table("check", "status", "detail / fix", show_lines=False)
    for c in checks:
        shade = colour[c.status] if c.essential or c.status == "ok" else "yellow"
        table.add_row(c.name, f"[{shade}]{c.status}[/]", c.detail)
    out.print(table)
    raise typer.Exit(0 if healthy(checks) else 1)


@images_app.command("build")
def images_build(
    base: Annotated[
        str | None,
        typer.Option(
            "--from",
            help="Build the Dockerfile from this pullable base (e.g. debian:bookworm-slim) instead of debootstrap.",
        ),
    ] = None,
    force: Annotated[bool, typer.Option("--force", help="Rebuild even if the recipe did not change.")] = False,
) -> None:
    """Build the runtime image (python + numpy/pandas/matplotlib, node, bash). Takes about a minute."""
    from sandloop.images.build import build_runtime

    with err.status("building the runtime image ...") as status:

        def progress(line: str) -> None:
            status.update(line[:110])
            if not line.startswith(("docker build:", "debootstrap:", "pip wheels:")):
                err.print(line)

        try:
            image = build_runtime(base=base, force=force, progress=progress)
        except SandboxError as exc:
            raise _fail(str(exc)) from None
    out.print(image)


@images_app.command("name")
def images_name() -> None:
    """Print the runtime image name this version of sandloop expects."""
    from sandloop.images import runtime_image

    out.print(runtime_image())


@app.command()
def agent(
    task: Annotated[str, typer.Argument(help="What the model should do.")],
    provider: Annotated[
        str, typer.Option("--provider", "-p", help="anthropic or openai (also any OpenAI-compatible server).")
    ] = "anthropic",
    model: Annotated[
        str | None, typer.Option("--model", "-m", help="Model name (default: claude-sonnet-5-5 / gpt-4o).")
    ] = None,
    base_url: Annotated[
        str | None, typer.Option("--base-url", help="Provider endpoint, e.g. http://localhost:11434/v1 for Ollama.")
    ] = None,
    max_iterations: Annotated[
        int, typer.Option("--max-iterations", "-n", help="Most model turns before stopping.")
    ] = 10,
    timeout: Annotated[float, typer.Option("-t", "--timeout", help="Default wall-clock seconds per code run.")] = 30,
    memory: Annotated[str, typer.Option("--memory", help="Memory ceiling per run.")] = "256m",
    runtime: Annotated[str, typer.Option("--runtime", help="runc, or runsc (gVisor).")] = "runc",
    as_json: Annotated[
        bool, typer.Option("--json", help="Print the result (answer, transcript, usage) as JSON.")
    ] = False,
    save: Annotated[
        Path | None, typer.Option("--save", help="Write the transcript as JSON Lines to this file.")
    ] = None,
) -> None:
    """Let a model solve TASK by writing and running code in the sandbox, shown as it happens."""
    from sandloop.agent import run_agent
    from sandloop.agent.providers import DEFAULT_MODELS, PROVIDERS, make_client
    from sandloop.agent.transcript import save_jsonl
    from sandloop.agent.types import ProviderError
    from sandloop.cli.agent_view import AgentView

    if provider not in PROVIDERS:
        raise _fail(f"unknown provider {provider!r}; choose one of: {', '.join(PROVIDERS)}", 2)
    try:
        limits = SandboxLimits(memory=memory, runtime=runtime)
        client = make_client(provider, model or DEFAULT_MODELS[provider], base_url=base_url)
    except (SandboxError, ProviderError) as exc:
        raise _fail(str(exc), 2) from None
    view = None if as_json else AgentView(err)
    try:
        result = run_agent(
            task,
            client,
            max_iterations,
            limits=limits,
            timeout_seconds=timeout,
            on_event=view.on_event if view else None,
        )
    except ProviderError as exc:
        raise _fail(f"the model provider failed: {exc}", 1) from None
    except SandboxError as exc:
        raise _fail(str(exc)) from None
    if save is not None:
        save_jsonl(result.transcript, save)
    if as_json:
        print(json.dumps(result.to_dict(), indent=2, ensure_ascii=False))
    else:
        assert view is not None
        view.finish(result)
    raise typer.Exit(0 if result.stop_reason == "answered" else 3)


@app.command()
def reap(
    dry_run: Annotated[bool, typer.Option("--dry-run", help="Only list what would be removed.")] = False,
) -> None:
    """Remove sandloop containers and volumes that expired or whose owner process is gone, and
    sessions idle past their TTL."""
    from sandloop.runner import default_root

    try:
        report = default_root().reap(dry_run=dry_run)
    except SandboxError as exc:
        raise _fail(str(exc)) from None
    table = Table("kind", "id", "purpose", "owner", "reason")
    for item in report.items:
        table.add_row(item.kind, item.id[:12], item.purpose, item.owner, item.reason)
    for sid in report.expired_sessions:
        table.add_row("session", sid, "session", "", "idle past its ttl")
    found = len(report.items) + len(report.expired_sessions)
    if found:
        out.print(table)
    verb = "would remove" if dry_run else "removed"
    out.print(f"{verb} {found} item(s)")


def _exit_for(result: ExecutionResult) -> typer.Exit:
    """The program's exit code; 124 when the sandbox killed it for time."""
    if result.timed_out:
        return typer.Exit(EXIT_TIMEOUT)
    return typer.Exit(result.exit_code if 0 <= result.exit_code <= 255 else 1)


def _session(session_id: str) -> Session:
    from sandloop.runner import configure
    from sandloop.sessions import Session
    from sandloop.settings import Settings

    configure(Settings(pool_size=0))  # one call per process: a warm pool would only cost containers

    try:
        return Session.attach(session_id)
    except SandboxError as exc:
        raise _fail(str(exc)) from None


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
            err.print(f"[yellow]sandloop:[/] {note}", soft_wrap=True)


@session_app.command("create")
def session_create(
    ttl: Annotated[float, typer.Option("--ttl", help="Idle seconds before the session is removed.")] = 3600,
    quota: Annotated[str, typer.Option("--quota", help="Workspace size cap, e.g. 256m.")] = "256m",
    memory: Annotated[str, typer.Option("--memory", help="Memory ceiling of its sandboxes.")] = "256m",
    runtime: Annotated[str, typer.Option("--runtime", help="runc, or runsc (gVisor).")] = "runc",
) -> None:
    """Create a session and print its id."""
    from sandloop.sessions import Session

    try:
        s = Session.create(SandboxLimits(memory=memory, runtime=runtime), ttl=ttl, quota=quota)
    except SandboxError as exc:
        raise _fail(str(exc)) from None
    s.close()
    out.print(s.id)


@session_app.command("ls")
def session_ls() -> None:
    """List live sessions."""
    import datetime

    from sandloop.sessions import Session

    table = Table("id", "quota", "enforced", "runtime", "idle for", "expires")
    now = datetime.datetime.now().timestamp()
    for r in Session.list():
        expires = datetime.datetime.fromtimestamp(r.expires_at).strftime("%Y-%m-%d %H:%M:%S")
        table.add_row(
            r.id,
            f"{r.quota_bytes >> 20}m",
            str(r.quota_enforced),
            r.limits.get("runtime", "runc"),
            f"{now - r.last_used:.0f}s",
            expires,
        )
    out.print(table)


@session_app.command("run")
def session_run(
    session_id: Annotated[str, typer.Argument(help="Session id.")],
    file: Annotated[Path | None, typer.Argument(help="Program; '-' or nothing reads stdin.")] = None,
    code: Annotated[str | None, _CODE_OPTION] = None,
    language: Annotated[str | None, typer.Option("-l", "--language")] = None,
    timeout: Annotated[float, typer.Option("-t", "--timeout")] = 30,
    input_file: Annotated[
        Path | None, typer.Option("--stdin", help="File whose content is the program's stdin.")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Run a program in a fresh process with the session's workspace as working directory:
    `session run SID script.py`, `session run SID -c 'ls -la' -l bash`."""
    source, lang, stdin_taken = _program(file, code, language)
    stdin_data = _program_stdin(input_file, stdin_taken)
    s = _session(session_id)
    try:
        result = s.run(source, lang, timeout, stdin=stdin_data)
    except SandboxError as exc:
        raise _fail(str(exc)) from None
    finally:
        s.close()
    _print_result(result, as_json)
    raise _exit_for(result)


def _free_path(target: Path) -> Path:
    """``target``, or ``name-2.ext``, ``name-3.ext`` ... if it exists: never overwrite a file."""
    n = 2
    free = target
    while free.exists():
        free = target.with_name(f"{target.stem}-{n}{target.suffix}")
        n += 1
    return free


@session_app.command("cell")
def session_cell(
    session_id: Annotated[str, typer.Argument(help="Session id.")],
    file: Annotated[Path | None, typer.Argument(help="Python file; '-' or nothing reads stdin.")] = None,
    code: Annotated[str | None, _CODE_OPTION] = None,
    timeout: Annotated[float, typer.Option("-t", "--timeout")] = 30,
    artifacts_dir: Annotated[
        Path | None, typer.Option("--artifacts", help="Save charts into this directory (never overwriting).")
    ] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Run a cell in the session's stateful interpreter; prints the last expression's value:
    `session cell SID -c 'df.describe()'`, `session cell SID analysis.py`."""
    source, _, _ = _program(file, code, "python")
    s = _session(session_id)
    try:
        result = s.run_cell(source, timeout)
    except SandboxError as exc:
        raise _fail(str(exc)) from None
    finally:
        s.close()
    _print_result(result, as_json)
    if result.value is not None and not as_json:
        print(result.value)
    for art in result.artifacts:
        if artifacts_dir is None:
            err.print(f"chart {art.name} ({art.mime_type}, {len(art.data)} bytes) not saved: add --artifacts DIR")
            continue
        artifacts_dir.mkdir(parents=True, exist_ok=True)
        target = _free_path(artifacts_dir / Path(art.name).name)
        target.write_bytes(art.data)
        err.print(f"saved {art.name} ({art.mime_type}, {len(art.data)} bytes) to {target}")
    if result.interpreter_restarted:
        err.print("[yellow]sandloop:[/] the interpreter had to be restarted: its variables are gone")
    raise _exit_for(result)


@session_app.command("cp")
def session_cp(
    src: Annotated[str, typer.Argument(help="Local path or SESSION:path.")],
    dst: Annotated[str, typer.Argument(help="Local path or SESSION:path.")],
) -> None:
    """Copy files in or out: `cp data.csv s-123:in/` , `cp s-123:out.png .` (a directory goes as a tree)."""

    def remote(spec: str) -> tuple[str, str] | None:
        head, sep, tail = spec.partition(":")
        return (head, tail or ".") if sep and head.startswith("s-") else None

    r_src, r_dst = remote(src), remote(dst)
    if bool(r_src) == bool(r_dst):
        raise _fail("exactly one of SRC and DST must be SESSION:path", 2)
    try:
        if r_dst:
            s = _session(r_dst[0])
            try:
                local = Path(src)
                if local.is_dir():
                    info = s.upload(local, r_dst[1])
                    out.print(f"uploaded {info['files']} files ({info['bytes']} bytes)")
                else:
                    target = (
                        r_dst[1].rstrip("/") + "/" + local.name
                        if r_dst[1].endswith("/") or r_dst[1] == "."
                        else r_dst[1]
                    )
                    out.print(f"wrote {s.write_file(target, local.read_bytes())} bytes to {s.id}:{target}")
            finally:
                s.close()
        else:
            assert r_src is not None
            s = _session(r_src[0])
            try:
                entries = s.list_files(r_src[1])
                is_file = len(entries) == 1 and entries[0]["type"] == "file" and r_src[1].endswith(entries[0]["name"])
                if is_file:
                    data = s.read_file(r_src[1])
                    dest = Path(dst) / Path(r_src[1]).name if Path(dst).is_dir() else Path(dst)
                    dest.write_bytes(data)
                    out.print(f"wrote {len(data)} bytes to {dest}")
                else:
                    import io
                    import tarfile

                    with tarfile.open(fileobj=io.BytesIO(s.download(r_src[1])), mode="r:gz") as tar:
                        tar.extractall(dst, filter="data")
                    out.print(f"extracted {r_src[1]} into {dst}")
            finally:
                s.close()
    except (SandboxError, OSError) as exc:
        raise _fail(str(exc)) from None


@session_app.command("rm")
def session_rm(session_ids: Annotated[list[str], typer.Argument(help="Session ids.")]) -> None:
    """Delete sessions: their interpreter, containers and workspace."""
    for sid in session_ids:
        _session(sid).delete()
        out.print(f"deleted {sid}")


def _warn_if_exposed(host: str, what: str) -> None:
    import ipaddress

    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        err.print(
            f"[yellow]warning:[/] {what} listens on {host} without TLS: bearer tokens and code cross the network "
            "in clear text. Put it behind a TLS-terminating proxy, or listen on 127.0.0.1."
        )


@app.command()
def serve(
    host: Annotated[str, typer.Option("--host", help="Interface to listen on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="TCP port.")] = 8080,
    provider_url: Annotated[
        list[str] | None,
        typer.Option(
            "--provider-url",
            help="A model endpoint agent runs may use: PROVIDER=URL (no key sent) or PROVIDER=URL;key=ENV_VAR "
            "(the value of $ENV_VAR is sent). Repeatable; the first per provider is its default.",
        ),
    ] = None,
    official_providers: Annotated[
        bool,
        typer.Option(
            "--official-providers/--no-official-providers",
            help="Also list api.anthropic.com and api.openai.com (with ANTHROPIC_API_KEY / OPENAI_API_KEY).",
        ),
    ] = True,
    metrics: Annotated[
        str, typer.Option("--metrics", help="Who may read /metrics: token (a valid token), open, or off.")
    ] = "token",
) -> None:
    """Serve the HTTP API (OpenAPI at /docs). Create a token first: `sandloop tokens create NAME`."""
    try:
        import uvicorn

        from sandloop.server.app import create_app
        from sandloop.server.providers import EndpointConfigError, ProviderEndpoints
    except ImportError:
        raise _fail("the HTTP API needs its extra: pip install 'sandloop[server]'", 2) from None
    if metrics not in ("token", "open", "off"):
        raise _fail("--metrics must be token, open or off", 2)
    try:
        endpoints = ProviderEndpoints(provider_url or [], official=official_providers)
    except EndpointConfigError as exc:
        raise _fail(f"--provider-url {exc}", 2) from None
    from sandloop.runner import shutdown
    from sandloop.server.lifecycle import at_shutdown

    _warn_if_exposed(host, "the HTTP API")
    # The warm pool's sandboxes go when the server stops, not at the next reap.
    access: Literal["token", "open", "off"] = metrics  # type: ignore[assignment]  # checked above
    app_ = at_shutdown(create_app(providers=endpoints, metrics_access=access), shutdown)
    uvicorn.run(app_, host=host, port=port, log_level="info")


@app.command()
def mcp(
    transport: Annotated[str, typer.Option("--transport", help="stdio, or http (streamable HTTP at /mcp).")] = "stdio",
    host: Annotated[str, typer.Option("--host")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port")] = 8765,
    runtime: Annotated[str, typer.Option("--runtime", help="runc, or runsc (gVisor).")] = "runc",
    memory: Annotated[str, typer.Option("--memory")] = "256m",
) -> None:
    """Serve sandloop as MCP tools (run code, sessions, files) for MCP clients.

    Over http every request needs a token (`sandloop tokens create NAME`, sent as
    `Authorization: Bearer ...`); a token sees only its own sessions. stdio trusts the local user.
    """
    try:
        from sandloop.server.mcp_server import create_mcp_server, http_app
    except ImportError:
        raise _fail("the MCP server needs its extra: pip install 'sandloop[mcp]'", 2) from None
    if transport not in ("stdio", "http"):
        raise _fail("--transport must be stdio or http", 2)
    try:
        limits = SandboxLimits(runtime=runtime, memory=memory)
    except SandboxError as exc:
        raise _fail(str(exc), 2) from None
    from sandloop.runner import shutdown

    try:
        if transport == "stdio":
            create_mcp_server(limits).run("stdio")
            return
        import uvicorn

        from sandloop.server.lifecycle import at_shutdown
        from sandloop.server.tokens import TokenStore

        tokens = TokenStore()
        _warn_if_exposed(host, "the MCP server")
        app_ = at_shutdown(http_app(create_mcp_server(limits, tokens), tokens, host=host), shutdown)
        uvicorn.run(app_, host=host, port=port, log_level="info")
    finally:
        shutdown()  # stdio ends by returning; over HTTP the lifespan above already did this


@tokens_app.command("create")
def tokens_create(
    name: Annotated[str, typer.Argument(help="A name to recognise the token by (unique among active tokens).")],
    max_concurrent: Annotated[int, typer.Option(help="Sandbox operations at once.")] = 4,
    runs_per_minute: Annotated[
        int, typer.Option(help="Sandbox operations (runs, cells, file calls) per minute.")
    ] = 120,
    max_memory: Annotated[str, typer.Option(help="Most memory a run may ask for.")] = "1g",
    max_timeout: Annotated[float, typer.Option(help="Longest timeout a run may ask for, in seconds.")] = 300,
    max_sessions: Annotated[int, typer.Option(help="Live sessions at once.")] = 10,
    max_workspace: Annotated[str, typer.Option(help="Total workspace quota of its live sessions.")] = "10g",
    agent_runs_per_day: Annotated[int, typer.Option(help="Agent runs per UTC day.")] = 100,
    agent_tokens_per_day: Annotated[int, typer.Option(help="Model tokens (in + out) per UTC day.")] = 1_000_000,
    agent_max_iterations: Annotated[int, typer.Option(help="Most model turns in one agent run.")] = 20,
    provider_url: Annotated[
        list[str] | None,
        typer.Option("--provider-url", help="Restrict agent runs to these of the server's endpoint URLs (repeatable)."),
    ] = None,
) -> None:
    """Create a token; the secret is printed once."""
    from sandloop.server.providers import normalize_url
    from sandloop.server.tokens import TokenError, TokenStore

    try:
        urls = tuple(normalize_url(u) for u in provider_url or [])
        secret, token = TokenStore().create(
            name,
            max_concurrent=max_concurrent,
            runs_per_minute=runs_per_minute,
            max_memory=max_memory,
            max_timeout=max_timeout,
            max_sessions=max_sessions,
            max_workspace=max_workspace,
            agent_runs_per_day=agent_runs_per_day,
            agent_tokens_per_day=agent_tokens_per_day,
            agent_max_iterations=agent_max_iterations,
            provider_urls=urls,
        )
    except (TokenError, ValueError) as exc:
        raise _fail(str(exc), 2) from None
    err.print(f"created {token.id} ({name}); the secret is shown only now:")
    print(secret)


@tokens_app.command("ls")
def tokens_ls(
    as_json: Annotated[bool, typer.Option("--json", help="One JSON object per token.")] = False,
) -> None:
    """List tokens with their ceilings and today's agent usage (never their secrets)."""
    import dataclasses
    import json

    from sandloop.server.tokens import TokenStore

    store = TokenStore()
    rows = [(t, store.usage(t.id)) for t in store.list()]
    if as_json:
        for t, used in rows:
            print(json.dumps({**dataclasses.asdict(t), "usage_today": dataclasses.asdict(used)}))
        return
    table = Table(
        "id", "name", "state", "ops/min", "at once", "memory", "timeout", "sessions", "workspace", "agent today"
    )
    for t, used in rows:
        table.add_row(
            t.id,
            t.name,
            "revoked" if t.revoked else "active",
            str(t.runs_per_minute),
            str(t.max_concurrent),
            t.max_memory,
            f"{t.max_timeout:g}",
            str(t.max_sessions),
            t.max_workspace,
            f"{used.agent_runs}/{t.agent_runs_per_day} runs, {used.model_tokens}/{t.agent_tokens_per_day} tokens",
        )
    # Ids are what `revoke` takes: never let the terminal's width cut them.
    table.columns[0].no_wrap = True
    table.columns[0].min_width = 16
    out.print(table)


@tokens_app.command("revoke")
def tokens_revoke(token: Annotated[str, typer.Argument(help="The token's id (tok_...) or name.")]) -> None:
    """Revoke a token at once."""
    from sandloop.server.tokens import TokenStore

    revoked = TokenStore().revoke(token)
    if revoked is None:
        raise _fail(f"no active token with id or name {token!r} (see `sandloop tokens ls`)", 1)
    out.print(f"revoked {revoked.id} ({revoked.name})")


@app.command("languages")
def list_languages() -> None:
    """List the registered languages."""
    for name in languages.names():
        lang = languages.get(name)
        out.print(f"{name}\t{' '.join(lang.command)} {lang.file_name}\taliases: {', '.join(lang.aliases) or '-'}")


def main() -> None:
    app()


if __name__ == "__main__":
    main()

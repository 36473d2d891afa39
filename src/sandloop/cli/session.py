"""``sandloop session ...``: sessions from the command line (one call per process, no warm pool)."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from sandloop.cli.common import (
    _CODE_OPTION,
    _OUTPUT_LIMIT_OPTION,
    SECRET_HELP,
    Streamer,
    _exit_for,
    _fail,
    _fail_for,
    _print_result,
    _program,
    _program_stdin,
    err,
    out,
    output_limit_bytes,
    parse_secrets,
    session_app,
)
from sandloop.contract import SandboxError, SandboxLimits

if TYPE_CHECKING:
    from sandloop.sessions import Session
    from sandloop.settings import Settings


def _one_call_settings() -> Settings:
    """One call per process: a warm pool (of sandboxes or of sessions) would only cost containers,
    started for nobody and removed at exit."""
    from sandloop.settings import Settings

    return Settings(pool_size=0, session_pool_size=0)


def _session(session_id: str) -> Session:
    from sandloop.root import configure
    from sandloop.sessions import Session

    configure(_one_call_settings())

    try:
        return Session.attach(session_id)
    except SandboxError as exc:
        raise _fail_for(exc) from None


@session_app.command("create")
def session_create(
    ttl: Annotated[float, typer.Option("--ttl", help="Idle seconds before the session is removed.")] = 3600,
    quota: Annotated[str, typer.Option("--quota", help="Workspace size cap, e.g. 256m.")] = "256m",
    memory: Annotated[str, typer.Option("--memory", help="Memory ceiling of its sandboxes.")] = "256m",
    runtime: Annotated[str, typer.Option("--runtime", help="runc, or runsc (gVisor).")] = "runc",
    allow: Annotated[
        list[str] | None,
        typer.Option("--allow", help="A host its code may reach over HTTP(S), through the egress proxy (repeatable)."),
    ] = None,
    template: Annotated[
        str | None,
        typer.Option("--template", help="Start from this template (name[:tag], see `sandloop templates ls`)."),
    ] = None,
) -> None:
    """Create a session and print its id."""
    from sandloop.root import configure
    from sandloop.sessions import Session

    configure(_one_call_settings())
    try:
        limits = SandboxLimits(memory=memory, runtime=runtime, egress=tuple(allow or ()))
        s = Session.create(limits, ttl=ttl, quota=quota, template=template)
    except SandboxError as exc:
        raise _fail_for(exc) from None
    s.close()
    out.print(s.id)


@session_app.command("ls")
def session_ls() -> None:
    """List live sessions."""
    import datetime

    from sandloop.root import default_root
    from sandloop.sessions import Session

    table = Table("id", "quota", "enforced", "runtime", "idle for", "expires", "state")
    table.columns[0].no_wrap = True  # ids are copied from here
    now = datetime.datetime.now().timestamp()
    store = default_root().sessions
    for r in Session.list():
        paused = store.paused(r.id)
        idle = bool(paused) and store.idle_paused(r.id)
        expires = datetime.datetime.fromtimestamp(r.expires_at).strftime("%Y-%m-%d %H:%M:%S")
        table.add_row(
            r.id,
            f"{r.quota_bytes >> 20}m",
            str(r.quota_enforced),
            r.limits.get("runtime", "runc"),
            f"{now - r.last_used:.0f}s",
            "-" if paused and not idle else expires,  # a caller's pause stops the idle clock
            f"paused ({paused}, idle: resumes on use)" if idle else f"paused ({paused})" if paused else "running",
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
    output_limit: Annotated[str | None, _OUTPUT_LIMIT_OPTION] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Run a program in a fresh process with the session's workspace as working directory:
    `session run SID script.py`, `session run SID -c 'ls -la' -l bash`. Output is written as it arrives."""
    source, lang, stdin_taken = _program(file, code, language)
    stdin_data = _program_stdin(input_file, stdin_taken)
    kept = output_limit_bytes(output_limit)
    streamer = None if as_json else Streamer()
    try:
        with _session(session_id) as s:  # an attached session: `with` only detaches
            limits = None if kept is None else SandboxLimits(**{**s.limits.model_dump(), "output_limit": kept})
            result = s.run(source, lang, timeout, stdin=stdin_data, limits=limits, on_output=streamer)
    except SandboxError as exc:
        raise _fail_for(exc) from None
    _print_result(result, as_json, streamer)
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
    output_limit: Annotated[str | None, _OUTPUT_LIMIT_OPTION] = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
    secret: Annotated[list[str] | None, typer.Option("--secret", help=SECRET_HELP)] = None,
) -> None:
    """Run a cell in the session's stateful interpreter; prints the last expression's value:
    `session cell SID -c 'df.describe()'`, `session cell SID analysis.py`. Output is written as it arrives."""
    source, _, _ = _program(file, code, "python")
    secrets = parse_secrets(secret)
    kept = output_limit_bytes(output_limit)
    streamer = None if as_json else Streamer()
    try:
        with _session(session_id) as s:
            result = s.run_cell(source, timeout, secrets=secrets, on_output=streamer, output_limit=kept)
    except SandboxError as exc:
        raise _fail_for(exc) from None
    _print_result(result, as_json, streamer)
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
            with _session(r_dst[0]) as s:
                local = Path(src)
                # As cp: into a directory (DST ends in '/', or is '.') a file or a tree keeps its
                # name (the way a download keeps it); otherwise DST is its new name.
                into = r_dst[1].endswith("/") or r_dst[1] in (".", "")
                target = r_dst[1].rstrip("/") + "/" + local.resolve().name if into else r_dst[1]
                if local.is_dir():
                    info = s.upload(local, target)
                    out.print(f"uploaded {info['files']} files ({info['bytes']} bytes) to {s.id}:{target}")
                else:
                    out.print(f"wrote {s.write_file(target, local.read_bytes())} bytes to {s.id}:{target}")
        else:
            assert r_src is not None
            with _session(r_src[0]) as s:
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
    except SandboxError as exc:
        raise _fail_for(exc) from None
    except OSError as exc:  # the local side: no such file, no permission
        raise _fail(f"{exc.filename or src}: {exc.strerror or exc}", 1) from None


@session_app.command("rm")
def session_rm(session_ids: Annotated[list[str], typer.Argument(help="Session ids.")]) -> None:
    """Delete sessions: their interpreter, containers and workspace."""
    from sandloop.root import configure

    root = configure(_one_call_settings())
    for sid in session_ids:
        try:  # a paused one is not resumed first; one with a damaged record goes too
            root.delete_session(sid)
        except SandboxError as exc:
            raise _fail_for(exc) from None
        out.print(f"deleted {sid}")

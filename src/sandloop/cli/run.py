"""``sandloop run``, ``agent``, ``doctor``, ``reap``, ``languages``: one-shot work on the default Sandloop."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer
from rich.table import Table

from sandloop import languages
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
    app,
    err,
    error_text,
    out,
    output_limit_bytes,
    parse_secrets,
)
from sandloop.contract import SandboxError, SandboxLimits


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
    allow: Annotated[
        list[str] | None,
        typer.Option(
            "--allow",
            help="A host the program may reach over HTTP(S), through sandloop's egress proxy (repeat it): "
            "pypi.org, *.example.com, host:8443. Its only way out; every attempt is reported.",
        ),
    ] = None,
    secret: Annotated[list[str] | None, typer.Option("--secret", help=SECRET_HELP)] = None,
    input_file: Annotated[
        Path | None,
        typer.Option(
            "--stdin",
            help="File whose content is the program's stdin. Without it, what is piped into sandloop is the "
            "program's stdin, unless the program itself came from stdin.",
        ),
    ] = None,
    output_limit: Annotated[str | None, _OUTPUT_LIMIT_OPTION] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print the whole result as JSON on stdout.")] = False,
    template: Annotated[
        str | None,
        typer.Option("--template", help="Start from this template (name[:tag], see `sandloop templates ls`)."),
    ] = None,
) -> None:
    """Run a program in a fresh sandbox: `sandloop run hello.py`, `echo 'print(6*7)' | sandloop run`.
    Its output is written as it arrives."""
    from sandloop.root import configure
    from sandloop.runner import run_code
    from sandloop.settings import Settings

    configure(Settings(pool_size=0))  # one run per process: a warm pool would only cost containers

    source, lang, stdin_taken = _program(file, code, language)
    stdin_data = _program_stdin(input_file, stdin_taken)
    secrets = parse_secrets(secret)
    kept = output_limit_bytes(output_limit)
    streamer = None if as_json else Streamer()
    try:
        limits = SandboxLimits(
            memory=memory,
            cpus=cpus,
            network=network,
            runtime=runtime,
            egress=tuple(allow or ()),
            **({"output_limit": kept} if kept is not None else {}),
        )
        result = run_code(
            source,
            lang,
            timeout,
            limits=limits,
            stdin=stdin_data,
            secrets=secrets,
            on_output=streamer,
            template=template,
        )
    except SandboxError as exc:
        if as_json:
            print(json.dumps({"code": exc.code, "message": str(exc)}))
        raise _fail_for(exc) from None
    _print_result(result, as_json, streamer)
    raise _exit_for(result)


@app.command()
def doctor(
    smoke: Annotated[bool, typer.Option("--smoke/--no-smoke", help="Also run print(1) on each runtime.")] = True,
) -> None:
    """Check the engine, the runtimes and the images, and say how to fix what is missing."""
    from sandloop.checks import healthy, run_checks
    from sandloop.root import default_root

    colour = {"ok": "green", "missing": "red", "off": "yellow", "failed": "red"}
    checks = run_checks(default_root(), smoke=smoke)
    table = Table("check", "status", "detail / fix", show_lines=False)
    for c in checks:
        shade = colour[c.status] if c.essential or c.status == "ok" else "yellow"
        table.add_row(c.name, f"[{shade}]{c.status}[/]", c.detail)
    out.print(table)
    raise typer.Exit(0 if healthy(checks) else 1)


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
    allow: Annotated[
        list[str] | None,
        typer.Option("--allow", help="A host the model's programs may reach over HTTP(S) (repeatable)."),
    ] = None,
    secret: Annotated[list[str] | None, typer.Option("--secret", help=SECRET_HELP)] = None,
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
        limits = SandboxLimits(memory=memory, runtime=runtime, egress=tuple(allow or ()))
        client = make_client(provider, model or DEFAULT_MODELS[provider], base_url=base_url)
    except (SandboxError, ProviderError) as exc:
        raise _fail(error_text(exc) if isinstance(exc, SandboxError) else str(exc), 2) from None
    view = None if as_json else AgentView(err)
    try:
        result = run_agent(
            task,
            client,
            max_iterations,
            limits=limits,
            secrets=parse_secrets(secret),
            timeout_seconds=timeout,
            on_event=view.on_event if view else None,
        )
    except ProviderError as exc:
        raise _fail(f"the model provider failed: {exc}", 1) from None
    except SandboxError as exc:
        raise _fail_for(exc) from None
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
    from sandloop.root import default_root

    try:
        report = default_root().reap(dry_run=dry_run)
    except SandboxError as exc:
        raise _fail_for(exc) from None
    from sandloop.pool.reaper import STUCK_ADVICE

    table = Table("kind", "id", "purpose", "owner", "reason")
    for item in report.removed:
        table.add_row(item.kind, item.id[:12], item.purpose, item.owner, item.reason)
    for sid in report.expired_sessions:
        table.add_row("session", sid, "session", "", "idle past its ttl, or warm and its process gone")
    found = len(report.removed) + len(report.expired_sessions)
    if found:
        out.print(table)
    verb = "would remove" if dry_run else "removed"
    out.print(f"{verb} {found} item(s)")
    if report.unremovable:
        for item in report.unremovable:
            err.print(f"[red]could not remove[/] {item.kind} {item.id[:12]} ({item.purpose}): {item.error}")
        err.print(f"{len(report.unremovable)} item(s) could not be removed: {STUCK_ADVICE}")
        raise typer.Exit(1)


@app.command("languages")
def list_languages() -> None:
    """List the registered languages."""
    for name in languages.names():
        lang = languages.get(name)
        out.print(f"{name}\t{' '.join(lang.command)} {lang.file_name}\taliases: {', '.join(lang.aliases) or '-'}")

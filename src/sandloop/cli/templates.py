"""``sandloop templates``: build, list, show and remove templates (``images/templates/``)."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Annotated

import typer
from rich.markup import escape
from rich.table import Table

from sandloop.cli.common import _fail, _fail_for, err, out, templates_app
from sandloop.contract import InvalidArgument, SandboxError, TemplateBuildFailed, parse_size
from sandloop.root import Sandloop


def _root() -> Sandloop:
    from sandloop.root import configure
    from sandloop.settings import Settings

    return configure(Settings(pool_size=0, session_pool_size=0))


@templates_app.command("build")
def templates_build(
    name: Annotated[str, typer.Argument(help="The template's name[:tag] (tag default: latest).")],
    file: Annotated[
        Path,
        typer.Option("-f", "--file", help="Its steps: a steps file (YAML) or a Dockerfile FROM the runtime image."),
    ],
    no_cache: Annotated[bool, typer.Option("--no-cache", "--force", help="Run every step again.")] = False,
    runtime: Annotated[str, typer.Option("--runtime", help="What runs the build's commands: runc, or runsc.")] = "runc",
    memory: Annotated[str, typer.Option("--memory", help="Memory ceiling of each build step.")] = "2g",
    cpus: Annotated[float, typer.Option("--cpus", help="CPU share of each build step.")] = 1.0,
    timeout: Annotated[float, typer.Option("--timeout", help="Seconds each build step may run.")] = 1800,
    disk: Annotated[str, typer.Option("--disk", help="Most each build step may add to the image.")] = "4g",
    as_json: Annotated[bool, typer.Option("--json", help="Print the result as JSON on stdout.")] = False,
) -> None:
    """Build a template: its RUN steps run sandboxed, without network; pip_install, npm_install and
    apt_install fetch on this host from its configured mirrors. Each step is cached."""
    from sandloop.images.templates import BuildEvent, BuildLimits, parse_steps_file

    if runtime not in ("runc", "runsc"):
        raise _fail(f"--runtime: must be runc or runsc, got {runtime!r}", 2)
    try:
        memory_bytes = parse_size(memory)
    except ValueError as exc:
        raise _fail(f"--memory: {exc}", 2) from None
    if not 64 * 2**20 <= memory_bytes <= 64 * 2**30:
        raise _fail("--memory: between 64m and 64g", 2)
    if not 0.1 <= cpus <= 64:
        raise _fail("--cpus: between 0.1 and 64", 2)
    if not 1 <= timeout <= 24 * 3600:
        raise _fail("--timeout: between 1 and 86400 seconds", 2)
    try:
        disk_bytes = parse_size(disk)
    except ValueError as exc:
        raise _fail(f"--disk: {exc}", 2) from None
    if not 16 * 2**20 <= disk_bytes <= 2**40:
        raise _fail("--disk: between 16m and 1t", 2)
    try:
        spec = parse_steps_file(file, name)
    except InvalidArgument as exc:
        raise _fail(str(exc), 2) from None
    limits = BuildLimits(
        memory_bytes=memory_bytes, cpus=cpus, timeout_seconds=timeout, runtime=runtime, disk_bytes=disk_bytes
    )
    root = _root()
    with err.status(f"building {spec.ref} ...") as status:

        def show(event: BuildEvent) -> None:
            head = f"[{event.step}/{event.steps}] {event.description[:100]}"
            if event.line:
                status.update(f"{head}: {event.line[:80]}")
                if not as_json:
                    err.print(f"  {escape(event.line)}", style="dim", soft_wrap=True)
            else:
                status.update(head)
                err.print(escape(head) + (" (cached)" if event.cached else ""), soft_wrap=True)

        try:
            result = root.templates.build(spec, force=no_cache, limits=limits, on_event=show)
        except TemplateBuildFailed as exc:
            if as_json:
                print(json.dumps({"code": exc.code, "message": str(exc), "step": exc.step, "log_tail": exc.log_tail}))
            raise _fail(str(exc)) from None
        except SandboxError as exc:
            if as_json:
                print(json.dumps({"code": exc.code, "message": str(exc)}))
            raise _fail_for(exc) from None
    if as_json:
        print(json.dumps(asdict(result)))
        return
    err.print(
        f"built {result.ref} in {result.seconds:.1f} s ({result.built_steps} steps run, {result.cached_steps} cached)"
    )
    out.print(result.ref)


@templates_app.command("ls")
def templates_ls(as_json: Annotated[bool, typer.Option("--json")] = False) -> None:
    """List the templates built here."""
    try:
        found = _root().templates.list()
    except SandboxError as exc:
        raise _fail_for(exc) from None
    if as_json:
        print(json.dumps([asdict(t) for t in found]))
        return
    table = Table("template", "from", "steps", "size", "created")
    for column in table.columns[:2]:
        column.overflow = "fold"  # a name is never cut
    for t in found:
        table.add_row(t.ref, t.base, str(len(t.steps)), f"{t.size_bytes >> 20} MiB", t.created)
    out.print(table)


@templates_app.command("show")
def templates_show(name: Annotated[str, typer.Argument(help="name[:tag]")]) -> None:
    """A template's image, base, steps and start command, as JSON."""
    try:
        info = _root().templates.get(name)
    except SandboxError as exc:
        raise _fail_for(exc) from None
    print(json.dumps(asdict(info), indent=2))


@templates_app.command("rm")
def templates_rm(name: Annotated[str, typer.Argument(help="name[:tag]")]) -> None:
    """Remove a template (refused while sessions or sandboxes run from it)."""
    try:
        _root().templates.remove(name)
    except SandboxError as exc:
        raise _fail_for(exc) from None
    err.print(f"removed {name}")


@templates_app.command("prune")
def templates_prune() -> None:
    """Drop the build cache (layers templates still use stay)."""
    try:
        n = _root().templates.prune()
    except SandboxError as exc:
        raise _fail_for(exc) from None
    err.print(f"removed {n} cached build steps")

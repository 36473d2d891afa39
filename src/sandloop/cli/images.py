"""``sandloop images``: the offline runtime image build."""

from __future__ import annotations

from typing import Annotated

import typer

from sandloop.cli.common import _fail, err, images_app, out
from sandloop.contract import SandboxError


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
    from sandloop.settings import runtime_image

    out.print(runtime_image())

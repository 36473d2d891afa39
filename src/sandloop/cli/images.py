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
    no_docker: Annotated[
        bool,
        typer.Option(
            "--no-docker",
            help="Build without Docker, into the direct backend's store (for SANDLOOP_BACKEND="
            '\'{"type": "oci", "engine": false}\').',
        ),
    ] = False,
) -> None:
    """Build the runtime image (python + numpy/pandas/matplotlib, node, bash). Takes about a minute."""
    from sandloop.images.build import build_rootfs, build_runtime
    from sandloop.settings import OCIConfig, Settings

    if no_docker and base is not None:
        raise _fail("--from names a base image to pull, which needs Docker: drop it or --no-docker")
    backend = Settings().backend
    store = backend.store if isinstance(backend, OCIConfig) else OCIConfig().store

    with err.status("building the runtime image ...") as status:

        def progress(line: str) -> None:
            status.update(line[:110])
            if not line.startswith(("docker build:", "debootstrap:", "pip wheels:", "Dockerfile line")):
                err.print(line)

        try:
            if no_docker:
                image = build_rootfs(store=store, force=force, progress=progress)
            else:
                image = build_runtime(base=base, force=force, progress=progress)
        except SandboxError as exc:
            raise _fail(str(exc)) from None
    out.print(image)


@images_app.command("name")
def images_name() -> None:
    """Print the runtime image name this version of sandloop expects."""
    from sandloop.settings import runtime_image

    out.print(runtime_image())

"""Image operations the offline build needs (import a rootfs tarball, build a Dockerfile)."""

from __future__ import annotations

from typing import Any

from sandloop.contract import SandboxError
from sandloop.runtime.docker.errors import engine_errors


class DockerImages:
    def __init__(self, backend: Any) -> None:
        self._backend = backend

    def exists(self, image: str) -> bool:
        return bool(self._backend.has_image(image))

    def import_rootfs(self, stream: Any, image: str) -> None:
        repository, _, tag = image.partition(":")
        with engine_errors(image):
            self._backend.api.import_image(src=stream, repository=repository, tag=tag or "latest", stream_src=True)

    def build(self, context_dir: str, image: str, buildargs: dict[str, str], on_line: Any = None) -> None:
        with engine_errors(image):
            for chunk in self._backend.api.build(
                path=context_dir,
                tag=image,
                buildargs=buildargs,
                network_mode="none",
                rm=True,
                forcerm=True,
                decode=True,
                timeout=3600,  # a long build must not hit the engine's per-call limit
            ):
                if "error" in chunk:
                    raise SandboxError(f"building {image} failed: {chunk['error'].strip()}")
                line = chunk.get("stream", "").rstrip()
                if line and on_line is not None:
                    on_line(line)

    def tag(self, image: str, alias: str) -> None:
        repository, _, tag = alias.partition(":")
        with engine_errors(image):
            self._backend.api.tag(image, repository, tag or "latest")

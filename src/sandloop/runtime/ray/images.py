"""Templates on a Ray cluster (issue 24): built on one node, received by every other.

``ClusterBuilder`` is the ``ImageBuilder`` the Ray backend hands the template manager
(``images/templates/``): the same step-by-step build, each step run by the *build node* (the
first usable node by id, so the step cache is one cache, not one per node), its RUN steps' log
lines streamed to the caller as they come, a helper step's packages (fetched on the driver by the
host's own clients) sent along as a tar. When the build names a template (its final tag), every
other usable node that does not have that image receives it from the build node, node to node
(``docker save`` there, ``docker load`` here, in chunks through Ray's object store): an image keeps
its id, so a run from the template lands on any node. Removing a template removes it on every
node; a template is in use while a sandbox runs from it on any node.

A node that joins after a build does not have the template: runs from it there fail with the
engine's "no such image" until the template is built again (every step cached: only the sending
runs). The build node's own failures are ``NodeLost`` like any call's; nothing is retried.
"""

from __future__ import annotations

import io
import tarfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from sandloop.contract import SandboxBusy
from sandloop.runtime.base import TEMPLATE_CACHE_REPO, BuildLimits

#: Seconds a quick call (an inspect, a tag) may take.
QUICK = 30.0
#: Seconds an image may take to go from the build node to another (a template is ~0.5 GB).
SEND_SECONDS = 1800.0
#: Seconds a builder call that writes an image (a COPY's layer, an ENV) may take.
WRITE_SECONDS = 300.0


class Nodes(Protocol):
    """What the builder needs of the cluster (``RayBackend``): its nodes, and calls to them."""

    def usable_nodes(self) -> list[str]: ...

    def node_call(self, node_id: str, method: str, *args: Any, timeout: float = ..., **kwargs: Any) -> Any: ...

    def node_stream(
        self, node_id: str, method: str, *args: Any, timeout: float, on_output: Callable[[str, bytes], None] | None
    ) -> Any: ...


class ClusterBuilder:
    """Template build steps on a cluster's build node; templates sent to every node."""

    def __init__(self, backend: Nodes) -> None:
        self.backend = backend

    def build_node(self) -> str:
        usable = self.backend.usable_nodes()
        if not usable:
            raise SandboxBusy("no node of the cluster offers sandboxes: templates cannot be built")
        return min(usable)

    def _call(self, method: str, *args: Any, timeout: float = QUICK, **kwargs: Any) -> Any:
        return self.backend.node_call(self.build_node(), "build", method, *args, timeout=timeout, **kwargs)

    def _each(self, method: str, *args: Any) -> list[Any]:
        return [self.backend.node_call(n, "build", method, *args) for n in self.backend.usable_nodes()]

    # -- reads: the build node's ---------------------------------------------------------------
    def inspect(self, ref: str) -> dict[str, Any] | None:
        found: dict[str, Any] | None = self._call("inspect", ref)
        return found

    def images(self, label: str) -> list[dict[str, Any]]:
        found: list[dict[str, Any]] = self._call("images", label)
        return found

    def read_file(self, image: str, path: str, limit: int = 8 * 1024 * 1024) -> bytes | None:
        found: bytes | None = self._call("read_file", image, path, limit)
        return found

    def has_entries(self, image: str, path: str) -> bool:
        return bool(self._call("has_entries", image, path))

    # -- steps ---------------------------------------------------------------------------------
    def run_step(
        self,
        parent: str,
        command: str,
        *,
        user: str,
        workdir: str,
        limits: BuildLimits,
        packages_dir: str | None = None,
        on_line: Callable[[str], None] | None = None,
    ) -> str:
        def relay(_stream: str, data: bytes) -> None:
            if on_line is not None:
                on_line(data.decode(errors="replace"))

        packages = _tar(Path(packages_dir)) if packages_dir is not None else None
        options = {"user": user, "workdir": workdir, "limits": limits}
        node = self.build_node()
        return str(
            self.backend.node_stream(
                node,
                "build_step_stream",
                parent,
                command,
                options,
                packages,
                timeout=limits.timeout_seconds + WRITE_SECONDS,
                on_output=relay,
            )
        )

    def add_files(self, parent: str, archive: bytes) -> str:
        return str(self._call("add_files", parent, archive, timeout=WRITE_SECONDS))

    def change(self, parent: str, *, env: dict[str, str] | None = None, labels: dict[str, str] | None = None) -> str:
        return str(self._call("change", parent, env=env, labels=labels, timeout=WRITE_SECONDS))

    def tag(self, image_id: str, repository: str, tag: str) -> None:
        source = self.build_node()
        self.backend.node_call(source, "build", "tag", image_id, repository, tag)
        if repository != TEMPLATE_CACHE_REPO:  # a template's name: every node gets the image
            self.send(source, image_id, f"{repository}:{tag}")

    def send(self, source: str, image_id: str, ref: str) -> list[str]:
        """``ref`` (``image_id``) from ``source`` to every other usable node lacking it; which got it."""
        sent = []
        for node in self.backend.usable_nodes():
            if node == source:
                continue
            there = self.backend.node_call(node, "build", "inspect", ref)
            if there is not None and there.get("Id") == image_id:
                continue  # it has it (one engine behind both nodes, or sent before)
            self.backend.node_call(node, "receive_image", source, ref, timeout=SEND_SECONDS)
            sent.append(node)
        return sent

    # -- every node's ----------------------------------------------------------------------------
    def remove_image(self, ref: str) -> str | None:
        problems = [p for p in self._each("remove_image", ref) if p]
        return problems[0] if problems else None

    def containers_using(self, image_id: str) -> list[str]:
        return [c for found in self._each("containers_using", image_id) for c in found]


def _tar(directory: Path) -> bytes:
    """A helper step's packages directory, as a tar (regular files and folders only)."""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w") as tar:
        tar.add(directory, arcname=".", filter=lambda info: info if info.isfile() or info.isdir() else None)
    return buffer.getvalue()

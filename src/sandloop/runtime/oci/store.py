"""Each runtime image exported once into a root-owned store that every direct run shares.

``<home>/oci/images/<image id>/rootfs`` holds ``docker export`` of a container made from the image
(so it carries the mount points Docker's init layer adds: /proc, /sys, /dev, /etc/hostname ...).
The directory is then bind-mounted read-only onto itself, so nothing (not runc, not a bug of ours,
not a sandbox) can write to it; runs mount it read-only again inside their own mount namespace.
Stores whose image is gone are removed by ``gc``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

from sandloop.contract import HostDiskFull, SandboxError

log = logging.getLogger(__name__)

#: Left free beside an export (the image's size is its size on Docker's disk; the tree is close).
EXPORT_RESERVE = 64 * 1024 * 1024


def _mounted(path: Path) -> bool:
    target = str(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == target for line in f)


class RootfsStore:
    def __init__(self, directory: Path, api: Callable[[], Any]) -> None:
        self.directory = directory
        self._api = api
        self._lock = threading.Lock()
        self._ready: dict[str, Path] = {}

    def image_id(self, image: str) -> str:
        return str(self._api().inspect_image(image)["Id"]).split(":", 1)[-1]

    def rootfs(self, image: str) -> Path:
        """The read-only root file system of ``image``, exported on first use."""
        ready = self._ready.get(image)
        if ready is not None:
            return ready
        with self._lock:
            image_id = self.image_id(image)
            path = self.directory / image_id / "rootfs"
            if not path.is_dir():
                self._export(image, image_id, path)
            if not _mounted(path):
                subprocess.run(["mount", "--bind", "-o", "ro", str(path), str(path)], check=True, capture_output=True)
            self._ready[image] = path
            return path

    def _check_space(self, image: str, size: int) -> None:
        """Refuse before writing when the export cannot fit (with a reserve): a full disk is found
        out at once, not after hundreds of megabytes written and removed again."""
        self.directory.mkdir(parents=True, exist_ok=True)
        st = os.statvfs(self.directory)
        free = st.f_bavail * st.f_frsize
        if size + EXPORT_RESERVE > free:
            raise HostDiskFull(
                f"cannot export {image} ({size >> 20} MiB) for the direct backend: the disk under "
                f"{self.directory} has {free >> 20} MiB free; free space there, or move the store "
                f'to a roomier disk (SANDLOOP_BACKEND=\'{{"type": "oci", "store": PATH}}\')'
            )

    def _export(self, image: str, image_id: str, path: Path) -> None:
        api = self._api()
        self._check_space(image, int(api.inspect_image(image).get("Size") or 0))
        tmp = self.directory / f".export-{image_id[:12]}-{uuid.uuid4().hex[:8]}"
        tmp.mkdir(parents=True, mode=0o700)
        container = api.create_container(image, command=["true"], network_disabled=True)["Id"]
        try:
            tar = subprocess.Popen(
                ["tar", "-x", "-C", str(tmp), "--numeric-owner", "-p", "-f", "-"],
                stdin=subprocess.PIPE,
                stderr=subprocess.PIPE,
            )
            assert tar.stdin is not None
            try:
                for chunk in api.export(container, chunk_size=1024 * 1024):
                    tar.stdin.write(chunk)
            except BrokenPipeError:
                pass  # tar gave up (its own error says why, below)
            finally:
                with contextlib.suppress(BrokenPipeError):
                    tar.stdin.close()
                err = tar.stderr.read() if tar.stderr else b""
                rc = tar.wait()
            if rc != 0:
                said = err.decode(errors="replace")[-300:]
                if "No space left" in said:
                    raise HostDiskFull(
                        f"exporting {image} for the direct backend filled the disk under {self.directory}; "
                        f"free space there, or move the store: {said}"
                    )
                raise SandboxError(f"exporting {image} for the direct backend failed: {said}")
            tmp.chmod(0o755)
            path.parent.mkdir(parents=True, exist_ok=True)
            tmp.rename(path)
            log.info("exported %s into %s", image, path)
        finally:
            with contextlib.suppress(Exception):
                api.remove_container(container, force=True)
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

    def gc(self, in_use: set[Path] | None = None) -> list[str]:
        """Remove stores whose image the engine no longer has (and no live bundle uses), and
        exports a crash interrupted."""
        in_use = in_use or set()
        if not self.directory.is_dir():
            return []
        images = {str(i["Id"]).split(":", 1)[-1] for i in self._api().images(all=True)}
        removed = []
        for entry in self.directory.iterdir():
            rootfs = entry / "rootfs"
            if entry.name.startswith(".export-"):
                if time.time() - entry.stat().st_mtime > 600:  # not one in progress elsewhere
                    shutil.rmtree(entry, ignore_errors=True)
                    removed.append(entry.name)
                continue
            if entry.name in images or rootfs in in_use:
                continue
            if _mounted(rootfs):
                subprocess.run(["umount", str(rootfs)], capture_output=True)
            shutil.rmtree(entry, ignore_errors=True)
            self._ready = {k: v for k, v in self._ready.items() if v != rootfs}
            removed.append(entry.name)
        return removed

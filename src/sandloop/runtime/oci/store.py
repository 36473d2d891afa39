"""Each runtime image exported once into a root-owned store that every direct run shares.

``<home>/oci/images/<image id>/rootfs`` holds ``docker export`` of a container made from the image
(so it carries the mount points Docker's init layer adds: /proc, /sys, /dev, /etc/hostname ...).
The directory is then bind-mounted read-only onto itself, so nothing (not runc, not a bug of ours,
not a sandbox) can write to it; runs mount it read-only again inside their own mount namespace.
Stores whose image is gone are removed by ``gc``.

Each store also keeps what a run needs of the image without asking Docker: ``image.json`` (the
image's config: env, entrypoint, working directory) and a ref per name (``refs/``), so a host
without an engine (``engine=False``) finds images by name. A root file system built without
Docker (``images/build.py``, ``build_rootfs``) is put here the same way, with ``built`` beside it:
no engine knows it, so ``gc`` keeps it.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
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
from sandloop.paths import unmount_below, write_atomically
from sandloop.runtime.labels import owner_alive, owner_id

log = logging.getLogger(__name__)

#: The file whose lock keeps two processes from exporting one image at once.
STORE_LOCK = ".lock"
#: What ``gc`` moved out of the way, being deleted: ``.trash-<owner>-<uuid>``, by that process
#: (or by the next ``gc`` once it has exited; ``runtime/labels.py`` names owners).
TRASH = ".trash-"
#: Left free beside an export (the image's size is its size on Docker's disk; the tree is close).
EXPORT_RESERVE = 64 * 1024 * 1024


def _mounted(path: Path) -> bool:
    target = str(path)
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == target for line in f)


#: Beside a root file system made without Docker (no engine lists it: ``gc`` keeps it).
BUILT = "built"
IMAGE_CONFIG = "image.json"


def _write_atomically(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    write_atomically(path, text, 0o644)


class RootfsStore:
    def __init__(self, directory: Path, api: Callable[[], Any], *, engine: bool = True) -> None:
        self.directory = directory
        self._api = api
        #: False: no Docker engine is asked anything (images are found by their refs).
        self.engine = engine
        self._lock = threading.Lock()
        self._trash_lock = threading.Lock()
        #: Deleting what the last ``gc`` moved out of the way (None: nothing was).
        self.trash_thread: threading.Thread | None = None
        self._ready: dict[str, Path] = {}

    def _ref(self, image: str) -> Path:
        return self.directory / "refs" / hashlib.sha256(image.encode()).hexdigest()[:32]

    def add_ref(self, image: str, image_id: str) -> None:
        _write_atomically(self._ref(image), json.dumps({"name": image, "id": image_id}))

    def _ref_id(self, image: str) -> str | None:
        with contextlib.suppress(OSError, ValueError, KeyError):
            return str(json.loads(self._ref(image).read_text())["id"])
        return None

    def image_id(self, image: str) -> str:
        """The image's id: the engine's (its ref noted for runs without it), else the ref's."""
        if not self.engine:
            found = self._ref_id(image)
            if found is None or not (self.directory / found / "rootfs").is_dir():
                raise SandboxError(
                    f"the image {image} is not in the store {self.directory}, and this backend runs without "
                    "Docker: build it there with `sandloop images build --no-docker`"
                )
            return found
        image_id = str(self._api().inspect_image(image)["Id"]).split(":", 1)[-1]
        if self._ref_id(image) != image_id:
            self.add_ref(image, image_id)
        return image_id

    def _referenced(self) -> set[str]:
        """The ids some name still points at."""
        out = set()
        for ref in (self.directory / "refs").glob("*"):
            with contextlib.suppress(OSError, ValueError, KeyError):
                out.add(str(json.loads(ref.read_text())["id"]))
        return out

    def has(self, image: str) -> bool:
        try:
            self.image_id(image)
        except SandboxError:
            return False
        return True

    def image_config(self, image: str) -> dict[str, Any]:
        """The image's config (``Env``, ``Entrypoint``, ``Cmd``, ``WorkingDir``), kept beside its
        root file system (read from the engine once where there is one)."""
        image_id = self.image_id(image)
        path = self.directory / image_id / IMAGE_CONFIG
        with contextlib.suppress(OSError, ValueError):
            loaded: dict[str, Any] = json.loads(path.read_text())
            return loaded
        if not self.engine:
            raise SandboxError(f"the store's copy of {image} has no {IMAGE_CONFIG}: build it again")
        config: dict[str, Any] = self._api().inspect_image(image).get("Config") or {}
        _write_atomically(path, json.dumps(config))
        return config

    def rootfs(self, image: str) -> Path:
        """The read-only root file system of ``image``, exported on first use."""
        ready = self._ready.get(image)
        if ready is not None:
            return ready
        with self._lock, self.across_processes():
            image_id = self.image_id(image)
            path = self.directory / image_id / "rootfs"
            if not path.is_dir():
                self._export(image, image_id, path)
            if self.engine and not (path.parent / IMAGE_CONFIG).is_file():
                self.image_config(image)  # an export made before image configs were kept
            if not _mounted(path):
                subprocess.run(["mount", "--bind", "-o", "ro", str(path), str(path)], check=True, capture_output=True)
            self._ready[image] = path
            return path

    @contextlib.contextmanager
    def across_processes(self) -> Any:
        """The store's lock between processes (a server, a CLI, test workers): two first runs of
        one image at once would export it twice, and the second rename fails on the first's tree
        (seen with three processes: ENOTEMPTY, EBUSY once it was bind-mounted)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.directory / STORE_LOCK, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield
        finally:
            os.close(fd)

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
        inspected = api.inspect_image(image)
        self._check_space(image, int(inspected.get("Size") or 0))
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
            _write_atomically(path.parent / IMAGE_CONFIG, json.dumps(inspected.get("Config") or {}))
            tmp.rename(path)
            log.info("exported %s into %s", image, path)
        finally:
            with contextlib.suppress(Exception):
                api.remove_container(container, force=True)
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)

    def gc(self, in_use: set[Path] | None = None) -> list[str]:
        """Remove stores whose image the engine no longer has, or built here and no longer named
        (unless a live bundle uses them), and exports or builds a crash interrupted. Under the
        store's lock each is only renamed out of the way (``.trash-``, at once); the trees, a
        gigabyte of files each, are deleted on a thread of their own, so a process's first run
        does not wait for them (four test workers starting together each waited 50-90 s), and
        two processes never delete one tree at once. Trash a process left (it exited first) goes
        with the next ``gc``."""
        in_use = in_use or set()
        if not self.directory.is_dir():
            return []
        images = {str(i["Id"]).split(":", 1)[-1] for i in self._api().images(all=True)} if self.engine else set()
        removed = []
        with self._lock, self.across_processes():
            named = self._referenced()
            for entry in self.directory.iterdir():
                rootfs = entry / "rootfs"
                if entry.name.startswith(TRASH):
                    continue
                if entry.name.startswith((".export-", ".build-")):
                    if time.time() - entry.stat().st_mtime > 600:  # not one in progress elsewhere
                        self._discard(entry)
                        removed.append(entry.name)
                    continue
                if entry.name in ("refs", STORE_LOCK) or entry.name in images or rootfs in in_use:
                    continue
                if not self.engine and not (entry / BUILT).exists():
                    continue  # an export: whether its image is gone only the engine knows
                if (entry / BUILT).exists() and entry.name in named:
                    continue  # built here (no engine lists it) and still named: kept
                self._discard(entry)
                self._ready = {k: v for k, v in self._ready.items() if v != rootfs}
                removed.append(entry.name)
            for entry in self.directory.iterdir():  # trash of a process that exited first: ours now
                if entry.name.startswith(TRASH) and owner_alive(entry.name[len(TRASH) : -33]) is False:
                    with contextlib.suppress(OSError):
                        entry.rename(self._trash_name())
        mine = self._trash_name().name[:-32]
        if any(entry.name.startswith(mine) for entry in self.directory.iterdir()):
            self.trash_thread = threading.Thread(
                target=self._empty_trash, args=(mine,), name="sandloop-store-trash", daemon=True
            )
            self.trash_thread.start()
        return removed

    def _trash_name(self) -> Path:
        """``.trash-<owner>-<uuid>``: the owner as the reaper names one (host:pid:start time, so a
        reused pid is not taken for the process that left it)."""
        return self.directory / f"{TRASH}{owner_id()}-{uuid.uuid4().hex}"

    def _discard(self, entry: Path) -> None:
        unmount_below(entry)
        try:
            entry.rename(self._trash_name())
        except OSError:  # cannot be moved (a mount left on it): deleted where it is
            shutil.rmtree(entry, ignore_errors=True)

    def _empty_trash(self, mine: str) -> None:
        with self._trash_lock:
            for entry in self.directory.iterdir():
                if entry.name.startswith(mine):
                    shutil.rmtree(entry, ignore_errors=True)

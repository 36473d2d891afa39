"""Session workspaces on Docker: a sparse ext4 image of the quota's size, loop-mounted on the host
under ``<home>/sessions/<id>/mnt`` and handed to containers as a named volume (a bind of that mount).

Why: it is kept apart from any container, so a session survives its containers being recycled and
can be reattached from another process; the quota is a real filesystem size, so code that writes
past it gets ENOSPC inside while the host disk and other sessions are untouched; and under gVisor a
named volume works where a plain host bind mount did not. Without root (no loop mounts) the
workspace is a plain named volume and the quota is not enforced (the ref says so).

The image is sparse, so the host's disk must be able to back every workspace to its quota: when it
could not (the host disk fills while a workspace grows), the loop device's writes fail under ext4
and data is lost (measured: a 100 MB write inside a 128m workspace on a host with 50 MB free got
ENOSPC only at fsync, the file kept its full length, and the kernel logged "failed to convert
unwritten extents -- potential data loss" and lost page writes). So a workspace is created only while the
free space covers what the existing ones may still grow by, plus its own quota, plus a reserve;
otherwise ``HostDiskFull`` says so at creation. This holds as long as sandloop alone fills that
disk; the check is per host directory, under one lock per process.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import threading
from pathlib import Path
from typing import Any

from sandloop.contract import HostDiskFull, SandboxError
from sandloop.runtime.base import WorkspaceRef
from sandloop.runtime.docker.errors import engine_errors
from sandloop.runtime.labels import LABEL_PREFIX, SESSION_LABEL

log = logging.getLogger(__name__)


def volume_name(session_id: str) -> str:
    return f"sandloop-ws-{session_id}"


#: Kept free beside the workspaces' quotas: session records, logs, temporary files.
DISK_RESERVE = 64 * 1024 * 1024
_reserve_lock = threading.Lock()


def _mib(n: int) -> str:
    return f"{n / (1024 * 1024):.0f} MiB"


def can_enforce_quotas() -> bool:
    return bool(os.geteuid() == 0 and shutil.which("mkfs.ext4") and shutil.which("mount"))


class DockerWorkspaces:
    def __init__(self, api: Any, home: Path) -> None:
        self._api = api  # a callable returning the docker APIClient (connected lazily)
        self.root = home / "sessions"
        #: False (no Docker engine): no volume is made; the direct backend binds the loop mount.
        self.volumes = True

    def _dir(self, session_id: str) -> Path:
        return self.root / session_id

    def may_still_grow(self) -> int:
        """Bytes the existing workspace images may still take from the host disk (sparse parts)."""
        total = 0
        for img in self.root.glob("*/workspace.img"):
            with contextlib.suppress(OSError):
                st = img.stat()
                total += max(0, st.st_size - st.st_blocks * 512)
        return total

    def _reserve(self, session_id: str, quota_bytes: int) -> None:
        st = os.statvfs(self.root)
        free = st.f_bavail * st.f_frsize
        growth = self.may_still_grow()
        if quota_bytes + growth + DISK_RESERVE > free:
            raise HostDiskFull(
                f"cannot create a {_mib(quota_bytes)} workspace for {session_id}: the disk under {self.root} "
                f"has {_mib(free)} free, the existing workspaces may still grow by {_mib(growth)} and "
                f"{_mib(DISK_RESERVE)} is kept in reserve; ask for a smaller quota, delete sessions, or "
                f"free space there"
            )

    def create(self, session_id: str, quota_bytes: int, owner_uid_gid: str) -> WorkspaceRef:
        """The workspace, whole, or an error and nothing left of it."""
        try:
            return self._create(session_id, quota_bytes, owner_uid_gid)
        except BaseException:
            self.delete(session_id)
            raise

    def _create(self, session_id: str, quota_bytes: int, owner_uid_gid: str) -> WorkspaceRef:
        d = self._dir(session_id)
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        labels = {
            f"{LABEL_PREFIX}owner": f"session:{session_id}",
            f"{LABEL_PREFIX}purpose": "session",
            SESSION_LABEL: session_id,
        }
        volume = volume_name(session_id)
        if can_enforce_quotas():
            img, mnt = d / "workspace.img", d / "mnt"
            mnt.mkdir(exist_ok=True)
            with _reserve_lock:  # the check and the image it admits, together
                self._reserve(session_id, quota_bytes)
                with open(img, "wb") as f:
                    f.truncate(quota_bytes)
            _check(
                [
                    "mkfs.ext4",
                    "-q",
                    "-F",
                    "-m",
                    "0",
                    "-O",
                    "^has_journal",
                    "-E",
                    f"root_owner={owner_uid_gid}",
                    str(img),
                ],
                "mkfs.ext4",
            )
            self._mount(d)
            shutil.rmtree(mnt / "lost+found", ignore_errors=True)
            opts: dict[str, str] | None = {"type": "none", "o": "bind", "device": str(mnt)}
            enforced = True
        elif not self.volumes:
            raise SandboxError("a workspace without Docker is a loop-mounted ext4 image: it needs root and mkfs.ext4")
        else:
            log.warning("no root or no loop mounts: session %s gets a workspace without a quota", session_id)
            opts, enforced = None, False
        if self.volumes:
            with engine_errors():
                self._api().create_volume(volume, driver="local", driver_opts=opts, labels=labels)
        return WorkspaceRef(volume, enforced)

    def _mount(self, d: Path) -> None:
        _check(["mount", "-o", "loop,nosuid,nodev", str(d / "workspace.img"), str(d / "mnt")], "mount")

    def ensure(self, session_id: str, ref: WorkspaceRef) -> None:
        """After a host reboot the loop mount is gone while the image remains: mount it again."""
        d = self._dir(session_id)
        if ref.quota_enforced and not os.path.ismount(d / "mnt"):
            self._mount(d)

    def on_host(self, session_id: str, ref: WorkspaceRef) -> Path | None:
        """The workspace's files on this host: the loop mount, or the volume's own directory."""
        if ref.quota_enforced:
            mnt = self._dir(session_id) / "mnt"
            return mnt if os.path.ismount(mnt) else None
        with engine_errors():
            point = self._api().inspect_volume(ref.name).get("Mountpoint")
        return Path(point) if point else None

    def delete(self, session_id: str) -> None:
        """Remove the volume, the mount and the image. Idempotent, best effort."""
        d = self._dir(session_id)
        if self.volumes:
            with contextlib.suppress(Exception):
                self._api().remove_volume(volume_name(session_id), force=True)
        mnt = d / "mnt"
        if os.path.ismount(mnt):
            subprocess.run(["umount", str(mnt)], capture_output=True, check=False)
            if os.path.ismount(mnt):
                subprocess.run(["umount", "-l", str(mnt)], capture_output=True, check=False)
        if not os.path.ismount(mnt):
            with contextlib.suppress(OSError):
                (d / "workspace.img").unlink()
            shutil.rmtree(mnt, ignore_errors=True)


def _check(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SandboxError(f"{what} failed while creating a workspace: {proc.stderr.strip() or proc.stdout.strip()}")

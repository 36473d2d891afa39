"""Session workspaces on Docker: a sparse ext4 image of the quota's size, loop-mounted on the host
under ``<home>/sessions/<id>/mnt`` and handed to containers as a named volume (a bind of that mount).

Why: it is kept apart from any container, so a session survives its containers being recycled and
can be reattached from another process; the quota is a real filesystem size, so code that writes
past it gets ENOSPC inside while the host disk and other sessions are untouched; and under gVisor a
named volume works where a plain host bind mount did not. Without root (no loop mounts) the
workspace is a plain named volume and the quota is not enforced (the ref says so).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
from pathlib import Path
from typing import Any

from sandloop.contract import SandboxError
from sandloop.runtime.base import WorkspaceRef
from sandloop.runtime.docker.errors import engine_errors
from sandloop.runtime.labels import LABEL_PREFIX, SESSION_LABEL

log = logging.getLogger(__name__)


def volume_name(session_id: str) -> str:
    return f"sandloop-ws-{session_id}"


def can_enforce_quotas() -> bool:
    return bool(os.geteuid() == 0 and shutil.which("mkfs.ext4") and shutil.which("mount"))


class DockerWorkspaces:
    def __init__(self, api: Any, home: Path) -> None:
        self._api = api  # a callable returning the docker APIClient (connected lazily)
        self.root = home / "sessions"

    def _dir(self, session_id: str) -> Path:
        return self.root / session_id

    def create(self, session_id: str, quota_bytes: int, owner_uid_gid: str) -> WorkspaceRef:
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
        else:
            log.warning("no root or no loop mounts: session %s gets a workspace without a quota", session_id)
            opts, enforced = None, False
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

    def delete(self, session_id: str) -> None:
        """Remove the volume, the mount and the image. Idempotent, best effort."""
        d = self._dir(session_id)
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

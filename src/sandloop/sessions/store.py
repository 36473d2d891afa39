"""Where sessions live: a record per session on the host, and a workspace per session.

A workspace is a sparse ext4 image of the quota's size, loop-mounted on the host under
``$SANDLOOP_HOME/sessions/<id>/mnt`` and handed to containers as a named Docker volume (a bind of
that mount). Why: it is kept apart from any container, so a session survives its containers being
recycled and can be reattached from another process; the quota is a real filesystem size, so code
that writes past it gets ENOSPC inside while the host disk and other sessions are untouched; and
under gVisor a named volume works where a plain host bind mount did not. Without root (no loop
mounts) the workspace is a plain named volume and the quota is not enforced (the record says so).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import secrets
import shutil
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from sandloop.contract import SandboxError, SessionNotFound
from sandloop.runtime.labels import LABEL_PREFIX

log = logging.getLogger(__name__)

SESSION_LABEL = f"{LABEL_PREFIX}session"
WORKSPACE = "/workspace"


def sandloop_home() -> Path:
    if os.environ.get("SANDLOOP_HOME"):
        return Path(os.environ["SANDLOOP_HOME"])
    if os.geteuid() == 0:
        return Path("/var/lib/sandloop")
    return Path(os.environ.get("XDG_DATA_HOME", Path.home() / ".local/share")) / "sandloop"


@dataclass
class SessionRecord:
    id: str
    created: float
    last_used: float
    ttl_seconds: float
    quota_bytes: int
    quota_enforced: bool
    volume: str
    image: str
    limits: dict[str, Any]

    @property
    def expires_at(self) -> float:
        return self.last_used + self.ttl_seconds


class SessionStore:
    def __init__(self, backend: Any, home: Path | None = None) -> None:
        self.backend = backend
        self.root = (home or sandloop_home()) / "sessions"

    def _dir(self, session_id: str) -> Path:
        if not session_id.startswith("s-") or not session_id[2:].isalnum():
            raise SessionNotFound(f"{session_id!r} is not a session id (they look like s-1a2b3c4d5e6f)")
        return self.root / session_id

    # -- records -------------------------------------------------------------------------------
    def load(self, session_id: str) -> SessionRecord:
        path = self._dir(session_id) / "session.json"
        try:
            record = SessionRecord(**json.loads(path.read_text()))
        except FileNotFoundError:
            raise SessionNotFound(f"no session {session_id}: it was deleted or expired") from None
        if record.expires_at < time.time():
            self.delete(session_id)
            raise SessionNotFound(f"session {session_id} expired after {record.ttl_seconds:g} s idle and was removed")
        return record

    def save(self, record: SessionRecord) -> None:
        path = self._dir(record.id) / "session.json"
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(asdict(record)))
        os.replace(tmp, path)

    def touch(self, record: SessionRecord) -> None:
        """Restart the idle clock. Written at most once a second (or per 1% of the TTL): a cell
        takes ~1 ms, and a file write on each would be most of it."""
        now = time.time()
        if now - record.last_used < min(1.0, record.ttl_seconds / 100):
            return
        record.last_used = now
        with contextlib.suppress(OSError):
            self.save(record)

    def list(self) -> list[SessionRecord]:
        out = []
        if self.root.is_dir():
            for d in sorted(self.root.iterdir()):
                with contextlib.suppress(SessionNotFound, ValueError, TypeError, json.JSONDecodeError):
                    out.append(self.load(d.name))
        return out

    # -- lifecycle -------------------------------------------------------------------------------
    def create(
        self, *, ttl_seconds: float, quota_bytes: int, image: str, limits: dict[str, Any], owner_uid_gid: str
    ) -> SessionRecord:
        session_id = "s-" + secrets.token_hex(6)
        d = self._dir(session_id)
        d.mkdir(parents=True, mode=0o700)
        volume = f"sandloop-ws-{session_id}"
        try:
            enforced = self._make_workspace(d, volume, session_id, quota_bytes, owner_uid_gid)
            now = time.time()
            record = SessionRecord(session_id, now, now, ttl_seconds, quota_bytes, enforced, volume, image, limits)
            self.save(record)
            return record
        except BaseException:
            self.delete(session_id)
            raise

    def _make_workspace(self, d: Path, volume: str, session_id: str, quota_bytes: int, owner: str) -> bool:
        labels = {
            f"{LABEL_PREFIX}owner": f"session:{session_id}",
            f"{LABEL_PREFIX}purpose": "session",
            SESSION_LABEL: session_id,
        }
        can_loop = os.geteuid() == 0 and shutil.which("mkfs.ext4") and shutil.which("mount")
        if can_loop:
            img, mnt = d / "workspace.img", d / "mnt"
            mnt.mkdir()
            with open(img, "wb") as f:
                f.truncate(quota_bytes)
            _check(
                ["mkfs.ext4", "-q", "-F", "-m", "0", "-O", "^has_journal", "-E", f"root_owner={owner}", str(img)],
                "mkfs.ext4",
            )
            self._mount(d)
            shutil.rmtree(mnt / "lost+found", ignore_errors=True)
            self.backend.create_volume(volume, labels, {"type": "none", "o": "bind", "device": str(mnt)})
            return True
        log.warning("no root or no loop mounts: session %s gets a workspace without a quota", session_id)
        self.backend.create_volume(volume, labels, None)
        return False

    def _mount(self, d: Path) -> None:
        _check(["mount", "-o", "loop,nosuid,nodev", str(d / "workspace.img"), str(d / "mnt")], "mount")

    def ensure_mounted(self, record: SessionRecord) -> None:
        """After a host reboot the loop mount is gone while the image remains: mount it again."""
        d = self._dir(record.id)
        if record.quota_enforced and not os.path.ismount(d / "mnt"):
            self._mount(d)

    def delete(self, session_id: str) -> None:
        """Remove the session's containers, volume, mount and files. Idempotent, best effort."""
        d = self._dir(session_id)
        with contextlib.suppress(Exception):
            self.backend.remove_containers_labelled(f"{SESSION_LABEL}={session_id}")
        with contextlib.suppress(Exception):
            self.backend.remove_labelled("volume", f"sandloop-ws-{session_id}")
        mnt = d / "mnt"
        if os.path.ismount(mnt):
            subprocess.run(["umount", str(mnt)], capture_output=True, check=False)
            if os.path.ismount(mnt):
                subprocess.run(["umount", "-l", str(mnt)], capture_output=True, check=False)
        if not os.path.ismount(mnt):
            shutil.rmtree(d, ignore_errors=True)

    def reap_expired(self, now: float | None = None) -> list[str]:
        """Delete every session idle past its TTL; return their ids."""
        now = time.time() if now is None else now
        gone = []
        if not self.root.is_dir():
            return gone
        for d in self.root.iterdir():
            try:
                record = SessionRecord(**json.loads((d / "session.json").read_text()))
            except FileNotFoundError:
                if time.time() - d.stat().st_mtime > 3600:  # a create that died half-way
                    self.delete(d.name)
                continue
            except (ValueError, TypeError, OSError):
                continue
            if record.expires_at < now:
                self.delete(record.id)
                gone.append(record.id)
        return gone


def _check(cmd: list[str], what: str) -> None:
    proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SandboxError(f"{what} failed while creating a workspace: {proc.stderr.strip() or proc.stdout.strip()}")

"""Where sessions live: a record per session on this host (``<home>/sessions/<id>/session.json``)
and a workspace per session, which the backend makes and keeps apart from any sandbox
(``Workspaces`` in ``runtime/base.py``; on Docker a loop-mounted ext4 volume of the quota's size).
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import json
import os
import secrets
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Protocol

from sandloop.contract import HostDiskFull, SessionNotFound
from sandloop.paths import default_home
from sandloop.runtime.base import Housekeeping, WorkspaceRef, Workspaces
from sandloop.runtime.labels import SESSION_LABEL

WORKSPACE = "/workspace"
__all__ = ["SESSION_LABEL", "WORKSPACE", "SessionRecord", "SessionStore"]


class SessionBackend(Workspaces, Housekeeping, Protocol):
    """What the store needs of a backend."""


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

    @property
    def workspace(self) -> WorkspaceRef:
        return WorkspaceRef(self.volume, self.quota_enforced)


class SessionStore:
    def __init__(self, backend: SessionBackend, home: Path | None = None) -> None:
        self.backend = backend
        self.root = (home or default_home()) / "sessions"

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
        try:
            tmp.write_text(json.dumps(asdict(record)))
            os.replace(tmp, path)  # the old record stays whole until the new one is
        except OSError as exc:
            tmp.unlink(missing_ok=True)
            if exc.errno == errno.ENOSPC:
                raise HostDiskFull(f"cannot save session {record.id}: the disk under {self.root} is full") from None
            raise

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
        try:
            ref = self.backend.create_workspace(session_id, quota_bytes, owner_uid_gid)
            now = time.time()
            record = SessionRecord(
                session_id, now, now, ttl_seconds, quota_bytes, ref.quota_enforced, ref.name, image, limits
            )
            self.save(record)
            return record
        except BaseException:
            self.delete(session_id)
            raise

    def ensure_workspace(self, record: SessionRecord) -> None:
        """After a host reboot a workspace may need remounting: the backend knows."""
        self.backend.ensure_workspace(record.id, record.workspace)

    def delete(self, session_id: str) -> None:
        """Remove the session's sandboxes, workspace and record. Idempotent, best effort."""
        d = self._dir(session_id)
        with contextlib.suppress(Exception):
            self.backend.remove_labelled(SESSION_LABEL, session_id)
        with contextlib.suppress(Exception):
            self.backend.delete_workspace(session_id)
        if not _mounts_below(d):  # never delete through a workspace that would not unmount
            shutil.rmtree(d, ignore_errors=True)

    def reap_expired(self, now: float | None = None) -> builtins.list[str]:
        """Delete every session idle past its TTL; return their ids."""
        now = time.time() if now is None else now
        gone: builtins.list[str] = []
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


def _mounts_below(d: Path) -> bool:
    prefix = str(d) + "/"
    try:
        with open("/proc/self/mounts") as f:
            return any(line.split()[1].startswith(prefix) for line in f if len(line.split()) > 1)
    except OSError:
        return os.path.ismount(d / "mnt")

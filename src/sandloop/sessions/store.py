"""Where sessions live: a record per session and a workspace per session, which the backend makes
and keeps apart from any sandbox (``Workspaces`` in ``runtime/base.py``; on Docker a loop-mounted
ext4 volume of the quota's size).

The record is a file on this host (``<home>/sessions/<id>/session.json``), or, on a backend that
spans hosts (``SharedRecords``: the Ray backend), kept where every driver of the cluster sees it.
Either way ``<home>/sessions/<id>/`` on this host holds what is local to it (the interpreter's
lock; on Docker, the workspace's mount point).
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
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Protocol, runtime_checkable

from sandloop.contract import HostDiskFull, SandboxError, SessionDamaged, SessionNotFound
from sandloop.paths import default_home, tree_size, write_atomically
from sandloop.runtime.base import Housekeeping, RemoteSessions, WorkspaceRef, Workspaces
from sandloop.runtime.labels import SESSION_LABEL, owner_alive
from sandloop.sessions.snapshots import PAUSED, paused_for_idleness, paused_kind

WORKSPACE = "/workspace"
#: The workspace is mounted here too: where code written for E2B's sandboxes keeps its files.
HOME_DIR = "/home/user"
__all__ = ["HOME_DIR", "SESSION_LABEL", "WORKSPACE", "SessionRecord", "SessionStore", "SharedRecords"]


class SessionBackend(Workspaces, Housekeeping, Protocol):
    """What the store needs of a backend."""


@runtime_checkable
class SharedRecords(Protocol):
    """A backend whose sessions' records every driver must see (drivers on other hosts attach to
    them): it keeps them (the Ray backend: in its registry on the head), not this host's files."""

    def get_record(self, session_id: str) -> dict[str, Any] | None: ...

    def put_record(self, session_id: str, record: dict[str, Any]) -> None: ...

    def remove_record(self, session_id: str) -> None: ...

    def all_records(self) -> dict[str, dict[str, Any]]:
        """Every record, in one call (the reaper reads them all)."""
        ...


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
    #: A warm session nobody has yet (``sessions/reserve.py``): the owner id of the process that
    #: keeps it. Nobody lists or attaches to it; it is removed when that process is gone.
    reserved_by: str = ""

    @property
    def expires_at(self) -> float:
        return self.last_used + self.ttl_seconds

    @property
    def workspace(self) -> WorkspaceRef:
        return WorkspaceRef(self.volume, self.quota_enforced)


class SessionStore:
    def __init__(
        self,
        backend: SessionBackend,
        home: Path | None = None,
        *,
        paused_retention: float = 30 * 86400,
        records_elsewhere: bool = False,
    ) -> None:
        """``records_elsewhere``: this host holds sessions whose records another keeps (a Ray
        node: the cluster's registry keeps them, a driver's reaper expires them); it neither writes
        records nor reaps."""
        self.backend = backend
        self.root = (home or default_home()) / "sessions"
        #: The longest a paused session is kept after it was last used (its idle TTL counts on:
        #: it goes at whichever comes first).
        self.paused_retention = paused_retention
        #: Where records live when not in this host's files.
        self.shared = backend if isinstance(backend, SharedRecords) else None
        #: Where sessions live when not on this host (pause and resume happen there).
        self.remote = backend if isinstance(backend, RemoteSessions) else None
        self.records_elsewhere = records_elsewhere

    def paused(self, session_id: str) -> str | None:
        """How the session is paused ("memory", "state", "files"), None while it runs."""
        if self.remote is not None:
            return self.remote.session_paused(session_id)
        return paused_kind(self._dir(session_id))

    def idle_paused(self, session_id: str) -> bool:
        """Whether the session is paused for want of use (``sessions/idle.py``): its next call
        resumes it, and its idle TTL goes on counting."""
        return self.remote is None and paused_for_idleness(self._dir(session_id))

    def stopped_here(self, session_id: str) -> bool:
        """Whether the session is paused on this host, or a pause of it was cut short here (its
        next pause, resume or attach settles which)."""
        d = self._dir(session_id)
        return paused_kind(d) is not None or (d / f".{PAUSED}").exists()

    def paused_bytes(self, session_id: str) -> int:
        """Bytes on disk of the session's pause (its memory image or state), 0 while it runs; what
        it holds beyond its workspace (counted against a token's ``--max-workspace``). 0 for a
        session on another host (a cluster's node keeps its pause)."""
        if self.remote is not None:
            return 0
        d = self._dir(session_id) / PAUSED
        return tree_size(d) if d.is_dir() else 0

    def expired(self, record: SessionRecord, now: float | None = None) -> bool:
        """Past its idle TTL, paused or not (issue 52 finding 9: a caller's pause was kept 30 days
        whatever its TTL; a pause is a use, so its TTL counts from it); a paused one also past
        ``paused_retention``, if that comes first."""
        now = time.time() if now is None else now
        if record.expires_at < now:
            return True
        if now <= record.last_used + self.paused_retention:
            return False  # whether it is paused does not matter (no call to its node)
        try:
            return self.paused(record.id) is not None
        except SandboxError:  # its node is gone: nothing of it is kept, paused or not
            return False

    def _dir(self, session_id: str) -> Path:
        if not session_id.startswith("s-") or not session_id[2:].isalnum():
            raise SessionNotFound(f"{session_id!r} is not a session id (they look like s-1a2b3c4d5e6f)")
        return self.root / session_id

    def here(self, session_id: str) -> Path:
        """The session's directory on this host, made if it is not there yet."""
        d = self._dir(session_id)
        d.mkdir(parents=True, exist_ok=True, mode=0o700)
        return d

    # -- records -------------------------------------------------------------------------------
    def _read(self, session_id: str) -> SessionRecord | None:
        """The record, ``None`` when there is none; a damaged one raises (ValueError, TypeError)."""
        d = self._dir(session_id)  # refuses what is not a session id
        if self.shared is not None:
            data = self.shared.get_record(session_id)
            return None if data is None else SessionRecord(**data)
        try:
            return SessionRecord(**json.loads((d / "session.json").read_text()))
        except FileNotFoundError:
            return None

    def load(self, session_id: str) -> SessionRecord:
        try:
            record = self._read(session_id)
        except (ValueError, TypeError) as exc:
            where = (
                "in the cluster's registry" if self.shared is not None else str(self._dir(session_id) / "session.json")
            )
            raise SessionDamaged(
                f"the record of session {session_id} is damaged ({exc}); it is kept as it is for you to look at "
                f"({where}): delete the session to remove it and what it holds"
            ) from None
        if record is None or record.reserved_by:
            raise SessionNotFound(f"no session {session_id}: it was deleted or expired")
        if self.expired(record):
            self.delete(session_id)
            raise SessionNotFound(f"session {session_id} expired after {record.ttl_seconds:g} s idle and was removed")
        if self.shared is not None:  # made on another host: this one needs its own directory
            self.here(session_id)
        return record

    def save(self, record: SessionRecord) -> None:
        if self.records_elsewhere:
            return  # the host that keeps the records saves them
        if self.shared is not None:
            self.shared.put_record(record.id, asdict(record))
            return
        try:  # the old record stays whole until the new one is
            write_atomically(self._dir(record.id) / "session.json", json.dumps(asdict(record)))
        except OSError as exc:
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
        with contextlib.suppress(OSError, SandboxError):
            self.save(record)

    def _all(self) -> dict[str, SessionRecord | None]:
        """Every session's record by id (``None``: damaged, left for a person to look at)."""
        out: dict[str, SessionRecord | None] = {}
        if self.shared is not None:
            for session_id, data in self.shared.all_records().items():
                try:
                    out[session_id] = SessionRecord(**data)
                except TypeError:
                    out[session_id] = None
        elif self.root.is_dir():
            for d in sorted(self.root.iterdir()):
                try:
                    record = self._read(d.name)
                except (SessionNotFound, ValueError, TypeError, OSError):
                    out[d.name] = None
                    continue
                if record is not None:
                    out[d.name] = record
        return out

    def list(self) -> list[SessionRecord]:
        """The live sessions (one found expired is removed on the way, as ``load`` does)."""
        out = []
        for record in self._all().values():
            if record is None or record.reserved_by:
                continue
            if self.expired(record):
                self.delete(record.id)
                continue
            out.append(record)
        return out

    # -- lifecycle -------------------------------------------------------------------------------
    def create(
        self,
        *,
        ttl_seconds: float,
        quota_bytes: int,
        image: str,
        limits: dict[str, Any],
        owner_uid_gid: str,
        reserved_by: str = "",
        place: str | None = None,
    ) -> SessionRecord:
        """A new session's record and workspace; ``reserved_by``: a warm session kept by that
        process until ``claim``; ``place``: where it lives, on a backend whose sessions live on
        other hosts (a node's id: a session from a snapshot lives where the snapshot is kept)."""
        session_id = "s-" + secrets.token_hex(6)
        d = self._dir(session_id)
        d.mkdir(parents=True, mode=0o700)
        try:
            if place is not None and self.remote is not None:
                self.remote.place_session(session_id, place)
            ref = self.backend.create_workspace(session_id, quota_bytes, owner_uid_gid)
            now = time.time()
            record = SessionRecord(
                session_id, now, now, ttl_seconds, quota_bytes, ref.quota_enforced, ref.name, image, limits, reserved_by
            )
            self.save(record)
            return record
        except BaseException:
            self.delete(session_id)
            raise

    def claim(self, record: SessionRecord, ttl_seconds: float) -> SessionRecord:
        """A warm session made someone's: from now on it is a session like any other."""
        now = time.time()
        claimed = replace(record, created=now, last_used=now, ttl_seconds=ttl_seconds, reserved_by="")
        self.save(claimed)
        return claimed

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
        if self.shared is not None:
            with contextlib.suppress(Exception):
                self.shared.remove_record(session_id)
        if not _mounts_below(d):  # never delete through a workspace that would not unmount
            shutil.rmtree(d, ignore_errors=True)

    def reap_expired(self, now: float | None = None) -> builtins.list[str]:
        """Delete every session idle past its TTL, and warm sessions whose keeper is gone; return
        their ids. Also a directory here with
        no record anywhere for an hour: a create that died half-way (or, with shared records, a
        session another host deleted)."""
        now = time.time() if now is None else now
        gone: builtins.list[str] = []
        if self.records_elsewhere:  # the sessions here are the records' keeper's to expire
            return gone
        records = self._all()
        for session_id, record in records.items():
            if record is not None and (self.expired(record, now) or owner_alive(record.reserved_by) is False):
                self.delete(session_id)
                gone.append(session_id)
        if self.root.is_dir():
            for d in self.root.iterdir():
                with contextlib.suppress(SessionNotFound, OSError):
                    if d.name not in records and time.time() - d.stat().st_mtime > 3600:
                        self.delete(d.name)
        return gone


def _mounts_below(d: Path) -> bool:
    prefix = str(d) + "/"
    try:
        with open("/proc/self/mounts") as f:
            return any(line.split()[1].startswith(prefix) for line in f if len(line.split()) > 1)
    except OSError:
        return os.path.ismount(d / "mnt")

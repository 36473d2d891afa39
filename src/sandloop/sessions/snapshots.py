"""Pause, resume, snapshot and fork a session (issue 25).

What a snapshot keeps, by kind (it always says which; it never pretends):

- ``memory``: the interpreter's whole state, through the backend's checkpoint
  (``MemorySnapshots``: runsc on the direct backend): variables, imports, background processes
  with their pids, open files, sockets, ``/tmp``; and the workspace's files.
- ``state``: where memory cannot be kept (runc: this host's CRIU cannot checkpoint), the default
  Python context's globals that pickle (modules by name), with the names that did not listed in
  ``dropped``; and the workspace's files. Processes, open files and other contexts are not kept.
- ``files``: the session had no interpreter running: the workspace's files only.

Layout on this host (``<home>``: sandloop's home)::

    sessions/<id>/paused/        a paused session's state (its workspace stays where it is)
    snapshots/<snap-id>/         snapshot.json, files/ (the workspace), memory/ or state.pkl

Each is written under a dot-name and renamed into place when whole, so a process killed part-way
leaves the session running (or paused) as it was, never neither; the leftovers are swept.
"""

from __future__ import annotations

import builtins
import contextlib
import json
import os
import secrets
import shutil
import stat
import subprocess
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from sandloop.contract import InvalidArgument, SandboxError, SnapshotNotFound
from sandloop.paths import tree_size
from sandloop.runtime.base import MemorySnapshots, RemoteSessions

KINDS = ("memory", "state", "files")
PAUSED = "paused"
#: In a paused session's state: paused by ``sessions/idle.py`` for want of use (its next call
#: resumes it; its idle TTL goes on counting).
IDLE_MARK = "idle"
#: In the workspace for the moment a ``state`` save or load crosses the sandbox's boundary.
STATE_FILE = ".sandloop-state.pkl"

#: Runs in the session's default Python context: pickles each global it can (modules by name), one
#: by one, to the workspace file; prints the names it could not keep. Leaves no name behind.
SAVE_STATE = """
def _sandloop_save(path):
    import json, pickle, types
    kept, dropped = {}, []
    for name, value in list(globals().items()):
        if name.startswith('_') or name in ('In', 'Out', 'exit', 'quit', 'get_ipython', 'display', 'open'):
            continue
        if isinstance(value, types.ModuleType):
            kept[name] = ('module', value.__name__)
            continue
        try:
            kept[name] = ('value', pickle.dumps(value))
        except Exception:
            dropped.append(name)
    with open(path, 'wb') as f:
        pickle.dump(kept, f)
    print(json.dumps(sorted(dropped)))
_sandloop_save(%r)
del _sandloop_save
"""

LOAD_STATE = """
def _sandloop_load(path):
    import importlib, json, os, pickle
    with open(path, 'rb') as f:
        kept = pickle.load(f)
    os.unlink(path)
    failed = []
    for name, (kind, value) in kept.items():
        try:
            globals()[name] = importlib.import_module(value) if kind == 'module' else pickle.loads(value)
        except Exception:
            failed.append(name)
    print(json.dumps(sorted(failed)))
_sandloop_load(%r)
del _sandloop_load
"""


@dataclass
class SnapshotRecord:
    id: str
    session_id: str
    name: str
    kind: str
    created: float
    size_bytes: int
    image: str
    limits: dict[str, Any]
    quota_bytes: int
    owner_uid_gid: str
    ttl_seconds: float
    #: Globals a ``state`` snapshot could not keep.
    dropped: list[str] = field(default_factory=list)
    #: Who made it (the HTTP API's token), for listing and quotas.
    owner: str = ""


def new_snapshot_id() -> str:
    return "snap-" + secrets.token_hex(6)


def check_snapshot_id(snapshot_id: str) -> str:
    if not isinstance(snapshot_id, str) or not snapshot_id.startswith("snap-") or not snapshot_id[5:].isalnum():
        raise SnapshotNotFound(f"{snapshot_id!r} is not a snapshot id (they look like snap-1a2b3c4d5e6f)")
    return snapshot_id


class SnapshotStore:
    """Snapshot records and their files under ``<home>/snapshots``."""

    def __init__(self, home: Path) -> None:
        self.root = home / "snapshots"

    def dir(self, snapshot_id: str) -> Path:
        return self.root / check_snapshot_id(snapshot_id)

    def staging(self, snapshot_id: str) -> Path:
        """Where a snapshot is written before it is whole (renamed by ``commit``)."""
        self.root.mkdir(parents=True, exist_ok=True, mode=0o700)
        return self.root / f".{snapshot_id}"

    def commit(self, record: SnapshotRecord) -> SnapshotRecord:
        staged = self.staging(record.id)
        record.size_bytes = tree_size(staged)
        (staged / "snapshot.json").write_text(json.dumps(asdict(record)))
        os.rename(staged, self.dir(record.id))
        return record

    def get(self, snapshot_id: str) -> SnapshotRecord:
        try:
            data = json.loads((self.dir(snapshot_id) / "snapshot.json").read_text())
        except (OSError, ValueError):
            raise SnapshotNotFound(f"no snapshot {snapshot_id}: it was deleted, or never made") from None
        return SnapshotRecord(**data)

    def list(self, session_id: str | None = None) -> builtins.list[SnapshotRecord]:
        out = []
        if self.root.is_dir():
            for d in sorted(self.root.iterdir()):
                if d.name.startswith("."):
                    continue
                with contextlib.suppress(SnapshotNotFound):
                    record = self.get(d.name)
                    if session_id is None or record.session_id == session_id:
                        out.append(record)
        return sorted(out, key=lambda r: r.created)

    def delete(self, snapshot_id: str) -> None:
        """Remove it. Idempotent."""
        shutil.rmtree(self.dir(snapshot_id), ignore_errors=True)

    def expire(self, retention: float) -> builtins.list[str]:
        """Remove snapshots older than ``retention`` seconds; their ids."""
        gone = [r.id for r in self.list() if r.created + retention < time.time()]
        for snapshot_id in gone:
            self.delete(snapshot_id)
        return gone

    def sweep(self, older_than: float = 3600) -> builtins.list[str]:
        """Remove staging folders a killed process left (older than ``older_than`` seconds)."""
        gone = []
        if self.root.is_dir():
            for d in self.root.iterdir():
                with contextlib.suppress(OSError):
                    if d.name.startswith(".") and time.time() - d.stat().st_mtime > older_than:
                        shutil.rmtree(d, ignore_errors=True)
                        gone.append(d.name)
        return gone

    def total_bytes(self, owner: str | None = None) -> int:
        return sum(r.size_bytes for r in self.list() if owner is None or r.owner == owner)


class ClusterSnapshots:
    """The snapshots of sessions that live on other hosts (``RemoteSessions``: the Ray backend's
    nodes), each kept by the node that made it, in that node's ``SnapshotStore``; asked of every
    node. Retention and the sweep are each node's reaper's."""

    def __init__(self, remote: RemoteSessions) -> None:
        self.remote = remote

    def locate(self, snapshot_id: str) -> tuple[str, SnapshotRecord]:
        """Where it is kept (a session started from it lives there too), and its record."""
        found = self.remote.snapshot_record(check_snapshot_id(snapshot_id))
        if found is None:
            raise SnapshotNotFound(f"no snapshot {snapshot_id}: it was deleted, or never made (or its node is gone)")
        return found[0], SnapshotRecord(**found[1])

    def get(self, snapshot_id: str) -> SnapshotRecord:
        return self.locate(snapshot_id)[1]

    def list(self, session_id: str | None = None) -> builtins.list[SnapshotRecord]:
        return sorted((SnapshotRecord(**r) for r in self.remote.snapshot_records(session_id)), key=lambda r: r.created)

    def delete(self, snapshot_id: str) -> None:
        self.remote.delete_snapshot(check_snapshot_id(snapshot_id))

    def expire(self, retention: float) -> builtins.list[str]:
        return []  # each node's reaper expires its own

    def sweep(self, older_than: float = 3600) -> builtins.list[str]:
        return []

    def total_bytes(self, owner: str | None = None) -> int:
        return sum(r.size_bytes for r in self.list() if owner is None or r.owner == owner)


def memory_backend(backend: Any) -> MemorySnapshots | None:
    return backend if isinstance(backend, MemorySnapshots) else None


def copy_files(source: Path, dest: Path) -> None:
    """The workspace's files, owners, modes and times kept (``dest`` made here)."""
    dest.mkdir(parents=True, exist_ok=True, mode=0o700)
    proc = subprocess.run(["cp", "-a", f"{source}/.", str(dest)], capture_output=True, text=True, check=False)
    if proc.returncode != 0:
        raise SandboxError(f"could not copy the workspace's files: {proc.stderr.strip()[-500:]}")


def take_file(source: Path, dest: Path) -> None:
    """Move a file the sandbox wrote in its workspace out to ``dest`` on the host, never following
    a link the sandbox may have put there instead (it would name a *host* path here): the file is
    opened with ``O_NOFOLLOW`` and must be a regular file; its bytes are copied, then it goes.

    Raises:
        SandboxError: it is missing, a link, or not a regular file.
    """
    try:
        try:
            fd = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError as exc:
            raise SandboxError(
                f"the sandbox's state file could not be read safely ({exc.strerror}): not kept"
            ) from None
        try:
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise SandboxError("the sandbox's state file is not a regular file: not kept")
            with open(fd, "rb", closefd=False) as src, open(dest, "xb") as out:
                shutil.copyfileobj(src, out, 1024 * 1024)
        finally:
            os.close(fd)
    finally:
        with contextlib.suppress(OSError):
            source.unlink()  # unlink never follows a link


def place_file(source: Path, dest: Path, uid: int, gid: int) -> None:
    """Copy a host file into the workspace as ``dest``, owned by the sandbox's user: whatever the
    sandbox left at that name (a link to a host path, a directory) is removed first and the file
    made with ``O_EXCL | O_NOFOLLOW``, so nothing outside the workspace is ever written."""
    with contextlib.suppress(FileNotFoundError, IsADirectoryError, PermissionError):
        dest.unlink()
    if dest.is_dir() and not dest.is_symlink():
        shutil.rmtree(dest)
    fd = os.open(dest, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
    try:
        os.fchown(fd, uid, gid)
        with open(source, "rb") as src, open(fd, "wb", closefd=False) as out:
            shutil.copyfileobj(src, out, 1024 * 1024)
    finally:
        os.close(fd)


def paused_kind(session_dir: Path) -> str | None:
    """The kind of the pause a session is in (None: it runs). The ``kind`` file is written last."""
    try:
        kind = (session_dir / PAUSED / "kind").read_text().strip()
    except OSError:
        return None
    return kind if kind in KINDS else None


def paused_for_idleness(session_dir: Path) -> bool:
    """Whether the session's pause is an idle pause (``sessions/idle.py``), not a caller's."""
    return paused_kind(session_dir) is not None and (session_dir / PAUSED / IDLE_MARK).exists()


def describe(record: SnapshotRecord) -> dict[str, Any]:
    """A snapshot as the front ends show it."""
    out = asdict(record)
    out.pop("limits", None)
    return out


def validate_count(count: int) -> int:
    if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 20:
        raise InvalidArgument(f"count must be a whole number from 1 to 20, got {count!r}")
    return count


__all__ = [
    "IDLE_MARK",
    "KINDS",
    "ClusterSnapshots",
    "LOAD_STATE",
    "PAUSED",
    "SAVE_STATE",
    "STATE_FILE",
    "SnapshotRecord",
    "SnapshotStore",
    "copy_files",
    "describe",
    "memory_backend",
    "new_snapshot_id",
    "paused_for_idleness",
    "paused_kind",
    "place_file",
    "take_file",
    "validate_count",
]

"""Watching a session's workspace for changes: inotify on the host's view of the workspace.

Why on the host: the kernel that keeps the workspace's files sees every change to them, made by
the session's own code, by its processes, or by the file API's helper sandboxes (a helper is a
sandbox of its own: on gVisor no inotify inside the session's sandbox would see its writes). On
runc the host kernel is the sandbox's; on gVisor the gofer makes each change with a host system
call. A watcher never reads or follows what the sandbox wrote:

- the watched directory is reached from the workspace's root one component at a time, each
  opened ``O_NOFOLLOW | O_DIRECTORY``: a symlink the sandbox planted (to /etc, say) is refused,
  not followed; the watch is added on the opened directory itself (``/proc/self/fd/N``), so
  swapping a directory for a link after the check changes nothing;
- a recursive watch walks the tree the same way (no symlinks, no other filesystem);
- an event's entry (``include_entry``) is an ``lstat`` beside the opened parent: never a read.

Events are E2B's (fsnotify's): create (also a move into the directory), write, chmod (attributes,
owner, extended attributes), remove, rename (a move out). Names are relative to the watched
directory (``nested/file.txt`` in a recursive watch). The file API writes a file that already
exists as a temporary file renamed over it (a reader never sees half of it): a watcher reports
that as one write of the file and never shows the temporary name.

Costs are bounded: at most ``MAX_WATCHERS`` on the host (each is an inotify instance, and the
kernel allows root 128 in all), ``MAX_PER_SESSION`` per session, ``MAX_DIRS`` directories in one
watch, ``MAX_EVENTS`` unread events (past it the watch ends with an error that says so).
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import threading
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from inotify_simple import INotify, flags

from sandloop.contract import InvalidArgument, PathRefused, SandboxBusy, SandboxError, WorkspaceFileNotFound
from sandloop.sessions.files_helper import describe

#: Live watchers on this host, in all (each is an inotify instance: root has 128 in all).
MAX_WATCHERS = 32
#: Live watchers of one session.
MAX_PER_SESSION = 8
#: Directories one recursive watch may cover.
MAX_DIRS = 4096
#: Events kept unread; past it the watch ends (its reader is told).
MAX_EVENTS = 10_000
#: Moves whose second half has not come yet (a move out of the tree never sends one).
MAX_MOVES = 64
#: The file API's temporary name for a file being replaced (files_helper.py's op_write):
#: ``NAME.<12 hex digits>.sandloop-tmp``.
TMP_SUFFIX = ".sandloop-tmp"
_TMP_TAIL = 1 + 12 + len(TMP_SUFFIX)

_MASK = (
    flags.CREATE
    | flags.MOVED_TO
    | flags.MOVED_FROM
    | flags.ATTRIB
    | flags.MODIFY
    | flags.DELETE
    | flags.DELETE_SELF
    | flags.MOVE_SELF
    | flags.ONLYDIR
    | flags.EXCL_UNLINK
)
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

_lock = threading.Lock()
_live: dict[str, int] = {}  # session id -> live watchers


@dataclass
class WatchEvent:
    """One change: ``type`` is create, write, chmod, remove or rename; ``name`` is relative to
    the watched directory; ``entry`` (when asked for, and the path still exists) is its
    ``stat`` as ``Session.stat`` gives it."""

    name: str
    type: str
    entry: dict[str, Any] | None = None


@dataclass
class _Dir:
    rel: str  # relative to the watch's directory ("" for itself)


def open_dir(root_fd: int, rel: str, shown: str) -> int:
    """``rel`` below ``root_fd``, opened one component at a time, never through a symlink."""
    fd = os.dup(root_fd)
    for part in [p for p in rel.split("/") if p not in ("", ".")]:
        try:
            child = os.open(part, _DIR_FLAGS, dir_fd=fd)
        except OSError as exc:
            os.close(fd)
            if exc.errno == errno.ENOENT:
                raise WorkspaceFileNotFound(f"no such directory in the workspace: {shown}") from None
            if exc.errno in (errno.ENOTDIR, errno.ELOOP):
                raise PathRefused(f"{shown} is not a directory (a file or a symlink): watch a directory") from None
            raise SandboxError(f"cannot open {shown} to watch it: {exc.strerror}") from None
        os.close(fd)
        fd = child
    return fd


class Watcher:
    """A watch on one directory of a workspace (``root`` is where this host sees the workspace,
    ``rel`` the directory in it). Read it with ``events()`` (what happened since the last call,
    without waiting) or ``wait(timeout)``; ``close()`` it (or use ``with``)."""

    def __init__(
        self,
        root: Path,
        rel: str,
        *,
        recursive: bool = False,
        include_entry: bool = False,
        session_id: str = "",
        shown: str | None = None,
    ) -> None:
        self.rel, self.recursive, self.include_entry = rel, recursive, include_entry
        self.session_id = session_id
        self._shown = shown or rel
        self._events: list[WatchEvent] = []
        self._error: str | None = None
        self._closed = False
        #: Called (from the watch's thread) when events arrive: an event loop's wake-up.
        self.notify: Callable[[], None] | None = None
        self._cond = threading.Condition()
        self._dirs: dict[int, _Dir] = {}
        self._moves: dict[int, tuple[str, bool]] = {}  # cookie -> (rel, is a replaced file's temp)
        _admit(session_id)
        self._admitted = True
        self._root_fd = self._inotify = self._wake_r = self._wake_w = -1
        try:
            root_fd = os.open(root, _DIR_FLAGS)
            try:
                self._root_fd = open_dir(root_fd, rel, self._shown)
            finally:
                os.close(root_fd)
            self._dev = os.fstat(self._root_fd).st_dev
            self._notify = INotify()
            self._wake_r, self._wake_w = os.pipe2(os.O_CLOEXEC)
            self._add(self._root_fd, "")
            if recursive:
                self._add_tree("")
        except BaseException:
            self._release()
            raise
        self._thread = threading.Thread(target=self._loop, name=f"sandloop-watch-{session_id}", daemon=True)
        self._thread.start()

    # -- reading ----------------------------------------------------------------------------------
    def events(self) -> list[WatchEvent]:
        """Every event since the last call; raises the error that ended the watch, if one did."""
        with self._cond:
            self._drain()
            return self._take()

    def wait(self, timeout: float) -> list[WatchEvent]:
        """Like ``events()``, waiting up to ``timeout`` seconds for one."""
        with self._cond:
            self._drain()
            if not self._events and self._error is None and not self._closed:
                self._cond.wait(timeout)
                self._drain()
            return self._take()

    def _take(self) -> list[WatchEvent]:
        if self._events:
            out, self._events = self._events, []
            return out
        if self._error is not None:
            raise SandboxError(self._error)
        if self._closed:
            raise SandboxError(f"the watch on {self._shown} was stopped")
        return []

    @property
    def closed(self) -> bool:
        return self._closed

    # -- the watch ----------------------------------------------------------------------------------
    def _add(self, fd: int, rel: str) -> None:
        if len(self._dirs) >= MAX_DIRS:
            raise SandboxBusy(
                f"{self._shown} has more than {MAX_DIRS} directories to watch; watch a narrower directory "
                "or without recursive"
            )
        wd = self._notify.add_watch(f"/proc/self/fd/{fd}", _MASK)
        self._dirs[wd] = _Dir(rel)

    def _add_tree(self, rel: str, *, announce: bool = False) -> None:
        """Watch every directory below ``rel`` (already watched itself), no symlink followed;
        ``announce``: a directory that just appeared, whose entries may have been made before
        its watch was: each gets a create event."""
        pending = [rel]
        while pending:
            here = pending.pop()
            try:
                fd = open_dir(self._root_fd, here, here)
            except (WorkspaceFileNotFound, PathRefused):
                continue  # gone or replaced since: its own events say so
            try:
                with os.scandir(fd) as it:
                    found = [(e.name, e.is_dir(follow_symlinks=False)) for e in it]
                if announce:
                    for name, _ in found:
                        if not name.endswith(TMP_SUFFIX):
                            self._emit(f"{here}/{name}" if here else name, "create")
                for name in [n for n, is_dir in found if is_dir]:
                    try:
                        child = os.open(name, _DIR_FLAGS, dir_fd=fd)
                    except OSError:
                        continue
                    try:
                        if os.fstat(child).st_dev != self._dev:
                            continue  # another filesystem mounted there: not the workspace's
                        sub = f"{here}/{name}" if here else name
                        self._add(child, sub)
                        pending.append(sub)
                    finally:
                        os.close(child)
            finally:
                os.close(fd)

    def _forget_tree(self, rel: str) -> None:
        prefix = rel + "/"
        for wd, d in list(self._dirs.items()):
            if d.rel == rel or d.rel.startswith(prefix):
                with contextlib.suppress(OSError):
                    self._notify.rm_watch(wd)
                self._dirs.pop(wd, None)

    def _loop(self) -> None:
        try:
            while True:
                select.select([self._notify.fileno(), self._wake_r], [], [])
                with self._cond:
                    if self._closed:
                        return
                    self._drain()
                    woken = bool(self._events) or self._error is not None
                    if woken:
                        self._cond.notify_all()
                    ended = self._error is not None
                if woken and self.notify is not None:
                    self.notify()
                if ended:
                    return
        except (OSError, ValueError):  # closed under us
            return

    def _drain(self) -> None:
        """Take what the kernel queued (the caller holds ``_cond``)."""
        if self._closed or self._error is not None:
            return
        try:
            raw = self._notify.read(timeout=0)
        except BlockingIOError:
            raw = []
        for event in raw:
            self._handle(event.wd, event.mask, event.cookie, event.name)
            if self._error is not None:
                return

    def _handle(self, wd: int, mask: int, cookie: int, name: str) -> None:
        if mask & flags.Q_OVERFLOW:
            self._fail("the kernel's event queue overflowed: events were lost and the watch ended")
            return
        d = self._dirs.get(wd)
        if d is None:
            return
        if mask & flags.IGNORED:
            self._dirs.pop(wd, None)
            return
        is_dir = bool(mask & flags.ISDIR)
        if not name:  # the directory itself
            if d.rel == "" and mask & (flags.DELETE_SELF | flags.MOVE_SELF):
                self._emit("", "remove" if mask & flags.DELETE_SELF else "rename")
            return
        rel = f"{d.rel}/{name}" if d.rel else name
        if name.endswith(TMP_SUFFIX) and not is_dir:
            if mask & flags.MOVED_FROM:  # the file API replacing rel without its temporary tail
                self._moved(cookie, rel[:-_TMP_TAIL], True)
            return
        if mask & flags.MOVED_FROM:
            self._moved(cookie, rel, False)
            if is_dir and self.recursive:
                self._forget_tree(rel)
        if mask & flags.MOVED_TO:
            moved = self._moves.pop(cookie, None)
            if moved is not None and moved[1] and moved[0] == rel:
                self._emit(rel, "write")  # the file API's replace: one write of the file
                return
        if mask & (flags.CREATE | flags.MOVED_TO):
            self._emit(rel, "create")
            if is_dir and self.recursive:
                try:
                    fd = open_dir(self._root_fd, rel, rel)
                except (WorkspaceFileNotFound, PathRefused):
                    fd = -1
                if fd >= 0:
                    try:
                        self._add(fd, rel)
                        self._add_tree(rel, announce=True)
                    except SandboxBusy as exc:
                        self._fail(str(exc))
                        return
                    finally:
                        os.close(fd)
        if mask & flags.MOVED_FROM:
            self._emit(rel, "rename")
        if mask & flags.ATTRIB:
            self._emit(rel, "chmod")
        if mask & flags.MODIFY:
            self._emit(rel, "write")
        if mask & flags.DELETE:
            self._emit(rel, "remove")

    def _moved(self, cookie: int, rel: str, replace: bool) -> None:
        """A move's first half, kept until its second (a move out of the tree has none: the
        oldest of more than ``MAX_MOVES`` is forgotten)."""
        self._moves[cookie] = (rel, replace)
        while len(self._moves) > MAX_MOVES:
            self._moves.pop(next(iter(self._moves)))

    def _emit(self, rel: str, kind: str) -> None:
        if len(self._events) >= MAX_EVENTS:
            self._fail(f"more than {MAX_EVENTS} events went unread: the watch on {self._shown} ended")
            return
        entry = self._entry(rel) if self.include_entry and kind in ("create", "write", "chmod") else None
        self._events.append(WatchEvent(rel, kind, entry))

    def _fail(self, message: str) -> None:
        self._error = message
        self._cond.notify_all()

    def _entry(self, rel: str) -> dict[str, Any] | None:
        """``rel``'s lstat as the file helper's ``entry`` gives it, or None once it is gone."""
        parent, _, name = rel.rpartition("/")
        try:
            fd = open_dir(self._root_fd, parent, parent)
        except SandboxError:
            return None
        try:
            info: dict[str, Any] = describe(os.stat(name, dir_fd=fd, follow_symlinks=False), name)
            if info["type"] == "symlink":
                info["target"] = os.readlink(name, dir_fd=fd)
            return info
        except OSError:
            return None
        finally:
            os.close(fd)

    # -- the end ------------------------------------------------------------------------------------
    def close(self) -> None:
        """Stop watching; idempotent. Releases the inotify instance and every descriptor."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
            with contextlib.suppress(OSError):
                os.write(self._wake_w, b"x")
        if threading.current_thread() is not self._thread:
            self._thread.join(5)
        self._release()

    def _release(self) -> None:
        for attr in ("_root_fd", "_wake_r", "_wake_w"):
            fd = getattr(self, attr, -1)
            if fd >= 0:
                with contextlib.suppress(OSError):
                    os.close(fd)
                setattr(self, attr, -1)
        notify = getattr(self, "_notify", None)
        if notify is not None and not notify.closed:
            notify.close()
        if self._admitted:
            self._admitted = False
            _leave(self.session_id)

    def __enter__(self) -> Watcher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"<Watcher {self._shown!r} recursive={self.recursive} closed={self._closed}>"


def _admit(session_id: str) -> None:
    with _lock:
        if sum(_live.values()) >= MAX_WATCHERS:
            raise SandboxBusy(f"this host already has {MAX_WATCHERS} file watchers; stop one and try again")
        if _live.get(session_id, 0) >= MAX_PER_SESSION:
            raise SandboxBusy(
                f"session {session_id} already has {MAX_PER_SESSION} file watchers; stop one and try again"
            )
        _live[session_id] = _live.get(session_id, 0) + 1


def _leave(session_id: str) -> None:
    with _lock:
        n = _live.get(session_id, 0) - 1
        if n > 0:
            _live[session_id] = n
        else:
            _live.pop(session_id, None)


def live_watchers(session_id: str | None = None) -> int:
    """How many watchers are open (on this host, or of one session)."""
    with _lock:
        return sum(_live.values()) if session_id is None else _live.get(session_id, 0)


def check_watchable(root: Path | None, session_id: str) -> Path:
    if root is None:
        raise InvalidArgument(
            f"session {session_id}'s workspace is not on this host (a Ray node keeps it): "
            "files can be watched only where the workspace is"
        )
    return root


__all__ = ["MAX_DIRS", "MAX_EVENTS", "MAX_PER_SESSION", "MAX_WATCHERS", "WatchEvent", "Watcher", "live_watchers"]

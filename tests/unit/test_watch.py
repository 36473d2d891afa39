"""The workspace watcher (sessions/watch.py) on a plain directory: the events E2B's envd gives,
recursion, the file API's replace shown as one write, and what a hostile sandbox could plant
(symlinks out, too many directories, a flood of events) never followed or unbounded."""

from __future__ import annotations

import os
import time

import pytest

from sandloop.contract import PathRefused, SandboxBusy, SandboxError, WorkspaceFileNotFound
from sandloop.sessions import watch
from sandloop.sessions.watch import Watcher, live_watchers


class _FdLedger:
    """Every descriptor the watch module opens and closes, counted at its calls (``os.open``,
    ``os.dup``, ``os.pipe2``, ``os.close``, ``INotify``): exact, whatever else in this process
    opens or closes descriptors meanwhile (a collected object of an earlier test, a thread)."""

    def __init__(self) -> None:
        self.opened: set[int] = set()
        self.closed: set[int] = set()
        self.notifies: list = []

    def __getattr__(self, name: str):
        return getattr(os, name)

    def open(self, *args, **kwargs) -> int:
        fd = os.open(*args, **kwargs)
        self.opened.add(fd)
        return fd

    def dup(self, fd: int) -> int:
        new = os.dup(fd)
        self.opened.add(new)
        return new

    def pipe2(self, flags: int) -> tuple[int, int]:
        r, w = os.pipe2(flags)
        self.opened.update((r, w))
        return r, w

    def close(self, fd: int) -> None:
        os.close(fd)
        self.closed.add(fd)

    def left_open(self) -> list:
        return sorted(self.opened - self.closed) + [n for n in self.notifies if not n.closed]


@pytest.fixture
def ledger(monkeypatch) -> _FdLedger:
    book = _FdLedger()

    class _CountedINotify(watch.INotify):
        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            book.notifies.append(self)

    monkeypatch.setattr(watch, "os", book)
    monkeypatch.setattr(watch, "INotify", _CountedINotify)
    return book


def _kinds(events):
    return [(e.name, e.type) for e in events]


def test_events_are_envds_and_arrive_before_the_next_call(tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "old.txt").write_text("1")
    with Watcher(tmp_path, "d", session_id="t") as w:
        (tmp_path / "d" / "new.txt").write_text("x")  # no sleep: the kernel queued it already
        os.chmod(tmp_path / "d" / "new.txt", 0o600)
        os.rename(tmp_path / "d" / "old.txt", tmp_path / "d" / "moved.txt")
        os.unlink(tmp_path / "d" / "new.txt")
        assert _kinds(w.events()) == [
            ("new.txt", "create"),
            ("new.txt", "write"),
            ("new.txt", "chmod"),
            ("old.txt", "rename"),
            ("moved.txt", "create"),
            ("new.txt", "remove"),
        ]
        assert w.events() == []


def test_the_file_apis_replace_is_one_write_and_its_temporary_name_never_shows(tmp_path):
    (tmp_path / "f.txt").write_text("old")
    with Watcher(tmp_path, ".", session_id="t", include_entry=True) as w:
        tmp = tmp_path / f"f.txt.{os.urandom(6).hex()}{watch.TMP_SUFFIX}"  # files_helper.py's op_write
        tmp.write_text("new")
        os.replace(tmp, tmp_path / "f.txt")
        events = w.events()
    assert _kinds(events) == [("f.txt", "write")]
    assert events[0].entry is not None and events[0].entry["size"] == 3 and events[0].entry["type"] == "file"


def test_a_recursive_watch_follows_new_directories_and_moves(tmp_path):
    (tmp_path / "a" / "b").mkdir(parents=True)
    with Watcher(tmp_path, "a", recursive=True, session_id="t") as w:
        (tmp_path / "a" / "b" / "f").write_text("1")
        assert _kinds(w.events()) == [("b/f", "create"), ("b/f", "write")]
        (tmp_path / "a" / "n").mkdir()
        deadline = time.monotonic() + 30  # the watch's thread adds the new directory's watch
        while not w._dirs or len(w._dirs) < 3:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        (tmp_path / "a" / "n" / "g").write_text("2")
        assert ("n/g", "write") in _kinds(w.events())
        os.rename(tmp_path / "a" / "n", tmp_path / "a" / "m")
        (tmp_path / "a" / "m" / "h").write_text("3")
        kinds = _kinds(w.events())
        assert ("n", "rename") in kinds and ("m", "create") in kinds and ("m/h", "create") in kinds
        assert not any(name.startswith("n/") for name, _ in kinds[kinds.index(("n", "rename")) :])


def test_a_directory_made_before_its_watch_was_added_still_shows_its_files(tmp_path):
    """mkdir -p a/b/c && touch a/b/c/f, faster than the watch's thread: each entry is announced."""
    with Watcher(tmp_path, ".", recursive=True, session_id="t") as w:
        (tmp_path / "x" / "y").mkdir(parents=True)
        (tmp_path / "x" / "y" / "f").write_text("1")
        kinds = _kinds(w.events())
    assert ("x", "create") in kinds and ("x/y", "create") in kinds and ("x/y/f", "create") in kinds


def test_symlinks_the_sandbox_planted_are_never_followed(tmp_path):
    outside = tmp_path / "host"
    ws = tmp_path / "ws"
    outside.mkdir()
    ws.mkdir()
    os.symlink(outside, ws / "escape")
    (ws / "real").mkdir()
    os.symlink(outside, ws / "real" / "inner")
    with pytest.raises(PathRefused, match="not a directory"):
        Watcher(ws, "escape", session_id="t")
    with pytest.raises(PathRefused):
        Watcher(ws, "escape/sub", session_id="t")
    with pytest.raises(WorkspaceFileNotFound):
        Watcher(ws, "missing", session_id="t")
    (ws / "file").write_text("x")
    with pytest.raises(PathRefused):
        Watcher(ws, "file", session_id="t")
    with Watcher(ws, ".", recursive=True, session_id="t") as w:
        (outside / "secret").write_text("host")  # through neither link
        assert w.events() == []
        assert len(w._dirs) == 2  # ws and ws/real: no link was walked
    assert live_watchers("t") == 0


def test_watchers_are_counted_per_session_and_on_the_host(tmp_path, monkeypatch, ledger):
    monkeypatch.setattr(watch, "MAX_PER_SESSION", 2)
    monkeypatch.setattr(watch, "MAX_WATCHERS", 3)
    a = Watcher(tmp_path, ".", session_id="s1")
    b = Watcher(tmp_path, ".", session_id="s1")
    with pytest.raises(SandboxBusy, match="session s1 already has 2"):
        Watcher(tmp_path, ".", session_id="s1")
    c = Watcher(tmp_path, ".", session_id="s2")
    with pytest.raises(SandboxBusy, match="this host already has 3"):
        Watcher(tmp_path, ".", session_id="s3")
    assert live_watchers() == 3
    for w in (a, b, c):
        w.close()
        w.close()  # idempotent
    assert live_watchers() == 0
    assert ledger.opened and len(ledger.notifies) == 3  # the ledger saw the watchers' descriptors
    assert ledger.left_open() == []  # the inotify instances, the pipes and the directories: all closed
    with pytest.raises(SandboxError, match="stopped"):
        a.events()


def test_a_tree_too_big_to_watch_is_refused_and_leaves_nothing(tmp_path, monkeypatch, ledger):
    monkeypatch.setattr(watch, "MAX_DIRS", 5)
    for i in range(8):
        (tmp_path / f"d{i}").mkdir()
    with pytest.raises(SandboxBusy, match="more than 5 directories"):
        Watcher(tmp_path, ".", recursive=True, session_id="t")
    assert ledger.opened and ledger.notifies
    assert ledger.left_open() == [] and live_watchers() == 0
    with Watcher(tmp_path, ".", session_id="t") as w:  # not recursive: one directory
        assert len(w._dirs) == 1


def test_a_flood_of_unread_events_ends_the_watch_with_a_reason(tmp_path, monkeypatch):
    monkeypatch.setattr(watch, "MAX_EVENTS", 50)
    with Watcher(tmp_path, ".", session_id="t") as w:
        for i in range(100):
            (tmp_path / f"f{i}").write_text("x")
        assert len(w.events()) == 50  # what was kept is still given, then why the watch ended
        with pytest.raises(SandboxError, match="more than 50 events went unread"):
            w.events()


def test_moves_out_of_the_tree_are_not_kept_forever(tmp_path):
    """A sandbox renaming thousands of files (temporary names too) out of the watched directory
    leaves at most MAX_MOVES halves of moves in memory."""
    (tmp_path / "in").mkdir()
    (tmp_path / "out").mkdir()
    with Watcher(tmp_path, "in", session_id="t") as w:
        for i in range(300):
            name = f"f{i}" + (watch.TMP_SUFFIX if i % 2 else "")
            (tmp_path / "in" / name).write_text("x")
            os.rename(tmp_path / "in" / name, tmp_path / "out" / name)
        events = w.events()
        assert len(w._moves) <= watch.MAX_MOVES
    assert ("f0", "rename") in [(e.name, e.type) for e in events]
    assert not any(watch.TMP_SUFFIX in e.name for e in events)

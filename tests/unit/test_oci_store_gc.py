"""The OCI store's garbage collection: what goes is renamed out of the way under the store's lock
and its tree deleted on a thread of its own, so a process's first run never waits for gigabytes of
files (four test workers starting together each waited 50-90 s for the same trees)."""

from __future__ import annotations

import os
import socket
import threading
import time

from sandloop.runtime.labels import owner_id
from sandloop.runtime.oci import store as store_module
from sandloop.runtime.oci.store import BUILT, TRASH, RootfsStore


def _tree(path, files=50):
    (path / "rootfs" / "usr").mkdir(parents=True)
    for i in range(files):
        (path / "rootfs" / "usr" / f"f{i}").write_text("x")


def test_gone_stores_leave_at_once_and_their_trees_go_on_a_thread_of_their_own(tmp_path, monkeypatch):
    directory = tmp_path / "images"
    unnamed, kept, half = directory / ("a" * 64), directory / ("b" * 64), directory / ".export-cut-short"
    for entry in (unnamed, kept, half):
        _tree(entry)
    (unnamed / BUILT).write_text("")
    (kept / BUILT).write_text("")
    os.utime(half, (time.time() - 3600, time.time() - 3600))
    store = RootfsStore(directory, lambda: None, engine=False)
    store.add_ref("kept:latest", "b" * 64)
    orphan = directory / f"{TRASH}{socket.gethostname()}:4194999:1234-{'c' * 32}"  # above pid_max: exited
    _tree(orphan)

    deleted_on = []
    rmtree = store_module.shutil.rmtree

    def recording(path, *args, **kwargs):
        deleted_on.append((os.path.basename(path)[: len(TRASH)], threading.current_thread().name))
        return rmtree(path, *args, **kwargs)

    monkeypatch.setattr(store_module.shutil, "rmtree", recording)
    assert sorted(store.gc()) == sorted([".export-cut-short", "a" * 64])
    assert not unnamed.exists() and not half.exists() and kept.is_dir() and not orphan.exists()
    assert store.trash_thread is not None
    store.trash_thread.join()
    assert sorted(e.name for e in directory.iterdir()) == sorted(["b" * 64, "refs", ".lock"])
    assert deleted_on and all(d == (TRASH, "sandloop-store-trash") for d in deleted_on)


def test_trash_of_a_live_process_is_left_to_it(tmp_path):
    directory = tmp_path / "images"
    theirs = directory / f"{TRASH}{owner_id(1)}-{'d' * 32}"  # pid 1 runs: its trash is its own to delete
    _tree(theirs)
    store = RootfsStore(directory, lambda: None, engine=False)
    assert store.gc() == [] and theirs.is_dir() and store.trash_thread is None

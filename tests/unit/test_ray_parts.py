"""The Ray backend's parts that need no cluster: a missing cluster is a clear error at once (not
Ray's minutes of retries), from code and from the CLI; the backend is built only by the root."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from sandloop import Settings
from sandloop.backends import build_backend
from sandloop.contract import EngineUnavailable, InvalidArgument
from sandloop.sessions.store import SessionRecord, SessionStore
from sandloop.testing.fake import FakeBackend

pytest.importorskip("ray")


def test_an_address_nothing_listens_on_is_refused_at_once():
    from sandloop.runtime.ray.backend import _reachable

    started = time.monotonic()
    with pytest.raises(EngineUnavailable, match="no Ray cluster at 127.0.0.1:1"):
        _reachable("127.0.0.1:1")
    assert time.monotonic() - started < 5
    _reachable("auto")  # left to Ray's own quick lookup


def test_the_ray_backend_is_built_by_the_composition_root():
    with pytest.raises(InvalidArgument, match="composition root"):
        build_backend(Settings(backend="ray"))


def test_the_cli_says_what_to_do_without_a_traceback():
    env = {**os.environ, "SANDLOOP_BACKEND": "ray", "RAY_ADDRESS": "127.0.0.1:1"}
    command = [sys.executable, "-m", "sandloop", "run", "-c", "print(1)"]
    done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=120)
    assert done.returncode == 125 and "Traceback" not in done.stderr
    assert "no Ray cluster at 127.0.0.1:1" in done.stderr and "ray start --head" in done.stderr


def test_a_nodes_stream_sends_output_in_batches_then_the_result():
    import threading

    from sandloop.runtime.ray.node import streamed

    go_on = threading.Event()

    def work(emit, cancel):
        emit("stdout", b"a")
        emit("stderr", b"b")
        go_on.wait(10)
        emit("stdout", b"c")
        return 7

    stream = streamed(work, threading.Event())
    first = next(stream)
    go_on.set()
    rest = list(stream)
    pieces = [p for kind, batch in [first, *rest[:-1]] for p in batch]
    assert pieces == [("stdout", b"a"), ("stderr", b"b"), ("stdout", b"c")]
    assert rest[-1] == ("result", 7) and len(rest) <= 3  # a, b (maybe together), c, then the result


def test_a_nodes_stream_raises_the_works_error_and_a_consumer_who_leaves_cancels_it():
    import threading

    from sandloop.contract import SandboxBusy
    from sandloop.runtime.ray.node import streamed

    def fails(emit, cancel):
        raise SandboxBusy("full")

    with pytest.raises(SandboxBusy, match="full"):
        list(streamed(fails, threading.Event()))

    stopped = threading.Event()

    def endless(emit, cancel):
        while not cancel.wait(0.05):
            emit("stdout", b".")
        stopped.set()
        return None

    cancel = threading.Event()
    stream = streamed(endless, cancel)
    assert next(stream)[0] == "output"
    stream.close()  # the driver went away (Ray closes the generator)
    assert cancel.is_set() and stopped.wait(5)


def test_a_nodes_session_store_keeps_no_records_and_reaps_nothing(tmp_path):
    """A node's sessions are the cluster's: their records are in the registry and the drivers'
    reapers expire them. Before, a node's own reaper deleted (workspace and interpreter) any
    session whose directory there was an hour old, since it found no record of it on the node."""
    backend = FakeBackend(home=tmp_path)
    node = SessionStore(backend, tmp_path, records_elsewhere=True)
    ref = backend.create_workspace("s-0123456789ab", 8 << 20, "65534:65534")
    d = node.here("s-0123456789ab")
    old = time.time() - 7200
    os.utime(d, (old, old))
    record = SessionRecord("s-0123456789ab", old, old, 60, 8 << 20, ref.quota_enforced, ref.name, "img", {})
    node.save(record)
    assert not (d / "session.json").exists()  # the registry keeps it
    assert node.reap_expired() == []
    assert d.is_dir() and [w for w in backend.owned() if w.kind == "workspace"]  # still there
    local = SessionStore(backend, tmp_path)  # a driver's store of this host's files removes it
    assert local.reap_expired() == [] and not d.exists()


def test_stopping_a_cluster_survives_a_process_that_goes_as_it_is_waited_on(monkeypatch):
    """The psutil Ray vendors lets pidfd_open's ENOENT through when a process exits just as it is
    waited on (seen in CI on Linux 6.18); the cluster's stop counts such a process by whether it
    still runs, not by the error: a gone one is gone, a live one is still reported alive."""
    import errno

    import psutil

    from sandloop.testing.ray_cluster import wait_gone

    def enoent(self, timeout=None):
        raise FileNotFoundError(errno.ENOENT, "No such file or directory")

    monkeypatch.setattr(psutil.Process, "wait", enoent)
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: no such process any more
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        procs = [psutil.Process(zombie.pid), psutil.Process(live.pid)]
        with pytest.raises(psutil.NoSuchProcess):
            psutil.Process(gone.pid)
        while psutil.Process(zombie.pid).status() != psutil.STATUS_ZOMBIE:
            time.sleep(0.05)  # it exits by itself; not reaped, as a daemon's child is not ours
        assert [p.pid for p in wait_gone(procs, timeout=0.5)] == [live.pid]
    finally:
        live.kill()
        live.wait()
        zombie.wait()

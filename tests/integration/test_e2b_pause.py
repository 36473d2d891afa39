"""E2B's SDKs, unchanged, pausing, resuming, snapshotting and forking sandboxes (issue 25), on a
server whose E2B sandboxes run on gVisor (their memory is kept)."""

from __future__ import annotations

import time

import e2b
import httpx
import pytest
from e2b import Sandbox as PlainSandbox
from e2b_code_interpreter import Sandbox

from sandloop import Sandloop, Settings
from sandloop.server.app import create_app
from sandloop.server.tokens import TokenStore
from tests.servers import e2b_environment, serve_in_thread

pytestmark = [pytest.mark.runsc, pytest.mark.timeout(900)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tokens = TokenStore(tmp_path_factory.mktemp("e2b-pause") / "tokens.sqlite")
    alice, _ = tokens.create("alice", max_concurrent=8, runs_per_minute=1000, max_timeout=600)
    root = Sandloop(Settings(pool_size=0, session_pool_size=0, e2b_runtime="runsc"))
    app = create_app(tokens, sandloop=root)
    with root, serve_in_thread(app) as url, e2b_environment(url, alice):
        yield {"url": url, "alice": alice, "root": root, "e2b": app.state.e2b}


def test_pause_connect_resumes_with_memory_and_list_says_paused(server):
    s = Sandbox.create(timeout=300, metadata={"job": "pause"})
    try:
        s.run_code("import numpy as np; data = np.arange(1000); note = 'kept'")
        s.files.write("/home/user/f.txt", "file kept")
        s.pause()
        assert not s.is_running()  # envd answers as E2B's proxy does for a paused sandbox (502)
        assert PlainSandbox.get_info(s.sandbox_id).state == "paused"
        listed = PlainSandbox.list(
            query=e2b.SandboxQuery(metadata={"job": "pause"}, state=[e2b.SandboxState.PAUSED])
        ).next_items()
        assert [i.sandbox_id for i in listed] == [s.sandbox_id]
        assert (
            PlainSandbox.list(
                query=e2b.SandboxQuery(metadata={"job": "pause"}, state=[e2b.SandboxState.RUNNING])
            ).next_items()
            == []
        )
        r = httpx.post(
            f"{server['url']}/sandboxes/{s.sandbox_id}/pause", headers={"X-API-Key": server["alice"]}, timeout=60
        )
        assert r.status_code == 409  # already paused
        again = Sandbox.connect(s.sandbox_id)  # resumes
        assert again.is_running()
        ex = again.run_code("print(int(data.sum()), note)")
        assert ex.logs.stdout == ["499500 kept\n"]
        assert again.files.read("/home/user/f.txt") == "file kept"
        assert PlainSandbox.get_info(s.sandbox_id).state == "running"
    finally:
        s.kill()


def test_snapshot_then_a_sandbox_from_it_then_delete(server):
    s = Sandbox.create(timeout=300)
    try:
        s.run_code("x = 41")
        snap = s.create_snapshot()
        s.run_code("x = 0")  # the snapshot keeps what was
        other = Sandbox.create(snap.snapshot_id, timeout=300)
        try:
            assert other.run_code("x + 1").text == "42"
            assert s.run_code("x").text == "0"
        finally:
            other.kill()
        assert PlainSandbox.delete_snapshot(snap.snapshot_id)
        assert not PlainSandbox.delete_snapshot(snap.snapshot_id)  # 404: gone
    finally:
        s.kill()


def test_auto_pause_at_the_timeout_keeps_the_sandbox(server):
    s = Sandbox.create(timeout=300, lifecycle={"on_timeout": "pause"})
    try:
        s.run_code("y = 'survived the timeout'")
        s.set_timeout(3)  # from now: the cell ran before it (a busy machine may take seconds for it)
        # the timeout has passed once the control plane has paused it (each call checks the timeout)
        deadline = time.monotonic() + 120
        while PlainSandbox.get_info(s.sandbox_id).state != "paused":
            assert time.monotonic() < deadline, "a sandbox past its timeout with on_timeout=pause was not paused"
            time.sleep(0.5)
        # what the pause kept: its memory (gVisor); "files" would say its interpreter had gone
        assert server["root"].sessions.paused(s.sandbox_id) == "memory"
        again = Sandbox.connect(s.sandbox_id, timeout=300)
        assert again.run_code("y").text == "survived the timeout"
    finally:
        s.kill()


def test_a_timeout_moved_after_the_reaper_looked_keeps_the_sandbox_running(server):
    """The reaper lists a sandbox past its timeout; a connect (or set_timeout) moves the timeout
    before the reaper acts: the sandbox goes on running (CI saw the reaper pause a sandbox a
    connect had just resumed, and the next cell answer SessionPaused)."""
    service = server["e2b"]
    s = Sandbox.create(timeout=300, lifecycle={"on_timeout": "pause"})
    try:
        s.run_code("y = 'still running'")
        box = service.registry.get(s.sandbox_id)
        with service._lifecycle(s.sandbox_id):  # the reaper's own sweep waits here meanwhile
            service.registry.set_end(s.sandbox_id, time.time() - 1)
            assert s.sandbox_id in service.registry.expired()  # what the reaper saw
            service.set_timeout(box, 300)  # what the connect did since
        assert service.timed_out(s.sandbox_id) is False
        assert server["root"].sessions.paused(s.sandbox_id) is None
        assert s.run_code("y").text == "still running"
    finally:
        s.kill()


def test_fork_gives_sandboxes_with_their_own_copy(server):
    s = Sandbox.create(timeout=300)
    try:
        s.run_code("z = [1]")
        s.files.write("/home/user/w.txt", "parent")
        forks = s.fork(count=2, timeout=300)
        try:
            assert all(isinstance(f, Sandbox) for f in forks), forks
            forks[0].run_code("z.append(2)")
            forks[0].files.write("/home/user/w.txt", "fork")
            assert s.run_code("len(z)").text == "1" and forks[1].run_code("len(z)").text == "1"
            assert forks[0].run_code("len(z)").text == "2"
            assert s.files.read("/home/user/w.txt") == "parent" and forks[1].files.read("/home/user/w.txt") == "parent"
            assert s.is_running()  # the source runs on, with its id
        finally:
            for f in forks:
                if isinstance(f, Sandbox):
                    f.kill()
    finally:
        s.kill()


def test_a_filesystem_only_pause_keeps_the_files_and_starts_cold(server):
    s = Sandbox.create(timeout=300)
    try:
        s.run_code("x = 1")
        s.files.write("/home/user/kept.txt", "kept")
        s.pause(keep_memory=False)
        again = Sandbox.connect(s.sandbox_id)
        assert again.run_code("'x' in globals()").text == "False"  # a cold start: memory not kept
        assert again.files.read("/home/user/kept.txt") == "kept"
    finally:
        s.kill()

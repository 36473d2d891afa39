"""Warm sessions (``sessions/reserve.py``): a session made ahead, its interpreter holding numpy,
pandas and pyplot, claimed by exactly one ``Session.create`` of its kind; on runc and runsc,
through the native API and E2B's SDK. Nothing of a warm session outlives the process that keeps
it: closing removes it, and so does the reaper once that process is killed."""

from __future__ import annotations

import subprocess
import sys
import time

import docker
import pytest

from sandloop import SandboxLimits, Sandloop, Settings
from sandloop.contract import SessionNotFound, parse_size
from sandloop.runtime.labels import owner_id
from sandloop.sessions.reserve import MIN_MEMORY

QUOTA = "16m"
OWNER = "65534:65534"


def limits_for(runtime: str) -> SandboxLimits:
    # A runsc sandbox counts the libraries' file pages as its memory: a warm one needs 512m.
    return SandboxLimits(runtime=runtime, memory="512m" if runtime == "runsc" else "256m")


@pytest.fixture
def warm_root(tmp_path):
    root = Sandloop(Settings(session_pool_size=1, home=tmp_path))
    yield root
    root.close()


def session_containers(session_id: str) -> list:
    client = docker.from_env()
    try:
        return client.containers.list(all=True, sparse=True, filters={"label": f"sandloop.session={session_id}"})
    finally:
        client.close()


def reserved_records(root: Sandloop) -> list:
    return [r for r in root.sessions._all().values() if r is not None and r.reserved_by]


def test_a_warm_session_is_claimed_whole_and_behaves_as_a_cold_one(warm_root, runtime):
    limits = limits_for(runtime)
    assert warm_root.reserves.prewarm(limits, parse_size(QUOTA), OWNER)
    (reserve,) = reserved_records(warm_root)
    assert warm_root.list_sessions() == []  # nobody lists a warm session
    with pytest.raises(SessionNotFound):
        warm_root.attach_session(reserve.id)  # nor attaches to it

    with warm_root.create_session(limits, ttl=900, quota=QUOTA) as s:
        assert warm_root.reserves.claimed == 1 and s.id == reserve.id
        assert s.record.ttl_seconds == 900 and not s.record.reserved_by
        assert [r.id for r in warm_root.list_sessions()] == [s.id]
        first = s.run_cell("import pandas as pd; df = pd.DataFrame({'a': range(100)}); df")
        assert first.ok and first.execution_count == 1, first
        assert first.outputs[0].is_main_result and {"text/html", "e2b/data"} <= set(first.outputs[0].data)
        # what a cold session's first cell sees: no name predefined, the workspace, the limits
        r = s.run_cell(
            "import os, sys\n"
            "print(sorted(k for k in dir() if not k.startswith('_') and k not in ('df', 'pd')), _ is df,"
            " os.getcwd(), os.getuid(), open('/proc/self/status').read().count('CapEff:\\t0000000000000000'),"
            " 'matplotlib.pyplot' in sys.modules)"
        )
        names = "['In', 'Out', 'exit', 'get_ipython', 'open', 'os', 'quit', 'sys']"
        assert r.stdout == f"{names} True /workspace 65534 1 True\n"
        assert r.execution_count == 2
        s.write_file("mine.txt", "only here")
        assert s.run("print(open('/workspace/mine.txt').read())").stdout == "only here\n"
        box = s._kernel._sandbox
        assert box is not None
        cgroup = getattr(box, "cgroup", "") or f"docker/{box.id}"  # gVisor's runs directly (oci/kernels.py)
        with open(f"/sys/fs/cgroup/memory/{cgroup}/memory.limit_in_bytes") as f:
            assert int(f.read()) == limits.memory_bytes
    assert session_containers(reserve.id) == []


def test_a_warm_session_is_for_exactly_its_kind(warm_root):
    limits = limits_for("runc")
    assert warm_root.reserves.prewarm(limits, parse_size(QUOTA), OWNER)
    other = warm_root.create_session(limits, quota="32m")  # another quota: cold
    small = warm_root.create_session(SandboxLimits(memory="128m"), quota=QUOTA)  # below MIN_MEMORY
    try:
        assert warm_root.reserves.claimed == 0
        assert parse_size("128m") < MIN_MEMORY
        assert other.run_cell("import sys; 'pandas' in sys.modules").value == "False"
        assert small.run_cell("1 + 1").value == "2"
    finally:
        other.delete()
        small.delete()
    a = warm_root.create_session(limits, quota=QUOTA)
    b = warm_root.create_session(limits, quota=QUOTA)  # the pool refills in the background: cold
    try:
        assert warm_root.reserves.claimed == 1 and a.id != b.id
        a.run_cell("x = 'a'")
        assert b.run_cell("'x' in dir()").value == "False"
        assert b.list_files() == [] and a.run_cell("'pandas' in __import__('sys').modules").value == "True"
    finally:
        a.delete()
        b.delete()


def test_e2b_sandboxes_start_warm_in_home_user(warm_root):
    from e2b_code_interpreter import Sandbox

    from sandloop.server.app import create_app
    from sandloop.server.tokens import TokenStore
    from tests.servers import e2b_environment, serve_in_thread

    tokens = TokenStore(warm_root.settings.home / "tokens.sqlite")
    key, _ = tokens.create("warm", max_concurrent=4, runs_per_minute=1000, max_timeout=120)
    with serve_in_thread(create_app(tokens, sandloop=warm_root)) as url, e2b_environment(url, key):
        first = Sandbox.create(timeout=120)  # the first of its kind: cold, and it starts the pool
        try:
            assert warm_root.reserves.claimed == 0
            assert warm_root.dispatcher.settle(120)
            second = Sandbox.create(timeout=120)
            try:
                assert warm_root.reserves.claimed == 1
                ex = second.run_code("import os, sys; os.getcwd(), 'pandas' in sys.modules")
                assert ex.results[0].text == "('/home/user', True)" and ex.execution_count == 1
                assert second.run_code("!pwd").logs.stdout == ["/home/user\n"]
            finally:
                second.kill()
        finally:
            first.kill()


def test_closing_removes_warm_sessions(tmp_path):
    root = Sandloop(Settings(session_pool_size=1, home=tmp_path))
    try:
        assert root.reserves.prewarm(limits_for("runc"), parse_size(QUOTA), OWNER)
        (reserve,) = reserved_records(root)
        assert session_containers(reserve.id)
    finally:
        root.close()
    assert session_containers(reserve.id) == []
    assert not (tmp_path / "sessions" / reserve.id).exists()
    with open("/proc/mounts") as f:
        assert reserve.id not in f.read()


def test_the_warm_sessions_of_a_killed_process_are_reaped(tmp_path):
    code = (
        "import os, sys\n"
        "from sandloop import Sandloop, Settings, SandboxLimits\n"
        f"root = Sandloop(Settings(session_pool_size=1, home={str(tmp_path)!r}))\n"
        f"assert root.reserves.prewarm(SandboxLimits(), {parse_size(QUOTA)}, {OWNER!r})\n"
        "print('ready', flush=True)\n"
        "sys.stdin.read()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "ready\n"
        with Sandloop(Settings(session_pool_size=0, home=tmp_path)) as root:
            (reserve,) = reserved_records(root)
            assert reserve.reserved_by == owner_id(proc.pid)
            assert root.reap().expired_sessions == []  # its keeper lives: left alone
            assert session_containers(reserve.id)
            proc.kill()
            proc.wait(30)
            deadline = time.monotonic() + 30
            while reserve.id not in root.reap().expired_sessions:
                assert time.monotonic() < deadline, "the killed process's warm session was not reaped"
                time.sleep(0.5)
            assert reserved_records(root) == []
            assert session_containers(reserve.id) == []
            assert not (tmp_path / "sessions" / reserve.id).exists()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)

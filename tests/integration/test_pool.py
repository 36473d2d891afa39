"""Warm pool, admission control and reaper against the real engine."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import docker
import pytest

from sandloop import SandboxBusy, SandboxLimits
from sandloop.pool import Dispatcher, reap
from sandloop.runner import build_request
from sandloop.runtime.base import SandboxSpec
from sandloop.runtime.docker import DockerBackend
from sandloop.settings import Settings, runtime_image
from tests.helpers import our_containers

SPEC = SandboxSpec(runtime_image(), SandboxLimits())


@pytest.fixture
def warm():
    d = Dispatcher(DockerBackend(), Settings(pool_size=3, pool_refill_concurrency=2))
    assert d.prewarm(SPEC, timeout=120)
    yield d
    d.close()


def test_warm_runs_hit_the_pool_and_never_reuse_a_sandbox(warm):
    seen_ids: set[str] = set()
    backend = warm.backend
    original = backend.execute

    def spy(sandbox, request, **kw):
        assert sandbox.id not in seen_ids, "a sandbox was handed out twice"
        seen_ids.add(sandbox.id)
        return original(sandbox, request, **kw)

    backend.execute = spy
    # each run writes a marker to /tmp and checks that no earlier run's marker is there
    code = "import os, uuid\nprint(os.listdir('/tmp/sandloop'), os.path.exists('/tmp/mark'))\nopen('/tmp/mark','w')"
    results = [warm.run(build_request(code)) for _ in range(6)]
    assert all(r.stdout == "['main.py'] False\n" for r in results)
    assert len(seen_ids) == 6
    stats = warm.stats()
    assert stats["warm_runs"] >= 4 and list(stats["pools"].values())[0]["hits"] >= 4


def test_concurrent_takes_get_distinct_sandboxes(warm):
    results = {}

    def work(i):
        results[i] = warm.run(build_request(f"import socket; print({i}, socket.gethostname())"))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(10)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert sorted(int(r.stdout.split()[0]) for r in results.values()) == list(range(10))


def test_admission_control_says_busy_instead_of_hanging():
    d = Dispatcher(DockerBackend(), Settings(pool_size=0, max_running=2, queue_wait_seconds=0.5))
    errors, results = [], []

    def work():
        try:
            results.append(d.run(build_request("import time; time.sleep(3)", timeout_seconds=10)))
        except SandboxBusy as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work) for _ in range(6)]
    started = time.monotonic()
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert len(results) == 2 and len(errors) == 4
    assert all(e.retryable and "SANDLOOP_MAX_RUNNING" in str(e) for e in errors)
    assert time.monotonic() - started < 30
    assert d.admission.rejected == 4
    d.close()
    assert our_containers() == []


def test_pool_discards_dead_sandboxes_and_recovers(warm):
    """A pooled container that died (e.g. the engine restarted) is never handed out."""
    api = warm.backend.api
    for cid in list(warm.pooled_ids()):
        api.kill(cid)
        api.wait(cid, timeout=60)  # dead on the engine, not assumed dead after a pause
    r = warm.run(build_request("print('fresh')"))
    assert r.stdout == "fresh\n" and r.ok
    assert list(warm.stats()["pools"].values())[0]["discarded"] >= 1
    assert warm.settle(60)


OWNER_SCRIPT = r"""
import sys, time
from sandloop import run_code
from sandloop.runner import configure
from sandloop.settings import Settings
configure(Settings(pool_size=2))
print("ready", flush=True)
run_code("import time; time.sleep(120)", timeout_seconds=300)
"""


@pytest.mark.skipif(
    Settings().backend.type != "docker",
    reason="lists Docker's containers (the direct backend's reaper: test_oci.py, owner killed mid-run)",
)
def test_reaper_cleans_up_after_a_process_killed_mid_run():
    proc = subprocess.Popen([sys.executable, "-c", OWNER_SCRIPT], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        client = docker.from_env()
        deadline = time.monotonic() + 60
        owner_pid_label = None
        while time.monotonic() < deadline:  # wait until its run container and pool exist
            mine = [
                c
                for c in client.containers.list(all=True, filters={"label": "sandloop.owner"})
                if c.labels["sandloop.owner"].split(":")[1] == str(proc.pid)
            ]
            if any(c.labels["sandloop.purpose"] == "run" for c in mine) and len(mine) >= 2:
                owner_pid_label = mine[0].labels["sandloop.owner"]
                break
            time.sleep(0.2)
        assert owner_pid_label, "the owner never started its sandboxes"
        foreign = client.containers.create(runtime_image(), labels={"not-sandloop": "1"}, entrypoint=["true"])
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(10)
        dry = reap(DockerBackend(), dry_run=True)
        assert {r.owner for r in dry} >= {owner_pid_label} and all(r.reason for r in dry)
        removed = reap(DockerBackend())
        assert {r.id for r in removed} >= {c.id for c in mine}
        left = client.containers.list(all=True, sparse=True, filters={"label": f"sandloop.owner={owner_pid_label}"})
        assert left == []
        foreign.reload()  # untouched: still there
        foreign.remove(force=True)
        client.close()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_reap_cli_dry_run(tmp_path):
    proc = subprocess.run(
        [sys.executable, "-m", "sandloop", "reap", "--dry-run"], capture_output=True, text=True, timeout=60
    )
    assert proc.returncode == 0 and "would remove" in proc.stdout

"""Warm sessions' bookkeeping on the test double (``sessions/reserve.py``, ``SessionStore``): who
sees a warm session before it is claimed, what a claim changes, when the reaper removes one, and
what happens when they cannot start. The real engine's side: tests/integration/test_warm_sessions.py."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from sandloop import SandboxLimits, Sandloop, SessionNotFound, Settings
from sandloop.contract import SandboxError, parse_size
from sandloop.runtime.labels import owner_id

QUOTA = "16m"
OWNER = "65534:65534"


@pytest.fixture
def fake(tmp_path):
    with Sandloop(Settings(backend="fake", home=tmp_path, pool_size=0, session_pool_size=1)) as root:
        yield root


def reserved(root: Sandloop) -> list:
    return [r for r in root.sessions._all().values() if r is not None and r.reserved_by]


def test_a_claim_makes_the_warm_session_an_ordinary_one(fake):
    limits = SandboxLimits()
    cold = fake.create_session(limits, quota=QUOTA)  # the first of its kind: cold, starts the pool
    assert fake.reserves.claimed == 0
    assert fake.reserves.prewarm(limits, parse_size(QUOTA), OWNER)
    (reserve,) = reserved(fake)
    assert reserve.reserved_by == owner_id()
    assert [r.id for r in fake.list_sessions()] == [cold.id]
    with pytest.raises(SessionNotFound):
        fake.attach_session(reserve.id)
    warm = fake.create_session(limits, ttl=1234, quota=QUOTA)
    assert warm.id == reserve.id and fake.reserves.claimed == 1
    assert warm.record.ttl_seconds == 1234 and warm.record.reserved_by == ""
    assert fake.sessions.load(warm.id).ttl_seconds == 1234  # saved, not only in this handle
    assert sorted(r.id for r in fake.list_sessions()) == sorted([cold.id, warm.id])
    r = warm.run_cell("x = 2\nx * 21")
    assert r.value == "42" and r.execution_count == 1
    attached = fake.attach_session(warm.id)
    assert attached.run_cell("x").value == "2"  # the same interpreter, found by its labels
    attached.close()
    warm.delete()
    cold.delete()


def test_the_reaper_removes_warm_sessions_whose_keeper_is_gone(fake, tmp_path):
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    gone = owner_id(int(dead.stdout))  # a process that has exited
    made = {"ttl_seconds": 600, "quota_bytes": parse_size(QUOTA), "image": fake.image, "limits": {}}
    record = fake.sessions.create(**made, owner_uid_gid=OWNER, reserved_by=gone)
    mine = fake.sessions.create(**made, owner_uid_gid=OWNER, reserved_by=owner_id())
    assert fake.sessions.reap_expired() == [record.id]
    assert not (tmp_path / "sessions" / record.id).exists()
    assert [r.id for r in reserved(fake)] == [mine.id]  # its keeper (this process) lives
    fake.sessions.delete(mine.id)


def test_limits_with_egress_or_too_little_memory_get_no_warm_session(fake):
    assert not fake.reserves.eligible(SandboxLimits(memory="128m"))
    assert not fake.reserves.eligible(SandboxLimits(runtime="runsc"))  # 256m: too little under gVisor
    assert fake.reserves.eligible(SandboxLimits(runtime="runsc", memory="512m"))
    assert not fake.reserves.eligible(SandboxLimits(egress=("pypi.org",)))
    assert fake.reserves.eligible(SandboxLimits())
    assert not fake.reserves.prewarm(SandboxLimits(memory="128m"), parse_size(QUOTA), OWNER)


@pytest.fixture
def fake3(tmp_path):
    """Three warm sessions a kind: the first refill is three starts at once (MAX_FAILURES), where
    one a kind is one start per upkeep tick (10 s each)."""
    with Sandloop(Settings(backend="fake", home=tmp_path, pool_size=0, session_pool_size=3)) as root:
        yield root


def test_a_kind_whose_warm_sessions_cannot_start_gets_none(fake3, monkeypatch):
    fake = fake3
    launch = fake.backend.launch

    def broken(spec, *, purpose, lifetime_seconds):
        if any(a.startswith("--preload") for a in spec.command):
            raise SandboxError("this image cannot preload")
        return launch(spec, purpose=purpose, lifetime_seconds=lifetime_seconds)

    monkeypatch.setattr(fake.backend, "launch", broken)
    limits = SandboxLimits()
    s = fake.create_session(limits, quota=QUOTA)  # cold: works, and starts the (failing) pool
    assert s.run_cell("1 + 1").value == "2"
    deadline = time.monotonic() + 60
    while fake.dispatcher.stats()["pools"]:  # dropped after MAX_FAILURES (3) starts in a row
        assert time.monotonic() < deadline, fake.dispatcher.stats()
        time.sleep(0.2)
    assert fake.reserves.take(limits, parse_size(QUOTA), OWNER) is None
    assert fake.dispatcher.stats()["pools"] == {}  # and no new pool for that kind
    assert reserved(fake) == []  # each failed start left nothing
    s.delete()

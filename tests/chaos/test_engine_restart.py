"""Chaos: the Docker engine stopped (SIGTERM) or killed (SIGKILL) in the middle of a burst of runs
and session cells, then brought back with scripts/engine-up.sh.

Every request must end in a correct result, a failed run (the engine stopped its container), or a
clear ``SandboxError`` -- never a wrong result, never a hang past its bound; runs must work again
once the engine is back; and once the root is closed nothing may be left: no container of this
process, no container or volume of the sessions made here, no workspace mount.

Before the breaker, the recovery-time retries and the orphan sweep, the SIGTERM case left ~100
containers behind (``Created`` ones made while the engine shut down, and pool containers).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import docker
import pytest

from sandloop import SandboxError, Sandloop, Settings
from tests.helpers import our_containers

ENGINE_UP = Path(__file__).resolve().parents[2] / "scripts" / "engine-up.sh"
RUN_TIMEOUT = 10.0
ENGINE_TIMEOUT = 20.0
#: No request may take longer: its own timeout, then engine calls that each give up.
BOUND = RUN_TIMEOUT + 3 * ENGINE_TIMEOUT

pytestmark = [
    pytest.mark.chaos,
    pytest.mark.docker,
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("dockerd"), reason="needs root and a local dockerd"),
]


def _dockerd_pid() -> int | None:
    out = subprocess.run(["pgrep", "-x", "dockerd"], capture_output=True, text=True).stdout.split()
    return int(out[0]) if out else None


class Load:
    """Runs on four threads and session cells on one, recording every outcome."""

    def __init__(self, root: Sandloop) -> None:
        self.root = root
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.outcomes: list[tuple[str, str, float, bool, float]] = []  # kind, outcome, seconds, sound, at
        self.sessions: list[str] = []
        self.threads = [threading.Thread(target=self.runs, args=(w,)) for w in range(4)]
        self.threads.append(threading.Thread(target=self.cells))

    def record(self, kind: str, outcome: str, started: float, sound: bool) -> None:
        with self.lock:
            self.outcomes.append((kind, outcome, time.monotonic() - started, sound, time.monotonic()))

    def runs(self, worker: int) -> None:
        i = 0
        while not self.stop.is_set():
            i += 1
            n = worker * 100_000 + i
            started = time.monotonic()
            try:
                r = self.root.run_code(f"import time\ntime.sleep(0.2)\nprint({n} * {n})", "python", RUN_TIMEOUT)
            except SandboxError as exc:
                self.record("run", type(exc).__name__, started, True)
                time.sleep(0.1)
                continue
            right = r.ok and r.stdout == f"{n * n}\n"
            self.record("run", "ok" if right else "failed run", started, right or not r.ok)

    def cells(self) -> None:
        session = None
        i = 0
        while not self.stop.is_set():
            started = time.monotonic()
            try:
                if session is None:
                    session = self.root.create_session(quota="32m")
                    with self.lock:
                        self.sessions.append(session.id)
                i += 1
                c = session.run_cell(f"{i} * 3", timeout_seconds=RUN_TIMEOUT)
                right = c.ok and c.value == str(i * 3)
                self.record("cell", "ok" if right else "failed cell", started, right or not c.ok)
            except SandboxError as exc:
                self.record("cell", type(exc).__name__, started, True)
                time.sleep(0.2)
        if session is not None:
            for _ in range(30):  # the engine may still be coming back
                try:
                    session.delete()
                    break
                except SandboxError:
                    time.sleep(1)
        for sid in self.sessions:  # sessions an outage broke: delete what is left of them
            for _ in range(10):
                try:
                    self.root.attach_session(sid).delete()
                    break
                except SandboxError as exc:
                    if "no session" in str(exc).lower() or "not found" in str(exc).lower():
                        break
                    time.sleep(1)

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(BOUND + 60)
        assert not any(t.is_alive() for t in self.threads), "a request hung"


def _leftovers(sessions: list[str]) -> list[str]:
    client = docker.from_env()
    try:
        out = [f"container {c.id[:12]} {c.status}" for c in our_containers(patience=60)]
        for sid in sessions:
            label = f"sandloop.session={sid}"
            out += [
                f"session container {c.id[:12]}" for c in client.containers.list(all=True, filters={"label": label})
            ]
            out += [f"session volume {v.name}" for v in client.volumes.list(filters={"label": label})]
        mounts = Path("/proc/mounts").read_text()
        out += [f"mount of {sid}" for sid in sessions if sid in mounts]
        return out
    finally:
        client.close()


@pytest.mark.timeout(420)
@pytest.mark.parametrize("backend", ["docker", "oci"])
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_engine_dies_mid_burst_then_restarts(sig, backend, tmp_path):
    """On ``oci`` the runs are direct (they need no engine once the image is exported) and the
    sessions go through Docker: the same outcomes and no leftovers are required of both."""
    pid = _dockerd_pid()
    if pid is None:
        pytest.skip("dockerd is not a local process here")
    settings = Settings(backend=backend, pool_size=2, home=tmp_path, engine_timeout=ENGINE_TIMEOUT)
    root = Sandloop(settings)
    load = Load(root)
    try:
        load.start()
        time.sleep(5)
        killed_at = time.monotonic()
        os.kill(pid, sig)
        time.sleep(3)
        subprocess.run(["bash", str(ENGINE_UP)], check=True, capture_output=True, timeout=180)
        back_at = time.monotonic()
        deadline = back_at + 90
        while time.monotonic() < deadline:  # recovered: a correct run after the restart
            with load.lock:
                if any(o[0] == "run" and o[1] == "ok" and o[4] - o[2] > back_at for o in load.outcomes):
                    break
            time.sleep(0.5)
        recovered_after = time.monotonic() - back_at
        time.sleep(3)
    finally:
        load.finish()
        root.close()
    outcomes = load.outcomes
    summary: dict[str, int] = {}
    for kind, outcome, *_ in outcomes:
        summary[f"{kind} {outcome}"] = summary.get(f"{kind} {outcome}", 0) + 1
    print(
        f"\n{sig.name} {backend}: {len(outcomes)} requests {summary}, recovered {recovered_after:.1f} s after restart"
    )
    assert all(o[3] for o in outcomes), [o for o in outcomes if not o[3]]  # never a wrong result
    assert max(o[2] for o in outcomes) < BOUND, "a request took longer than its bound"
    assert any(o[0] == "run" and o[1] == "ok" and o[4] - o[2] > back_at for o in outcomes), "runs never recovered"
    assert any(o[4] > killed_at and o[1] != "ok" for o in outcomes), "the fault was never seen"
    assert _leftovers(load.sessions) == []

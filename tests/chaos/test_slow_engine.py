"""Chaos: an engine that stops answering for a while (SIGSTOP of dockerd, or of containerd under
it) in the middle of a burst of runs and session cells, then goes on (SIGCONT).

Admission control and timeouts must hold: more callers than slots, so the extra ones are told
``SandboxBusy`` after the queue wait instead of piling up; every request ends within its bound in
a correct result, a failed run or a clear ``SandboxError`` (never a wrong result, never a hang);
runs work again once the engine answers; and nothing is left once the root is closed.
"""

from __future__ import annotations

import os
import shutil
import signal
import time

import pytest

from tests.chaos.load import RUN_TIMEOUT, Loads, leftovers, pid_of

ENGINE_TIMEOUT = 5.0
STALL = 8.0
QUEUE_WAIT = 2.0
#: Its own timeout, then engine calls that each give up, and the queue wait.
BOUND = RUN_TIMEOUT + 4 * ENGINE_TIMEOUT + QUEUE_WAIT

pytestmark = [
    pytest.mark.chaos,
    pytest.mark.docker,
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("dockerd"), reason="needs root and a local dockerd"),
]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("stalled", ["dockerd", "containerd"])
def test_a_stalled_engine_mid_burst(stalled, tmp_path):
    """Both backends under load at once through one stall."""
    pid = pid_of(stalled)
    if pid is None:
        pytest.skip(f"{stalled} is not a local process here")
    settings = {
        "pool_size": 2,
        "engine_timeout": ENGINE_TIMEOUT,
        "max_running": 3,
        "queue_wait_seconds": QUEUE_WAIT,
    }
    loads = Loads(tmp_path, settings, workers=6, bound=BOUND)  # 6 run callers + 1 cell caller for 3 slots, each
    stopped = False
    try:
        loads.start()
        loads.wait_served(3)  # under way on both: runs and cells served
        stalled_at = time.monotonic()
        os.kill(pid, signal.SIGSTOP)
        stopped = True
        time.sleep(STALL)
        os.kill(pid, signal.SIGCONT)
        stopped = False
        back_at = time.monotonic()
        recovered_after = loads.wait_for_recovery(back_at, within=60)
        loads.wait_served(5, since=back_at, kinds=("run",))  # and goes on serving runs
    finally:
        if stopped:
            os.kill(pid, signal.SIGCONT)
        loads.finish()
    for backend, load in loads.loads.items():
        outcomes = load.outcomes
        during = [o for o in outcomes if stalled_at < o[4] < back_at + 1]
        print(
            f"\n{stalled} stalled {STALL:.0f} s, {backend}: {len(outcomes)} requests {load.summary()}, "
            f"{len(during)} ended during the stall, longest {max(o[2] for o in outcomes):.1f} s, "
            f"recovered {recovered_after:.1f} s after"
        )
        assert all(o[3] for o in outcomes), (backend, [o for o in outcomes if not o[3]])  # never a wrong result
        assert max(o[2] for o in outcomes) < BOUND, f"{backend}: a request took longer than its bound"
        assert load.recovered_since(back_at), f"{backend}: runs never recovered"
    assert leftovers(loads.sessions) == []

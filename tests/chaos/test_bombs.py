"""Chaos: 400 memory and fork bombs in a row (runc; 60 under gVisor), four at a time.

Every bomb must end within its bound, killed by its own limits (the memory cgroup, the pids
ceiling, the timeout), never ``ok``; and the host must stay healthy: no memory cgroup of a bomb's
sandbox left holding memory, its process count back where it was, no zombie and no sandbox left,
a plain run right afterwards. (Memory is judged by the sandboxes' own cgroups, where it is exact:
the host's MemAvailable moves with everything else on a shared machine; 582 MiB of drift failed
a run whose bombs had all been removed.)
"""

from __future__ import annotations

import contextlib
import os
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import docker
import pytest

from sandloop import SandboxLimits, Sandloop, Settings
from tests.helpers import direct_sandboxes, our_containers

pytestmark = [pytest.mark.chaos, pytest.mark.docker]

MEMORY_BOMB = "x = []\nwhile True:\n    x.append(bytearray(1 << 24))\n"
FORK_BOMB = "import os\nwhile True:\n    os.fork()\n"
TIMEOUT = 1.0
#: A bomb's timeout, the sandbox's start and teardown on a loaded 2-core machine.
BOUND = 30.0


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise AssertionError("no MemAvailable in /proc/meminfo")


def _sandbox_memory_cgroups() -> dict[str, int]:
    """Memory cgroups of sandboxes on this host (Docker's containers and direct sandboxes) and the
    bytes each is charged."""
    found = {}
    base = Path("/sys/fs/cgroup/memory")
    for directory in [d for d in (*base.glob("docker/*"), *base.glob("sandloop/sandloop-*")) if d.is_dir()]:
        usage = directory / "memory.usage_in_bytes"
        with contextlib.suppress(OSError, ValueError):
            found[str(directory)] = int(usage.read_text())
    return found


def _processes() -> list[tuple[int, str, int]]:
    """(pid, state, parent pid) of every process on the host."""
    out = []
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            out.append((int(entry), fields[0], int(fields[1])))
    return out


def _killed(kind: str, r) -> bool:
    if r.ok:
        return False
    if r.oom_killed or r.timed_out:
        return True
    # A fork bomb's first process may itself die of EAGAIN at the pids ceiling.
    return kind == "fork" and r.exit_code == 1 and "BlockingIOError" in r.stderr


@pytest.mark.timeout(900)
def test_hundreds_of_bombs_in_a_row_leave_the_host_healthy(runtime):
    n = 400 if runtime == "runc" else 60  # gVisor's sandboxes start ~5x slower
    limits = SandboxLimits(memory="64m", runtime=runtime)
    with Sandloop(Settings(pool_size=2)) as root:
        assert root.run_code("print(1)", limits=limits).stdout == "1\n"
        memory_before, processes_before = _mem_available(), len(_processes())
        cgroups_before = set(_sandbox_memory_cgroups())  # the warm pool's, and other processes' sandboxes

        def bomb(i: int) -> tuple[str, bool, float, str]:
            kind = "memory" if i % 2 == 0 else "fork"
            started = time.monotonic()
            r = root.run_code(MEMORY_BOMB if kind == "memory" else FORK_BOMB, limits=limits, timeout_seconds=TIMEOUT)
            how = "oom" if r.oom_killed else "timeout" if r.timed_out else f"exit {r.exit_code}"
            return kind, _killed(kind, r), time.monotonic() - started, how

        started = time.monotonic()
        with ThreadPoolExecutor(4) as pool:
            results = list(pool.map(bomb, range(n)))
        elapsed = time.monotonic() - started
        after = root.run_code("print(sum(range(10)))", limits=limits)
        assert (after.ok, after.stdout) == (True, "45\n"), after  # the host still runs code
        assert not our_containers(patience=60)
    settled = time.monotonic() + 30
    while time.monotonic() < settled and len(_processes()) > processes_before + 10:
        time.sleep(1)
    memory_after, processes = _mem_available(), _processes()
    # a cgroup whose sandbox still exists is another process's (ours would be in our_containers)
    client = docker.from_env()
    try:
        alive = {c.id for c in client.containers.list(all=True, sparse=True)} | set(direct_sandboxes(lambda _: True))
    finally:
        client.close()
    left = {
        path: used
        for path, used in _sandbox_memory_cgroups().items()
        if path not in cgroups_before and Path(path).name not in alive
    }
    print(
        f"\n{n} bombs on {runtime} in {elapsed:.0f} s: {Counter((k, h) for k, _, _, h in results)}, "
        f"longest {max(r[2] for r in results):.1f} s; MemAvailable {memory_before >> 20} -> {memory_after >> 20} MiB, "
        f"processes {processes_before} -> {len(processes)}"
    )
    assert all(killed for _, killed, _, _ in results), [r for r in results if not r[1]]
    assert max(r[2] for r in results) < BOUND
    assert left == {}, left  # no bomb's cgroup (and so none of its memory) outlived its sandbox
    assert len(processes) <= processes_before + 10  # no bomb's processes survived
    assert not [p for p in processes if p[1] == "Z" and p[2] == os.getpid()]  # no zombie of ours

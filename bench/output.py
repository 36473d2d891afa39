"""Output at the pace of a pipe (issue 60), side by side in one run on one machine:

1. 10,000 short lines (``print('line', i, 'x' * 40)``): Debian's ``python3 -c`` on the host into a
   pipe (the floor), ``run_code`` (a warm sandbox) on runc and gVisor, and the same in Node;
2. 2,000 lines in a session cell: Python and bash, runc and gVisor;
3. the first line of a program that prints one line and then sleeps: how long until the caller
   sees it (``run_code``'s ``on_output``), on runc and gVisor.

    python bench/output.py --runs 5 --out docs/benchmarks.md

Measures are interleaved round-robin, so the machine's noise falls on all alike.
"""

from __future__ import annotations

import argparse
import subprocess
import time
from pathlib import Path
from statistics import median as p50

from _report import emit  # bench/ is the script's directory

PY = "for i in range(10000):\n    print('line', i, 'x' * 40)\n"
NODE = "for (let i = 0; i < 10000; i++) console.log('line', i, 'x'.repeat(40));\n"
CELL = "for i in range(2000):\n    print('line', i, 'x' * 40)\n"
BASH = "for i in $(seq 2000); do echo line $i xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx; done"
FIRST = "import time\nprint('first', flush=True)\ntime.sleep(1)\n"


def one_round(sl, session, rt: str, timed, times: dict) -> None:
    from sandloop import SandboxLimits

    limits = SandboxLimits(runtime=rt)
    timed(f"run_code python {rt}", lambda: sl.run_code(PY, limits=limits, timeout_seconds=120))
    timed(f"run_code node {rt}", lambda: sl.run_code(NODE, "node", limits=limits, timeout_seconds=120))
    timed(f"cell python {rt}", lambda: session.run_cell(CELL, timeout_seconds=120))
    timed(f"cell bash {rt}", lambda: session.run_cell(BASH, language="bash", timeout_seconds=120))
    started = time.monotonic()
    first: list[float] = []

    def out(stream: str, data: bytes) -> None:
        if not first:
            first.append(time.monotonic() - started)

    sl.run_code(FIRST, limits=limits, on_output=out)
    times.setdefault(f"first line {rt}", []).append(first[0] if first else float("nan"))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()

    from sandloop import SandboxLimits, Sandloop, Settings, __version__

    times: dict[str, list[float]] = {}

    def timed(name: str, call) -> None:
        started = time.monotonic()
        call()
        times.setdefault(name, []).append(time.monotonic() - started)

    with Sandloop(Settings(pool_size=2)) as sl:
        sessions = {rt: sl.create_session(limits=SandboxLimits(runtime=rt)) for rt in ("runc", "runsc")}
        try:
            for s in sessions.values():
                s.run_cell("print(1)")
                s.run_cell("echo 1", language="bash")
            for rt in ("runc", "runsc"):  # warm the pools
                sl.run_code("print(1)", limits=SandboxLimits(runtime=rt))
            for _ in range(args.runs):
                timed(
                    "floor",
                    lambda: subprocess.run(["/usr/bin/python3", "-c", PY], stdout=subprocess.PIPE, check=True),
                )
                for rt in ("runc", "runsc"):
                    one_round(sl, sessions[rt], rt, timed, times)
        finally:
            for s in sessions.values():
                s.delete()

    floor = p50(times["floor"])
    rows = [
        f"### Output at the pace of a pipe ({args.runs} interleaved rounds, sandloop {__version__}, "
        f"{time.strftime('%Y-%m-%d')})",
        "",
        "| what | p50 | vs floor |",
        "|---|---:|---:|",
    ]
    for name, values in times.items():
        if name.startswith("first line"):
            continue
        rows.append(f"| {name} | {p50(values) * 1000:.0f} ms | {p50(values) / floor:.1f}x |")
    rows += ["", "| first line of a program that then sleeps | p50 |", "|---|---:|"]
    for rt in ("runc", "runsc"):
        rows.append(f"| {rt} | {p50(times[f'first line {rt}']) * 1000:.0f} ms |")
    emit("\n".join(rows) + "\n", args.out)


if __name__ == "__main__":
    main()

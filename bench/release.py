"""This checkout beside the previous release and the bare floor, in one run (issue 40's `make
bench`): the same requests sent round-robin to three worker processes (``_release_worker.py``),
so the machine's noise hits all three alike.

    make bench        # or: .bench/venv/bin/python bench/release.py [--runs 30] [--previous REF]

The previous release is the commit named in ``bench/previous-release`` (the last one that landed;
``--previous`` names another), exported with ``git archive`` and installed into its own venv
(``.bench/previous/``); its runtime image is built by its own ``sandloop images build`` (nothing
if its recipe is this one's). The floor is Debian's ``python3 -c`` on the host. Measured per
side: a cold ``print(1)`` (no pool: a sandbox started for it) and the CPU it costs (its
sandbox's, read from the direct sandboxes' parent cpuacct cgroup once its teardown is drained,
less that of the image's own ``python3 -c`` run bare in its root file system; and the worker's
own, the start path in Python, timed once the image's page-cache prefetch is done); a pooled
``print(1)``; 40 pooled runs on 4 threads; a new session's first cell and the cell after it. Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import venv
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
PREVIOUS = REPO / ".bench" / "previous"
WORKER = HERE / "_release_worker.py"


def previous_ref(given: str | None) -> str:
    ref = given or (HERE / "previous-release").read_text().split()[0]
    return subprocess.run(
        ["git", "-C", str(REPO), "rev-parse", "--verify", f"{ref}^{{commit}}"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()


def image_rootfs() -> str:
    """This checkout's runtime image as the direct backend's store holds it (exported if not yet)."""
    from sandloop import Sandloop
    from sandloop.recipe_hash import default_runtime_image
    from sandloop.settings import Settings

    with Sandloop(Settings(pool_size=0, session_pool_size=0)) as root:
        return str(root.backend.store.rootfs(root.settings.image or default_runtime_image()))


def install_previous(commit: str) -> Path:
    """The previous release's interpreter (its venv made and filled once per commit)."""
    python = PREVIOUS / "venv" / "bin" / "python"
    stamp = PREVIOUS / "installed"
    if stamp.exists() and stamp.read_text() == commit and python.exists():
        return python
    src = PREVIOUS / "src"
    subprocess.run(["rm", "-rf", str(src), str(PREVIOUS / "venv")], check=True)
    src.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(REPO), "archive", commit], capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(src)], input=archive, check=True)
    venv.create(PREVIOUS / "venv", with_pip=True)
    subprocess.run([str(python), "-m", "pip", "install", "--quiet", str(src)], check=True)
    subprocess.run([str(PREVIOUS / "venv" / "bin" / "sandloop"), "images", "build"], check=True)
    stamp.write_text(commit)
    return python


class Side:
    def __init__(self, name: str, argv: list[str]) -> None:
        self.name = name
        env = {**os.environ, "PYTHONPATH": ""}
        # cwd outside the checkout: the previous release must not import this one's sources
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd="/", env=env)
        assert self.ask_line() == {"ready": True}, f"{name} did not start"

    def ask_line(self) -> dict:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"{self.name}'s worker ended (exit {self.proc.wait()})")
        return json.loads(line)

    def ask(self, op: str) -> dict:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": op}) + "\n")
        self.proc.stdin.flush()
        return self.ask_line()

    def close(self) -> None:
        if self.proc.poll() is None:
            self.ask_quit()

    def ask_quit(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps({"op": "quit"}) + "\n")
        self.proc.stdin.close()
        self.proc.wait(120)


def rounds(sides: list[Side], op: str, runs: int) -> dict[str, list[dict]]:
    out: dict[str, list[dict]] = {s.name: [] for s in sides}
    for i in range(runs):
        for side in sides[i % len(sides) :] + sides[: i % len(sides)]:  # who goes first rotates
            out[side.name].append(side.ask(op))
    return out


def p50(rows: list[dict], key: str = "ms") -> float:
    return statistics.median(r[key] for r in rows)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=30)
    ap.add_argument("--previous", help="a git ref (default: bench/previous-release)")
    args = ap.parse_args()
    commit = previous_ref(args.previous)
    previous_python = install_previous(commit)
    now = subprocess.run(["git", "-C", str(REPO), "rev-parse", "--short", "HEAD"], capture_output=True, text=True)
    sides = [
        Side("floor", ["/usr/bin/python3", str(WORKER), "floor", image_rootfs()]),
        Side(f"this ({now.stdout.strip()})", [sys.executable, str(WORKER), "sandloop"]),
        Side(f"previous ({commit[:7]})", [str(previous_python), str(WORKER), "sandloop"]),
    ]
    floor, this, previous = (s.name for s in sides)
    try:
        cold = rounds(sides, "cold", args.runs)
        warm = rounds(sides, "warm", args.runs)
        burst = rounds(sides, "burst:4:40", max(3, args.runs // 10))
        session = rounds(sides[1:], "session", max(5, args.runs // 3))
    finally:
        for side in sides:
            side.close()
    floor_cold, bare_cpu = p50(cold[floor]), p50(cold[floor], "bare_image_cpu_ms")
    floor_rate = 40 / (p50(burst[floor]) / 1000)

    def row(label: str, value: Callable[[str], str]) -> str:
        return f"| {label} | " + " | ".join(value(name) for name in (floor, this, previous)) + " |"

    lines = [
        f"| {args.runs} rounds, round-robin | {floor} | {this} | {previous} |",
        "|---|---:|---:|---:|",
        row("cold `print(1)` p50 ms", lambda n: f"{p50(cold[n]):.1f}"),
        row("cold ÷ the floor's", lambda n: f"{p50(cold[n]) / floor_cold:.2f}"),
        row("CPU per cold run ms: the floor's process, a sandbox's", lambda n: f"{p50(cold[n], 'cpu_ms'):.1f}"),
        row(
            "start CPU per cold run ms: a sandbox's processes less the image's python3 run bare",
            lambda n: "" if n == floor else f"{p50(cold[n], 'cpu_ms') - bare_cpu:.1f}",
        ),
        row("... and the caller's own (Python) CPU per cold run ms", lambda n: f"{p50(cold[n], 'own_cpu_ms'):.1f}"),
        row("pooled `print(1)` p50 ms", lambda n: f"{p50(warm[n]):.1f}"),
        row("40 runs on 4 threads, runs/s", lambda n: f"{40 / (p50(burst[n]) / 1000):.0f}"),
        row("... ÷ the floor's", lambda n: f"{40 / (p50(burst[n]) / 1000) / floor_rate:.2f}"),
        row(
            "a session made, two cells, deleted p50 ms (no warm one)",
            lambda n: "" if n == floor else f"{p50(session[n]):.0f}",
        ),
        row("a session's next cell p50 ms", lambda n: "" if n == floor else f"{p50(session[n], 'next_cell_ms'):.1f}"),
    ]
    print("\n".join(lines))


if __name__ == "__main__":
    main()

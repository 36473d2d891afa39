"""Templates (issue 24): the build of code-interpreter-v1 + ``pip install scikit-learn`` + a 1 MB
COPY, cold (no step cache, the wheels fetched again) and cached; then a sandbox from it beside the
runtime image in one run, round-robin: warm ``print(1)`` p50 (through the pool) and cold start p50.

    .venv/bin/python bench/templates.py [--runs 30]

Reaches PyPI through the host's pip (a benchmark, not a test). Prints a Markdown table.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from sandloop import SandboxLimits, Sandloop
from sandloop.images.templates import parse_steps_file
from sandloop.runtime.base import SandboxSpec
from sandloop.settings import Settings

NAME = "bench-sklearn:v1"


def p50(values: list[float]) -> float:
    return statistics.median(values) * 1000


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--runs", type=int, default=30)
    args = parser.parse_args()
    folder = Path(tempfile.mkdtemp(prefix="sandloop-bench-template-"))
    (folder / "data.bin").write_bytes(os.urandom(1024 * 1024))
    (folder / "steps.yaml").write_text(
        "from: runtime\nsteps:\n  - pip_install: [scikit-learn]\n  - copy: {src: data.bin, dest: /opt/data.bin}\n"
    )
    spec = parse_steps_file(folder / "steps.yaml", NAME)
    rows: list[tuple[str, str]] = []
    with Sandloop(Settings(pool_size=0)) as cold:
        cold.templates.prune()
        began = time.monotonic()
        first = cold.templates.build(spec, force=True)
        rows.append(("build, cold (no cache; wheels downloaded) s", f"{time.monotonic() - began:.1f}"))
        cached = []
        for _ in range(5):
            began = time.monotonic()
            again = cold.templates.build(spec)
            cached.append(time.monotonic() - began)
            assert again.built_steps == 0 and again.image_id == first.image_id
        rows.append(("build, cached (every step a hit) p50 s", f"{statistics.median(cached):.2f}"))
        check = cold.run_code("import sklearn; print(sklearn.__version__)", template=NAME, timeout_seconds=120)
        assert check.exit_code == 0, check.stderr
        rows.append(("scikit-learn in the template", check.stdout.strip()))
        image = cold.image_for(NAME)
        size = cold.templates.get(NAME).size_bytes >> 20
        rows.append(("template image MiB (runtime image + layers)", str(size)))
        # cold starts, round-robin
        cold_runtime, cold_template = [], []
        for _ in range(args.runs):
            for target, out in ((None, cold_runtime), (NAME, cold_template)):
                began = time.monotonic()
                r = cold.run_code("print(1)", template=target)
                out.append(time.monotonic() - began)
                assert r.stdout == "1\n", r.stderr
    with Sandloop(Settings(pool_size=2)) as warm:
        limits = SandboxLimits()
        for target in (warm.image, image):
            # the image's programs read into the page cache first (a server does it once per image;
            # a run measured while 650 MB are read in the background pays for it)
            prefetch = getattr(warm.backend, "prefetch_image", None)
            if prefetch is not None:
                prefetch(target, wait=True)
            assert warm.dispatcher.prewarm(SandboxSpec(target, limits), timeout=120)
        warm_runtime, warm_template = [], []
        for _ in range(args.runs):
            for target, out in ((None, warm_runtime), (NAME, warm_template)):
                warm.dispatcher.settle(60)
                began = time.monotonic()
                r = warm.run_code("print(1)", template=target)
                out.append(time.monotonic() - began)
                assert r.stdout == "1\n", r.stderr
        warm.templates.remove(NAME)  # the benchmark leaves no template behind
    rows += [
        ("warm print(1) p50 ms: runtime image / template", f"{p50(warm_runtime):.1f} / {p50(warm_template):.1f}"),
        ("warm ratio (target ≤ 1.10)", f"{p50(warm_template) / p50(warm_runtime):.2f}"),
        ("cold print(1) p50 ms: runtime image / template", f"{p50(cold_runtime):.1f} / {p50(cold_template):.1f}"),
        ("cold ratio (target ≤ 1.20)", f"{p50(cold_template) / p50(cold_runtime):.2f}"),
    ]
    print("| templates (issue 24), " + time.strftime("%Y-%m-%d") + f", {args.runs} runs each | |")
    print("|---|---:|")
    for name, value in rows:
        print(f"| {name} | {value} |")
    sys.stdout.flush()


if __name__ == "__main__":
    main()

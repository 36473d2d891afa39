"""One side of ``bench/release.py``: answers timing requests (one JSON line in, one out) for the
sandloop installed in the interpreter that runs it, or for the bare floor (``floor``: Debian's
``python3 -c`` on the host, no sandloop imported). It uses only the API every release has had
(``Sandloop``, ``Settings``, ``run_code``, ``create_session``, ``run_cell``), so the previous
release answers the same requests.

    python bench/_release_worker.py sandloop|floor [ROOTFS]

``floor ROOTFS`` also runs the image's own ``python3 -c`` in ``ROOTFS`` (chroot, nothing else),
for the start-CPU row: a sandbox's CPU less that of the same program run bare.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

FLOOR = "/usr/bin/python3"


#: The parent of every direct sandbox's cgroups (cgroup v1, hierarchical: a sandbox's CPU stays
#: counted here after its own cgroup is removed).
SANDBOXES_CPUACCT = Path("/sys/fs/cgroup/cpuacct/sandloop/cpuacct.usage")


def children_cpu_ms() -> float:
    """CPU of the processes this one waited for: the floor's ``python3``. A sandbox's processes
    are not among them (bwrap's sandbox is torn down, not waited for: 0.0 here per cold run)."""
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (r.ru_utime + r.ru_stime) * 1000


def sandboxes_cpu_ms() -> float:
    """CPU of every direct sandbox (bwrap's set-up included: it starts inside the cgroups)."""
    try:
        return int(SANDBOXES_CPUACCT.read_text()) / 1e6
    except FileNotFoundError:
        return 0.0


def own_cpu_ms() -> float:
    """This process's CPU: sandloop's start path in Python (the floor's is ``subprocess.run``)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return (r.ru_utime + r.ru_stime) * 1000


def main() -> None:
    mode = sys.argv[1]
    if mode == "floor":
        rootfs = sys.argv[2] if len(sys.argv) > 2 else ""

        def warm() -> None:
            out = subprocess.run([FLOOR, "-c", "print(1)"], capture_output=True, check=True)
            assert out.stdout == b"1\n"

        def cold() -> dict[str, float]:
            started = time.perf_counter()
            warm()
            timed = {"ms": (time.perf_counter() - started) * 1000}  # the floor's own, alone
            if not rootfs:
                return timed
            # the sandbox's own program, run bare: the image's python3 in its root file system
            # (no namespaces, cgroups or filter): what a start costs is the sandbox's CPU less this
            before = children_cpu_ms()

            def enter() -> None:  # no chroot program: only the interpreter's own CPU is counted
                os.chroot(rootfs)
                os.chdir("/")

            out = subprocess.run(["/usr/bin/python3", "-c", "print(1)"], capture_output=True, preexec_fn=enter)
            assert out.stdout == b"1\n", out
            return {**timed, "bare_image_cpu_ms": children_cpu_ms() - before}

        def cell_session() -> float:
            raise NotImplementedError

    else:
        from sandloop import Sandloop
        from sandloop.recipe_hash import default_runtime_image
        from sandloop.settings import Settings

        pooled = Sandloop(Settings(pool_size=4, pool_refill_concurrency=2, session_pool_size=0))
        unpooled = Sandloop(Settings(pool_size=0, session_pool_size=0))

        def cold() -> None:
            r = unpooled.run_code("print(1)")
            assert r.stdout == "1\n", r
            unpooled.backend.drain(60)  # its teardown reaped, so its processes' CPU is counted

        def warm() -> None:
            r = pooled.run_code("print(1)")
            assert r.stdout == "1\n", r

        def cell_session() -> float:
            """A new session's first cell (cold: no warm session), then the time of a second."""
            s = unpooled.create_session(ttl=600, quota="16m")
            try:
                assert s.run_cell("x = 1").error is None
                started = time.perf_counter()
                assert s.run_cell("x + 1").value == "2"
                return (time.perf_counter() - started) * 1000
            finally:
                s.delete()

        warm()  # the pool is made before the first timed run
        # The image's programs are read into the page cache once per process, on a thread of its
        # own (runtime/pagecache.py: ~0.6 s of CPU): done before timing, or the first rounds'
        # own-CPU rows carry it (17 ms a cold run read so, against ~4 once it was done).
        for root in (pooled, unpooled):
            prefetch = getattr(root.backend, "prefetch_image", None)
            if prefetch is not None:
                prefetch(root.settings.image or default_runtime_image(), wait=True)

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        op = json.loads(line)["op"]
        before_cpu, before_own, started = children_cpu_ms() + sandboxes_cpu_ms(), own_cpu_ms(), time.perf_counter()
        extra: dict[str, float] = {}
        if op == "cold":
            extra.update(cold() or {})
        elif op == "warm":
            warm()
        elif op == "session":
            extra["next_cell_ms"] = cell_session()
        elif op.startswith("burst:"):  # burst:THREADS:RUNS, pooled
            threads, runs = (int(n) for n in op.split(":")[1:])
            with ThreadPoolExecutor(threads) as pool:
                list(pool.map(lambda _: warm(), range(runs)))
        elif op == "quit":
            break
        elapsed = (time.perf_counter() - started) * 1000
        spent = children_cpu_ms() + sandboxes_cpu_ms() - before_cpu - extra.get("bare_image_cpu_ms", 0.0)
        cpu = {"cpu_ms": spent, "own_cpu_ms": own_cpu_ms() - before_own}
        print(json.dumps({"ms": elapsed, **cpu, **extra}), flush=True)  # extra's "ms" wins


if __name__ == "__main__":
    main()

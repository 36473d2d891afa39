"""One side of ``bench/release.py``: answers timing requests (one JSON line in, one out) for the
sandloop installed in the interpreter that runs it, or for the bare floor (``floor``: Debian's
``python3 -c`` on the host, no sandloop imported). It uses only the API every release has had
(``Sandloop``, ``Settings``, ``run_code``, ``create_session``, ``run_cell``), so the previous
release answers the same requests.

    python bench/_release_worker.py sandloop|floor
"""

from __future__ import annotations

import json
import resource
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

FLOOR = "/usr/bin/python3"


def children_cpu_ms() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (r.ru_utime + r.ru_stime) * 1000


def own_cpu_ms() -> float:
    """This process's CPU: sandloop's start path in Python (the floor's is ``subprocess.run``)."""
    r = resource.getrusage(resource.RUSAGE_SELF)
    return (r.ru_utime + r.ru_stime) * 1000


def main() -> None:
    mode = sys.argv[1]
    if mode == "floor":

        def cold() -> None:
            out = subprocess.run([FLOOR, "-c", "print(1)"], capture_output=True, check=True)
            assert out.stdout == b"1\n"

        warm = cold

        def cell_session() -> float:
            raise NotImplementedError

    else:
        from sandloop import Sandloop
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

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        op = json.loads(line)["op"]
        before_cpu, before_own, started = children_cpu_ms(), own_cpu_ms(), time.perf_counter()
        extra: dict[str, float] = {}
        if op == "cold":
            cold()
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
        cpu = {"cpu_ms": children_cpu_ms() - before_cpu, "own_cpu_ms": own_cpu_ms() - before_own}
        print(json.dumps({"ms": elapsed, **cpu, **extra}), flush=True)


if __name__ == "__main__":
    main()

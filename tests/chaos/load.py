"""The load every chaos scenario runs under: runs on several threads and session cells on one,
every outcome recorded (kind, outcome, seconds, sound, finished-at); and what may be left after."""

from __future__ import annotations

import subprocess
import threading
import time
from pathlib import Path

import docker

from sandloop import SandboxError, Sandloop
from tests.helpers import our_containers

RUN_TIMEOUT = 10.0


class Load:
    """Runs on ``workers`` threads and session cells on one, recording every outcome. An exception
    other than ``SandboxError`` is recorded as an unsound outcome (the test names it) and the load
    goes on, so the sessions are still deleted at the end."""

    def __init__(self, root: Sandloop, workers: int = 4, bound: float = 120.0) -> None:
        self.root = root
        self.bound = bound
        self.stop = threading.Event()
        self.lock = threading.Lock()
        self.outcomes: list[tuple[str, str, float, bool, float]] = []  # kind, outcome, seconds, sound, at
        self.sessions: list[str] = []
        self.threads = [threading.Thread(target=self.runs, args=(w,)) for w in range(workers)]
        self.threads.append(threading.Thread(target=self.cells))

    def record(self, kind: str, outcome: str, started: float, sound: bool) -> None:
        with self.lock:
            self.outcomes.append((kind, outcome, time.monotonic() - started, sound, time.monotonic()))

    def runs(self, worker: int) -> None:
        i = 0
        while not self.stop.is_set():
            i += 1
            n = worker * 100_000 + i
            started = time.monotonic()
            try:
                r = self.root.run_code(f"import time\ntime.sleep(0.2)\nprint({n} * {n})", "python", RUN_TIMEOUT)
            except SandboxError as exc:
                self.record("run", type(exc).__name__, started, True)
                time.sleep(0.1)
                continue
            except Exception as exc:  # noqa: BLE001 - anything else is a bug: recorded as unsound, load goes on
                self.record("run", f"raised {exc!r}", started, False)
                time.sleep(0.1)
                continue
            right = r.ok and r.stdout == f"{n * n}\n"
            self.record("run", "ok" if right else "failed run", started, right or not r.ok)

    def cells(self) -> None:
        session = None
        i = 0
        while not self.stop.is_set():
            started = time.monotonic()
            try:
                if session is None:
                    session = self.root.create_session(quota="32m")
                    with self.lock:
                        self.sessions.append(session.id)
                i += 1
                c = session.run_cell(f"{i} * 3", timeout_seconds=RUN_TIMEOUT)
                right = c.ok and c.value == str(i * 3)
                self.record("cell", "ok" if right else "failed cell", started, right or not c.ok)
            except SandboxError as exc:
                self.record("cell", type(exc).__name__, started, True)
                time.sleep(0.2)
            except Exception as exc:  # noqa: BLE001 - a bug (seen: a BrokenPipeError): recorded, cleanup still runs
                self.record("cell", f"raised {exc!r}", started, False)
                time.sleep(0.2)
        if session is not None:
            for _ in range(30):  # the engine may still be coming back
                try:
                    session.delete()
                    break
                except SandboxError:
                    time.sleep(1)
        for sid in self.sessions:  # sessions an outage broke: delete what is left of them
            for _ in range(10):
                try:
                    self.root.attach_session(sid).delete()
                    break
                except SandboxError as exc:
                    if "no session" in str(exc).lower() or "not found" in str(exc).lower():
                        break
                    time.sleep(1)

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def summary(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for kind, outcome, *_ in self.outcomes:
            out[f"{kind} {outcome}"] = out.get(f"{kind} {outcome}", 0) + 1
        return out

    def recovered_since(self, at: float) -> bool:
        """A correct run that started after ``at``."""
        return self.served(at)["run"] > 0

    def wait_for_recovery(self, since: float, within: float) -> float:
        """Seconds from ``since`` until a correct run that started after it (or ``within``)."""
        deadline = since + within
        while time.monotonic() < deadline and not self.recovered_since(since):
            time.sleep(0.5)
        return time.monotonic() - since

    def served(self, since: float = 0.0) -> dict[str, int]:
        """Correct outcomes of requests started after ``since``, by kind (run, cell)."""
        with self.lock:
            out = {"run": 0, "cell": 0}
            for kind, outcome, seconds, _, at in self.outcomes:
                if outcome == "ok" and at - seconds > since:
                    out[kind] += 1
            return out

    def wait_served(self, n: int, since: float = 0.0, within: float = 120.0, kinds=("run", "cell")) -> None:
        """Until ``n`` correct requests of each of ``kinds`` started after ``since`` (the load is
        under way, or has gone on after a fault): the load's own progress, not a sleep."""
        deadline = time.monotonic() + within
        while min(self.served(since)[k] for k in kinds) < n:
            assert time.monotonic() < deadline, f"{n} runs and cells not served within {within} s: {self.summary()}"
            time.sleep(0.1)

    def finish(self) -> None:
        self.stop.set()
        for t in self.threads:
            t.join(self.bound + 60)
        assert not any(t.is_alive() for t in self.threads), "a request hung"


def leftovers(sessions: list[str]) -> list[str]:
    client = docker.from_env()
    try:
        out = [f"container {c.id[:12]} {c.status}" for c in our_containers(patience=60)]
        for sid in sessions:
            label = f"sandloop.session={sid}"
            out += [
                f"session container {c.id[:12]}"
                for c in client.containers.list(all=True, sparse=True, filters={"label": label})
            ]
            out += [f"session volume {v.name}" for v in client.volumes.list(filters={"label": label})]
        mounts = Path("/proc/mounts").read_text()
        out += [f"mount of {sid}" for sid in sessions if sid in mounts]
        return out
    finally:
        client.close()


def pid_of(program: str) -> int | None:
    out = subprocess.run(["pgrep", "-x", program], capture_output=True, text=True).stdout.split()
    return int(out[0]) if out else None


BACKENDS = ("docker", "oci")


class Loads:
    """The same load on each backend at once, each root with a home of its own: one engine fault
    is seen by both (before, each backend had a fault and an engine restart of its own)."""

    def __init__(self, home: Path, settings: dict, **load_kw) -> None:
        from sandloop import Settings

        self.roots = {b: Sandloop(Settings(backend=b, home=home / b, **settings)) for b in BACKENDS}
        self.loads = {b: Load(root, **load_kw) for b, root in self.roots.items()}

    def start(self) -> None:
        for load in self.loads.values():
            load.start()

    def wait_for_recovery(self, since: float, within: float) -> float:
        """Seconds from ``since`` until both have served a correct run started after it."""
        return max(load.wait_for_recovery(since, within) for load in self.loads.values())

    def wait_served(self, n: int, since: float = 0.0, within: float = 120.0, kinds=("run", "cell")) -> None:
        for load in self.loads.values():
            load.wait_served(n, since, within, kinds)

    def finish(self) -> None:
        """Every load stopped (each request ended) before any root closes."""
        try:
            for load in self.loads.values():
                load.finish()
        finally:
            for root in self.roots.values():
                root.close()

    @property
    def sessions(self) -> list[str]:
        return [sid for load in self.loads.values() for sid in load.sessions]

"""A real local Ray cluster for tests and benchmarks: a head (no sandloop resource) and sandbox nodes (each
with ``{"sandloop": 1}`` and a SANDLOOP_HOME of its own), on loopback, on ports and a temp dir of
its own. Stopped by the pids it started (every process whose command line names its temp dir),
never by ``ray stop``, which would stop every cluster on the machine."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil  # the dev extras have it (not a dependency of sandloop itself)

RAY = str(Path(sys.executable).parent / "ray")


def wait_gone(procs: list[psutil.Process], timeout: float) -> list[psutil.Process]:
    """The processes still alive after up to ``timeout`` seconds. Not ``psutil.wait_procs``: the
    psutil Ray vendors lets ``pidfd_open``'s ENOENT through when a process exits as it is asked
    (Linux 6.18), so a process that is gone failed the stop; such a one is polled until it has gone
    (a zombie counts as gone: it runs nothing)."""
    deadline = time.monotonic() + timeout
    alive = []
    for proc in procs:
        try:
            proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except psutil.NoSuchProcess:
            continue
        except psutil.TimeoutExpired:
            alive.append(proc)
        except OSError:
            while _running(proc) and time.monotonic() < deadline:
                time.sleep(0.1)
            if _running(proc):
                alive.append(proc)
    return alive


def _running(proc: psutil.Process) -> bool:
    try:
        return bool(proc.is_running() and proc.status() != psutil.STATUS_ZOMBIE)
    except psutil.NoSuchProcess:
        return False


def free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LocalCluster:
    def __init__(self, workers: int = 2) -> None:
        # Short: Ray's Unix sockets live under it (a socket path has at most 107 bytes).
        self.tmp = Path(tempfile.mkdtemp(prefix="slray-", dir="/tmp"))
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.workers = workers
        self.node_ports: list[int] = []
        self.homes: list[Path] = []
        self.last_killed = -1

    def _env(self, home: Path | None = None) -> dict[str, str]:
        env = {**os.environ, "RAY_USAGE_STATS_ENABLED": "0", "RAY_DISABLE_IMPORT_WARNING": "1"}
        env.pop("RAY_ADDRESS", None)
        if home is not None:
            env["SANDLOOP_HOME"] = str(home)
        return env

    def _start(self, args: list[str], env: dict[str, str]) -> None:
        done = subprocess.run([RAY, "start", *args], env=env, capture_output=True, text=True, timeout=180)
        if done.returncode != 0:
            raise RuntimeError(f"ray start {' '.join(args)} failed:\n{done.stdout}\n{done.stderr}")

    def start(self) -> LocalCluster:
        common = ["--node-ip-address=127.0.0.1", "--disable-usage-stats", "--num-cpus=1"]
        self._start(
            ["--head", f"--port={self.port}", f"--temp-dir={self.tmp}", "--include-dashboard=false", *common],
            self._env(),
        )
        for i in range(self.workers):
            self.add_node(i)
        return self

    def add_node(self, i: int) -> None:
        home = self.tmp / f"home{i}"
        home.mkdir(exist_ok=True)
        self.homes.append(home)
        self.node_ports.append(0)
        self.restart_node(i)

    def processes(self) -> list[psutil.Process]:
        """Every process of this cluster: those naming its temp dir or its port, and their
        descendants (the agents and workers a raylet starts rename themselves ``ray::...``)."""
        marks = (str(self.tmp), f":{self.port} ", f":{self.port}")
        mine: dict[int, psutil.Process] = {}
        for proc in psutil.process_iter(["cmdline"]):
            try:
                line = " ".join(proc.info["cmdline"] or []) + " "
                if "ray" in line and any(m in line for m in marks):
                    mine[proc.pid] = proc
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
        for proc in list(mine.values()):
            with contextlib.suppress(psutil.NoSuchProcess):
                for child in proc.children(recursive=True):
                    mine[child.pid] = child
        return list(mine.values())

    def raylet(self, i: int) -> psutil.Process:
        for proc in self.processes():
            cmd = " ".join(proc.info["cmdline"] or [])
            if "raylet" in cmd and f"--node_manager_port={self.node_ports[i]}" in cmd:
                return proc
        raise LookupError(f"no raylet for node {i}")

    def kill_node(self, i: int) -> None:
        """SIGKILL node ``i``'s raylet, as a host lost would: its workers (the node's actor)
        notice and exit; its containers run on to their deadlines."""
        self.last_killed = i
        raylet = self.raylet(i)
        children = raylet.children(recursive=True)
        raylet.send_signal(signal.SIGKILL)
        wait_gone([raylet], timeout=10)
        del children  # left to notice their raylet is gone, as on a real host

    def node_index(self, node_id: str) -> int:
        """Which of our worker nodes has this Ray node id (by its raylet's port)."""
        import ray

        for node in ray.nodes():  # type: ignore[no-untyped-call]
            if node["NodeID"] == node_id:
                return self.node_ports.index(int(node["NodeManagerPort"]))
        raise LookupError(node_id)

    def restart_node(self, i: int) -> None:
        """Start worker ``i`` again (a new Ray node, on the same SANDLOOP_HOME)."""
        port = free_port()
        self._start(
            [
                f"--address={self.address}",
                f"--node-manager-port={port}",
                f"--resources={json.dumps({'sandloop': 1})}",
                "--node-ip-address=127.0.0.1",
                "--disable-usage-stats",
                "--num-cpus=1",
            ],
            self._env(self.homes[i]),
        )
        self.node_ports[i] = port

    def stop(self) -> None:
        for _ in range(3):
            procs = self.processes()
            if not procs:
                break
            for proc in procs:
                with contextlib.suppress(psutil.NoSuchProcess):
                    proc.send_signal(signal.SIGTERM)
            alive = wait_gone(procs, timeout=10)
            for proc in alive:
                with contextlib.suppress(psutil.NoSuchProcess):
                    proc.kill()
            time.sleep(0.5)
        self._unmount_homes()

    def _unmount_homes(self) -> None:
        """Workspaces a node left mounted under its home (a test that failed before deleting its
        session): unmounted, so nothing of the cluster outlives it; then its temp dir goes."""
        import shutil

        with open("/proc/mounts") as f:
            points = [line.split()[1] for line in f if line.split()[1].startswith(str(self.tmp) + "/")]
        for point in sorted(points, reverse=True):
            subprocess.run(["umount", "-l", point], capture_output=True, check=False)
        shutil.rmtree(self.tmp, ignore_errors=True)

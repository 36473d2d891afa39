"""The direct sandboxes' teardown: a few threads that kill, wait for and remove what each
sandbox leaves (its processes, the runtime's state, cgroups, tmpfs mounts, the bundle), off the
request path; the sweeps of what a crash or a killed owner left; and ``drain`` for shutdown.

Each sandbox handed over (``hand_over``) is no longer listed as owned (``dying``): it is ours to
remove, not the reaper's; if this process dies first, its bundle is listed again.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import os
import queue
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from pathlib import Path

from sandloop.runtime.base import Owned
from sandloop.runtime.labels import OWNER_LABEL, owner_alive
from sandloop.runtime.oci.bundle import (
    BWRAP,
    CGROUP_PARENT,
    DIRECT_RUNTIMES,
    RUNTIME_LABEL,
    DirectSandbox,
    bundle_labels,
    cgroup_dirs,
    kill,
    kill_pid_file,
    list_bundles,
    remove_cgroup,
    remove_tree,
)
from sandloop.runtime.oci.kernels import holder_pid, wait_for_holder

log = logging.getLogger(__name__)


class Teardowns:
    """Tears down direct sandboxes under ``state`` on ``threads`` threads; ``runtime_argv(name)``
    says how to call a runtime (its path and registered arguments)."""

    def __init__(self, state: Path, runtime_argv: Callable[[str], list[str]], threads: int = 2) -> None:
        self.state = state
        self._runtime_argv = runtime_argv
        self._queue: queue.Queue[DirectSandbox | Callable[[], object] | None] = queue.Queue()
        self._pending = 0
        self._swept = False
        self._pending_lock = threading.Condition()
        #: Sandboxes handed to a teardown thread: no longer ``owned()`` (ours to remove, not the
        #: reaper's; if this process dies first, their bundles are listed again).
        self.dying: set[str] = set()
        #: How long the last teardowns took, from ``destroy`` to nothing left (benchmarks).
        self.teardown_seconds: collections.deque[float] = collections.deque(maxlen=1000)
        self._workers = [
            threading.Thread(target=self._loop, name="sandloop-oci-teardown", daemon=True) for _ in range(threads)
        ]
        for worker in self._workers:
            worker.start()

    def hand_over(self, sandbox: DirectSandbox) -> None:
        """Close the sandbox's pipes and queue its teardown (idempotent)."""
        sandbox.channel.close()
        if sandbox.stdin_fd >= 0:
            with contextlib.suppress(OSError):
                os.close(sandbox.stdin_fd)
            sandbox.stdin_fd = -1
        with self._pending_lock:
            if sandbox.destroyed:
                return  # destroy is idempotent
            sandbox.destroyed = True
            sandbox.destroyed_at = time.monotonic()
            self.dying.add(sandbox.id)
            self._pending += 1
        self._queue.put(sandbox)

    @property
    def pending(self) -> int:
        """Teardowns queued or running."""
        with self._pending_lock:
            return self._pending

    def remove(self, item: Owned) -> str | None:
        """Remove a listed bundle now; None, or why it could not be removed."""
        try:
            self.delete(item.id, item.labels.get(RUNTIME_LABEL, "runc"))
        except Exception as exc:  # noqa: BLE001 - reaping is best effort
            log.warning("could not remove %s: %s", item.id, exc)
            return str(exc)
        return None

    def close(self) -> None:
        for _ in self._workers:
            self._queue.put(None)

    def _loop(self) -> None:
        while True:
            sandbox = self._queue.get()
            if sandbox is None:
                return
            try:
                if callable(sandbox):
                    sandbox()
                else:
                    self._tear_down(sandbox)
                    self.teardown_seconds.append(time.monotonic() - sandbox.destroyed_at)
            except Exception as exc:  # noqa: BLE001 - a teardown thread must survive
                log.warning("could not tear down %s: %s (the reaper will)", getattr(sandbox, "id", sandbox), exc)
            finally:
                with self._pending_lock:
                    self._pending -= 1
                    if not callable(sandbox):
                        self.dying.discard(sandbox.id)
                    self._pending_lock.notify_all()

    def sweep_once(self) -> None:
        """At this process's first direct launch, hand the teardown thread a sweep of what killed
        processes of this host left in the store (``sweep_dead_owners``): a SIGKILLed ``sandloop
        run`` left its bundle, cgroups and tmpfs mounts (its processes died with it) until ``sandloop
        reap`` or a server's reaper. Off the request path; ``drain``/``close`` wait for it."""
        with self._pending_lock:
            if self._swept:
                return
            self._swept = True
            self._pending += 1
        self._queue.put(self.sweep_dead_owners)

    def sweep_dead_owners(self) -> int:
        """Remove the direct sandboxes whose owner process on this host is gone (the reaper's
        "owner gone", nothing else: a session's interpreter is owned by its session, another
        host's by a process this one cannot see), and the half-made bundles (``.ID``, killed
        between writing the config and starting) of such owners. Returns how many."""
        n = 0
        for item in list_bundles(self.state, self.dying):
            if owner_alive(item.labels.get(OWNER_LABEL, "")) is False and self.remove(item) is None:
                n += 1
        directory = self.state / "bundles"
        for half in directory.glob(".*") if directory.is_dir() else ():
            labels = bundle_labels(half)  # None: being written, its owner alive and mid-launch
            if labels is not None and owner_alive(labels.get(OWNER_LABEL, "")) is False:
                remove_tree(half)
                n += 1
        return n

    def _tear_down(self, sandbox: DirectSandbox) -> None:
        if sandbox.writer is not None:
            sandbox.writer.join(5)
        if sandbox.proc.poll() is None:
            kill(sandbox)
            try:
                sandbox.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                sandbox.proc.kill()
                sandbox.proc.wait(timeout=10)
        if sandbox.proc.returncode is not None and sandbox.proc.returncode >= 0 and self._forget_stopped(sandbox):
            return
        self.delete(sandbox.id, sandbox.runtime)

    def _forget_stopped(self, sandbox: DirectSandbox) -> bool:
        """What ``runc delete`` does for a stopped container (its PID 1 is dead, so is every process
        of its PID namespace): remove the empty cgroups and the state directory. Done here it costs
        no process start (a ``runc delete`` is ~3-8 ms of CPU per run). False: use ``runc delete``."""
        for directory in cgroup_dirs(sandbox.id):
            if not remove_cgroup(directory, 40, 0.005):  # its last processes may still be exiting
                return False
        shutil.rmtree(self.state / "runtime" / sandbox.runtime / sandbox.id, ignore_errors=True)
        remove_tree(sandbox.bundle)
        return True

    def delete(self, sandbox_id: str, runtime: str) -> None:
        """Remove a direct sandbox by id: its processes, runtime state, cgroups and bundle."""
        holder = holder_pid(self.state / "bundles" / sandbox_id)  # a session interpreter's (kernels.py)
        if runtime == BWRAP:  # no runtime state: its processes (by its pid file), cgroups, bundle
            kill_pid_file(self.state / "bundles" / sandbox_id, sandbox_id)
            for _ in range(200):
                if not any((d / "cgroup.procs").read_text().strip() for d in cgroup_dirs(sandbox_id)):
                    break
                time.sleep(0.01)
        else:
            root = self.state / "runtime" / runtime
            if holder:  # a held interpreter: its own `runsc run` cleans up once its sandbox is killed
                kill_pid_file(self.state / "bundles" / sandbox_id, sandbox_id)
                wait_for_holder(holder)  # (a `runsc delete` racing it waited ~5 s)
            if not holder or runtime == "runc" or any(root.glob(f"{sandbox_id}_*")):
                argv = self._runtime_argv(runtime)
                subprocess.run(
                    [*argv, "--root", str(root), "delete", "--force", sandbox_id], capture_output=True, timeout=30
                )
        wait_for_holder(holder)
        for directory in cgroup_dirs(sandbox_id):  # runc removes them; this is for a crash
            remove_cgroup(directory, 100, 0.01)  # (and runsc's memory cgroup, once its processes exit)
        remove_tree(self.state / "bundles" / sandbox_id)

    def drain(self, timeout: float) -> bool:
        """Wait until every handed-over teardown is done (at shutdown)."""
        deadline = time.monotonic() + timeout
        with self._pending_lock:
            while self._pending:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._pending_lock.wait(remaining)
        return True

    def collect_garbage(self, store_gc: Callable[[set[Path]], list[str]]) -> list[str]:
        """At start-up: remove exported stores whose image is gone (unless a bundle still uses
        them), bundles a crash left half-written or half-removed (no config), and empty cgroups of
        sandboxes that have no bundle any more (a teardown cut short at exit). Only what is older
        than a minute: never a sandbox being made. Returns what went. Never raises."""
        removed: list[str] = []
        try:
            bundles = self.state / "bundles"
            in_use: set[Path] = set()
            known: set[str] = set()
            now = time.time()
            for bundle in bundles.iterdir() if bundles.is_dir() else []:
                old = now - bundle.stat().st_mtime > 60
                try:
                    config = json.loads((bundle / "config.json").read_text())
                except (OSError, ValueError):
                    config = None
                if config is None and old:
                    sandbox_id = bundle.name.lstrip(".")
                    for runtime in DIRECT_RUNTIMES:
                        self.delete(sandbox_id, runtime)
                    remove_tree(bundle)
                    removed.append(bundle.name)
                    continue
                known.add(bundle.name)
                if config is not None:
                    with contextlib.suppress(KeyError, TypeError):
                        in_use.add(Path(config["root"]["path"]))
            for directory in Path("/sys/fs/cgroup").glob(f"*/{CGROUP_PARENT}/sandloop-*"):
                if directory.name not in known and now - directory.stat().st_mtime > 60:
                    with contextlib.suppress(OSError):  # one with tasks in it is not ours to remove
                        directory.rmdir()
                        removed.append(str(directory))
            removed += store_gc(in_use)
        except Exception as exc:  # noqa: BLE001 - housekeeping must not stop runs
            log.warning("could not collect the direct backend's garbage: %s", exc)
        return removed

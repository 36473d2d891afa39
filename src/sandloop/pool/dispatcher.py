"""``Dispatcher``: routes each run to a warm sandbox or a cold one, under admission control.

The result, limits, timeout semantics and isolation are the same either way: a warm sandbox is a
cold one started earlier. Used sandboxes are destroyed off the critical path; pools start lazily,
are torn down at interpreter exit, and whatever a killed process leaves behind is reaped by label.
"""

from __future__ import annotations

import atexit
import collections
import functools
import logging
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Protocol

from sandloop.contract import ExecutionResult, ImageMissing, InvalidLimits, RuntimeUnavailable
from sandloop.pool.admission import Admission
from sandloop.pool.warm import PoolBackend, WarmPool
from sandloop.runtime.base import Backend, Housekeeping, RunRequest, Sandbox, SandboxSpec
from sandloop.runtime.labels import LABEL_PREFIX
from sandloop.settings import Settings

log = logging.getLogger(__name__)

_live: weakref.WeakSet[Dispatcher] = weakref.WeakSet()


class DispatchBackend(Backend[Any], Housekeeping, Protocol):
    """What a dispatcher needs: sandbox lifecycle, and housekeeping for its upkeep."""


def live_dispatchers() -> list[Dispatcher]:
    """Every dispatcher not yet closed in this process."""
    return [d for d in list(_live) if not d._closed]


@atexit.register
def _close_all() -> None:
    for dispatcher in list(_live):
        dispatcher.close()


class Dispatcher:
    def __init__(self, backend: DispatchBackend, settings: Settings | None = None) -> None:
        self.backend = backend
        #: A backend whose nodes pool and admit their own sandboxes (Ray): each whole run goes
        #: there in one call; nothing is pooled or admitted here.
        self._delegates = bool(getattr(backend, "dispatches_runs", False))
        self.settings = settings or Settings()
        s = self.settings
        self.admission = Admission(s.max_running, s.max_creating, s.queue_wait_seconds)
        self._pools: collections.OrderedDict[SandboxSpec, WarmPool] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._destroyer = ThreadPoolExecutor(2, thread_name_prefix="sandloop-destroy")
        self._pending = 0
        self._pending_cond = threading.Condition()
        self._closed = False
        self._upkeep: threading.Thread | None = None
        self._stop = threading.Event()
        self.cold_runs = 0
        self.warm_runs = 0
        _live.add(self)

    # -- runs ---------------------------------------------------------------------------------
    def run(self, request: RunRequest, pool_size: int | None = None) -> ExecutionResult:
        started = time.monotonic()
        if self._delegates:
            return self.backend.run(request)
        with self.admission.running():
            pool = self.pool_for(request.spec, size=pool_size)
            sandbox = pool.take() if pool is not None else None
            if sandbox is None:
                self.cold_runs += 1
                with self.admission.creating():
                    try:
                        sandbox = self.backend.launch(
                            request.spec, purpose="run", lifetime_seconds=request.timeout_seconds
                        )
                    except (ImageMissing, RuntimeUnavailable, InvalidLimits):
                        # no sandbox of this kind can ever start: keep no pool refilling for it
                        self.drop_pools(lambda spec: spec == request.spec)
                        raise
            else:
                self.warm_runs += 1
            try:
                return self.backend.execute(sandbox, request, started=started)
            finally:
                self.destroy_later(sandbox)

    def destroy_later(self, sandbox: Sandbox, destroy: Callable[[Any], None] | None = None) -> None:
        """``destroy(sandbox)`` (the backend's by default) on a background thread."""
        with self._pending_cond:
            self._pending += 1
        try:
            self._destroyer.submit(self._destroy_now, sandbox, destroy)
        except RuntimeError:  # shutting down: do it now
            self._destroy_now(sandbox, destroy)

    def _destroy_now(self, sandbox: Sandbox, destroy: Callable[[Any], None] | None = None) -> None:
        try:
            (destroy or self.backend.destroy)(sandbox)
        finally:
            with self._pending_cond:
                self._pending -= 1
                self._pending_cond.notify_all()

    def quiesce(self, timeout: float = 60.0) -> bool:
        """Wait until every used sandbox has been destroyed (tests, benchmarks, shutdown)."""
        with self._pending_cond:
            return self._pending_cond.wait_for(lambda: self._pending == 0, timeout)

    def settle(self, timeout: float = 60.0) -> bool:
        """Wait for pending removals (retrying failed ones) and for every pool to be full."""
        deadline = time.monotonic() + timeout
        with self._lock:
            pools = list(self._pools.values())
        if not (self.quiesce(timeout) and all(pool.wait_ready(timeout) or pool.failing for pool in pools)):
            return False
        while self.backend.retry_removals() and time.monotonic() < deadline:
            time.sleep(0.5)
        return self.backend.retry_removals() == 0

    def pooled_ids(self) -> set[str]:
        """Container ids of the sandboxes waiting in pools (not leftovers)."""
        with self._lock:
            pools = list(self._pools.values())
        return {sid for pool in pools for sid in pool.ready_ids()}

    # -- pools --------------------------------------------------------------------------------
    def pool_for(
        self, spec: SandboxSpec, create: bool = True, size: int | None = None, maker: PoolBackend | None = None
    ) -> WarmPool | None:
        """The pool of ``spec`` (made with ``create``). ``maker``: what makes its members, when
        they are not the backend's sandboxes (warm sessions: ``sessions/reserve.py``), whose
        ``size`` is then its own, not capped by ``pool_size``."""
        if maker is None:
            size = self.settings.pool_size if size is None else min(size, self.settings.pool_size)
        size = size or 0
        if size <= 0 or self._closed:
            return None
        with self._lock:
            pool = self._pools.get(spec)
            if pool is not None:
                self._pools.move_to_end(spec)
                return pool
            if not create:
                return None
            destroy = (
                self.destroy_later if maker is None else functools.partial(self.destroy_later, destroy=maker.destroy)
            )
            pool = WarmPool(
                maker or self.backend,
                spec,
                size=size,
                refill_concurrency=self.settings.pool_refill_concurrency,
                idle_seconds=self.settings.pool_idle_seconds,
                admission=self.admission,
                destroy=destroy,
            )
            self._pools[spec] = pool
            evicted = self._pools.popitem(last=False)[1] if len(self._pools) > self.settings.pool_max_keys else None
            self._start_upkeep()
        if evicted is not None:
            threading.Thread(target=evicted.close, daemon=True).start()
        return pool

    def drop_pools(self, matches: Callable[[SandboxSpec], bool]) -> None:
        """Close the pools whose spec ``matches`` (e.g. a session's, before its workspace goes)."""
        with self._lock:
            gone = [spec for spec in self._pools if matches(spec)]
            pools = [self._pools.pop(spec) for spec in gone]
        for pool in pools:
            pool.close()
        self.quiesce(60)

    def prewarm(self, spec: SandboxSpec, timeout: float = 60.0) -> bool:
        """Start the pool for ``spec`` and wait until it is full."""
        pool = self.pool_for(spec)
        return pool.wait_ready(timeout) if pool is not None else False

    def stats(self) -> dict[str, Any]:
        with self._lock:
            pools = {_pool_name(spec): p.snapshot() for spec, p in self._pools.items()}
        return {
            "cold_runs": self.cold_runs,
            "warm_runs": self.warm_runs,
            "in_flight": self.admission.in_flight,
            "rejected": self.admission.rejected,
            "pools": pools,
        }

    # -- upkeep ---------------------------------------------------------------------------------
    def _start_upkeep(self) -> None:
        if self._upkeep is None:
            self._upkeep = threading.Thread(target=self._upkeep_loop, name="sandloop-upkeep", daemon=True)
            self._upkeep.start()

    def _upkeep_loop(self) -> None:
        from sandloop.pool.reaper import reap

        try:
            reap(self.backend)  # leftovers of processes that died before us
        except Exception as exc:  # noqa: BLE001
            log.debug("start-up reap failed: %s", exc)
        last_reap = time.monotonic()
        while not self._stop.wait(min(10.0, self.settings.pool_idle_seconds / 2)):
            with self._lock:
                pools = list(self._pools.values())
            for pool in pools:
                pool.expire()
            self.backend.retry_removals()
            if time.monotonic() - last_reap > self.settings.reap_interval_seconds:
                last_reap = time.monotonic()
                self.backend.sweep_orphans()
                try:
                    reap(self.backend)
                except Exception as exc:  # noqa: BLE001
                    log.debug("periodic reap failed: %s", exc)

    def close(self) -> None:
        """Destroy every pooled sandbox and wait for pending removals. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            pools = list(self._pools.values())
            self._pools.clear()
        self._stop.set()
        for pool in pools:
            pool.close()
        self._destroyer.shutdown(wait=True)
        if self._delegates:
            return  # its nodes keep their own pools and reapers, shared with other drivers
        deadline = time.monotonic() + 10  # an overloaded engine; the reaper has the rest
        while self.backend.retry_removals() and time.monotonic() < deadline:
            time.sleep(0.5)
        if not [d for d in live_dispatchers() if d.backend is self.backend]:
            # the last user of this backend is going: nothing it made may outlive it
            self.backend.sweep_orphans(min_age=0)


def _pool_name(spec: SandboxSpec) -> str:
    """How stats and metrics name a pool: its image and limits (and what it holds, when it holds
    warm sessions rather than sandboxes for runs)."""
    name = f"{spec.image} {spec.limits.runtime} {spec.limits.memory}"
    held = dict(spec.labels).get(f"{LABEL_PREFIX}purpose")
    return f"{held}: {name}" if held else name

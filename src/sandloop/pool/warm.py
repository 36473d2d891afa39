"""``WarmPool``: single-use sandboxes started ahead of time for one ``SandboxSpec``.

Each pooled sandbox is created and started with its limits applied and its launcher (a loaded
Python interpreter) waiting for a program. ``take()`` hands one out at most once; the caller runs
one program in it and destroys it. Refills happen in the background, at most
``refill_concurrency`` at a time, each under the admission control's creation bound.
"""

from __future__ import annotations

import collections
import logging
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

from sandloop.pool.admission import Admission
from sandloop.runtime.base import Sandbox, SandboxSpec

log = logging.getLogger(__name__)


class PoolBackend(Protocol):
    """What a pool needs of a backend (a part of ``runtime.base.Backend``)."""

    def launch(self, spec: SandboxSpec, *, purpose: str, lifetime_seconds: float) -> Sandbox: ...

    def is_alive(self, sandbox: Sandbox) -> bool: ...

    def destroy(self, sandbox: Sandbox) -> None: ...


@dataclass
class PoolStats:
    hits: int = 0
    misses: int = 0
    waited: int = 0
    discarded: int = 0
    refills: int = 0
    refill_errors: int = 0
    refill_seconds: list[float] = field(default_factory=list)

    def snapshot(self, size: int, ready: int, refilling: int) -> dict[str, Any]:
        times = self.refill_seconds[-200:]
        return {
            "size": size,
            "ready": ready,
            "refilling": refilling,
            "hits": self.hits,
            "misses": self.misses,
            "waited_for_refill": self.waited,
            "discarded": self.discarded,
            "refills": self.refills,
            "refill_errors": self.refill_errors,
            "refill_p50_ms": round(statistics.median(times) * 1000, 1) if times else None,
        }


class WarmPool:
    def __init__(
        self,
        backend: PoolBackend,
        spec: SandboxSpec,
        *,
        size: int,
        refill_concurrency: int,
        idle_seconds: float,
        admission: Admission,
        destroy: Callable[[Sandbox], None],
    ) -> None:
        self.backend = backend
        self.spec = spec
        self.size = size
        self.idle_seconds = idle_seconds
        self._admission = admission
        self._destroy = destroy  # callable(sandbox): off the critical path
        self._ready: collections.deque[Sandbox] = collections.deque()
        self._cond = threading.Condition()
        self._refilling = 0
        self._waiters = 0
        self._closed = False
        self._backoff_until = 0.0
        self.last_used = time.monotonic()
        self.stats = PoolStats()
        #: The last refill failed (no image, engine down): nobody should wait for this pool.
        self.failing = False
        self._refiller = ThreadPoolExecutor(refill_concurrency, thread_name_prefix="sandloop-refill")

    # -- taking -------------------------------------------------------------------------------
    def take(self, wait_seconds: float = 5.0) -> Sandbox | None:
        """A ready sandbox (never handed out before), or None: the caller takes the cold path.

        With none ready, waits for a refill already in flight when there are fewer waiters than
        refills (a refill under way is never slower than starting another cold sandbox).
        """
        deadline = time.monotonic() + wait_seconds
        with self._cond:
            self.last_used = time.monotonic()
            waited = False
            while True:
                sandbox = self._pop_healthy()
                if sandbox is not None:
                    self.stats.hits += 1
                    self.stats.waited += waited
                    break
                remaining = deadline - time.monotonic()
                if self._closed or self._refilling <= self._waiters or remaining <= 0:
                    self.stats.misses += 1
                    break
                self._waiters += 1
                waited = True
                try:
                    self._cond.wait(remaining)
                finally:
                    self._waiters -= 1
            self._top_up_locked()
        return sandbox

    def _pop_healthy(self) -> Sandbox | None:
        now = time.monotonic()
        while self._ready:
            sandbox = self._ready.popleft()
            if now - sandbox.started_at > self.idle_seconds or not self.backend.is_alive(sandbox):
                self.stats.discarded += 1
                self._destroy(sandbox)
                continue
            return sandbox
        return None

    # -- refilling ------------------------------------------------------------------------------
    def top_up(self) -> None:
        with self._cond:
            self._top_up_locked()

    def _top_up_locked(self) -> None:
        if self._closed or time.monotonic() < self._backoff_until:
            return
        for _ in range(self.size - len(self._ready) - self._refilling):
            self._refilling += 1
            try:
                self._refiller.submit(self._refill_one)
            except RuntimeError:  # executor shut down
                self._refilling -= 1
                return

    def _refill_one(self) -> None:
        sandbox = None
        started = time.monotonic()
        try:
            with self._admission.creating():
                sandbox = self.backend.launch(self.spec, purpose="pool", lifetime_seconds=self.idle_seconds)
        except Exception as exc:  # noqa: BLE001 - a failed refill must not kill the pool
            log.warning("warm pool refill failed: %s", exc)
            with self._cond:
                self.stats.refill_errors += 1
                self.failing = True
                self._backoff_until = time.monotonic() + 1.0  # the engine may be restarting
        finally:
            with self._cond:
                self._refilling -= 1
                if sandbox is not None:
                    if self._closed:
                        self._destroy(sandbox)
                    else:
                        self.failing = False
                        self.stats.refills += 1
                        self.stats.refill_seconds.append(time.monotonic() - started)
                        self._ready.append(sandbox)
                self._cond.notify_all()

    def wait_ready(self, timeout: float = 60.0) -> bool:
        """Block until the pool is full (tests, benchmarks, ``prewarm``)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            self._top_up_locked()
            while len(self._ready) < self.size:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or (self.failing and self._refilling == 0):
                    return False
                if self._refilling == 0:
                    self._top_up_locked()
                self._cond.wait(min(remaining, 0.5))
            return True

    # -- upkeep -----------------------------------------------------------------------------
    def expire(self) -> None:
        """Drop sandboxes past their idle life; empty the pool when nobody used it for a while."""
        with self._cond:
            idle = time.monotonic() - self.last_used > self.idle_seconds
            keep: collections.deque[Sandbox] = collections.deque()
            while self._ready:
                sandbox = self._ready.popleft()
                if idle or time.monotonic() - sandbox.started_at > self.idle_seconds:
                    self._destroy(sandbox)
                else:
                    keep.append(sandbox)
            self._ready = keep
            if not idle:
                self._top_up_locked()

    def ready_ids(self) -> list[str]:
        with self._cond:
            return [sandbox.id for sandbox in self._ready]

    def snapshot(self) -> dict[str, Any]:
        with self._cond:
            return self.stats.snapshot(self.size, len(self._ready), self._refilling)

    def close(self) -> None:
        with self._cond:
            self._closed = True
            ready, self._ready = list(self._ready), collections.deque()
            self._cond.notify_all()
        self._refiller.shutdown(wait=True, cancel_futures=True)
        for sandbox in ready:
            self._destroy(sandbox)

"""Admission control: a bound on sandboxes running at once and on creations in flight.

A run waits at most ``queue_wait_seconds`` for a slot, then gets ``SandboxBusy`` (retryable):
never a silent hang, never hundreds of concurrent creates starving the engine.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

from sandloop.contract import SandboxBusy


class Admission:
    def __init__(self, max_running: int, max_creating: int, queue_wait_seconds: float) -> None:
        self.max_running = max_running
        self.max_creating = max_creating
        self.queue_wait_seconds = queue_wait_seconds
        self._running = threading.BoundedSemaphore(max_running)
        self._creating = threading.BoundedSemaphore(max_creating)
        self._lock = threading.Lock()
        self.rejected = 0
        self.in_flight = 0

    @contextlib.contextmanager
    def running(self, wait: float | None = None) -> Iterator[None]:
        wait = self.queue_wait_seconds if wait is None else wait
        if not self._running.acquire(timeout=wait):
            with self._lock:
                self.rejected += 1
            raise SandboxBusy(
                f"sandloop is busy: {self.max_running} runs are already in flight and no slot freed up "
                f"within {wait:g} s. Retry later, or raise SANDLOOP_MAX_RUNNING."
            )
        with self._lock:
            self.in_flight += 1
        try:
            yield
        finally:
            with self._lock:
                self.in_flight -= 1
            self._running.release()

    @contextlib.contextmanager
    def creating(self, wait: float | None = None) -> Iterator[None]:
        wait = self.queue_wait_seconds if wait is None else wait
        if not self._creating.acquire(timeout=wait):
            with self._lock:
                self.rejected += 1
            raise SandboxBusy(
                f"sandloop is busy: {self.max_creating} sandboxes are already being created and none "
                f"finished within {wait:g} s. Retry later, or raise SANDLOOP_MAX_CREATING."
            )
        try:
            yield
        finally:
            self._creating.release()

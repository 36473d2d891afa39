"""Idle sessions paused to disk (``Settings.session_idle_pause_seconds``), so a host holds more
sessions than its memory: a session whose interpreter has run nothing for that long is paused
as ``Session.pause`` would (its memory under gVisor, its picklable Python state under runc, its
files always), marked as an idle pause; its next call (a cell, a run, a file, ``attach``)
resumes it, and its idle TTL goes on counting meanwhile (``SessionStore.expired``).

Left running: a session a cell, pause or resume holds now (the pauser never waits for a lock),
one with terminals or connections open in this process (``session_reach.live_reach``; a port
exposed with none open resumes it on its next connection), one without an interpreter (nothing
in memory to give back), one a front end keeps to its own lifecycle (``IdlePauser.skip``: the
E2B API's sandboxes, which pause at their own timeout), and every session of a cluster (its
nodes hold them). Under runc a pause keeps picklable state only: its processes end (the kind
and what was dropped are in the pause's state, as for ``Session.pause``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from sandloop.contract import SandboxError
from sandloop.sessions.host import SessionHost
from sandloop.sessions.session_reach import live_reach

log = logging.getLogger(__name__)

#: The longest between two sweeps (a shorter idle time sweeps every quarter of it).
MAX_SWEEP_EVERY = 30.0


class IdlePauser:
    """Sweeps the host's sessions for idle ones (``sweep``), from a thread of its own once
    ``start``ed, until ``close``."""

    def __init__(self, host: SessionHost, idle_seconds: float) -> None:
        self.host = host
        self.idle_seconds = idle_seconds
        self._skips: list[Callable[[str], bool]] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    @property
    def enabled(self) -> bool:
        store = self.host.sessions
        return self.idle_seconds > 0 and store.remote is None and not store.records_elsewhere

    def skip(self, predicate: Callable[[str], bool]) -> None:
        """Never pause a session for which ``predicate(session_id)`` is true."""
        self._skips.append(predicate)

    def sweep(self) -> dict[str, str]:
        """Pause every session idle past the idle time now; the kind each paused one kept, by id."""
        if not self.enabled:
            return {}
        from sandloop.sessions.session import Session

        store = self.host.sessions
        paused: dict[str, str] = {}
        now = time.time()
        for record in store.list():
            if now - record.last_used < self.idle_seconds or store.stopped_here(record.id):
                continue
            reach = live_reach(record.id)
            if (reach is not None and reach.open_count()) or any(skip(record.id) for skip in self._skips):
                continue
            session = Session(root=self.host, _record=record)
            try:
                kind = session.pause_if_idle(self.idle_seconds)
            except SandboxError as exc:  # it goes on running; the next sweep tries again
                log.warning("could not pause idle session %s: %s", record.id, exc)
                continue
            finally:
                session.let_go()
            if kind is not None:
                log.info("paused idle session %s (%s) after %.0f s unused", record.id, kind, now - record.last_used)
                paused[record.id] = kind
        return paused

    def start(self) -> None:
        """Sweep from a daemon thread (if enabled), every quarter of the idle time, at most 30 s."""
        with self._lock:
            if not self.enabled or self._thread is not None or self._stop.is_set():
                return
            self._thread = threading.Thread(target=self._loop, name="sandloop-idle-pause", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        every = min(MAX_SWEEP_EVERY, max(0.5, self.idle_seconds / 4))
        while not self._stop.wait(every):
            try:
                self.sweep()
            except Exception:  # noqa: BLE001 - a sweep that fails leaves sessions running; the next tries again
                log.warning("idle sweep failed", exc_info=True)

    def close(self) -> None:
        """Stop sweeping (a sweep under way ends its current pause first). Idempotent."""
        self._stop.set()
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(120)


__all__ = ["MAX_SWEEP_EVERY", "IdlePauser"]

"""A circuit breaker in front of the Docker engine.

While the engine answers, it costs nothing. When an engine call fails (connection refused, a
timeout, a 5xx while dockerd shuts down), the breaker opens: creations fail at once with
``EngineUnavailable`` instead of piling up against an engine that is going away (during a restart
each of them would leave a half-made container behind), and a prober thread pings the engine
every ``probe_interval`` seconds (and a caller at most every ``INLINE_PROBE_GAP`` seconds). The
first ping that succeeds closes the breaker and runs the recovery callbacks at once (retry the
removals that failed, remove what an outage orphaned), not on the next call.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from sandloop.contract import EngineUnavailable

log = logging.getLogger(__name__)

#: While open, a caller pings the engine itself at most this often (the others fail at once).
INLINE_PROBE_GAP = 0.2


class EngineBreaker:
    def __init__(
        self, ping: Callable[[], object], on_recover: Callable[[], object], *, probe_interval: float = 1.0
    ) -> None:
        self._ping = ping
        self._on_recover = on_recover
        self.probe_interval = probe_interval
        self._lock = threading.Lock()
        self._opened_at: float | None = None
        self._reason = ""
        self._prober: threading.Thread | None = None
        self._probe_lock = threading.Lock()
        self._last_probe = 0.0
        self.openings = 0

    @property
    def is_open(self) -> bool:
        return self._opened_at is not None

    def check(self) -> None:
        """Raise ``EngineUnavailable`` at once while the engine is known to be away. One caller at
        a time (at most every ``INLINE_PROBE_GAP`` seconds) pings first, so the first call after
        the engine is back goes through without waiting for the prober."""
        opened = self._opened_at
        if opened is None:
            return
        if self._probe_lock.acquire(blocking=False):
            try:
                if time.monotonic() - self._last_probe >= INLINE_PROBE_GAP:
                    self._last_probe = time.monotonic()
                    try:
                        self._ping()
                    except Exception:  # noqa: BLE001 - still away
                        pass
                    else:
                        self._close(background=True)
                        return
            finally:
                self._probe_lock.release()
        if self._opened_at is not None:
            raise EngineUnavailable(
                f"the Docker engine is not answering ({self._reason}; for {time.monotonic() - opened:.0f} s); "
                f"sandloop checks it every {self.probe_interval:g} s and resumes by itself: retry shortly, "
                "or start it with scripts/engine-up.sh"
            )

    def failed(self, exc: BaseException) -> None:
        """An engine call failed: open, and probe until the engine answers again."""
        with self._lock:
            if self._opened_at is not None:
                return
            self._opened_at = time.monotonic()
            self._reason = str(exc).split(". ")[0][:200]
            self.openings += 1
            log.warning("Docker engine unavailable (%s): creations fail fast until it answers", self._reason)
            self._prober = threading.Thread(target=self._probe, name="sandloop-engine-probe", daemon=True)
            self._prober.start()

    def _probe(self) -> None:
        while self._opened_at is not None:
            time.sleep(self.probe_interval)
            try:
                self._ping()
            except Exception:  # noqa: BLE001 - still away
                continue
            self._close(background=False)

    def _close(self, *, background: bool) -> None:
        """The engine answered: close, and run the recovery once (whoever saw it first)."""
        with self._lock:
            if self._opened_at is None:
                return
            down_for = time.monotonic() - self._opened_at
            self._opened_at = None
        log.warning("Docker engine answers again after %.1f s: resuming", down_for)
        if background:
            threading.Thread(target=self._recover, name="sandloop-engine-recover", daemon=True).start()
        else:
            self._recover()

    def _recover(self) -> None:
        try:
            self._on_recover()
        except Exception as exc:  # noqa: BLE001 - recovery is best effort; the upkeep retries
            log.warning("recovery after the engine came back failed: %s", exc)

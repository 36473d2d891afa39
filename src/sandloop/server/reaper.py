"""The server's session reaper: every ``reap_interval_seconds`` (60 by default) it removes the
sessions past their idle TTL, paused ones included, and every session of a revoked token.

Before it (issue 52 finding 9), expiry ran only when a request listed or made sessions, and a
revoked token's sessions stayed: nobody could use them any more (every route checks the token),
but a paused one kept its memory image on disk for 30 days. A token revoked by another process
(``sandloop tokens revoke`` writes the database this server reads), or while the server was
down, is found by the next sweep: it reads the tokens' table, not an event.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from typing import TYPE_CHECKING

from sandloop.contract import SandboxError

if TYPE_CHECKING:
    from sandloop.server.context import Api
    from sandloop.server.e2b.service import E2B

log = logging.getLogger(__name__)


class SessionReaper:
    """Sweeps from a daemon thread once ``start``ed, until ``stop``."""

    def __init__(self, api: Api, e2b: E2B | None = None) -> None:
        self.api, self.e2b = api, e2b
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def sweep(self) -> list[str]:
        """Remove expired sessions and revoked tokens' sessions now; the ids removed."""
        gone = self.api.root.sessions.reap_expired()
        tokens = self.api.tokens
        for token in tokens.list():
            if token.revoked is None:
                continue
            for session_id in sorted(tokens.sessions_of(token.id)):
                self._remove(session_id)
                gone.append(session_id)
        return gone

    def _remove(self, session_id: str) -> None:
        if self.e2b is not None and self.e2b.registry.get(session_id) is not None:
            self.e2b.kill(session_id)  # its handles, registry row and ownership go too
        else:
            with contextlib.suppress(SandboxError):  # not a session id, or one removed already
                self.api.root.sessions.delete(session_id)
        self.api.tokens.disown(session_id)
        log.info("removed session %s: its token was revoked", session_id)

    def start(self) -> None:
        with self._lock:
            if self._thread is not None or self._stop.is_set():
                return
            self._thread = threading.Thread(target=self._loop, name="sandloop-session-reaper", daemon=True)
            self._thread.start()

    def _loop(self) -> None:
        while not self._stop.wait(self.api.root.settings.reap_interval_seconds):
            try:
                self.sweep()
            except Exception:  # noqa: BLE001 - a sweep that fails leaves sessions as they were; the next tries again
                log.warning("sweeping sessions failed", exc_info=True)

    def stop(self) -> None:
        self._stop.set()
        with self._lock:
            thread = self._thread
        if thread is not None:
            thread.join(30)


__all__ = ["SessionReaper"]

"""What a token may spend: runs per minute and at once (every operation that starts or uses a
sandbox counts), live sessions and workspace quota, and its agent runs' daily budget."""

from __future__ import annotations

import collections
import contextlib
import threading
import time
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING

from sandloop.contract import parse_size
from sandloop.server.tokens import Token, TokenStore

if TYPE_CHECKING:
    from sandloop.sessions.store import SessionRecord, SessionStore


class QuotaError(Exception):
    """Refused by a token's ceilings. ``status`` is 403 (never allowed) or 429 (not now)."""

    def __init__(self, status: int, code: str, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.retry_after = status, code, message, retry_after


class RateWindow:
    """Per-token operations per minute and operations in flight."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._starts: dict[str, collections.deque[float]] = collections.defaultdict(collections.deque)
        self._running: dict[str, int] = collections.defaultdict(int)

    def enter(self, token: Token, operations: int = 1) -> None:
        """Count ``operations`` against the per-minute rate (all of them or none: a batch of file
        writes is refused whole rather than cut off half-way) and one against "at once"."""
        now = time.monotonic()
        with self._lock:
            window = self._starts[token.id]
            while window and now - window[0] > 60:
                window.popleft()
            if len(window) + operations > token.runs_per_minute:
                wait = max(1, int(60 - (now - window[0])) + 1) if window else 60
                batch = f" (this request is {operations})" if operations > 1 else ""
                raise QuotaError(
                    429,
                    "rate_limited",
                    f"this token allows {token.runs_per_minute} sandbox operations per minute{batch}",
                    retry_after=wait,
                )
            if self._running[token.id] >= token.max_concurrent:
                raise QuotaError(
                    429,
                    "too_many_concurrent",
                    f"this token allows {token.max_concurrent} sandbox operations at once",
                    retry_after=1,
                )
            window.extend([now] * operations)
            self._running[token.id] += 1

    def leave(self, token: Token) -> None:
        with self._lock:
            self._running[token.id] -= 1

    @contextlib.contextmanager
    def use(self, token: Token, operations: int = 1) -> Iterator[None]:
        """Counts ``operations`` against the token's rate, and one "at once" for as long as the
        block runs."""
        self.enter(token, operations)
        try:
            yield
        finally:
            self.leave(token)


def footprints(sessions: SessionStore, records: Iterable[SessionRecord]) -> list[int]:
    """What each live session holds against its token's ``--max-workspace``: its workspace quota,
    and the bytes on disk of its pause (its memory image or state) while it is paused.

    Counted once made, as a snapshot's bytes are: a pause's size is known only when it is
    written (a gVisor image is the memory the sandbox touched, not its limit), so the token's
    next create, pause, snapshot or fork is refused instead (issue 52 finding 9: pauses were
    not counted, and a 512m token put 1.5 GiB on disk under gVisor)."""
    return [r.quota_bytes + sessions.paused_bytes(r.id) for r in records]


def check_session_room(token: Token, live_footprints: Iterable[int], quota_bytes: int) -> None:
    """Refuse a new session past the token's count or total workspace ceiling (403);
    ``live_footprints``: its live sessions' (``footprints``)."""
    live = list(live_footprints)
    if len(live) >= token.max_sessions:
        raise QuotaError(
            403,
            "over_token_limit",
            f"this token may keep {token.max_sessions} sessions at once; delete one first (DELETE /v1/sessions/ID)",
        )
    ceiling = parse_size(token.max_workspace)
    if sum(live) + quota_bytes > ceiling:
        raise QuotaError(
            403,
            "over_token_limit",
            f"this token may hold {token.max_workspace} of workspace in all (--max-workspace); its live sessions "
            f"hold {sum(live)} bytes (their quotas and paused sessions' images), so ask for a smaller quota, "
            "resume a paused session (its image is removed) or delete a session",
        )


def check_snapshot_room(token: Token, live_footprints: Iterable[int], snapshot_bytes: int) -> None:
    """Refuse a new snapshot, pause or fork once the token's sessions (``footprints``: quotas
    and paused images) and its snapshots' disk together reach its workspace ceiling (403)."""
    ceiling = parse_size(token.max_workspace)
    held = sum(live_footprints) + snapshot_bytes
    if held >= ceiling:
        raise QuotaError(
            403,
            "over_token_limit",
            f"this token may hold {token.max_workspace} of workspace, paused sessions and snapshots in all "
            f"(--max-workspace); its sessions and snapshots hold {held} bytes: delete a snapshot "
            "(DELETE /v1/snapshots/ID), resume a paused session (its image is removed) or delete a session",
        )


def check_agent_budget(tokens: TokenStore, token: Token, max_iterations: int) -> None:
    """Before an agent run: the iteration ceiling (403) and today's runs and model tokens (429)."""
    if max_iterations > token.agent_max_iterations:
        raise QuotaError(
            403, "over_token_limit", f"this token allows at most {token.agent_max_iterations} iterations per agent run"
        )
    used = tokens.usage(token.id)
    if used.agent_runs >= token.agent_runs_per_day:
        raise QuotaError(
            429,
            "over_daily_budget",
            f"this token's {token.agent_runs_per_day} agent runs for {used.day} (UTC) are used; "
            "the budget resets at 00:00 UTC",
            retry_after=_seconds_to_midnight(),
        )
    if used.model_tokens >= token.agent_tokens_per_day:
        raise QuotaError(
            429,
            "over_daily_budget",
            f"this token's {token.agent_tokens_per_day} model tokens for {used.day} (UTC) are used; "
            "the budget resets at 00:00 UTC",
            retry_after=_seconds_to_midnight(),
        )


def _seconds_to_midnight() -> int:
    now = time.time()
    return max(1, int(86400 - now % 86400))

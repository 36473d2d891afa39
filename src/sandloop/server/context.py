"""What every route of the HTTP API shares: the ``Api`` state (the Sandloop, tokens, provider
endpoints, per-token windows, metrics) with the rules a route applies before calling the core
(limits clamped to the token's ceilings, session ownership, metering), and authentication."""

import collections
import contextlib
import json
import threading
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Annotated, Any

from fastapi import Depends, Request, Security
from fastapi.responses import StreamingResponse
from fastapi.security import HTTPBearer

from sandloop.contract import SandboxError, SandboxLimits, parse_size
from sandloop.contract.egress import covers
from sandloop.present import result_json
from sandloop.server.errors import ApiError, error_for
from sandloop.server.models import LimitsIn
from sandloop.server.providers import ProviderEndpoints
from sandloop.server.quota import RateWindow, footprints
from sandloop.server.tokens import Token, TokenStore

if TYPE_CHECKING:
    from sandloop.root import Sandloop
    from sandloop.sessions import Session, SessionRecord

#: The defaults a caller gets when it names no memory or timeout (clamped to its token's ceilings).
DEFAULT_MEMORY, DEFAULT_TIMEOUT = "256m", 30.0


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.runs: collections.Counter[str] = collections.Counter()
        self.seconds_sum = 0.0
        self.rejections: collections.Counter[str] = collections.Counter()
        #: Runs by what started their sandbox (``ExecutionResult.backend``: docker, oci, fake).
        self.backends: collections.Counter[str] = collections.Counter()

    def run(self, outcome: str, seconds: float, backend: str | None = None) -> None:
        with self._lock:
            self.runs[outcome] += 1
            self.seconds_sum += seconds
            if backend:
                self.backends[backend] += 1

    def reject(self, code: str) -> None:
        with self._lock:
            self.rejections[code] += 1


_bearer = HTTPBearer(auto_error=False, description="A token from `sandloop tokens create NAME`.")


async def auth(request: Request, _: Annotated[Any, Security(_bearer)] = None) -> Token:
    """The token ``RequestGuard`` verified (before the body was read); declared for OpenAPI.
    Async: a sync dependency would take a worker thread per request just to read the scope."""
    token = request.scope.get("state", {}).get("token")
    if token is None:  # RequestGuard authenticates every protected path; this is a backstop
        raise ApiError(401, "unauthorized", "send Authorization: Bearer <token>")
    assert isinstance(token, Token)
    return token


Auth = Annotated[Token, Depends(auth)]


@dataclass
class Api:
    root: "Sandloop"
    tokens: TokenStore
    endpoints: ProviderEndpoints
    metrics: Metrics = field(default_factory=Metrics)
    rates: RateWindow = field(default_factory=RateWindow)
    #: One session check-and-create at a time, so two cannot both fit under a ceiling.
    session_lock: threading.Lock = field(default_factory=threading.Lock)

    # -- what a token may ask for ---------------------------------------------------------------
    @staticmethod
    def clamp_timeout(token: Token, timeout: float | None) -> float:
        if timeout is None:
            return min(DEFAULT_TIMEOUT, token.max_timeout)
        if timeout > token.max_timeout:
            raise ApiError(403, "over_token_limit", f"this token may ask for at most {token.max_timeout:g} s")
        return timeout

    @staticmethod
    def limits_for(token: Token, wanted: LimitsIn) -> SandboxLimits:
        ceiling = parse_size(token.max_memory)
        if wanted.memory is None:
            memory: str | int = min(parse_size(DEFAULT_MEMORY), ceiling)
        else:
            try:
                memory = parse_size(wanted.memory)
            except ValueError as exc:
                raise ApiError(400, "invalid_argument", str(exc)) from None
            if memory > ceiling:
                raise ApiError(403, "over_token_limit", f"this token may ask for at most {token.max_memory} of memory")
        try:
            egress = SandboxLimits(egress=wanted.egress).egress
        except SandboxError as exc:
            raise ApiError(400, "invalid_limits", str(exc)) from None
        beyond = [rule for rule in egress if not covers(token.egress, rule)]
        if beyond:
            policy = ", ".join(token.egress) or "none: no egress at all"
            raise ApiError(
                403, "egress_refused", f"this token may not reach {', '.join(beyond)} (its egress policy: {policy})"
            )
        return SandboxLimits(memory=memory, cpus=wanted.cpus, pids=wanted.pids, runtime=wanted.runtime, egress=egress)

    # -- sessions a token owns -----------------------------------------------------------------
    def check_owner(self, token: Token, session_id: str) -> None:
        if self.tokens.owner_of(session_id) != token.id:  # someone else's and nonexistent look the same
            raise ApiError(404, "not_found", f"no session {session_id}")

    def owned(self, token: Token, session_id: str) -> "Session":
        self.check_owner(token, session_id)
        return self.root.attach_session(session_id, resume=False)  # resumed only when asked

    def with_session(self, token: Token, session_id: str, call: Callable[["Session"], Any]) -> Any:
        """``call(session)`` on one of the token's sessions, counted against its rate (each
        operation starts or uses a sandbox)."""
        with self.rates.use(token), self.owned(token, session_id) as s:  # attached: `with` only detaches
            return call(s)

    def live_sessions(self, token: Token) -> list["SessionRecord"]:
        mine = self.tokens.sessions_of(token.id)
        return [r for r in self.root.list_sessions() if r.id in mine]

    def held(self, token: Token) -> list[int]:
        """What each of the token's live sessions holds against its ``--max-workspace``: its
        quota, and its pause's bytes while paused (``quota.footprints``)."""
        return footprints(self.root.sessions, self.live_sessions(token))

    # -- answers ---------------------------------------------------------------------------------
    def count(self, result: Any) -> dict[str, Any]:
        outcome = "timeout" if result.timed_out else "ok" if result.ok else "error"
        self.metrics.run(outcome, result.duration_seconds, getattr(result, "backend", None))
        return result_json(result)

    def sse_output(
        self, token: Token, call: Callable[[Callable[[str, bytes], None], threading.Event], Any]
    ) -> StreamingResponse:
        """``call(on_output, cancel)`` (a run or a cell, given where to send output as it arrives
        and an event set when the client leaves) as server-sent events: ``stdout``/``stderr``
        ({text}) and a cell's ``display`` outputs (MIME bundles) as they come, then ``result``
        (the body an unstreamed call answers) or ``error``. Counted against the token's rate and
        concurrency here, before the response starts (a 429 is a status, not an event)."""
        import codecs

        self.rates.enter(token)

        def work(emit: Any) -> None:
            decoders = {name: codecs.getincrementaldecoder("utf-8")("replace") for name in ("stdout", "stderr")}

            def on_output(stream: str, data: bytes) -> None:
                if stream == "display":  # an output a session's cell displayed (its JSON)
                    emit("display", json.loads(data))
                    return
                text = decoders[stream].decode(data)
                if text:
                    emit(stream, {"text": text})

            emit("result", self.count(call(on_output, cancel)))

        cancel = threading.Event()
        try:
            return self.sse_from_thread(work, lambda: self.rates.leave(token), cancel)
        except BaseException:
            self.rates.leave(token)
            raise

    @staticmethod
    def sse_from_thread(work: Any, release: Any, gone: threading.Event | None = None) -> StreamingResponse:
        """Run ``work(emit)`` in a worker thread and stream each ``emit(kind, data)`` as a
        server-sent event; ``release()`` runs when the work ends, whatever happened; ``gone`` is
        set when the client stops reading before the end (its interrupt button, its timeout)."""
        import asyncio
        import json

        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any] | None] = asyncio.Queue()

        def put(item: tuple[str, Any] | None) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone (the server stopped): no reader
                loop.call_soon_threadsafe(queue.put_nowait, item)

        def emit(kind: str, data: Any) -> None:
            put((kind, data))

        def run() -> None:
            try:
                work(emit)
            except SandboxError as exc:
                emit("error", {"code": error_for(exc).code, "message": str(exc)})
            except Exception as exc:  # noqa: BLE001 - reported to the client, not raised into the server
                emit("error", {"code": "internal", "message": f"{type(exc).__name__}: {exc}"})
            finally:
                release()
                put(None)

        # A thread of its own, started now: not the request's thread pool, whose start a client
        # that disconnects cancels (the request's cancel scope reaches a task made inside it, and
        # then ``release``, the token's concurrency slot, was never called: measured, the slot
        # stayed taken), nor the response body's generator, which such a client never starts.
        # The work ends by its own timeout whether anyone reads it or not.
        threading.Thread(target=run, name="sandloop-stream", daemon=True).start()

        async def stream() -> AsyncIterator[str]:
            ended = False
            try:
                while (item := await queue.get()) is not None:
                    kind, data = item
                    yield f"event: {kind}\ndata: {json.dumps(data, default=str)}\n\n"
                ended = True
            finally:
                if not ended and gone is not None:
                    gone.set()

        return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

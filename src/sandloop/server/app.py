"""The HTTP API (FastAPI). A front end: it authenticates, applies the token's limits, translates
JSON to the core's calls and the core's errors to ``{code, message}`` with the right status.

    sandloop serve --host 127.0.0.1 --port 8080     # OpenAPI at /docs and /openapi.json
"""

import base64
import collections
import threading
import time
from typing import Annotated, Any, Literal

from fastapi import Depends, FastAPI, Request, Response
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from sandloop.contract import (
    EngineUnavailable,
    ImageMissing,
    InvalidArgument,
    PathRefused,
    RuntimeUnavailable,
    SandboxBusy,
    SandboxError,
    SandboxLimits,
    SessionNotFound,
    UnknownLanguage,
    WorkspaceFileNotFound,
    parse_size,
)
from sandloop.notes import sandbox_notes
from sandloop.server.tokens import Token, TokenStore

MAX_CODE_CHARS = 1_000_000
MAX_FILE_BYTES = 16 * 1024 * 1024


class ApiError(Exception):
    def __init__(self, status: int, code: str, message: str, retry_after: int | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.retry_after = status, code, message, retry_after


class LimitsIn(BaseModel):
    """The limits a caller may ask for (within its token's ceilings). No network over the API."""

    memory: str = Field("256m", pattern=r"^\s*\d+\s*[bkmgBKMG]?[bB]?\s*$", max_length=20)
    cpus: float = Field(0.5, gt=0, le=2)
    pids: int = Field(64, ge=8, le=1024)
    runtime: Literal["runc", "runsc"] = "runc"


class RunIn(BaseModel):
    code: str = Field(max_length=MAX_CODE_CHARS)
    language: str = "python"
    timeout_seconds: float = Field(30, gt=0, le=3600)
    stdin: str | None = Field(None, max_length=MAX_CODE_CHARS)
    limits: LimitsIn = Field(default_factory=LimitsIn)


class CellIn(BaseModel):
    code: str = Field(max_length=MAX_CODE_CHARS)
    timeout_seconds: float = Field(30, gt=0, le=3600)


class SessionIn(BaseModel):
    ttl_seconds: float = Field(3600, ge=10, le=7 * 86400)
    quota: str = Field("256m", pattern=r"^\s*\d+\s*[bkmgBKMG]?[bB]?\s*$", max_length=20)
    limits: LimitsIn = Field(default_factory=LimitsIn)


class AgentRunIn(BaseModel):
    task: str = Field(min_length=1, max_length=100_000)
    provider: Literal["anthropic", "openai"] = "anthropic"
    model: str = Field("claude-sonnet-4-5", min_length=1, max_length=200)
    #: An OpenAI-compatible or Anthropic-format endpoint; the API key comes from the server's env.
    base_url: str | None = Field(None, max_length=2000)
    max_iterations: int = Field(10, ge=1, le=50)
    timeout_seconds: float = Field(30, gt=0, le=300)
    limits: LimitsIn = Field(default_factory=LimitsIn)


class RateWindow:
    """Per-token runs per minute and concurrent runs."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._starts: dict[str, collections.deque[float]] = collections.defaultdict(collections.deque)
        self._running: dict[str, int] = collections.defaultdict(int)

    def enter(self, token: Token) -> None:
        now = time.monotonic()
        with self._lock:
            window = self._starts[token.id]
            while window and now - window[0] > 60:
                window.popleft()
            if len(window) >= token.runs_per_minute:
                raise ApiError(
                    429,
                    "rate_limited",
                    f"this token allows {token.runs_per_minute} runs per minute",
                    retry_after=max(1, int(60 - (now - window[0])) + 1),
                )
            if self._running[token.id] >= token.max_concurrent:
                raise ApiError(
                    429, "too_many_concurrent", f"this token allows {token.max_concurrent} runs at once", retry_after=1
                )
            window.append(now)
            self._running[token.id] += 1

    def leave(self, token: Token) -> None:
        with self._lock:
            self._running[token.id] -= 1


class Metrics:
    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.runs: collections.Counter[str] = collections.Counter()
        self.seconds_sum = 0.0
        self.rejections: collections.Counter[str] = collections.Counter()

    def run(self, outcome: str, seconds: float) -> None:
        with self._lock:
            self.runs[outcome] += 1
            self.seconds_sum += seconds

    def reject(self, code: str) -> None:
        with self._lock:
            self.rejections[code] += 1


def _error_for(exc: SandboxError) -> ApiError:
    if isinstance(exc, SandboxBusy):
        return ApiError(429, "busy", str(exc), retry_after=2)
    if isinstance(exc, (SessionNotFound, WorkspaceFileNotFound)):
        return ApiError(404, "not_found", str(exc))
    if isinstance(exc, PathRefused):
        big = "cap" in str(exc) or "bytes" in str(exc)
        return ApiError(413 if big else 400, "too_large" if big else "path_refused", str(exc))
    if isinstance(exc, (UnknownLanguage, InvalidArgument)):
        return ApiError(400, "invalid_argument", str(exc))
    if isinstance(exc, (EngineUnavailable, ImageMissing, RuntimeUnavailable)):
        return ApiError(503, "engine_unavailable", str(exc), retry_after=5)
    return ApiError(500, "sandbox_error", str(exc))


def create_app(tokens: TokenStore | None = None) -> FastAPI:
    from sandloop.runner import default_dispatcher, run_code
    from sandloop.sessions import Session, SessionStore

    store = tokens or TokenStore()
    app = FastAPI(title="sandloop", version="0.1.0", description="Run code in throwaway, hardened sandboxes.")
    rates = RateWindow()
    metrics = Metrics()
    app.state.tokens, app.state.metrics = store, metrics

    @app.exception_handler(ApiError)
    def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        metrics.reject(exc.code) if exc.status in (401, 403, 413, 429) else None
        headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after else None
        if exc.status == 401:
            headers = {**(headers or {}), "WWW-Authenticate": "Bearer"}
        return JSONResponse({"code": exc.code, "message": exc.message}, status_code=exc.status, headers=headers)

    @app.exception_handler(SandboxError)
    def _sandbox_error(request: Request, exc: SandboxError) -> JSONResponse:
        return _api_error(request, _error_for(exc))

    from fastapi.exceptions import RequestValidationError

    @app.exception_handler(RequestValidationError)
    def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: {e['msg']}" for e in exc.errors())
        too_big = any(e.get("type") == "string_too_long" for e in exc.errors())
        status = 413 if too_big else 400
        return JSONResponse(
            {"code": "too_large" if too_big else "invalid_request", "message": problems}, status_code=status
        )

    async def auth(request: Request) -> Token:  # async: a rejection never waits for a worker thread
        header = request.headers.get("authorization", "")
        scheme, _, secret = header.partition(" ")
        if scheme.lower() != "bearer" or not secret:
            raise ApiError(
                401, "unauthorized", "send Authorization: Bearer <token> (create one with `sandloop tokens create`)"
            )
        token = store.verify(secret.strip())
        if token is None:
            raise ApiError(401, "unauthorized", "unknown or revoked token")
        return token

    Auth = Annotated[Token, Depends(auth)]

    def limits_for(token: Token, wanted: LimitsIn, timeout: float) -> SandboxLimits:
        try:
            memory = parse_size(wanted.memory)
        except ValueError as exc:
            raise ApiError(400, "invalid_argument", str(exc)) from None
        if memory > parse_size(token.max_memory):
            raise ApiError(403, "over_token_limit", f"this token may ask for at most {token.max_memory} of memory")
        if timeout > token.max_timeout:
            raise ApiError(403, "over_token_limit", f"this token may ask for at most {token.max_timeout:g} s")
        return SandboxLimits(memory=wanted.memory, cpus=wanted.cpus, pids=wanted.pids, runtime=wanted.runtime)

    def result_json(result: Any) -> dict[str, Any]:
        body = result.model_dump(mode="json", exclude={"artifacts"})
        body["notes"] = sandbox_notes(result)
        if hasattr(result, "artifacts"):
            body["artifacts"] = [
                {"name": a.name, "mime_type": a.mime_type, "data_base64": base64.b64encode(a.data).decode()}
                for a in result.artifacts
            ]
        return body

    def owned(token: Token, session_id: str) -> Session:
        if store.owner_of(session_id) != token.id:  # someone else's and nonexistent look the same
            raise ApiError(404, "not_found", f"no session {session_id}")
        return Session.attach(session_id)

    # -- endpoints ------------------------------------------------------------------------------
    from importlib import resources

    from fastapi.responses import HTMLResponse

    page = resources.files("sandloop.server").joinpath("static/index.html").read_text()

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def playground() -> str:
        """The web playground: plain HTML and JavaScript over this same API."""
        return page

    @app.get("/healthz")
    def healthz() -> dict[str, Any]:
        try:
            default_dispatcher().backend.info()
            return {"status": "ok"}
        except SandboxError as exc:
            raise _error_for(exc) from None

    @app.get("/metrics", response_class=PlainTextResponse)
    def prometheus() -> str:
        stats = default_dispatcher().stats()
        lines = ["# TYPE sandloop_runs_total counter"]
        lines += [f'sandloop_runs_total{{outcome="{k}"}} {v}' for k, v in sorted(metrics.runs.items())]
        lines += ["# TYPE sandloop_run_seconds_sum counter", f"sandloop_run_seconds_sum {metrics.seconds_sum:.6f}"]
        lines += ["# TYPE sandloop_rejections_total counter"]
        lines += [f'sandloop_rejections_total{{code="{k}"}} {v}' for k, v in sorted(metrics.rejections.items())]
        lines += ["# TYPE sandloop_warm_runs_total counter", f"sandloop_warm_runs_total {stats['warm_runs']}"]
        lines += ["# TYPE sandloop_cold_runs_total counter", f"sandloop_cold_runs_total {stats['cold_runs']}"]
        lines += ["# TYPE sandloop_pool_ready gauge"]
        lines += [f'sandloop_pool_ready{{pool="{k}"}} {v["ready"]}' for k, v in stats["pools"].items()]
        lines += ["# TYPE sandloop_in_flight gauge", f"sandloop_in_flight {stats['in_flight']}"]
        return "\n".join(lines) + "\n"

    @app.post("/v1/runs")
    async def create_run(body: RunIn, token: Auth) -> dict[str, Any]:
        limits = limits_for(token, body.limits, body.timeout_seconds)
        rates.enter(token)  # 429s are decided here, before any thread is taken
        try:
            result = await run_in_threadpool(
                run_code, body.code, body.language, body.timeout_seconds, limits=limits, stdin=body.stdin
            )
        finally:
            rates.leave(token)
        metrics.run("timeout" if result.timed_out else "ok" if result.ok else "error", result.duration_seconds)
        return result_json(result)

    @app.post("/v1/agent/runs", response_class=StreamingResponse)
    async def agent_run(body: AgentRunIn, token: Auth) -> StreamingResponse:
        """Run the agent loop; its transcript streams as server-sent events (assistant,
        tool_call, tool_result, then done with the answer, or error)."""
        import asyncio
        import dataclasses
        import json

        from sandloop.agent import run_agent
        from sandloop.agent.providers import make_client
        from sandloop.agent.types import ProviderError

        limits = limits_for(token, body.limits, body.timeout_seconds)
        try:
            client = make_client(body.provider, body.model, base_url=body.base_url)
        except ProviderError as exc:
            raise ApiError(400, "provider_config", str(exc)) from None
        rates.enter(token)
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any] | None] = asyncio.Queue()

        def emit(kind: str, data: Any) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (kind, data))

        def work() -> None:
            try:
                result = run_agent(
                    body.task,
                    client,
                    body.max_iterations,
                    limits=limits,
                    timeout_seconds=body.timeout_seconds,
                    on_event=lambda e: emit(e.kind, dataclasses.asdict(e.turn)),
                )
                emit(
                    "done",
                    {
                        "answer": result.answer,
                        "stop_reason": result.stop_reason,
                        "turns": result.turns,
                        "usage": None if result.usage is None else dataclasses.asdict(result.usage),
                    },
                )
            except ProviderError as exc:
                emit("error", {"code": "provider_error", "message": str(exc)})
            except Exception as exc:  # noqa: BLE001 - reported to the client, not raised into the server
                emit("error", {"code": "internal", "message": f"{type(exc).__name__}: {exc}"})
            finally:
                rates.leave(token)
                loop.call_soon_threadsafe(queue.put_nowait, None)

        async def stream():
            worker = asyncio.ensure_future(run_in_threadpool(work))
            try:
                while (item := await queue.get()) is not None:
                    kind, data = item
                    yield f"event: {kind}\ndata: {json.dumps(data, default=str)}\n\n"
            finally:
                await worker

        return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    @app.post("/v1/sessions", status_code=201)
    def create_session(body: SessionIn, token: Auth) -> dict[str, Any]:
        limits = limits_for(token, body.limits, 1)
        s = Session.create(limits, ttl=body.ttl_seconds, quota=body.quota)
        store.own(s.id, token.id)
        s.close()
        return session_json(s.record)

    def session_json(record: Any) -> dict[str, Any]:
        return {
            "id": record.id,
            "created": record.created,
            "last_used": record.last_used,
            "ttl_seconds": record.ttl_seconds,
            "quota_bytes": record.quota_bytes,
            "quota_enforced": record.quota_enforced,
            "limits": record.limits,
        }

    @app.get("/v1/sessions")
    def list_sessions(token: Auth) -> list[dict[str, Any]]:
        mine = store.sessions_of(token.id)
        return [session_json(r) for r in SessionStore(default_dispatcher().backend).list() if r.id in mine]

    @app.get("/v1/sessions/{session_id}")
    def get_session(session_id: str, token: Auth) -> dict[str, Any]:
        s = owned(token, session_id)
        s.close()
        return session_json(s.record)

    @app.delete("/v1/sessions/{session_id}", status_code=204)
    def delete_session(session_id: str, token: Auth) -> Response:
        owned(token, session_id).delete()
        store.disown(session_id)
        return Response(status_code=204)

    @app.post("/v1/sessions/{session_id}/runs")
    async def session_run(session_id: str, body: RunIn, token: Auth) -> dict[str, Any]:
        limits_for(token, body.limits, body.timeout_seconds)
        return await in_session(
            token, session_id, lambda s: s.run(body.code, body.language, body.timeout_seconds, stdin=body.stdin)
        )

    async def in_session(token: Token, session_id: str, call: Any) -> dict[str, Any]:
        """Run ``call(session)`` counted against the token's rate, off the event loop."""
        rates.enter(token)
        try:
            s = await run_in_threadpool(owned, token, session_id)
            try:
                result = await run_in_threadpool(call, s)
            finally:
                s.close()
        finally:
            rates.leave(token)
        metrics.run("timeout" if result.timed_out else "ok" if result.ok else "error", result.duration_seconds)
        return result_json(result)

    @app.post("/v1/sessions/{session_id}/cells")
    async def session_cell(session_id: str, body: CellIn, token: Auth) -> dict[str, Any]:
        if body.timeout_seconds > token.max_timeout:
            raise ApiError(403, "over_token_limit", f"this token may ask for at most {token.max_timeout:g} s")
        return await in_session(token, session_id, lambda s: s.run_cell(body.code, body.timeout_seconds))

    @app.get("/v1/sessions/{session_id}/files")
    def list_files(session_id: str, token: Auth, path: str = ".") -> list[dict[str, Any]]:
        s = owned(token, session_id)
        try:
            return s.list_files(path)
        finally:
            s.close()

    @app.get("/v1/sessions/{session_id}/files/{path:path}")
    def get_file(session_id: str, path: str, token: Auth) -> Response:
        s = owned(token, session_id)
        try:
            return Response(s.read_file(path), media_type="application/octet-stream")
        finally:
            s.close()

    @app.put("/v1/sessions/{session_id}/files/{path:path}")
    async def put_file(session_id: str, path: str, request: Request, token: Auth) -> dict[str, Any]:
        declared = int(request.headers.get("content-length") or 0)
        if declared > MAX_FILE_BYTES:
            raise ApiError(413, "too_large", f"files up to {MAX_FILE_BYTES} bytes; use a session upload for more")
        data = bytearray()
        async for chunk in request.stream():
            data += chunk
            if len(data) > MAX_FILE_BYTES:
                raise ApiError(413, "too_large", f"files up to {MAX_FILE_BYTES} bytes")
        s = await run_in_threadpool(owned, token, session_id)
        try:
            size = await run_in_threadpool(s.write_file, path, bytes(data))
        finally:
            s.close()
        return {"path": path, "size": size}

    @app.delete("/v1/sessions/{session_id}/files/{path:path}", status_code=204)
    def delete_file(session_id: str, path: str, token: Auth) -> Response:
        s = owned(token, session_id)
        try:
            s.delete_file(path)
        finally:
            s.close()
        return Response(status_code=204)

    return app

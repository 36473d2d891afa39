"""The HTTP API (FastAPI). A front end: it authenticates, applies the token's limits, translates
JSON to the core's calls and the core's errors to ``{code, message}`` with the right status.

    sandloop serve --host 127.0.0.1 --port 8080     # OpenAPI at /docs and /openapi.json

What a token holder can reach is bounded before any work starts: ``RequestGuard`` caps bodies
and authenticates before a body is read (guard.py); every operation that starts or uses a
sandbox counts against the token's rate and concurrency, sessions against its count and
workspace ceilings, agent runs against its daily budget (quota.py); agent runs reach only the
provider endpoints the operator listed (providers.py).
"""

import collections
import threading
from collections.abc import AsyncIterator
from importlib import resources
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import Depends, FastAPI, Request, Response, Security
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, PlainTextResponse, StreamingResponse
from fastapi.security import HTTPBearer
from fastapi.staticfiles import StaticFiles
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException

from sandloop.contract import SandboxError, SandboxLimits, parse_size
from sandloop.present import result_json
from sandloop.server.errors import ApiError, error_for
from sandloop.server.guard import RequestGuard
from sandloop.server.models import (
    MAX_ARCHIVE_BYTES,
    MAX_FILE_BYTES,
    MAX_JSON_BYTES,
    AgentRunIn,
    CellIn,
    LimitsIn,
    RunIn,
    SessionIn,
    SessionRunIn,
)
from sandloop.server.providers import EndpointConfigError, EndpointRefused, ProviderEndpoints
from sandloop.server.quota import QuotaError, RateWindow, check_agent_budget, check_session_room
from sandloop.server.tokens import Token, TokenStore

if TYPE_CHECKING:
    from sandloop.root import Sandloop
    from sandloop.sessions import Session

#: The defaults a caller gets when it names no memory or timeout (clamped to its token's ceilings).
DEFAULT_MEMORY, DEFAULT_TIMEOUT = "256m", 30.0
#: Bodies of routes that take none (GET, DELETE) are refused past this.
_SMALL_BODY = 64 * 1024


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


def _is_file_put(method: str, path: str) -> bool:
    return method == "PUT" and path.startswith("/v1/sessions/") and "/files/" in path


def _is_archive_post(method: str, path: str) -> bool:
    return method == "POST" and path.startswith("/v1/sessions/") and path.endswith("/archive")


def create_app(
    tokens: TokenStore | None = None,
    *,
    sandloop: "Sandloop | None" = None,
    providers: ProviderEndpoints | None = None,
    metrics_access: Literal["open", "token", "off"] = "token",
) -> FastAPI:
    """The API over a ``Sandloop`` (default: the process-wide one) and a token store.
    ``providers``: the endpoints agent runs may reach (default: the official ones only).
    ``metrics_access``: who may read ``/metrics``."""
    from sandloop.runner import default_root

    root = sandloop or default_root()
    run_code = root.run_code
    store = tokens or TokenStore(root.settings.home / "tokens.sqlite")
    endpoints = providers or ProviderEndpoints()
    app = FastAPI(
        title="sandloop",
        version="0.1.0",
        description="Run code in throwaway, hardened sandboxes. Send `Authorization: Bearer <token>` "
        "(create one with `sandloop tokens create NAME`).",
        docs_url=None,
        redoc_url=None,
    )
    rates = RateWindow()
    metrics = Metrics()
    session_lock = threading.Lock()
    app.state.tokens, app.state.metrics = store, metrics

    def protected(path: str) -> bool:
        return path.startswith("/v1/") or (path == "/metrics" and metrics_access == "token")

    def body_cap(method: str, path: str) -> int:
        if _is_file_put(method, path):
            return MAX_FILE_BYTES
        if _is_archive_post(method, path):
            return MAX_ARCHIVE_BYTES
        return MAX_JSON_BYTES if method in ("POST", "PUT", "PATCH") else _SMALL_BODY

    app.add_middleware(RequestGuard, tokens=store, body_cap=body_cap, protected=protected, on_reject=metrics.reject)

    # -- errors: always {code, message} ---------------------------------------------------------
    @app.exception_handler(ApiError)
    def _api_error(request: Request, exc: ApiError) -> JSONResponse:
        if exc.status in (401, 403, 413, 429):
            metrics.reject(exc.code)
        headers = {"Retry-After": str(exc.retry_after)} if exc.retry_after else {}
        if exc.status == 401:
            headers["WWW-Authenticate"] = "Bearer"
        return JSONResponse({"code": exc.code, "message": exc.message}, status_code=exc.status, headers=headers)

    @app.exception_handler(SandboxError)
    def _sandbox_error(request: Request, exc: SandboxError) -> JSONResponse:
        return _api_error(request, error_for(exc))

    @app.exception_handler(QuotaError)
    def _quota_error(request: Request, exc: QuotaError) -> JSONResponse:
        return _api_error(request, ApiError(exc.status, exc.code, exc.message, exc.retry_after))

    @app.exception_handler(StarletteHTTPException)
    def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "invalid_request")
        message = f"no route {request.method} {request.url.path}; see /docs" if exc.status_code == 404 else exc.detail
        return JSONResponse({"code": code, "message": str(message)}, status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    def _validation(request: Request, exc: RequestValidationError) -> JSONResponse:
        problems = "; ".join(
            f"{'.'.join(str(p) for p in e['loc'][1:]) or 'body'}: "
            + ("unknown field (see /docs for this route's fields)" if e.get("type") == "extra_forbidden" else e["msg"])
            for e in exc.errors()
        )
        too_big = any(e.get("type") == "string_too_long" for e in exc.errors())
        status = 413 if too_big else 400
        return JSONResponse(
            {"code": "too_large" if too_big else "invalid_request", "message": problems}, status_code=status
        )

    # -- who is calling, and what they may ask for ----------------------------------------------
    bearer = HTTPBearer(auto_error=False, description="A token from `sandloop tokens create NAME`.")

    def auth(request: Request, _: Annotated[Any, Security(bearer)] = None) -> Token:
        token = request.scope.get("state", {}).get("token")
        if token is None:  # RequestGuard authenticates every protected path; this is a backstop
            raise ApiError(401, "unauthorized", "send Authorization: Bearer <token>")
        assert isinstance(token, Token)
        return token

    Auth = Annotated[Token, Depends(auth)]

    def clamp_timeout(token: Token, timeout: float | None) -> float:
        if timeout is None:
            return min(DEFAULT_TIMEOUT, token.max_timeout)
        if timeout > token.max_timeout:
            raise ApiError(403, "over_token_limit", f"this token may ask for at most {token.max_timeout:g} s")
        return timeout

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
        return SandboxLimits(memory=memory, cpus=wanted.cpus, pids=wanted.pids, runtime=wanted.runtime)

    def owned(token: Token, session_id: str) -> "Session":
        if store.owner_of(session_id) != token.id:  # someone else's and nonexistent look the same
            raise ApiError(404, "not_found", f"no session {session_id}")
        return root.attach_session(session_id)

    def with_session(token: Token, session_id: str, call: Any) -> Any:
        """``call(session)`` on one of the token's sessions, counted against its rate (each
        operation starts or uses a sandbox)."""
        with rates.use(token), owned(token, session_id) as s:  # attached: `with` only detaches
            return call(s)

    def sse_from_thread(work: Any, release: Any) -> StreamingResponse:
        """Run ``work(emit)`` in a worker thread and stream each ``emit(kind, data)`` as a
        server-sent event; ``release()`` runs when the work ends, whatever happened."""
        import asyncio
        import json

        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[tuple[str, Any] | None] = asyncio.Queue()

        def emit(kind: str, data: Any) -> None:
            loop.call_soon_threadsafe(queue.put_nowait, (kind, data))

        def run() -> None:
            try:
                work(emit)
            except SandboxError as exc:
                emit("error", {"code": error_for(exc).code, "message": str(exc)})
            except Exception as exc:  # noqa: BLE001 - reported to the client, not raised into the server
                emit("error", {"code": "internal", "message": f"{type(exc).__name__}: {exc}"})
            finally:
                release()
                loop.call_soon_threadsafe(queue.put_nowait, None)

        async def stream() -> AsyncIterator[str]:
            worker = asyncio.ensure_future(run_in_threadpool(run))
            try:
                while (item := await queue.get()) is not None:
                    kind, data = item
                    yield f"event: {kind}\ndata: {json.dumps(data, default=str)}\n\n"
            finally:
                await worker

        return StreamingResponse(stream(), media_type="text/event-stream", headers={"Cache-Control": "no-cache"})

    def count(result: Any) -> dict[str, Any]:
        metrics.run("timeout" if result.timed_out else "ok" if result.ok else "error", result.duration_seconds)
        return result_json(result)

    # -- pages ----------------------------------------------------------------------------------
    static = resources.files("sandloop.server").joinpath("static")
    page = static.joinpath("index.html").read_text()
    try:
        import swagger_ui_bundle

        # Before /static, which would otherwise match these paths first.
        app.mount("/static/swagger", StaticFiles(directory=swagger_ui_bundle.swagger_ui_path), name="swagger")
        docs_page = static.joinpath("docs.html").read_text()
    except ImportError:  # pragma: no cover - the server extra installs it
        docs_page = "<p>Swagger UI is not installed (pip install 'sandloop[server]'); the spec is at /openapi.json</p>"
    app.mount("/static", StaticFiles(packages=[("sandloop.server", "static")]), name="static")

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def playground() -> str:
        """The web playground: plain HTML and JavaScript over this same API."""
        return page

    @app.get("/docs", response_class=HTMLResponse, include_in_schema=False)
    def docs() -> str:
        """Swagger UI, served from this server (no CDN)."""
        return docs_page

    @app.get("/healthz")
    def healthz() -> dict[str, Any]:
        try:
            root.info()
            return {"status": "ok"}
        except SandboxError as exc:
            raise error_for(exc) from None

    @app.get("/metrics", response_class=PlainTextResponse, include_in_schema=metrics_access != "off")
    def prometheus(request: Request) -> str:
        if metrics_access == "off":
            raise ApiError(404, "not_found", "metrics are off on this server (sandloop serve --metrics)")
        stats = root.dispatcher.stats()
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

    # -- runs -----------------------------------------------------------------------------------
    @app.post("/v1/runs", response_model=None)
    async def create_run(body: RunIn, token: Auth) -> dict[str, Any] | StreamingResponse:
        """Run code once in a fresh sandbox. With ``stream: true`` the answer is server-sent
        events: output as it arrives, then the result."""
        limits = limits_for(token, body.limits)
        timeout = clamp_timeout(token, body.timeout_seconds)
        if body.stream:
            import codecs

            rates.enter(token)

            def work(emit: Any) -> None:
                decoders = {name: codecs.getincrementaldecoder("utf-8")("replace") for name in ("stdout", "stderr")}

                def on_output(stream: str, data: bytes) -> None:
                    text = decoders[stream].decode(data)
                    if text:
                        emit(stream, {"text": text})

                result = run_code(
                    body.code, body.language, timeout, limits=limits, stdin=body.stdin, on_output=on_output
                )
                emit("result", count(result))

            return sse_from_thread(work, lambda: rates.leave(token))
        with rates.use(token):  # 429s are decided here, before any thread is taken
            result = await run_in_threadpool(
                run_code, body.code, body.language, timeout, limits=limits, stdin=body.stdin
            )
        return count(result)

    @app.get("/v1/usage")
    def usage(token: Auth) -> dict[str, Any]:
        """This token's agent usage today (UTC) and its ceilings."""
        used = store.usage(token.id)
        return {
            "day": used.day,
            "agent_runs": used.agent_runs,
            "agent_iterations": used.agent_iterations,
            "input_tokens": used.input_tokens,
            "output_tokens": used.output_tokens,
            "limits": {
                "agent_runs_per_day": token.agent_runs_per_day,
                "agent_tokens_per_day": token.agent_tokens_per_day,
                "agent_max_iterations": token.agent_max_iterations,
            },
        }

    @app.post("/v1/agent/runs", response_class=StreamingResponse)
    async def agent_run(body: AgentRunIn, token: Auth) -> StreamingResponse:
        """Run the agent loop; its transcript streams as server-sent events (assistant,
        tool_call, tool_result, then done with the answer, or error). The model endpoint is one
        the operator listed (``base_url`` picks among them; any other is refused, 403)."""
        import dataclasses

        from sandloop.agent import run_agent
        from sandloop.agent.providers import DEFAULT_MODELS, make_client
        from sandloop.agent.tools import execute_code_tool
        from sandloop.agent.types import ProviderError

        limits = limits_for(token, body.limits)
        timeout = clamp_timeout(token, body.timeout_seconds)
        try:
            endpoint = endpoints.resolve(body.provider, body.base_url, token.provider_urls)
            key = endpoint.api_key()
        except EndpointRefused as exc:
            raise ApiError(403, "provider_url_refused", str(exc)) from None
        except EndpointConfigError as exc:
            raise ApiError(503, "provider_config", str(exc)) from None
        iterations = body.max_iterations or min(10, token.agent_max_iterations)
        check_agent_budget(store, token, iterations)
        try:
            client = make_client(
                body.provider, body.model or DEFAULT_MODELS[body.provider], base_url=endpoint.base_url, api_key=key
            )
        except ProviderError as exc:
            raise ApiError(400, "provider_config", str(exc)) from None
        rates.enter(token)
        store.record_usage(token.id, agent_runs=1)

        class BudgetSpent(Exception):
            pass

        def work(emit: Any) -> None:
            def on_event(event: Any) -> None:
                emit(event.kind, dataclasses.asdict(event.turn))
                if event.kind == "assistant":
                    spent = event.turn.usage
                    used = store.record_usage(
                        token.id,
                        iterations=1,
                        input_tokens=spent.input_tokens if spent else 0,
                        output_tokens=spent.output_tokens if spent else 0,
                    )
                    if used.model_tokens >= token.agent_tokens_per_day and event.turn.tool_calls:
                        raise BudgetSpent(
                            f"this token's {token.agent_tokens_per_day} model tokens for {used.day} (UTC) are "
                            "used; the run stopped before its next tool call"
                        )

            try:
                tools = [execute_code_tool(limits=limits, default_timeout=timeout, runner=root.run_code)]
                result = run_agent(body.task, client, iterations, tools=tools, on_event=on_event)
            except BudgetSpent as exc:
                emit("error", {"code": "over_daily_budget", "message": str(exc)})
                return
            except ProviderError as exc:
                emit("error", {"code": "provider_error", "message": str(exc)})
                return
            emit(
                "done",
                {
                    "answer": result.answer,
                    "stop_reason": result.stop_reason,
                    "turns": result.turns,
                    "usage": None if result.usage is None else dataclasses.asdict(result.usage),
                },
            )

        return sse_from_thread(work, lambda: rates.leave(token))

    # -- sessions -------------------------------------------------------------------------------
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

    def live_sessions(token: Token) -> list[Any]:
        mine = store.sessions_of(token.id)
        return [r for r in root.list_sessions() if r.id in mine]

    @app.post("/v1/sessions", status_code=201)
    def create_session(body: SessionIn, token: Auth) -> dict[str, Any]:
        limits = limits_for(token, body.limits)
        try:
            quota = parse_size(body.quota)
        except ValueError as exc:
            raise ApiError(400, "invalid_argument", str(exc)) from None
        with rates.use(token), session_lock:  # one check-and-create at a time, so two cannot both fit
            check_session_room(token, [r.quota_bytes for r in live_sessions(token)], quota)
            s = root.create_session(limits, ttl=body.ttl_seconds, quota=body.quota)
            store.own(s.id, token.id)
            s.close()
        return session_json(s.record)

    @app.get("/v1/sessions")
    def list_sessions(token: Auth) -> list[dict[str, Any]]:
        return [session_json(r) for r in live_sessions(token)]

    @app.get("/v1/sessions/{session_id}")
    def get_session(session_id: str, token: Auth) -> dict[str, Any]:
        with owned(token, session_id) as s:
            return session_json(s.record)

    @app.delete("/v1/sessions/{session_id}", status_code=204)
    def delete_session(session_id: str, token: Auth) -> Response:
        with rates.use(token):
            owned(token, session_id).delete()
        store.disown(session_id)
        return Response(status_code=204)

    @app.post("/v1/sessions/{session_id}/runs")
    def session_run(session_id: str, body: SessionRunIn, token: Auth) -> dict[str, Any]:
        timeout = clamp_timeout(token, body.timeout_seconds)
        return count(
            with_session(token, session_id, lambda s: s.run(body.code, body.language, timeout, stdin=body.stdin))
        )

    @app.post("/v1/sessions/{session_id}/cells")
    def session_cell(session_id: str, body: CellIn, token: Auth) -> dict[str, Any]:
        timeout = clamp_timeout(token, body.timeout_seconds)
        return count(with_session(token, session_id, lambda s: s.run_cell(body.code, timeout)))

    @app.get("/v1/sessions/{session_id}/files")
    def list_files(session_id: str, token: Auth, path: str = ".") -> list[dict[str, Any]]:
        entries: list[dict[str, Any]] = with_session(token, session_id, lambda s: s.list_files(path))
        return entries

    @app.get("/v1/sessions/{session_id}/files/{path:path}")
    def get_file(session_id: str, path: str, token: Auth) -> Response:
        data = with_session(token, session_id, lambda s: s.read_file(path))
        return Response(data, media_type="application/octet-stream")

    @app.put("/v1/sessions/{session_id}/files/{path:path}")
    async def put_file(session_id: str, path: str, request: Request, token: Auth) -> dict[str, Any]:
        data = await request.body()  # RequestGuard capped it at MAX_FILE_BYTES while it streamed in
        size = await run_in_threadpool(with_session, token, session_id, lambda s: s.write_file(path, data))
        return {"path": path, "size": size}

    @app.post("/v1/sessions/{session_id}/archive")
    async def upload_archive(session_id: str, request: Request, token: Auth, dest: str = ".") -> dict[str, Any]:
        """Unpack a tar, tar.gz or zip (the body) into ``dest`` of the workspace. Links, members that
        leave the workspace and archives that expand past the quota are refused; nothing is
        written then."""
        data = await request.body()  # capped by RequestGuard while it streamed in
        return await run_in_threadpool(with_session, token, session_id, lambda s: s.upload(data, dest))

    @app.get("/v1/sessions/{session_id}/archive")
    def download_archive(session_id: str, token: Auth, path: str = ".") -> Response:
        """A tar.gz of a file or directory of the workspace (symlinks left out)."""
        data = with_session(token, session_id, lambda s: s.download(path))
        name = (path.strip("/").rsplit("/", 1)[-1] or "workspace").replace('"', "")
        if name == ".":
            name = "workspace"
        return Response(
            data,
            media_type="application/gzip",
            headers={"Content-Disposition": f'attachment; filename="{name}.tar.gz"'},
        )

    @app.delete("/v1/sessions/{session_id}/files/{path:path}", status_code=204)
    def delete_file(session_id: str, path: str, token: Auth) -> Response:
        with_session(token, session_id, lambda s: s.delete_file(path))
        return Response(status_code=204)

    return app

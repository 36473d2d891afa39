"""The HTTP API (FastAPI). A front end: it authenticates, applies the token's limits, translates
JSON to the core's calls and the core's errors to ``{code, message}`` with the right status.

    sandloop serve --host 127.0.0.1 --port 8080     # OpenAPI at /docs and /openapi.json

What a token holder can reach is bounded before any work starts: ``RequestGuard`` caps bodies
and authenticates before a body is read (guard.py); every operation that starts or uses a
sandbox counts against the token's rate and concurrency, sessions against its count and
workspace ceilings, agent runs against its daily budget (quota.py); agent runs reach only the
provider endpoints the operator listed (providers.py).

    app.py       create_app: middleware, the error table, the routers
    context.py   Api: shared state and the rules a route applies; auth
    runs.py      /v1/runs (optionally streamed), /v1/agent/runs, /v1/usage
    sessions.py  /v1/sessions, files, archives
    reaper.py    expired sessions and revoked tokens' sessions removed
    e2b/         E2B's control plane, envd and code interpreter (E2B's SDKs, unchanged)
    pages.py     /, /docs, /healthz, /metrics
"""

import logging
import secrets
from typing import TYPE_CHECKING, Literal

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from sandloop.contract import SandboxError
from sandloop.server.context import Api
from sandloop.server.e2b import mount_e2b
from sandloop.server.e2b.control import CONTROL_PATH
from sandloop.server.e2b.template_uploads import MAX_UPLOAD_BYTES, UPLOAD_PATH
from sandloop.server.e2b.templates import TEMPLATE_PATH
from sandloop.server.errors import ApiError, error_for
from sandloop.server.guard import RequestGuard
from sandloop.server.models import MAX_ARCHIVE_BYTES, MAX_FILE_BYTES, MAX_JSON_BYTES
from sandloop.server.pages import add_pages
from sandloop.server.preview import Preview
from sandloop.server.providers import ProviderEndpoints
from sandloop.server.quota import QuotaError
from sandloop.server.reaper import SessionReaper
from sandloop.server.runs import runs_routes
from sandloop.server.sessions import session_routes
from sandloop.server.snapshots import snapshot_routes
from sandloop.server.templates import template_routes
from sandloop.server.terminals import TerminalTable, terminal_routes
from sandloop.server.tokens import TokenStore

if TYPE_CHECKING:
    from sandloop.root import Sandloop

log = logging.getLogger("sandloop.server")

#: Bodies of routes that take none (GET, DELETE) are refused past this.
_SMALL_BODY = 64 * 1024


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
    preview_domain: str = "localhost",
) -> FastAPI:
    """The API over a ``Sandloop`` (default: the process-wide one) and a token store.
    ``providers``: the endpoints agent runs may reach (default: the official ones only).
    ``metrics_access``: who may read ``/metrics``. ``preview_domain``: preview URLs are
    ``<port>-<session id>.<preview_domain>`` (``app.state.preview``, served by
    ``lifecycle.http_protocol``)."""
    from sandloop.root import default_root

    root = sandloop or default_root()
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
    api = Api(root, store, endpoints)
    metrics = api.metrics
    app.state.tokens, app.state.metrics = store, metrics

    def protected(path: str) -> bool:
        return (
            path.startswith("/v1/")
            or bool(CONTROL_PATH.match(path))
            or (bool(TEMPLATE_PATH.match(path)) and not UPLOAD_PATH.match(path))  # signed: no key
            or (path == "/metrics" and metrics_access == "token")
        )

    def body_cap(method: str, path: str) -> int:
        if _is_file_put(method, path):
            return MAX_FILE_BYTES
        if _is_archive_post(method, path):
            return MAX_ARCHIVE_BYTES
        if method == "PUT" and UPLOAD_PATH.match(path):
            return MAX_UPLOAD_BYTES
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

    @app.exception_handler(Exception)
    def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # A bug, not the caller's doing: the answer keeps the API's shape and names the log entry
        # (Starlette re-raises after this answer, so the server's log has the whole traceback).
        incident = secrets.token_hex(4)
        log.error(
            "incident %s: %s %s raised %s: %s", incident, request.method, request.url.path, type(exc).__name__, exc
        )
        return JSONResponse(
            {
                "code": "internal",
                "message": f"the server failed on this request ({type(exc).__name__}); its log has the details "
                f"under incident {incident}",
            },
            status_code=500,
        )

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

    add_pages(app, api, metrics_access)
    app.include_router(runs_routes(api))
    app.include_router(session_routes(api))
    app.include_router(snapshot_routes(api))
    app.include_router(template_routes(api))
    app.state.terminals = TerminalTable()  # this server's terminals (and their channels), by session
    app.include_router(terminal_routes(api, app.state.terminals))
    e2b = mount_e2b(app, api, preview_domain)  # E2B's SDKs: the control plane here, sandbox traffic split off
    app.state.preview, app.state.e2b = Preview(api, e2b, preview_domain), e2b
    # An E2B sandbox pauses at its own timeout (E2B's lifecycle), never for idleness.
    root.idle.skip(lambda session_id: e2b.registry.get(session_id) is not None)
    # Expired sessions (paused ones too) and revoked tokens' sessions, removed while nobody calls.
    app.state.reaper = reaper = SessionReaper(api, e2b)
    app.router.on_startup.append(reaper.start)
    app.router.on_shutdown.append(reaper.stop)
    return app

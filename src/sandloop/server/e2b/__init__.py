"""An E2B-compatible API: E2B's official SDKs drive sandloop unchanged.

    E2B_API_URL=http://HOST:8080 E2B_SANDBOX_URL=http://HOST:8080 E2B_API_KEY=e2b_... python app.py

Both URLs are ``sandloop serve``'s own. The SDKs send every sandbox's traffic to the sandbox URL
with ``E2b-Sandbox-Id`` and ``E2b-Sandbox-Port`` headers; ``E2BSplit`` (outermost middleware)
sends such a request to the sandbox app (envd on 49983, the code interpreter on 49999), except
``/sandboxes...`` and ``/v<N>/sandboxes...``, which are always the control plane's.

    control.py    the control plane (X-API-Key): create, connect, list, get, timeout, kill
    templates.py  the template build API (E2B's Template SDK) on sandloop's templates
    envd.py       processes and the filesystem (Connect RPC), /files
    jupyter.py    /execute (streamed NDJSON), /contexts
    service.py    E2B sandboxes as sessions: ownership, access tokens, timeouts, processes
    registry.py   the rows that map one to the other
    connect.py    the Connect protocol (JSON codec)
    procs_helper.py  the process table inside the sandbox (sent as a cell, never imported)
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qs

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from sandloop.server.e2b.control import CONTROL_PATH, control_routes, e2b_error_response
from sandloop.server.e2b.envd import envd_routes
from sandloop.server.e2b.jupyter import jupyter_routes
from sandloop.server.e2b.registry import Registry
from sandloop.server.e2b.service import E2B, E2BError
from sandloop.server.e2b.template_routes import template_api_routes
from sandloop.server.guard import RequestGuard
from sandloop.server.models import MAX_FILE_BYTES, MAX_JSON_BYTES

ENVD_PORT, JUPYTER_PORT = "49983", "49999"


def _header(scope: Scope, name: bytes) -> str:
    for k, v in scope["headers"]:
        if k.lower() == name:
            return str(v.decode("latin-1"))
    return ""


def _signed(scope: Scope) -> dict[str, str] | None:
    """A signed file URL's query (``download_url`` / ``upload_url``): it names no sandbox, its
    signature does."""
    if scope["path"] != "/files" or b"signature=" not in scope.get("query_string", b""):
        return None
    query = parse_qs(scope["query_string"].decode("latin-1"), keep_blank_values=True)
    return {k: v[0] for k, v in query.items()}


class E2BSplit:
    """Sends sandbox traffic (``E2b-Sandbox-Id`` set, not a control-plane path; or a signed
    ``/files`` URL) to ``sandbox``."""

    def __init__(self, app: ASGIApp, sandbox: ASGIApp) -> None:
        self.app, self.sandbox = app, sandbox

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
        elif (_header(scope, b"e2b-sandbox-id") and not CONTROL_PATH.match(scope["path"])) or _signed(scope):
            await self.sandbox(scope, receive, send)
        else:
            await self.app(scope, receive, send)


def sandbox_app(e2b: E2B) -> ASGIApp:
    """envd and the code interpreter; every request's access token is checked before its body
    is read."""

    def authenticate(headers: dict[bytes, bytes], scope: Scope) -> object:
        sandbox_id = headers.get(b"e2b-sandbox-id", b"").decode("latin-1")
        envd = headers.get(b"x-access-token", b"").decode("latin-1")
        traffic = headers.get(b"e2b-traffic-access-token", b"").decode("latin-1")
        signed = _signed(scope)
        if not envd and not traffic and signed is not None:  # envd's validateSigning
            operation = "write" if scope["method"] == "POST" else "read"
            try:
                return (e2b.signed(sandbox_id or None, operation, signed),)
            except E2BError as exc:
                return exc.message
        if not envd and not traffic:
            return "send the sandbox's access token (X-Access-Token): it came with the sandbox"
        if not e2b.registry.check_access(sandbox_id, envd or None, traffic or None):
            return f"wrong access token for sandbox {sandbox_id}, or no such sandbox"
        return (sandbox_id,)  # not a str: a str is the guard's reason to refuse

    def body_cap(method: str, path: str) -> int:
        return MAX_FILE_BYTES + 1024 * 1024 if path == "/files" else MAX_JSON_BYTES

    async def sandbox_of(request: Request) -> tuple[Any, Any]:
        (sandbox_id,) = request.scope["state"]["token"]
        return await run_in_threadpool(e2b.for_traffic, sandbox_id)

    health = APIRouter()

    @health.get("/health", status_code=204)
    def healthy(request: Request) -> Response:
        """envd's health: 204 while the sandbox the request names lives; 502 once it was killed or
        timed out, as E2B's edge answers for a sandbox that is gone (the SDK's ``is_running()``
        reads that; before, this said 204 for any sandbox, even a killed one)."""
        sandbox_id = request.headers.get("e2b-sandbox-id", "")
        try:
            e2b.live(e2b.registry.get(sandbox_id), sandbox_id)
            if e2b.paused(sandbox_id):  # not running: E2B's proxy answers a paused sandbox the same
                raise E2BError(502, "paused")
        except E2BError:
            # E2B's proxy's own words, which the SDK reads ("was not found": the sandbox is gone)
            body = {"sandboxId": sandbox_id, "message": "The sandbox was not found", "code": 502}
            return JSONResponse(body, status_code=502)
        return Response(status_code=204)

    port_routers = {
        ENVD_PORT: [envd_routes(e2b, sandbox_of), health],
        JUPYTER_PORT: [jupyter_routes(e2b, sandbox_of), health],
    }
    apps = {}
    for port, routers in port_routers.items():
        sub = FastAPI(docs_url=None, redoc_url=None, openapi_url=None)
        for r in routers:
            sub.include_router(r)

        @sub.exception_handler(StarletteHTTPException)
        def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
            return JSONResponse({"code": exc.status_code, "message": str(exc.detail)}, status_code=exc.status_code)

        @sub.exception_handler(Exception)
        def _any_error(request: Request, exc: Exception) -> JSONResponse:
            return e2b_error_response(exc)

        apps[port] = sub

    async def by_port(scope: Scope, receive: Receive, send: Send) -> None:
        port = _header(scope, b"e2b-sandbox-port") or ENVD_PORT
        target = apps.get(port)
        if target is None:
            response = JSONResponse(
                {"code": 502, "message": f"port {port} of a sandbox is not reachable: sandboxes have no network"},
                status_code=502,
            )
            await response(scope, receive, send)
            return
        await target(scope, receive, send)

    guard = RequestGuard(
        by_port,
        e2b.api.tokens,
        body_cap=body_cap,
        protected=lambda path: path != "/health",
        authenticate=authenticate,
        on_reject=e2b.api.metrics.reject,
        numeric_codes=True,  # envd's error shape
    )
    return guard


def mount_e2b(app: FastAPI, api: Any, preview_domain: str = "localhost") -> E2B:
    """Add the E2B control plane to ``app`` and the sandbox traffic split in front of it."""
    registry = Registry(api.root.settings.home / "e2b.sqlite", api.root.settings.home / "e2b-secret")
    e2b = E2B(api, registry, preview_domain)
    app.include_router(control_routes(e2b))
    routes, e2b.templates = template_api_routes(e2b)
    app.include_router(routes)
    app.add_middleware(E2BSplit, sandbox=sandbox_app(e2b))
    app.router.on_shutdown.append(e2b.stop)

    @app.exception_handler(E2BError)
    def _e2b_error(request: Request, exc: E2BError) -> JSONResponse:
        return e2b_error_response(exc)

    return e2b


__all__ = ["E2B", "E2BSplit", "mount_e2b"]

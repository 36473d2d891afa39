"""E2B's control plane: create, connect, list, get, set the timeout of, and kill sandboxes.

Authenticated by ``X-API-Key`` (a sandloop token; RequestGuard checks it before the body is
read). Each sandbox is a session counted against the key's ceilings like any other.
"""

from __future__ import annotations

import contextvars
import datetime
import math
import re
import urllib.parse
from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from sandloop.contract import InvalidArgument, SandboxError, TemplateNotFound, parse_size
from sandloop.server.context import Auth
from sandloop.server.e2b.service import E2B, ENVD_VERSION, MAX_TIMEOUT, TEMPLATES, TTL_MARGIN, E2BError
from sandloop.server.errors import error_for
from sandloop.server.models import LimitsIn
from sandloop.server.quota import QuotaError, check_session_room, check_snapshot_room

#: Every /sandboxes... and /snapshots... path (and /v<N>/...) is the control plane's, whatever
#: headers say.
CONTROL_PATH = re.compile(r"^/((v\d+/)?sandboxes|snapshots)(/|$)")
DEFAULT_TIMEOUT = 15  # E2B's, for a body that names none
WORKSPACE_QUOTA = "1g"
#: Options sandloop does not honour: refused with a reason instead of silently ignored.
_REFUSED = {
    # the SDK's own words when its gateway fails (scripts match them); refused before a sandbox exists
    "mcp": "Failed to start MCP gateway: sandloop runs no MCP gateway inside sandboxes (it would run as "
    "root); sandloop serves MCP itself (`sandloop mcp`)",
    "network": "per-sandbox network rules are sandloop's egress allowlists: use the native API's limits.egress "
    "(only network.allowPublicTraffic is taken: whether preview URLs need the traffic access token)",
    "volumeMounts": "volume mounts are not supported; each sandbox has its own workspace at /home/user",
    "iam": "workload identity is not supported",
}


def iso(ts: float) -> str:
    return datetime.datetime.fromtimestamp(ts, datetime.UTC).isoformat().replace("+00:00", "Z")


def _timeout(value: Any, default: float) -> float:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise E2BError(400, f"timeout must be a number of seconds, got {value!r}")
    if not 1 <= value <= MAX_TIMEOUT:
        raise E2BError(400, f"timeout must be between 1 and {MAX_TIMEOUT} seconds, got {value}")
    return float(value)


def _asks_for(value: Any) -> bool:
    """Whether an option's value asks for something (SDKs send ``{"enabled": false}``, ``{}``
    and ``[]`` for "no")."""
    if isinstance(value, dict):
        if "enabled" in value:
            return bool(value["enabled"])
        return any(_asks_for(v) for v in value.values())
    if isinstance(value, list):
        return bool(value)
    return bool(value)


def _public_traffic(body: dict[str, Any]) -> bool | None:
    """``network.allowPublicTraffic`` taken out of the body (None: not said; a new sandbox is then
    public, as E2B's, and one from a snapshot is as its source was): the rest of ``network`` is
    refused as before."""
    network = body.get("network")
    if not isinstance(network, dict):
        return None
    network = dict(network)
    public = network.pop("allowPublicTraffic", network.pop("allow_public_traffic", None))
    if public is not None and not isinstance(public, bool):
        raise E2BError(400, "network.allowPublicTraffic must be true or false")
    body["network"] = network
    return public


def _strings(value: Any, name: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in value.items()):
        raise E2BError(400, f"{name} must be an object of strings")
    if len(value) > 256 or sum(len(k) + len(v) for k, v in value.items()) > 64 * 1024:
        raise E2BError(400, f"{name} is too large (at most 256 entries, 64 KiB)")
    return dict(value)


async def body_of(request: Request) -> dict[str, Any]:
    """A control-plane body: a JSON object, or nothing ({})."""
    raw = await request.body()
    if not raw:
        return {}
    try:
        body = await request.json()
    except (ValueError, RecursionError):  # RecursionError: nested past any sense (a 400)
        raise E2BError(400, "the body must be JSON") from None
    if not isinstance(body, dict):
        raise E2BError(400, "the body must be a JSON object")
    return body


#: The Host the request came to (its port is the preview URLs' port too).
_host: contextvars.ContextVar[str] = contextvars.ContextVar("e2b_host", default="")


async def _remember_host(request: Request) -> None:
    _host.set(request.headers.get("host", ""))


def control_routes(e2b: E2B) -> APIRouter:
    router = APIRouter(include_in_schema=False, dependencies=[Depends(_remember_host)])
    api, api_registry = e2b.api, e2b.registry

    def sandbox_json(box: Any, *, tokens: bool = True, detail: bool = False) -> dict[str, Any]:
        out: dict[str, Any] = {
            "templateID": box.template,
            "sandboxID": box.sandbox_id,
            "clientID": "sandloop",
            "envdVersion": ENVD_VERSION,
            "alias": box.template,
        }
        if tokens:
            out["envdAccessToken"] = api_registry.access_token(box.sandbox_id, "envd")
            out["trafficAccessToken"] = api_registry.access_token(box.sandbox_id, "traffic")
            out["domain"] = e2b.domain_for(_host.get())  # get_host(port): <port>-<id>.<domain>
        if detail:
            out.update(
                startedAt=iso(box.started),
                endAt=iso(box.end_at),
                cpuCount=max(1, math.ceil(box.cpus)),
                memoryMB=box.memory_mb,
                diskSizeMB=box.disk_mb,
                state="paused" if e2b.paused(box.sandbox_id) else "running",
                metadata=box.metadata,
            )
        return out

    def create(token: Any, body: dict[str, Any], v1: bool) -> dict[str, Any]:
        # first: an option refused says why before the template it implies does (the SDK names
        # "mcp-gateway" as the template of a sandbox with MCP servers)
        public = _public_traffic(body)
        for key, why in _REFUSED.items():
            value = body.get(key)
            if _asks_for(value) or (key == "mcp" and isinstance(value, dict) and value):  # any server named
                raise E2BError(400, f"{key}: {why}")
        template = body.get("templateID") or "base"
        if not isinstance(template, str):
            raise E2BError(400, "templateID must be a string")
        on_timeout = "kill"
        if body.get("autoPause") is True:  # autoPauseMemory false: E2B's filesystem-only pause
            on_timeout = "pause-files" if body.get("autoPauseMemory") is False else "pause"
        auto_resume = _asks_for(body.get("autoResume"))
        if template.startswith("snap-"):  # a snapshot of one of this key's sandboxes
            return from_snapshot(token, template, body, on_timeout, auto_resume, public)
        own: str | None = None  # a template this key built (or the operator did), else the runtime image
        if template.split(":")[0] not in TEMPLATES:
            try:
                api.root.templates.image_for(template.lower(), owner=token.id)
            except (TemplateNotFound, InvalidArgument):
                raise E2BError(
                    404,
                    f"template '{template}' not found: build it with E2B's Template SDK (Template.build) or "
                    f"`sandloop templates build`; built in: {', '.join(repr(t) for t in TEMPLATES[:2])}",
                ) from None
            own = template.lower()
        # SDKs before the v2 route send allow_internet_access=true whether or not the caller asked
        # (it is their default): only a v2 request's true is the caller's own choice.
        if body.get("allow_internet_access") is True and not v1:
            raise E2BError(
                400,
                "sandloop sandboxes have no network: leave allow_internet_access unset (or False); "
                "to reach listed hosts use the native API's egress allowlist",
            )
        timeout = _timeout(body.get("timeout"), DEFAULT_TIMEOUT)
        metadata, envs = _strings(body.get("metadata"), "metadata"), _strings(body.get("envVars"), "envVars")
        limits = api.limits_for(token, LimitsIn(runtime=api.root.settings.e2b_runtime))
        quota = parse_size(WORKSPACE_QUOTA)
        e2b.reap()
        e2b.start_reaper()
        with api.rates.use(token), api.session_lock:
            check_session_room(token, api.held(token), quota)
            s = api.root.create_session(limits, ttl=timeout + TTL_MARGIN, quota=quota, template=own)
            api.tokens.own(s.id, token.id)
            box = api_registry.add(
                s.id,
                token.id,
                template=template,
                timeout=timeout,
                metadata=metadata,
                envs=envs,
                cpus=limits.cpus,
                memory_mb=limits.memory_bytes // 2**20,
                disk_mb=quota // 2**20,
            )
            api_registry.set_lifecycle(s.id, on_timeout, auto_resume)
            api_registry.set_public_traffic(s.id, public is not False)
            s.close()
        return sandbox_json(box)

    def from_snapshot(
        token: Any, snapshot_id: str, body: dict[str, Any], on_timeout: str, auto_resume: bool, public: bool | None
    ) -> dict[str, Any]:
        """A sandbox started from a snapshot (E2B's snapshots are templates: ``Sandbox.create(id)``).
        It takes public traffic as its create says, else as its source did (issue 52 finding 7:
        a snapshot of a sandbox that took none made one that took any)."""
        from sandloop.sessions.session import Session

        try:
            snap = api.root.snapshots.get(snapshot_id)
        except SandboxError:
            snap = None
        if snap is None or snap.owner != token.id:
            raise E2BError(404, f"template '{snapshot_id}' not found (no snapshot of that id is this key's)")
        source = api_registry.get(snap.session_id)
        if public is None:  # the source's (kept with the snapshot: the source may be gone)
            public = not api_registry.snapshot_private(snap.id) and (
                source is None or api_registry.public_traffic(source.sandbox_id)
            )
        timeout = _timeout(body.get("timeout"), DEFAULT_TIMEOUT)
        with api.rates.use(token), api.session_lock:
            check_session_room(token, api.held(token), snap.quota_bytes)
            s = Session.from_snapshot(snap.id, ttl=timeout + TTL_MARGIN, root=api.root)
            api_registry.set_public_traffic(s.id, public)
            box = register(token, s, snapshot_id, timeout, source, body)
            api_registry.set_lifecycle(s.id, on_timeout, auto_resume)
        return sandbox_json(box)

    def register(token: Any, s: Any, template: str, timeout: float, like: Any, body: dict[str, Any]) -> Any:
        """A new session (a fork, or one from a snapshot) as one of the key's sandboxes."""
        api.tokens.own(s.id, token.id)
        limits = s.limits
        box = api_registry.add(
            s.id,
            token.id,
            template=template,
            timeout=timeout,
            metadata=_strings(body.get("metadata"), "metadata") or (like.metadata if like else {}),
            envs=like.envs if like else {},
            cpus=limits.cpus,
            memory_mb=limits.memory_bytes // 2**20,
            disk_mb=s.record.quota_bytes // 2**20,
        )
        s.close()
        return box

    @router.post("/sandboxes/{sandbox_id}/pause", status_code=204)
    async def pause(sandbox_id: str, request: Request, token: Auth) -> Response:
        """Stop it, keeping its memory (gVisor) or its Python state (runc), or with
        ``{"memory": false}`` its files only; 409 when paused."""
        body = await body_of(request)

        def work() -> None:
            e2b.mine(token, sandbox_id)
            if e2b.paused(sandbox_id):
                raise E2BError(409, f"sandbox {sandbox_id} is already paused")
            with api.rates.use(token):
                # its image counts against the key's --max-workspace once made (quota.footprints)
                check_snapshot_room(token, api.held(token), api.root.snapshots.total_bytes(token.id))
                e2b.pause(sandbox_id, keep_memory=body.get("memory") is not False)

        await run_in_threadpool(work)
        return Response(status_code=204)

    @router.post("/sandboxes/{sandbox_id}/resume", status_code=201)
    async def resume(sandbox_id: str, request: Request, token: Auth) -> dict[str, Any]:
        body = await body_of(request)

        def work() -> dict[str, Any]:
            box = e2b.mine(token, sandbox_id)
            if not e2b.paused(sandbox_id):
                raise E2BError(409, f"sandbox {sandbox_id} is already running")
            with api.rates.use(token):
                e2b.resume(sandbox_id, _timeout(body.get("timeout"), DEFAULT_TIMEOUT))
            return sandbox_json(e2b.mine(token, box.sandbox_id))

        return await run_in_threadpool(work)

    @router.post("/sandboxes/{sandbox_id}/snapshots", status_code=201)
    async def snapshot(sandbox_id: str, request: Request, token: Auth) -> dict[str, Any]:
        body = await body_of(request)
        name = body.get("name") or ""
        if not isinstance(name, str) or len(name) > 128:
            raise E2BError(400, "name must be a string of at most 128 characters")

        def work() -> dict[str, Any]:
            e2b.mine(token, sandbox_id)
            with api.rates.use(token):
                check_snapshot_room(token, api.held(token), api.root.snapshots.total_bytes(token.id))
                snap = e2b.session(sandbox_id).snapshot(name, owner=token.id)
                if not api_registry.public_traffic(sandbox_id):
                    api_registry.keep_snapshot_private(snap.id)
            return snapshot_json(snap)

        return await run_in_threadpool(work)

    @router.get("/snapshots")
    def list_snapshots(token: Auth, sandboxID: str | None = None, name: str | None = None) -> list[dict[str, Any]]:  # noqa: N803 - E2B's
        return [
            snapshot_json(r)
            for r in api.root.snapshots.list(sandboxID)
            if r.owner == token.id and (name is None or r.name == name)
        ]

    @router.post("/sandboxes/{sandbox_id}/fork", status_code=201)
    async def fork(sandbox_id: str, request: Request, token: Auth) -> list[dict[str, Any]]:
        body = await body_of(request)
        count = body.get("count", 1)
        if isinstance(count, bool) or not isinstance(count, int) or not 1 <= count <= 20:
            raise E2BError(400, f"count must be a whole number from 1 to 20, got {count!r}")
        timeout = _timeout(body.get("timeout"), DEFAULT_TIMEOUT)

        def work() -> list[dict[str, Any]]:
            source = e2b.mine(token, sandbox_id)
            with api.rates.use(token), api.session_lock:
                live = api.held(token)
                quota = parse_size(WORKSPACE_QUOTA)
                check_session_room(token, live + [quota] * (count - 1), quota)
                children = e2b.session(sandbox_id).fork(count)
                out = []
                for child in children:
                    child.record.ttl_seconds = timeout + TTL_MARGIN
                    api.root.sessions.save(child.record)
                    # as its source, from before it is anyone's (issue 52 finding 7: a fork of one
                    # that took no public traffic took any); its traffic token is its own (an HMAC of its id)
                    api_registry.set_public_traffic(child.id, api_registry.public_traffic(sandbox_id))
                    box = register(token, child, source.template, timeout, source, {})
                    api_registry.set_lifecycle(child.id, *api_registry.lifecycle(sandbox_id))
                    out.append({"sandbox": sandbox_json(box)})
            return out

        return await run_in_threadpool(work)

    @router.post("/sandboxes", status_code=201)
    @router.post("/v2/sandboxes", status_code=201)
    async def create_sandbox(request: Request, token: Auth) -> dict[str, Any]:
        body = await body_of(request)
        return await run_in_threadpool(create, token, body, not request.url.path.startswith("/v2/"))

    @router.post("/sandboxes/{sandbox_id}/connect")
    @router.post("/v2/sandboxes/{sandbox_id}/connect")
    async def connect(sandbox_id: str, request: Request, token: Auth) -> JSONResponse:
        body = await body_of(request)

        def work() -> JSONResponse:
            box = e2b.mine(token, sandbox_id)
            timeout = _timeout(body.get("timeout"), 0) if body.get("timeout") is not None else 0
            if e2b.paused(sandbox_id):  # connecting resumes it: 201, as E2B's
                with api.rates.use(token):
                    e2b.resume(sandbox_id, timeout or DEFAULT_TIMEOUT)
                return JSONResponse(sandbox_json(e2b.mine(token, sandbox_id)), status_code=201)
            if timeout and box.end_at < datetime.datetime.now().timestamp() + timeout:
                e2b.set_timeout(box, timeout)
                box = e2b.mine(token, sandbox_id)
            return JSONResponse(sandbox_json(box))

        return await run_in_threadpool(work)

    @router.get("/sandboxes/{sandbox_id}")
    def get_sandbox(sandbox_id: str, token: Auth) -> dict[str, Any]:
        return sandbox_json(e2b.mine(token, sandbox_id), detail=True)

    @router.delete("/sandboxes/{sandbox_id}", status_code=204)
    def kill_sandbox(sandbox_id: str, token: Auth) -> Response:
        # Not metered: a key over its rate must still be able to give back what it holds.
        e2b.mine(token, sandbox_id)
        e2b.kill(sandbox_id)
        return Response(status_code=204)

    @router.post("/sandboxes/{sandbox_id}/timeout", status_code=204)
    async def set_timeout(sandbox_id: str, request: Request, token: Auth) -> Response:
        body = await body_of(request)
        timeout = _timeout(body.get("timeout"), -1)
        if timeout < 0:
            raise E2BError(400, 'send {"timeout": seconds}')
        await run_in_threadpool(lambda: e2b.set_timeout(e2b.mine(token, sandbox_id), timeout))
        return Response(status_code=204)

    def listed(token: Any, request: Request) -> list[Any]:
        """The token's live sandboxes that match the query (metadata, state, template, startedAfter),
        in start order: newest first unless ``order=asc`` (as E2B's API, across the whole list)."""
        e2b.reap()
        query = request.query_params
        wanted = dict(urllib.parse.parse_qsl(query.get("metadata", "")))
        # ?state=running&state=paused (the SDKs) or ?state=running,paused
        states = {s for value in (query.getlist("state") or ["running,paused"]) for s in value.split(",") if s}
        template = query.get("template")
        after = None
        if query.get("startedAfter"):
            try:
                after = datetime.datetime.fromisoformat(query["startedAfter"].replace("Z", "+00:00")).timestamp()
            except ValueError:
                raise E2BError(400, "startedAfter must be an ISO 8601 time, e.g. 2026-12-01T15:00:00Z") from None
        order = query.get("order", "desc")
        if order not in ("asc", "desc"):
            raise E2BError(400, "order must be asc or desc")
        live = {r.id for r in api.live_sessions(token)}
        boxes = [
            box
            for box in api_registry.of_token(token.id)
            if box.sandbox_id in live
            and all(box.metadata.get(k) == v for k, v in wanted.items())
            and (template is None or template == box.template)
            and (after is None or box.started >= after - 1e-6)  # the ISO time kept microseconds
            and ("paused" if e2b.paused(box.sandbox_id) else "running") in states
        ]
        return sorted(boxes, key=lambda b: (b.started, b.sandbox_id), reverse=order == "desc")

    @router.get("/sandboxes")
    def list_v1(request: Request, token: Auth) -> list[dict[str, Any]]:
        return [sandbox_json(box, tokens=False, detail=True) for box in listed(token, request)]

    @router.get("/v2/sandboxes")
    def list_v2(request: Request, token: Auth) -> JSONResponse:
        """A page of ``limit``; ``X-Next-Token`` names where the next starts (the last one's start
        and id, so that a sandbox made or killed between pages moves no one to another page)."""
        boxes = listed(token, request)
        try:
            limit = int(request.query_params.get("limit") or 100)
        except ValueError:
            raise E2BError(400, "limit must be a number") from None
        limit = max(1, min(limit, 1000))
        cursor = request.query_params.get("nextToken")
        if cursor:
            started, _, sandbox_id = cursor.partition("|")
            try:
                key = (float(started), sandbox_id)
            except ValueError:
                raise E2BError(400, "nextToken is not one this server gave") from None
            desc = request.query_params.get("order", "desc") == "desc"
            boxes = [b for b in boxes if ((b.started, b.sandbox_id) < key if desc else (b.started, b.sandbox_id) > key)]
        page = boxes[:limit]
        headers = {"X-Next-Token": f"{page[-1].started!r}|{page[-1].sandbox_id}"} if len(boxes) > limit else {}
        return JSONResponse([sandbox_json(box, tokens=False, detail=True) for box in page], headers=headers)

    @router.api_route("/sandboxes/{sandbox_id}/{action}", methods=["GET", "POST", "PUT"], include_in_schema=False)
    def unsupported(sandbox_id: str, action: str, token: Auth) -> None:
        e2b.mine(token, sandbox_id)
        raise E2BError(
            501,
            f"{action} is not supported by sandloop's E2B-compatible API (metrics, logs and network rules "
            "are not); see the README's 'Coming from E2B'",
        )

    return router


def snapshot_json(snap: Any) -> dict[str, Any]:
    return {"snapshotID": snap.id, "names": [snap.name] if snap.name else [snap.id]}


def e2b_error_response(exc: Exception) -> JSONResponse:
    """Any error on an E2B path, as E2B's ``{"code": status, "message"}``."""
    if isinstance(exc, E2BError | QuotaError):
        status, message = exc.status, exc.message
    elif isinstance(exc, SandboxError):
        err = error_for(exc)
        status, message = err.status, err.message
    else:
        status, message = getattr(exc, "status", 500), getattr(exc, "message", str(exc))
    return JSONResponse({"code": status, "message": message}, status_code=status)

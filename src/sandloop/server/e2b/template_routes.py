"""The HTTP routes of E2B's template build API (``templates.py`` does the work): authenticated by
``X-API-Key``, except the signed upload of a COPY's archive."""

from __future__ import annotations

import os
import uuid
from typing import TYPE_CHECKING, Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from sandloop.contract import SandboxError
from sandloop.server.context import Auth
from sandloop.server.e2b.control import body_of
from sandloop.server.e2b.service import E2BError

if TYPE_CHECKING:
    from sandloop.server.e2b.service import E2B

#: Every /templates... and /v<N>/templates... path is E2B's template API.
from sandloop.server.e2b.template_uploads import too_large
from sandloop.server.e2b.templates import E2BTemplates


def template_api_routes(e2b: E2B) -> Any:
    """The routes (authenticated by X-API-Key, except the signed upload)."""
    templates = E2BTemplates(e2b)
    router = APIRouter(include_in_schema=False)

    @router.post("/v3/templates", status_code=202)
    @router.post("/v2/templates", status_code=202)
    async def request_build(request: Request, token: Auth) -> dict[str, Any]:
        body = await body_of(request)
        with e2b.api.rates.use(token):
            return templates.request(token, body)

    @router.get("/templates/{template_id}/files/{files_hash}", status_code=201)
    def upload_link(template_id: str, files_hash: str, request: Request, token: Auth) -> dict[str, Any]:
        return templates.uploads.upload_link(token, template_id, files_hash, str(request.base_url))

    @router.put("/templates/{template_id}/files/{files_hash}/upload")
    async def upload(template_id: str, files_hash: str, request: Request) -> Response:
        target = templates.uploads.check_upload(template_id, files_hash, dict(request.query_params))
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_name(f".{target.name}.{uuid.uuid4().hex[:8]}")
        size = 0
        limit = templates.uploads.reserve_upload(target)
        try:
            with open(partial, "wb") as f:
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise E2BError(413, too_large(limit))
                    f.write(chunk)
            os.replace(partial, target)
        finally:
            partial.unlink(missing_ok=True)
            templates.uploads.release_upload(target, limit)
        return Response(status_code=200)

    @router.post("/v2/templates/{template_id}/builds/{build_id}", status_code=202)
    @router.post("/templates/{template_id}/builds/{build_id}", status_code=202)
    async def start_build(template_id: str, build_id: str, request: Request, token: Auth) -> Response:
        body = await body_of(request)
        await run_in_threadpool(templates.start, token, template_id, build_id, body)
        return Response(status_code=202)

    @router.get("/templates/{template_id}/builds/{build_id}/status")
    def build_status(template_id: str, build_id: str, request: Request, token: Auth) -> dict[str, Any]:
        try:
            offset = int(request.query_params.get("logsOffset") or 0)
        except ValueError:
            raise E2BError(400, "logsOffset must be a number") from None
        return templates.status(token, template_id, build_id, offset)

    @router.get("/templates/aliases/{alias}")
    def alias(alias: str, token: Auth) -> dict[str, Any]:
        return templates.alias(token, alias)

    @router.post("/templates/tags", status_code=201)
    async def assign_tags(request: Request, token: Auth) -> dict[str, Any]:
        body = await body_of(request)
        return await run_in_threadpool(templates.assign_tags, token, body)

    @router.delete("/templates/tags", status_code=204)
    async def remove_tags(request: Request, token: Auth) -> Response:
        body = await body_of(request)
        await run_in_threadpool(templates.remove_tags, token, body)
        return Response(status_code=204)

    @router.get("/templates/{template_id}/tags")
    def tags(template_id: str, token: Auth) -> list[dict[str, Any]]:
        return templates.tags(token, template_id)

    @router.get("/templates")
    @router.get("/v2/templates")
    def list_templates(token: Auth) -> JSONResponse:
        return JSONResponse(templates.list(token))

    @router.delete("/templates/{template_id}", status_code=204)
    def delete(template_id: str, token: Auth) -> Response:
        if template_id.startswith("snap-"):  # E2B's snapshots are templates (Sandbox.delete_snapshot)
            snapshots = templates.root.snapshots
            try:
                snap = snapshots.get(template_id)
            except SandboxError:
                snap = None
            if snap is None or snap.owner != token.id:
                raise E2BError(404, f"snapshot {template_id} not found")
            snapshots.delete(snap.id)
            return Response(status_code=204)
        templates.delete(token, template_id)
        return Response(status_code=204)

    return router, templates

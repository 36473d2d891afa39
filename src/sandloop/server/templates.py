"""Routes: templates (``images/templates/``), each the building token's own. A build runs its
steps with the token's ceilings (memory, the longest run it may ask for) and holds one of its
concurrent slots; a server builds at most two at once. Files for COPY steps come in the body."""

from __future__ import annotations

import base64
import binascii
import os
import shutil
import threading
from dataclasses import asdict
from pathlib import Path, PurePosixPath
from typing import Any

from fastapi import APIRouter, Response
from starlette.concurrency import run_in_threadpool

from sandloop.contract import InvalidArgument, TemplateBuildFailed, parse_size
from sandloop.images.templates import BuildLimits, from_mapping, split_ref
from sandloop.images.templates.build import scratch
from sandloop.server.context import Api, Auth
from sandloop.server.errors import ApiError
from sandloop.server.models import MAX_TEMPLATE_FILES_BYTES, TemplateIn

#: Builds at once on one server (each is a container with up to a token's memory).
BUILDS_AT_ONCE = 2


def build_limits(token: Any, runtime: str = "runc") -> BuildLimits:
    """A build step may use what the token's runs may: its memory ceiling and longest run; and
    add to the image at most the token's disk ceiling (``--max-workspace``), capped at the default."""
    return BuildLimits(
        memory_bytes=parse_size(token.max_memory),
        cpus=1.0,
        timeout_seconds=float(token.max_timeout),
        runtime=runtime,
        disk_bytes=min(parse_size(token.max_workspace), BuildLimits.disk_bytes),
    )


def write_context(files: dict[str, str], into: Path, cap: int = MAX_TEMPLATE_FILES_BYTES) -> None:
    """The body's files under ``into``: relative paths only, never through a link, at most ``cap`` bytes."""
    total = 0
    for name, encoded in files.items():
        path = PurePosixPath(name)
        if not name or path.is_absolute() or ".." in path.parts or "\x00" in name or len(name) > 1024:
            raise ApiError(400, "invalid_argument", f"files: {name!r} must be a relative path without '..'")
        try:
            data = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            raise ApiError(400, "invalid_argument", f"files: {name} is not base64") from None
        total += len(data)
        if total > cap:
            raise ApiError(413, "too_large", f"files: more than {cap >> 20} MiB in all; send less")
        target = into.joinpath(*path.parts)
        target.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        with os.fdopen(fd, "wb") as f:
            f.write(data)


def template_routes(api: Api) -> APIRouter:
    router = APIRouter()
    root, rates = api.root, api.rates
    builds = threading.BoundedSemaphore(BUILDS_AT_ONCE)

    @router.post("/v1/templates", status_code=201)
    async def build_template(body: TemplateIn, token: Auth) -> dict[str, Any]:
        """Build a template from steps (as a steps file has them); cached per step."""

        def work() -> dict[str, Any]:
            name, tag = split_ref(body.name)
            context = scratch("api-")
            try:
                write_context(body.files, context)
                raw: dict[str, Any] = {"steps": body.steps}
                for key, value in (("from", body.from_), ("start_cmd", body.start_cmd), ("ready_cmd", body.ready_cmd)):
                    if value:
                        raw[key] = value
                spec = from_mapping(raw, name, tag, context, source="template")
                if spec.base != "runtime":
                    root.templates.image_for(spec.base, owner=token.id)  # one it may see
                if not builds.acquire(blocking=False):
                    raise ApiError(429, "busy", "the server is building other templates: try again", retry_after=5)
                try:
                    result = root.templates.build(
                        spec, force=body.force, limits=build_limits(token, body.runtime), owner=token.id
                    )
                finally:
                    builds.release()
            finally:
                shutil.rmtree(context, ignore_errors=True)
            return asdict(result)

        with rates.use(token):
            try:
                return await run_in_threadpool(work)
            except TemplateBuildFailed as exc:  # its message names the step and ends with its log
                raise ApiError(400, exc.code, str(exc)) from None
            except InvalidArgument as exc:
                raise ApiError(400, exc.code, str(exc)) from None

    @router.get("/v1/templates")
    def list_templates(token: Auth) -> list[dict[str, Any]]:
        return [_public(asdict(t)) for t in root.templates.list(owner=token.id)]

    @router.get("/v1/templates/{ref}")
    def get_template(ref: str, token: Auth) -> dict[str, Any]:
        return _public(asdict(root.templates.get(ref, owner=token.id)))

    @router.delete("/v1/templates/{ref}", status_code=204)
    def delete_template(ref: str, token: Auth) -> Response:
        root.templates.remove(ref, owner=token.id)
        return Response(status_code=204)

    return router


def _public(info: dict[str, Any]) -> dict[str, Any]:
    info["owned"] = bool(info.pop("owner"))  # a token id is never shown
    return info

"""Routes: sessions, their files and archives, each scoped to the calling token."""

from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from sandloop.contract import parse_size
from sandloop.server.context import Api, Auth
from sandloop.server.errors import ApiError
from sandloop.server.models import CellIn, ContextIn, SessionIn, SessionRunIn, secrets_of
from sandloop.server.quota import check_session_room


def session_json(record: Any, paused: str | None = None, idle_paused: bool = False) -> dict[str, Any]:
    """``idle_paused``: paused for want of use (its next call resumes it), not by a caller."""
    return {
        "paused": paused,
        "idle_paused": bool(paused) and idle_paused,
        "id": record.id,
        "created": record.created,
        "last_used": record.last_used,
        "ttl_seconds": record.ttl_seconds,
        "quota_bytes": record.quota_bytes,
        "quota_enforced": record.quota_enforced,
        "limits": record.limits,
        "image": record.image,
    }


def session_routes(api: Api) -> APIRouter:
    router = APIRouter()
    root, store, rates, session_lock = api.root, api.tokens, api.rates, api.session_lock
    limits_for, clamp_timeout, count = api.limits_for, api.clamp_timeout, api.count
    owned, with_session, live_sessions = api.owned, api.with_session, api.live_sessions

    @router.post("/v1/sessions", status_code=201)
    def create_session(body: SessionIn, token: Auth) -> dict[str, Any]:
        limits = limits_for(token, body.limits)
        try:
            quota = parse_size(body.quota)
        except ValueError as exc:
            raise ApiError(400, "invalid_argument", str(exc)) from None
        if body.template is not None:  # one this token may see (its own, or the operator's)
            root.templates.image_for(body.template, owner=token.id)
        with rates.use(token), session_lock:  # one check-and-create at a time, so two cannot both fit
            check_session_room(token, api.held(token), quota)
            s = root.create_session(limits, ttl=body.ttl_seconds, quota=body.quota, template=body.template)
            store.own(s.id, token.id)
            s.close()
        return session_json(s.record)

    @router.get("/v1/sessions")
    def list_sessions(token: Auth) -> list[dict[str, Any]]:
        return [
            session_json(r, paused := root.sessions.paused(r.id), bool(paused) and root.sessions.idle_paused(r.id))
            for r in live_sessions(token)
        ]

    @router.get("/v1/sessions/{session_id}")
    def get_session(session_id: str, token: Auth) -> dict[str, Any]:
        with owned(token, session_id) as s:
            return session_json(s.record, s.paused, s.paused_for_idleness)

    @router.delete("/v1/sessions/{session_id}", status_code=204)
    def delete_session(session_id: str, token: Auth) -> Response:
        api.check_owner(token, session_id)
        with rates.use(token):
            root.delete_session(session_id)
        store.disown(session_id)
        return Response(status_code=204)

    async def answer(token: Any, session_id: str, call: Any, stream: bool) -> dict[str, Any] | StreamingResponse:
        """``call(session, on_output)``: its result, or with ``stream`` server-sent events (a
        session that is not the token's is a 404 before the stream starts)."""
        if not stream:
            return count(await run_in_threadpool(with_session, token, session_id, call))
        await run_in_threadpool(lambda: owned(token, session_id).close())

        def work(on_output: Any, cancel: Any) -> Any:
            with owned(token, session_id) as s:  # attached: `with` only detaches
                return call(s, on_output, cancel)

        return api.sse_output(token, work)

    @router.post("/v1/sessions/{session_id}/runs", response_model=None)
    async def session_run(session_id: str, body: SessionRunIn, token: Auth) -> dict[str, Any] | StreamingResponse:
        """A program in a fresh process with the workspace as its working directory. With
        ``stream: true``: server-sent events, as for /v1/runs."""
        timeout = clamp_timeout(token, body.timeout_seconds)
        secrets = secrets_of(body.secrets)

        def call(s: Any, on_output: Any = None, _cancel: Any = None) -> Any:  # ends by its own timeout
            return s.run(body.code, body.language, timeout, stdin=body.stdin, secrets=secrets, on_output=on_output)

        return await answer(token, session_id, call, body.stream)

    @router.post("/v1/sessions/{session_id}/cells", response_model=None)
    async def session_cell(session_id: str, body: CellIn, token: Auth) -> dict[str, Any] | StreamingResponse:
        """A cell in the session's interpreter (its state persists). With ``stream: true``:
        server-sent events, output as the cell prints it, then ``result``."""
        timeout = clamp_timeout(token, body.timeout_seconds)
        secrets = secrets_of(body.secrets)

        def call(s: Any, on_output: Any = None, cancel: Any = None) -> Any:
            # a client that stops reading (the playground's interrupt) interrupts the cell; its
            # interpreter and variables stay
            on_display = None
            if on_output is not None:  # streamed: each output as a `display` event as it comes
                relay = on_output
                on_display = lambda o: relay("display", o.model_dump_json().encode())  # noqa: E731
            return s.run_cell(
                body.code,
                timeout,
                secrets=secrets,
                on_output=on_output,
                cancel=cancel,
                detach=True,
                context=body.context,
                language=body.language,
                on_display=on_display,
            )

        return await answer(token, session_id, call, body.stream)

    @router.get("/v1/sessions/{session_id}/contexts")
    def list_contexts(session_id: str, token: Auth) -> list[dict[str, Any]]:
        """The session's interpreters: the default Python and JavaScript ones, then those made."""
        contexts = with_session(token, session_id, lambda s: s.list_contexts())
        return [c.model_dump() for c in contexts]

    @router.post("/v1/sessions/{session_id}/contexts", status_code=201)
    def create_context(session_id: str, body: ContextIn, token: Auth) -> dict[str, Any]:
        """A new independent interpreter in the session's sandbox (its own variables, the same files)."""
        context = with_session(token, session_id, lambda s: s.create_context(body.language, body.cwd))
        return dict(context.model_dump())

    @router.post("/v1/sessions/{session_id}/contexts/{context_id}/restart")
    def restart_context(session_id: str, context_id: str, token: Auth) -> dict[str, Any]:
        context = with_session(token, session_id, lambda s: s.restart_context(context_id))
        return dict(context.model_dump())

    @router.delete("/v1/sessions/{session_id}/contexts/{context_id}", status_code=204)
    def remove_context(session_id: str, context_id: str, token: Auth) -> Response:
        with_session(token, session_id, lambda s: s.remove_context(context_id))
        return Response(status_code=204)

    @router.get("/v1/sessions/{session_id}/files")
    def list_files(session_id: str, token: Auth, path: str = ".") -> list[dict[str, Any]]:
        entries: list[dict[str, Any]] = with_session(token, session_id, lambda s: s.list_files(path))
        return entries

    @router.get("/v1/sessions/{session_id}/files/{path:path}")
    def get_file(session_id: str, path: str, token: Auth) -> Response:
        data = with_session(token, session_id, lambda s: s.read_file(path))
        return Response(data, media_type="application/octet-stream")

    @router.put("/v1/sessions/{session_id}/files/{path:path}")
    async def put_file(session_id: str, path: str, request: Request, token: Auth) -> dict[str, Any]:
        data = await request.body()  # RequestGuard capped it at MAX_FILE_BYTES while it streamed in
        size = await run_in_threadpool(with_session, token, session_id, lambda s: s.write_file(path, data))
        return {"path": path, "size": size}

    @router.post("/v1/sessions/{session_id}/archive")
    async def upload_archive(session_id: str, request: Request, token: Auth, dest: str = ".") -> dict[str, Any]:
        """Unpack a tar, tar.gz or zip (the body) into ``dest`` of the workspace. Links, members that
        leave the workspace and archives that expand past the quota are refused; nothing is
        written then."""
        data = await request.body()  # capped by RequestGuard while it streamed in
        return await run_in_threadpool(with_session, token, session_id, lambda s: s.upload(data, dest))

    @router.get("/v1/sessions/{session_id}/archive")
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

    @router.delete("/v1/sessions/{session_id}/files/{path:path}", status_code=204)
    def delete_file(session_id: str, path: str, token: Auth) -> Response:
        with_session(token, session_id, lambda s: s.delete_file(path))
        return Response(status_code=204)

    return router

"""Terminals over HTTP: a program on a terminal inside a session's sandbox (``Session.terminal``),
held by this server between calls, for the playground's terminal panel and any client.

    POST   /v1/sessions/{id}/terminals               {"cols", "rows", "cmd"?}  -> 201 {"pid"}
    GET    /v1/sessions/{id}/terminals               the running ones
    GET    /v1/sessions/{id}/terminals/{pid}/output  server-sent events: data (base64), exit
    POST   /v1/sessions/{id}/terminals/{pid}/input   {"data": text} or {"base64": bytes}
    POST   /v1/sessions/{id}/terminals/{pid}/resize  {"cols", "rows"}
    DELETE /v1/sessions/{id}/terminals/{pid}         hung up

``TerminalTable`` and ``follow`` are shared with E2B's ``sandbox.pty`` (e2b/envd_pty.py).
"""

from __future__ import annotations

import asyncio
import base64
import json
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field
from starlette.concurrency import run_in_threadpool

from sandloop.runtime.reach.mux import ReachError, Terminal
from sandloop.server.context import Api, Auth
from sandloop.server.errors import ApiError

#: Seconds between keepalives on a quiet terminal's stream.
KEEPALIVE = 30.0
#: Terminals one session may hold through this server at once (its sandbox's agent has 64
#: channels for terminals and connections together).
MAX_TERMINALS = 16


class TerminalTable:
    """This server's terminals of each session, by the pid the sandbox gave them."""

    def __init__(self) -> None:
        self._terms: dict[str, dict[int, tuple[Terminal, dict[str, Any]]]] = {}
        self._lock = threading.Lock()

    def add(self, session_id: str, term: Terminal, config: dict[str, Any]) -> None:
        with self._lock:
            self._terms.setdefault(session_id, {})[term.pid] = (term, config)

    def count(self, session_id: str) -> int:
        return len(self.listed(session_id))

    def get(self, session_id: str, pid: int) -> Terminal | None:
        with self._lock:
            found = self._terms.get(session_id, {}).get(pid)
        return None if found is None else found[0]

    def listed(self, session_id: str) -> list[dict[str, Any]]:
        with self._lock:
            terms = list(self._terms.get(session_id, {}).items())
        running = [(pid, config) for pid, (term, config) in terms if term.exit_code is None and not term.ended]
        return [{"pid": pid, "config": config} for pid, config in running]

    def ended(self, session_id: str, pid: int) -> None:
        with self._lock:
            self._terms.get(session_id, {}).pop(pid, None)

    def forget(self, session_id: str) -> None:
        """The session went (deleted, paused): its terminals went with its interpreter."""
        with self._lock:
            terms = self._terms.pop(session_id, {})
        for term, _ in terms.values():
            term.close()


async def follow(term: Terminal, keepalive: float = KEEPALIVE) -> AsyncIterator[tuple[str, Any]]:
    """A terminal's stream: ``("data", bytes)`` as it shows them, ``("keepalive", None)`` on a
    quiet one, then ``("exit", code)`` (minus the signal that ended it). A newer follower of the
    same terminal takes its output from then on."""
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()

    def ready() -> None:  # on the agent's reader thread
        loop.call_soon_threadsafe(wake.set)

    term.on_ready = ready
    try:
        while True:
            wake.clear()
            data, ended = term.take()
            if data:
                yield "data", data
            if ended:
                yield "exit", await run_in_threadpool(term.wait, 30)
                return
            if data:
                continue
            try:
                await asyncio.wait_for(wake.wait(), keepalive)
            except TimeoutError:
                yield "keepalive", None
    finally:
        if term.on_ready is ready:
            term.on_ready = None


class TerminalIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cols: int = Field(80, ge=1, le=1000)
    rows: int = Field(24, ge=1, le=1000)
    cmd: list[str] | None = Field(None, description="A program and its arguments (default: a login bash).")


class InputIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    data: str | None = Field(None, max_length=65536, description="Text typed (UTF-8).")
    base64: str | None = Field(None, max_length=90000, description="Bytes, base64.")


class SizeIn(BaseModel):
    model_config = ConfigDict(extra="forbid")
    cols: int = Field(ge=1, le=1000)
    rows: int = Field(ge=1, le=1000)


def terminal_routes(api: Api, table: TerminalTable) -> APIRouter:
    router = APIRouter()

    def running(token: Any, session_id: str, pid: int) -> Terminal:
        api.check_owner(token, session_id)
        term = table.get(session_id, pid)
        if term is None or term.exit_code is not None:
            raise ApiError(404, "not_found", f"no terminal {pid} runs in session {session_id}")
        return term

    def reach_call(call: Callable[[], Any]) -> Any:
        try:
            return call()
        except ReachError as exc:
            raise ApiError(409, "terminal_gone", str(exc)) from None

    @router.post("/v1/sessions/{session_id}/terminals", status_code=201)
    def create_terminal(session_id: str, body: TerminalIn, token: Auth) -> dict[str, Any]:
        if table.count(session_id) >= MAX_TERMINALS:
            raise ApiError(429, "too_many_terminals", f"session {session_id} has {MAX_TERMINALS} terminals open here")

        def start(s: Any) -> Terminal:
            try:
                made: Terminal = s.terminal(body.cols, body.rows, cmd=body.cmd)
                return made
            except ReachError as exc:
                raise ApiError(400 if "directory" in str(exc) else 503, "terminal_refused", str(exc)) from None

        term = api.with_session(token, session_id, start)
        table.add(session_id, term, {"cmd": (body.cmd or ["/bin/bash"])[0], "args": (body.cmd or [])[1:]})
        return {"pid": term.pid, "cols": body.cols, "rows": body.rows}

    @router.get("/v1/sessions/{session_id}/terminals")
    def list_terminals(session_id: str, token: Auth) -> list[dict[str, Any]]:
        api.check_owner(token, session_id)
        return table.listed(session_id)

    @router.get("/v1/sessions/{session_id}/terminals/{pid}/output")
    async def terminal_output(session_id: str, pid: int, token: Auth) -> StreamingResponse:
        term = await run_in_threadpool(running, token, session_id, pid)

        async def events() -> AsyncIterator[str]:
            async for kind, value in follow(term):
                if kind == "data":
                    yield f"event: data\ndata: {json.dumps(base64.b64encode(value).decode())}\n\n"
                elif kind == "exit":
                    table.ended(session_id, pid)
                    yield f"event: exit\ndata: {json.dumps({'exit_code': value})}\n\n"
                else:
                    yield ": keepalive\n\n"

        return StreamingResponse(events(), media_type="text/event-stream", headers={"Cache-Control": "no-store"})

    @router.post("/v1/sessions/{session_id}/terminals/{pid}/input", status_code=204)
    def terminal_input(session_id: str, pid: int, body: InputIn, token: Auth) -> Response:
        term = running(token, session_id, pid)
        if (body.data is None) == (body.base64 is None):
            raise ApiError(400, "invalid_argument", "send one of data (text) or base64 (bytes)")
        try:
            raw = body.data.encode() if body.data is not None else base64.b64decode(body.base64 or "", validate=True)
        except ValueError:
            raise ApiError(400, "invalid_argument", "base64: not base64") from None
        reach_call(lambda: term.send(raw))
        return Response(status_code=204)

    @router.post("/v1/sessions/{session_id}/terminals/{pid}/resize", status_code=204)
    def terminal_resize(session_id: str, pid: int, body: SizeIn, token: Auth) -> Response:
        term = running(token, session_id, pid)
        reach_call(lambda: term.resize(body.cols, body.rows))
        return Response(status_code=204)

    @router.delete("/v1/sessions/{session_id}/terminals/{pid}", status_code=204)
    def terminal_close(session_id: str, pid: int, token: Auth) -> Response:
        term = running(token, session_id, pid)
        term.close()
        table.ended(session_id, pid)
        return Response(status_code=204)

    return router

"""Terminals over HTTP: a program on a terminal inside a session's sandbox (``Session.terminal``),
held by this server between calls, for the playground's terminal panel and any client.

    POST   /v1/sessions/{id}/terminals               {"cols", "rows", "cmd"?}  -> 201 {"pid"}
    GET    /v1/sessions/{id}/terminals               the running ones
    GET    /v1/sessions/{id}/terminals/{pid}/output  server-sent events: data (base64), exit
    POST   /v1/sessions/{id}/terminals/{pid}/input   {"data": text} or {"base64": bytes}
    POST   /v1/sessions/{id}/terminals/{pid}/resize  {"cols", "rows"}
    DELETE /v1/sessions/{id}/terminals/{pid}         hung up

A terminal's channel is released the moment it ends, followed or not (``Held``); a session's go
with its sandbox's agent; a stream ends when its token is revoked.

``TerminalTable`` and ``follow`` are shared with E2B's ``sandbox.pty`` (e2b/envd_pty.py).
"""

from __future__ import annotations

import asyncio
import base64
import collections
import contextlib
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
from sandloop.server.tokens import TokenStore

#: Seconds between keepalives on a quiet terminal's stream.
KEEPALIVE = 30.0
#: Terminals one session may hold through this server at once (its sandbox's agent has 64
#: channels for terminals and connections together).
MAX_TERMINALS = 16
#: The last ended terminals (of all sessions) kept for a follower that comes right after the end:
#: their exit code and, when nobody followed them, at most ``ENDED_TAIL`` bytes of their last
#: output (at most 4 MiB in all); their channels are released at the end all the same.
ENDED_KEPT = 64
ENDED_TAIL = 64 * 1024


class TokenRevoked(Exception):
    """The token a terminal's stream was opened with was revoked: the stream ends."""


class Held:
    """One terminal this server holds for a session. Its channel is released (``Terminal.close``)
    the moment it ends -- its program exits, it is hung up, or its sandbox's agent goes -- whether
    anyone follows its output or not (issue 52: ended terminals kept their channels and up to
    4 MiB of output each; after 64 the session's terminals and previews were refused). What it
    showed and nobody took yet is taken off first, for its follower."""

    def __init__(self, session_id: str, term: Terminal, config: dict[str, Any]) -> None:
        self.session_id, self.term, self.config = session_id, term, config
        self.released = False
        self._tail = b""
        self._lock = threading.Lock()
        self._wake: Callable[[], None] | None = None  # its follower's (the newest)
        self._on_end: Callable[[Held], None] | None = None

    @property
    def pid(self) -> int:
        return self.term.pid

    @property
    def running(self) -> bool:
        return not self.released and self.term.exit_code is None and not self.over

    @property
    def over(self) -> bool:
        """Its program exited (the agent sends its output's end first), or its agent is gone."""
        return self.term.exit_code is not None or not self.term.reach.alive

    def watch(self, on_end: Callable[[Held], None]) -> None:
        """``on_end(self)`` once it is over (on the agent's reader thread, or here if it is now)."""
        self._on_end = on_end
        self.term.on_ready = self._ready
        if self.over:
            self._ready()

    def _ready(self) -> None:
        if self.over and not self.released and self._on_end is not None:
            self._on_end(self)
        wake = self._wake
        if wake is not None:
            wake()

    def release(self, keep: int | None = None) -> None:
        """Frees its channel, keeping what it showed that nobody took (its last ``keep`` bytes
        when nobody follows it)."""
        with self._lock:
            if self.released:
                return
            data, _ = self.term.take()
            self._tail = data if keep is None or self._wake is not None else data[-keep:]
            self.released = True
        self.term.close()
        wake = self._wake
        if wake is not None:
            wake()

    def take(self) -> tuple[bytes, bool]:
        """As ``Terminal.take``, and after the release what was taken off at it."""
        with self._lock:
            if self.released:
                data, self._tail = self._tail, b""
                return data, True
            return self.term.take()

    def follow(self, wake: Callable[[], None]) -> None:
        """The newest follower's wake, called whenever there is something to take (the newest
        follower takes the output from then on)."""
        self._wake = wake

    def unfollow(self, wake: Callable[[], None]) -> None:
        if self._wake is wake:
            self._wake = None

    def exit_code(self) -> int:
        """Its exit code once it ended (blocking, up to 30 s: the agent sends it just after the
        output's end).

        Raises:
            ReachError: it was hung up, or its sandbox went, before it ended.
            TimeoutError: no exit code came.
        """
        return self.term.wait(30)


class TerminalTable:
    """This server's terminals of each session, by the pid the sandbox gave them: the running
    ones, and the last ``ENDED_KEPT`` ended ones (their channels released)."""

    def __init__(self) -> None:
        self._terms: dict[str, dict[int, Held]] = {}
        self._ended: collections.OrderedDict[tuple[str, int], Held] = collections.OrderedDict()
        self._lock = threading.Lock()
        self._changed = threading.Condition(self._lock)

    def add(self, session_id: str, term: Terminal, config: dict[str, Any]) -> Held:
        held = Held(session_id, term, config)
        with self._lock:
            self._terms.setdefault(session_id, {})[term.pid] = held
        held.watch(self._over)  # once it is in the table: an end from now on moves it out
        return held

    def _over(self, held: Held) -> None:
        """It ended (on the agent's reader thread): its channel released, kept a while if its
        program exited (not when its sandbox's agent went: its session went with it)."""
        key = (held.session_id, held.pid)
        with self._lock:
            live = self._terms.get(held.session_id, {})
            if live.get(held.pid) is not held:
                return  # closed by a call, or its session forgotten: released there
            del live[held.pid]
            if not live:
                self._terms.pop(held.session_id, None)
            exited = held.term.exit_code is not None
            if exited:
                self._ended[key] = held
                self._ended.move_to_end(key)
                while len(self._ended) > ENDED_KEPT:
                    self._ended.popitem(last=False)
        held.release(keep=ENDED_TAIL if exited else None)
        with self._changed:
            self._changed.notify_all()

    def count(self, session_id: str) -> int:
        return len(self.listed(session_id))

    def held(self, session_id: str, pid: int) -> Held | None:
        """A running terminal, or one of the last ended ones."""
        with self._lock:
            found = self._terms.get(session_id, {}).get(pid)
            return found if found is not None else self._ended.get((session_id, pid))

    def get(self, session_id: str, pid: int) -> Terminal | None:
        found = self.held(session_id, pid)
        return None if found is None else found.term

    def running(self, session_id: str, pid: int) -> Terminal | None:
        found = self.held(session_id, pid)
        return found.term if found is not None and found.running else None

    def listed(self, session_id: str) -> list[dict[str, Any]]:
        with self._lock:
            terms = list(self._terms.get(session_id, {}).values())
        return [{"pid": h.pid, "config": h.config} for h in terms if h.running]

    def close(self, session_id: str, pid: int) -> bool:
        """Hangs up a terminal (or forgets an ended one); False if there is none such."""
        with self._lock:
            found = self._terms.get(session_id, {}).pop(pid, None)
            kept = self._ended.pop((session_id, pid), None)
        if found is not None:
            found.release()
        with self._changed:
            self._changed.notify_all()
        return found is not None or kept is not None

    def forget(self, session_id: str) -> None:
        """The session went (killed, paused): its terminals went with its sandbox's agent; their
        channels are released now. (An agent's end, seen by the reader thread, does the same for
        a session that went any other way: deleted or paused natively, idle, at its TTL.)"""
        with self._lock:
            terms = self._terms.pop(session_id, {})
            for key in [k for k in self._ended if k[0] == session_id]:
                del self._ended[key]
        for held in terms.values():
            held.release()
        with self._changed:
            self._changed.notify_all()

    def wait_gone(self, session_id: str, pid: int, timeout: float) -> bool:
        """Waits until the terminal no longer runs here (its end handled, its channel released)."""
        with self._changed:
            return self._changed.wait_for(lambda: pid not in self._terms.get(session_id, {}), timeout)


async def follow(
    held: Held, keepalive: float = KEEPALIVE, *, tokens: TokenStore | None = None, token_id: str | None = None
) -> AsyncIterator[tuple[str, Any]]:
    """A terminal's stream: ``("data", bytes)`` as it shows them, ``("keepalive", None)`` on a
    quiet one, then ``("exit", code)`` (minus the signal that ended it). A newer follower of the
    same terminal takes its output from then on.

    Raises:
        TokenRevoked: ``token_id`` was revoked (``TokenStore.on_revoke``: at once by this
            process, within ``REVOKE_POLL`` seconds by ``sandloop tokens revoke``).
        ReachError: it was hung up, or its sandbox went, before it ended.
    """
    loop = asyncio.get_running_loop()
    wake = asyncio.Event()
    revoked = threading.Event()

    def ready() -> None:  # on the agent's reader thread, or a revoking one
        with contextlib.suppress(RuntimeError):  # the loop is gone (the server stopped): nobody follows
            loop.call_soon_threadsafe(wake.set)

    def on_revoke(revoked_id: str) -> None:
        if revoked_id == token_id:
            revoked.set()
            ready()

    off: Callable[[], None] | None = None
    held.follow(ready)
    try:
        if tokens is not None and token_id is not None:
            off = await run_in_threadpool(tokens.on_revoke, on_revoke)
            if await run_in_threadpool(tokens.get, token_id) is None:  # revoked before the watch began
                revoked.set()
        while True:
            wake.clear()
            if revoked.is_set():
                raise TokenRevoked("the token this stream was opened with was revoked: the stream ended")
            data, ended = held.take()
            if data:
                yield "data", data
            if ended:
                yield "exit", await run_in_threadpool(held.exit_code)
                return
            if data:
                continue
            try:
                await asyncio.wait_for(wake.wait(), keepalive)
            except TimeoutError:
                yield "keepalive", None
    finally:
        if off is not None:
            off()
        held.unfollow(ready)


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
        term = table.running(session_id, pid)
        if term is None:
            raise ApiError(404, "not_found", f"no terminal {pid} runs in session {session_id}")
        return term

    def followed(token: Any, session_id: str, pid: int) -> Held:
        api.check_owner(token, session_id)
        held = table.held(session_id, pid)
        if held is None:
            raise ApiError(404, "not_found", f"no terminal {pid} runs (or just ended) in session {session_id}")
        return held

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
        """Server-sent events: ``data`` (base64) as it shows them, then ``exit`` ({exit_code});
        a terminal that just ended still gives what nobody took and its exit code. ``error``
        ({code, message}) ends a stream early: ``terminal_gone`` (hung up, or its session went)
        or ``unauthorized`` (the token was revoked)."""
        held = await run_in_threadpool(followed, token, session_id, pid)

        def error(code: str, message: str) -> str:
            return f"event: error\ndata: {json.dumps({'code': code, 'message': message})}\n\n"

        async def events() -> AsyncIterator[str]:
            try:
                async for kind, value in follow(held, tokens=api.tokens, token_id=token.id):
                    if kind == "data":
                        yield f"event: data\ndata: {json.dumps(base64.b64encode(value).decode())}\n\n"
                    elif kind == "exit":
                        yield f"event: exit\ndata: {json.dumps({'exit_code': value})}\n\n"
                    else:
                        yield ": keepalive\n\n"
            except TokenRevoked as exc:
                yield error("unauthorized", str(exc))
            except (ReachError, TimeoutError) as exc:
                yield error("terminal_gone", f"terminal {pid} ended without an exit code: {exc}")

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
        api.check_owner(token, session_id)
        if not table.close(session_id, pid):
            raise ApiError(404, "not_found", f"no terminal {pid} in session {session_id}")
        return Response(status_code=204)

    return router

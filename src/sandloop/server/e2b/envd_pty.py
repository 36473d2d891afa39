"""E2B's pseudo-terminals (``sandbox.pty``) on envd's process wire: ``Start`` with ``pty`` (a
size), ``SendInput`` with ``input.pty``, ``Update`` with ``pty.size``, ``SendSignal``, ``Connect``
again after a disconnect, and ``List``. Each is a session terminal (``runtime/reach/``): a program
on a terminal inside the sandbox, a process of the sandbox like its commands (``kill -0 PID``
from a command sees it), started beside the interpreter rather than by it, so keys and output
never wait for a cell."""

from __future__ import annotations

import base64
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from starlette.concurrency import run_in_threadpool

from sandloop.runtime.reach.mux import ReachError, Terminal
from sandloop.server.e2b.connect import ConnectError
from sandloop.server.e2b.envd_shapes import signal_name
from sandloop.server.terminals import Held, TerminalTable, TokenRevoked, follow

if TYPE_CHECKING:
    from sandloop.server.e2b.service import E2B

#: Seconds between keepalives on a quiet terminal's stream.
KEEPALIVE = 30.0


class Ptys(TerminalTable):
    """This server's terminals of each E2B sandbox, by the pid the sandbox gave them."""

    def __init__(self, e2b: E2B) -> None:
        super().__init__()
        self.e2b = e2b

    def start(self, sandbox_id: str, config: dict[str, Any], pty: dict[str, Any]) -> Terminal:
        cols, rows = _size(pty.get("size") or {})
        session = self.e2b.session(sandbox_id)
        try:
            term = session.terminal(
                cols, rows, cmd=[config["cmd"], *config["args"]], envs=config["envs"], cwd=config["cwd"]
            )
        except ReachError as exc:
            raise ConnectError("invalid_argument" if "directory" in str(exc) else "unavailable", str(exc)) from None
        self.add(sandbox_id, term, config)
        return term

    def resize(self, sandbox_id: str, pid: int, size: dict[str, Any]) -> None:
        term = self._running(sandbox_id, pid)
        term.resize(*_size(size))

    def send(self, sandbox_id: str, pid: int, data: str) -> None:
        try:
            raw = base64.b64decode(data, validate=True)
        except ValueError:
            raise ConnectError("invalid_argument", "input.pty must be base64 bytes") from None
        self._running(sandbox_id, pid).send(raw)

    def _running(self, sandbox_id: str, pid: int) -> Terminal:
        term = self.running(sandbox_id, pid)
        if term is None:
            raise ConnectError("not_found", f"no terminal with pid {pid} runs in sandbox {sandbox_id}")
        return term

    async def events(self, sandbox_id: str, term: Terminal, started: bool) -> AsyncIterator[dict[str, Any]]:
        """envd's events of one terminal: its start, what it shows, its end. The stream ends
        (unauthenticated) once the key that made the sandbox is revoked."""
        if started:
            yield {"event": {"start": {"pid": term.pid}}}
        held = self.held(sandbox_id, term.pid)
        if held is None or held.term is not term:  # forgotten since (its sandbox went): what it left
            held = Held(sandbox_id, term, {})
        box = await run_in_threadpool(self.e2b.registry.get, sandbox_id)
        tokens, token_id = self.e2b.api.tokens, None if box is None else box.token_id
        try:
            async for kind, value in follow(held, KEEPALIVE, tokens=tokens, token_id=token_id):
                if kind == "data":
                    yield {"event": {"data": {"pty": base64.b64encode(value).decode()}}}
                elif kind == "keepalive":
                    yield {"event": {"keepalive": {}}}
                else:
                    code = int(value)
                    status = f"exit status {code}" if code >= 0 else f"signal: {signal_name(-code)}"
                    yield {
                        "event": {"end": {"exitCode": code if code >= 0 else -1, "exited": code >= 0, "status": status}}
                    }
        except TokenRevoked:
            raise ConnectError(
                "unauthenticated", f"the key that made sandbox {sandbox_id} was revoked: its terminal streams ended"
            ) from None
        except (TimeoutError, ReachError) as exc:
            raise ConnectError("unavailable", f"terminal {term.pid} ended: {exc}") from None


def _size(size: dict[str, Any]) -> tuple[int, int]:
    try:
        cols, rows = int(size.get("cols") or 80), int(size.get("rows") or 24)
    except (TypeError, ValueError):
        raise ConnectError("invalid_argument", "pty.size.cols and rows must be whole numbers") from None
    if not (1 <= cols <= 1000 and 1 <= rows <= 1000):
        raise ConnectError("invalid_argument", f"pty.size must be 1-1000 columns and rows, got {cols}x{rows}")
    return cols, rows

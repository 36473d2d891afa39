"""E2B's pseudo-terminals (``sandbox.pty``) on envd's process wire: ``Start`` with ``pty`` (a
size), ``SendInput`` with ``input.pty``, ``Update`` with ``pty.size``, ``SendSignal``, ``Connect``
again after a disconnect, and ``List``. Each is a session terminal (``runtime/reach/``): a program
on a terminal inside the sandbox, a process of the sandbox like its commands (``kill -0 PID``
from a command sees it), started beside the interpreter rather than by it, so keys and output
never wait for a cell."""

from __future__ import annotations

import asyncio
import base64
import threading
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from starlette.concurrency import run_in_threadpool

from sandloop.runtime.reach.mux import ReachError, Terminal
from sandloop.server.e2b.connect import ConnectError
from sandloop.server.e2b.envd_shapes import signal_name

if TYPE_CHECKING:
    from sandloop.server.e2b.service import E2B

#: Seconds between keepalives on a quiet terminal's stream.
KEEPALIVE = 30.0


class Ptys:
    """This server's terminals of each E2B sandbox, by the pid the sandbox gave them."""

    def __init__(self, e2b: E2B) -> None:
        self.e2b = e2b
        self._terms: dict[str, dict[int, tuple[Terminal, dict[str, Any]]]] = {}
        self._lock = threading.Lock()

    def start(self, sandbox_id: str, config: dict[str, Any], pty: dict[str, Any]) -> Terminal:
        size = pty.get("size") or {}
        cols, rows = _size(size)
        session = self.e2b.session(sandbox_id)
        try:
            term = session.terminal(
                cols, rows, cmd=[config["cmd"], *config["args"]], envs=config["envs"], cwd=config["cwd"]
            )
        except ReachError as exc:
            raise ConnectError("invalid_argument" if "directory" in str(exc) else "unavailable", str(exc)) from None
        with self._lock:
            self._terms.setdefault(sandbox_id, {})[term.pid] = (term, config)
        return term

    def get(self, sandbox_id: str, pid: int) -> Terminal | None:
        with self._lock:
            found = self._terms.get(sandbox_id, {}).get(pid)
        return None if found is None else found[0]

    def listed(self, sandbox_id: str) -> list[dict[str, Any]]:
        with self._lock:
            terms = list(self._terms.get(sandbox_id, {}).items())
        return [
            {"pid": pid, "config": config} for pid, (term, config) in terms if term.exit_code is None and not term.ended
        ]

    def ended(self, sandbox_id: str, pid: int) -> None:
        with self._lock:
            self._terms.get(sandbox_id, {}).pop(pid, None)

    def forget(self, sandbox_id: str) -> None:
        """The sandbox went (killed, paused): its terminals went with its interpreter."""
        with self._lock:
            terms = self._terms.pop(sandbox_id, {})
        for term, _ in terms.values():
            term.close()

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
        term = self.get(sandbox_id, pid)
        if term is None or term.exit_code is not None:
            raise ConnectError("not_found", f"no terminal with pid {pid} runs in sandbox {sandbox_id}")
        return term

    async def events(self, sandbox_id: str, term: Terminal, started: bool) -> AsyncIterator[dict[str, Any]]:
        """The stream of one terminal: its start, what it shows, its end (a newer follower of
        the same terminal takes its output from then on)."""
        if started:
            yield {"event": {"start": {"pid": term.pid}}}
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
                    yield {"event": {"data": {"pty": base64.b64encode(data).decode()}}}
                if ended:
                    try:
                        code = await run_in_threadpool(term.wait, 30)
                    except (TimeoutError, ReachError) as exc:
                        raise ConnectError("unavailable", f"terminal {term.pid} ended: {exc}") from None
                    self.ended(sandbox_id, term.pid)
                    status = f"exit status {code}" if code >= 0 else f"signal: {signal_name(-code)}"
                    yield {
                        "event": {"end": {"exitCode": code if code >= 0 else -1, "exited": code >= 0, "status": status}}
                    }
                    return
                if data:
                    continue
                try:
                    await asyncio.wait_for(wake.wait(), KEEPALIVE)
                except TimeoutError:
                    yield {"event": {"keepalive": {}}}
        finally:
            if term.on_ready is ready:  # a reconnect's stream may have taken it over meanwhile
                term.on_ready = None


def _size(size: dict[str, Any]) -> tuple[int, int]:
    try:
        cols, rows = int(size.get("cols") or 80), int(size.get("rows") or 24)
    except (TypeError, ValueError):
        raise ConnectError("invalid_argument", "pty.size.cols and rows must be whole numbers") from None
    if not (1 <= cols <= 1000 and 1 <= rows <= 1000):
        raise ConnectError("invalid_argument", f"pty.size must be 1-1000 columns and rows, got {cols}x{rows}")
    return cols, rows

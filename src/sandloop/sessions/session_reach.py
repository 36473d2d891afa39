"""Reaching into a session's running sandbox: its loopback ports and terminals (``Session``'s
part; the channels are ``runtime/reach/``'s).

    with Session() as s:
        s.run_cell("import subprocess; subprocess.Popen(['python3', '-m', 'http.server', '8000'])")
        with s.expose(8000) as url:          # http://127.0.0.1:<free port>, served by the sandbox
            print(httpx.get(url).text)
        term = s.terminal(cols=100, rows=30)
        term.send(b"ls\\n")

Nothing is opened for the sandbox: the host starts one small agent inside the sandbox beside the
interpreter (as one of its own processes: same user, cgroup, filters) and speaks to it on that
program's stdin and stdout. The sandbox still reaches nothing; the host reaches its loopback.
One agent per session per process, started on first use; it ends with the interpreter (a
restart, a pause) or the session's ``delete``, and the next use starts another.
"""

from __future__ import annotations

import contextlib
import logging
import re
import socket
import threading
from typing import Any

from sandloop.contract import HttpAnswer, InvalidArgument, SandboxError
from sandloop.runtime.base import Reachable
from sandloop.runtime.reach.mux import AGENT_ARGV, Channel, Reach, ReachError, Terminal
from sandloop.runtime.reach.request import MAX_ANSWER_BYTES, http_request
from sandloop.sessions.session_parts import SessionParts

log = logging.getLogger(__name__)
_METHOD = re.compile(r"^[A-Z]{1,16}$")
_HEADER_NAME = re.compile(r"^[A-Za-z0-9-]{1,64}$")
#: The most ``max_bytes`` may ask for (an answer is held whole in this process).
MAX_ANSWER_LIMIT = 64 * 1024 * 1024
_reaches: dict[str, Reach] = {}
_reaches_lock = threading.Lock()


def live_reach(session_id: str) -> Reach | None:
    """This process's agent in the session, if one is running."""
    with _reaches_lock:
        reach = _reaches.get(session_id)
    return reach if reach is not None and reach.alive else None


def close_reach(session_id: str) -> None:
    """End this process's agent in the session (its connections close, its terminals hang up)."""
    with _reaches_lock:
        reach = _reaches.pop(session_id, None)
    if reach is not None:
        reach.close()


class SessionReach(SessionParts):
    def _reach(self) -> Reach:
        self._check_open()
        self._live()
        with _reaches_lock:
            reach = _reaches.get(self.id)
            if reach is not None and reach.alive:
                return reach
        backend = self._root.backend
        if not isinstance(backend, Reachable):
            raise SandboxError(
                f"the {type(backend).__name__} cannot reach into a sandbox (ports and terminals need the "
                "docker or oci backend)"
            )
        stream = backend.exec_stream(self._kernel.handle(self.limits), list(AGENT_ARGV))
        made = Reach(stream)
        with _reaches_lock:
            old = _reaches.get(self.id)
            if old is not None and old.alive:  # another thread was first: use its agent
                made.close()
                return old
            _reaches[self.id] = made
        return made

    def connect(self, port: int) -> Channel:
        """A connection to ``port`` on the sandbox's own loopback (a server the code started).

        Raises:
            PortClosed: nothing listens on that port in the sandbox.
            ReachError: too many connections and terminals open at once, or the sandbox went.
        """
        return self._reach().connect(port)

    def request(
        self,
        port: int,
        path: str = "/",
        *,
        method: str = "GET",
        body: bytes = b"",
        headers: dict[str, str] | None = None,
        timeout: float = 30.0,
        max_bytes: int = MAX_ANSWER_BYTES,
    ) -> HttpAnswer:
        """One HTTP request to a server on ``port`` inside the sandbox (over ``connect``: nothing
        is opened for the sandbox), its answer read whole up to ``max_bytes`` of body, within
        ``timeout`` seconds in all. What an agent uses to check the server its code started.

        Raises:
            PortClosed: nothing listens on that port in the sandbox.
            ReachError: no HTTP answer within ``timeout`` (or not HTTP at all).
            InvalidArgument: a method that is not an HTTP token, a path that is not ``/...``.
        """
        method = str(method).upper()
        if not _METHOD.match(method):
            raise InvalidArgument(f"method must be an HTTP method such as GET or POST, got {method!r}")
        if not isinstance(path, str) or not path.startswith("/") or any(c in path for c in " \r\n\t"):
            raise InvalidArgument(f"path must start with / and hold no spaces or line breaks, got {path!r}")
        if not 0 < float(timeout) <= 3600:
            raise InvalidArgument(f"timeout must be more than 0 and at most 3600 seconds, got {timeout}")
        if not isinstance(max_bytes, int) or not 0 <= max_bytes <= MAX_ANSWER_LIMIT:
            raise InvalidArgument(f"max_bytes must be a whole number 0-{MAX_ANSWER_LIMIT}, got {max_bytes!r}")
        for name, value in (headers or {}).items():
            if not _HEADER_NAME.match(str(name)) or any(c in str(value) for c in "\r\n\0"):
                raise InvalidArgument(f"header {name!r}: a name is letters, digits and -, a value has no line breaks")
        return http_request(self.connect(port), port, method, path, body, headers or {}, float(timeout), max_bytes)

    def terminal(
        self,
        cols: int = 80,
        rows: int = 24,
        *,
        cmd: list[str] | None = None,
        envs: dict[str, str] | None = None,
        cwd: str | None = None,
    ) -> Terminal:
        """A program (default: a login bash) on a new terminal inside the sandbox: ``send`` keys,
        ``recv`` what it shows, ``resize``, ``signal``, ``wait`` for its exit code, ``close``."""
        for name, value in (("cols", cols), ("rows", rows)):
            if not isinstance(value, int) or not 1 <= value <= 1000:
                raise ReachError(f"{name} must be a whole number 1-1000, got {value!r}")
        return self._reach().terminal(cols, rows, cmd=cmd, envs=envs, cwd=cwd)

    def expose(self, port: int, *, host: str = "127.0.0.1", local_port: int = 0) -> Exposed:
        """Serve the sandbox's ``port`` on this machine's ``host``:``local_port`` (0: a free one),
        as ``kubectl port-forward`` does: every connection there is a connection to the port inside.
        ``with`` (or ``close()``) stops it. Nothing listening inside yet is fine: each connection
        is tried when it comes."""
        if not 1 <= int(port) <= 65535:  # as connect says it, but now: connections come later
            raise ReachError(f"port must be 1-65535, got {port}")
        self._reach()  # the agent is there (and the session live) before anything listens
        return Exposed(self, int(port), host, local_port)


class Exposed:
    """A local listener whose connections go to a port inside a session's sandbox."""

    def __init__(self, session: SessionReach, port: int, host: str, local_port: int) -> None:
        self.session, self.port = session, port
        self._listener = socket.create_server((host, local_port))
        self.address = self._listener.getsockname()[:2]
        self.url = f"http://{self.address[0]}:{self.address[1]}"
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._accept, name=f"expose-{port}", daemon=True)
        self._thread.start()

    def __str__(self) -> str:
        return self.url

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        with conn:
            try:
                channel = self.session.connect(self.port)
            except Exception as exc:  # noqa: BLE001 - every failure is this connection's answer, never a thread's traceback
                if not isinstance(exc, ReachError | SandboxError):
                    log.warning("port %s of session %s: %r", self.port, self.session.id, exc)
                body = f"sandloop: {exc}\n".encode()
                head = f"HTTP/1.1 502 Bad Gateway\r\nContent-Type: text/plain\r\nContent-Length: {len(body)}\r\n"
                with contextlib.suppress(OSError):
                    conn.sendall(head.encode() + b"Connection: close\r\n\r\n" + body)
                return
            pipe(conn, channel)

    def close(self) -> None:
        self._closed.set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)
        self._listener.close()
        self._thread.join(10)

    def __enter__(self) -> str:
        return self.url

    def __exit__(self, *exc: Any) -> None:
        self.close()


def pipe(conn: socket.socket, channel: Channel) -> None:
    """Bytes both ways between a local socket and a channel until both ends are done."""

    def upstream() -> None:
        try:
            while data := conn.recv(65536):
                channel.send(data)
            channel.end_input()
        except (OSError, ReachError):
            channel.close()

    t = threading.Thread(target=upstream, daemon=True)
    t.start()
    try:
        while data := channel.recv():
            conn.sendall(data)
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_WR)
    except OSError:
        pass
    finally:
        channel.close()
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)
        t.join(30)

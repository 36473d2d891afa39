"""Preview URLs: HTTP and WebSocket traffic to a port a sandbox's code listens on, through the
server's own port.

Two forms, both read from a request's head before the API sees it (``lifecycle.py``'s protocol
hands such a connection over whole, so WebSocket upgrades and streaming need nothing more):

- by host, as E2B's ``get_host``: ``<port>-<sandbox id>.<domain>`` (default domain
  ``localhost``: browsers resolve every ``*.localhost`` to loopback), any path;
- by path, for pages on the API's own origin: ``/sandboxes/<id>/ports/<port>/<rest>`` is
  ``/<rest>`` inside (one request per connection: each head is rewritten).

Access: a token that owns the session (``Authorization: Bearer``, or ``?sandloop_token=`` once,
which is then kept in a cookie scoped to that preview), or the E2B sandbox's traffic access
token (``e2b-traffic-access-token``); an E2B sandbox is public unless it was created with
``network.allow_public_traffic = false``, as E2B's are. A paused E2B sandbox with auto-resume
wakes on its first request. Bounded: ``MAX_CONNECTIONS`` per sandbox (the agent's channels),
``IDLE`` seconds without a byte either way, ``MAX_BYTES`` per connection; a closed port
answers 502 with a body that says so.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl, urlencode

from starlette.concurrency import run_in_threadpool

from sandloop.contract import SandboxError
from sandloop.runtime.reach.mux import BUFFER, Channel, PortClosed, ReachError
from sandloop.sessions.session_reach import live_reach

if TYPE_CHECKING:
    from sandloop.server.context import Api
    from sandloop.server.e2b.service import E2B

log = logging.getLogger(__name__)
#: envd's and the code interpreter's ports: E2B's SDK sends its own calls to these by host; they
#: stay the API's (``E2BSplit``).
E2B_PORTS = (49983, 49999)
HOST_FORM = re.compile(r"^(\d{1,5})-([A-Za-z0-9_-]{1,64})\.(.+?)(:\d+)?$")
PATH_FORM = re.compile(r"^/sandboxes/([A-Za-z0-9_-]{1,64})/ports/(\d{1,5})(/[^?]*)?(\?.*)?$")
#: The longest preview request head (h11's own limit for the API's: a longer one is the API's to refuse).
MAX_HEAD = 16 * 1024
IDLE = 300.0
MAX_BYTES = 1 << 30
TOKEN_PARAM = "sandloop_token"
#: What a path-form preview's answer carries: CSP's sandbox (an opaque origin) with what apps need.
PATH_FORM_CSP = "sandbox allow-scripts allow-forms allow-popups allow-modals allow-downloads"
COOKIE = "sandloop_preview"


class Refused(Exception):
    def __init__(self, status: int, message: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.headers = status, message, headers or {}


@dataclass
class Target:
    session_id: str
    port: int
    head: bytes
    headers: dict[str, str]
    by_path: bool
    query_token: str = ""
    #: Header lines added to the answer (a cookie for a token given once in the query; the path
    #: form's sandboxing policy).
    add: list[str] = field(default_factory=list)


def _parse_head(head: bytes) -> tuple[str, str, str, dict[str, str], list[bytes]] | None:
    """(method, target, version, headers lower-cased, raw header lines) of a request head."""
    try:
        text = head.decode("latin-1")
        lines = text.split("\r\n")
        method, target, version = lines[0].split(" ")
    except ValueError:
        return None
    headers: dict[str, str] = {}
    raw = []
    for line in lines[1:]:
        if not line:
            break
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
        raw.append(line.encode("latin-1"))
    return method, target, version, headers, raw


def _rebuild(method: str, target: str, version: str, raw: list[bytes], drop: set[str], add: list[str]) -> bytes:
    kept = [line for line in raw if line.split(b":", 1)[0].strip().lower().decode("latin-1") not in drop]
    lines = [f"{method} {target} {version}".encode("latin-1"), *kept, *(a.encode("latin-1") for a in add)]
    return b"\r\n".join(lines) + b"\r\n\r\n"


def _strip_token(query: str) -> tuple[str, str]:
    """(the query without ``sandloop_token``, the token) of ``?a=b&sandloop_token=...``."""
    pairs = parse_qsl(query.lstrip("?"), keep_blank_values=True)
    token = next((v for k, v in pairs if k == TOKEN_PARAM), "")
    rest = [(k, v) for k, v in pairs if k != TOKEN_PARAM]
    return (("?" + urlencode(rest)) if rest else ""), token


class Preview:
    def __init__(self, api: Api, e2b: E2B | None, domain: str = "localhost") -> None:
        self.api, self.e2b, self.domain = api, e2b, domain.lower().strip(".")

    # -- which requests are previews -----------------------------------------------------------
    def match(self, head: bytes) -> Target | None:
        parsed = _parse_head(head)
        if parsed is None:
            return None
        method, target, version, headers, raw = parsed
        host = headers.get("host", "").lower()
        by_host = HOST_FORM.match(host)
        if by_host and by_host.group(3) == self.domain and int(by_host.group(1)) not in E2B_PORTS:
            path, _, query = target.partition("?")
            query, token = _strip_token(query)
            rebuilt = _rebuild(method, path + query, version, raw, set(), []) if token else head
            found = Target(by_host.group(2), int(by_host.group(1)), rebuilt, headers, False, token)
            if token:
                found.add.append(f"Set-Cookie: {COOKIE}={token}; Path=/; HttpOnly; SameSite=Lax")
            return found
        by_path = PATH_FORM.match(target)
        if by_path:
            session_id, port = by_path.group(1), int(by_path.group(2))
            query, token = _strip_token(by_path.group(4) or "")
            inner = (by_path.group(3) or "/") + query
            rebuilt = _rebuild(method, inner, version, raw, {"connection"}, ["Connection: close"])
            if headers.get("upgrade"):  # a WebSocket: the connection is the upgrade's, kept open
                rebuilt = _rebuild(method, inner, version, raw, set(), [])
            found = Target(session_id, port, rebuilt, headers, True, token)
            # On the API's own origin: the page is its own opaque origin, or its scripts could
            # read the playground's token and call the API as its user.
            found.add.append(f"Content-Security-Policy: {PATH_FORM_CSP}")
            if token:
                cookie_path = f"/sandboxes/{session_id}/ports/{port}"
                found.add.append(f"Set-Cookie: {COOKIE}={token}; Path={cookie_path}; HttpOnly; SameSite=Lax")
            return found
        return None

    # -- access --------------------------------------------------------------------------------
    def _bearer(self, target: Target) -> str:
        auth = target.headers.get("authorization", "")
        if auth.lower().startswith("bearer "):
            return auth[7:].strip()
        if target.query_token:
            return target.query_token
        for part in target.headers.get("cookie", "").split(";"):
            name, _, value = part.strip().partition("=")
            if name == COOKIE:
                return value
        return ""

    def _authorize(self, target: Target) -> None:
        """Raises ``Refused`` unless this request may reach the sandbox (and wakes a paused E2B one)."""
        sid = target.session_id
        box = self.e2b.registry.get(sid) if self.e2b is not None else None
        secret = self._bearer(target)
        token = self.api.tokens.verify(secret) if secret else None
        owner = self.api.tokens.owner_of(sid)
        if token is not None and owner == token.id:
            pass
        elif box is not None and self.e2b is not None:
            traffic = target.headers.get("e2b-traffic-access-token", "")
            if not (
                self.e2b.registry.public_traffic(sid) or self.e2b.registry.check_access(sid, None, traffic or None)
            ):
                raise Refused(
                    403,
                    f"sandbox {sid} takes no public traffic: send its traffic access token "
                    "(e2b-traffic-access-token: the sandbox's trafficAccessToken)",
                )
        elif owner is None:
            raise Refused(404, f"no sandbox {sid}")
        else:
            why = "the token does not own it" if token is not None else "send a token that owns it"
            raise Refused(
                401 if token is None else 404,
                f"sandbox {sid}: {why} (Authorization: Bearer <token>, or ?{TOKEN_PARAM}=<token> once in a browser)",
            )
        if box is not None and self.e2b is not None:
            from sandloop.server.e2b.service import E2BError

            try:
                self.e2b.for_traffic(sid)  # gone or past its timeout: refused; paused: woken (auto-resume)
            except E2BError as exc:
                raise Refused(502 if exc.status in (404, 502) else exc.status, exc.message) from None

    def open(self, target: Target) -> Channel:
        """The connection to the port, authorized (blocking: run it on a thread)."""
        self._authorize(target)
        reach = live_reach(target.session_id)
        try:
            if reach is None:
                session = self.api.root.attach_session(target.session_id, resume=False)
                try:
                    reach = session._reach()
                finally:
                    session.let_go()
            return reach.connect(target.port, first=target.head)  # the head behind the open: one round trip
        except PortClosed as exc:
            raise Refused(502, f"sandbox {target.session_id}: {exc}: start a server on it first") from None
        except ReachError as exc:
            raise Refused(503, f"sandbox {target.session_id}: {exc}") from None
        except SandboxError as exc:
            raise Refused(502, f"sandbox {target.session_id} cannot be reached: {exc}") from None


def refusal(status: int, message: str) -> bytes:
    reason = {401: "Unauthorized", 403: "Forbidden", 404: "Not Found", 502: "Bad Gateway", 503: "Service Unavailable"}
    body = json.dumps({"code": status, "message": message}).encode() + b"\n"
    head = (
        f"HTTP/1.1 {status} {reason.get(status, 'Error')}\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n"
    )
    return head.encode() + b"\r\n" + body


class Relay(asyncio.Protocol):
    """One client connection handed over to a sandbox's port: opened on a thread, then bytes both
    ways (the agent's reader thread wakes this loop), idle-timed and capped."""

    def __init__(
        self,
        preview: Preview,
        target: Target,
        transport: asyncio.Transport,
        rest: bytes,
        closed: Callable[[], None] | None = None,
    ) -> None:
        self.preview, self.target, self.transport = preview, target, transport
        self._on_closed = closed
        self.loop = asyncio.get_running_loop()
        self.channel: Channel | None = None
        self.early = bytearray(rest)
        self.bytes = 0
        self.last = time.monotonic()
        self.closed = False
        self.writable = True
        self._pull_pending = False
        transport.set_protocol(self)
        transport.pause_reading()
        self.loop.create_task(self._open())
        self._idle = self.loop.call_later(IDLE, self._check_idle)

    async def _open(self) -> None:
        try:
            channel = await run_in_threadpool(self.preview.open, self.target)
        except Refused as exc:
            self._refuse(exc.status, exc.message)
            return
        except Exception as exc:  # noqa: BLE001 - the client gets an answer, the log the cause
            log.exception("preview of %s:%d failed", self.target.session_id, self.target.port)
            self._refuse(502, f"the preview failed ({type(exc).__name__}); the server's log has the details")
            return
        if self.closed:
            channel.close()
            return
        self.channel = channel

        def ready() -> None:  # on the agent's reader thread
            self.loop.call_soon_threadsafe(self._pull)

        channel.on_ready = ready
        self._send(bytes(self.early))  # (the head went with the open)
        self.early.clear()
        self.transport.resume_reading()
        self._pull()

    def _refuse(self, status: int, message: str) -> None:
        if not self.transport.is_closing():
            self.transport.write(refusal(status, message))
        self._close()

    # -- client -> sandbox -----------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        self.last = time.monotonic()
        if self.channel is None:
            self.early += data
            if len(self.early) > BUFFER:
                self.transport.pause_reading()
            return
        self._send(data)

    def _send(self, data: bytes) -> None:
        if not data or self.channel is None:
            return
        self.bytes += len(data)
        if self.bytes > MAX_BYTES:
            self._close()
            return
        try:
            self.channel.send(data)
        except ReachError:
            self._close()

    def eof_received(self) -> bool:
        if self.channel is not None:
            with contextlib.suppress(ReachError):
                self.channel.end_input()
        return True  # keep the write side open for the answer

    # -- sandbox -> client -----------------------------------------------------------------------
    def _pull(self) -> None:
        if self.closed or self.channel is None or not self.writable:
            return
        data, ended = self.channel.take()
        if data:
            self.last = time.monotonic()
            self.bytes += len(data)
            if self.target.add and data.startswith(b"HTTP/1."):  # the answer's head: after its status line
                lines = "".join(f"\r\n{line}" for line in self.target.add)
                data = data.replace(b"\r\n", lines.encode("latin-1") + b"\r\n", 1)
                self.target.add = []
            self.transport.write(data)
        if ended or self.bytes > MAX_BYTES:
            self._close()

    def pause_writing(self) -> None:
        self.writable = False

    def resume_writing(self) -> None:
        self.writable = True
        self._pull()

    # -- end --------------------------------------------------------------------------------------
    def _check_idle(self) -> None:
        if self.closed:
            return
        quiet = time.monotonic() - self.last
        if quiet >= IDLE:
            self._close()
        else:
            self._idle = self.loop.call_later(IDLE - quiet, self._check_idle)

    def connection_lost(self, exc: Exception | None) -> None:
        self._close()

    def _close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self._idle.cancel()
        if self.channel is not None:
            self.channel.on_ready = None
            self.channel.close()
        if not self.transport.is_closing():
            self.transport.close()
        if self._on_closed is not None:  # the server's own bookkeeping of the connection
            with contextlib.suppress(Exception):
                self._on_closed()

"""Preview URLs: HTTP and WebSocket traffic to a port a sandbox's code listens on, through the
server's own port.

Sandbox content is never served on the API's origin (issue 52 finding 1: a page served by path
on the API's origin read the playground's token, three ways past a CSP header patched into its
answer). Two forms, both read from a request's head before the API sees it (``lifecycle.py``'s
protocol hands such a connection over whole):

- by host, as E2B's ``get_host``: ``<port>-<sandbox id>.<domain>`` (default domain
  ``localhost``: browsers resolve every ``*.localhost`` to loopback), any path: an origin of its
  own per sandbox and port. This is the only form that reaches a sandbox;
- by path, ``/sandboxes/<id>/ports/<port>/<rest>``: answered with a redirect to the host form
  (the query kept), never relayed.

A relayed connection (``relay.py``) serves exactly one preview target, and both directions are
parsed as HTTP with h11 (one ``h11.Connection`` facing the client, one facing the sandbox), never patched as
bytes: each request is re-serialized with the owner's credentials taken out (``Authorization``
and ``X-API-Key`` holding a sandloop key, a ``sandloop_preview`` cookie, ``e2b-traffic-access-token``,
``?sandloop_token=``: issue 52 finding 2), a request for another host on the same connection is
refused (421), and after a WebSocket's (or any) ``101`` the bytes go through as they are.

Access: a token that owns the session (``Authorization: Bearer``), or, in a browser,
``?sandloop_token=`` once: that visit is answered with a redirect (``Referrer-Policy:
no-referrer``) to the same page on the preview's *keyed origin*,
``<port>-<id>.k<key>.<domain>``, whose key is good for that sandbox and port only (an HMAC under
this server's secret naming the token: never the token itself, void once the token is revoked
or the server restarts). The key rides in the host name, not a cookie, because a preview is
often shown in a frame of another site (the playground), where browsers neither set nor send
third-party cookies (Chromium's incognito contexts: measured, the frame got 401). The sandbox
may see its own key: it opens only that same port of that same sandbox. Or the E2B sandbox's
traffic access token (``e2b-traffic-access-token``); an E2B sandbox is public unless it was
created with ``network.allow_public_traffic = false``, as E2B's are. A paused E2B sandbox with
auto-resume wakes on its first request.

Bounded: ``MAX_CONNECTIONS`` per sandbox (the agent's channels), of which visitors without the
owner's token (a public E2B sandbox's) hold at most ``ANONYMOUS_SHARE`` and open at most
``ANONYMOUS_OPENS`` a second (burst ``ANONYMOUS_BURST``); ``IDLE`` seconds without a byte either
way; ``MAX_BYTES`` per connection; a relay whose token is revoked ends within ``RECHECK``
seconds (revocation may come from another process: ``sandloop tokens revoke``). The open never
waits on a thread for the agent, and the client's reading pauses while its channel's window is
full (issue 52 finding 3: one 17 MiB upload into a server that read nothing froze the whole
server for 60 s). A closed port answers 502 with a body that says so.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
import secrets
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING
from urllib.parse import parse_qsl, urlencode

import h11

from sandloop.contract import SandboxError
from sandloop.runtime.reach.mux import MAX_CHANNELS, Reach, ReachError
from sandloop.sessions.session_reach import live_reach

if TYPE_CHECKING:
    from sandloop.server.context import Api
    from sandloop.server.e2b.service import E2B

log = logging.getLogger(__name__)
#: envd's and the code interpreter's ports: E2B's SDK sends its own calls to these by host; they
#: stay the API's (``E2BSplit``).
E2B_PORTS = (49983, 49999)
HOST_FORM = re.compile(r"^(\d{1,5})-([A-Za-z0-9_-]{1,64})\.(.+?)(:\d+)?$")
KEYED_FORM = re.compile(r"^(\d{1,5})-([A-Za-z0-9_-]{1,64})\.k([0-9a-f]{12})([0-9a-f]{24})\.(.+?)(:\d+)?$")
PATH_FORM = re.compile(r"^/sandboxes/([A-Za-z0-9_-]{1,64})/ports/(\d{1,5})(/[^?]*)?(\?.*)?$")
#: The longest preview request head (h11's own limit for the API's: a longer one is the API's to refuse).
MAX_HEAD = 16 * 1024
#: The longest answer head a sandbox's server may send.
MAX_ANSWER_HEAD = 64 * 1024
IDLE = 300.0
MAX_BYTES = 1 << 30
MAX_CONNECTIONS = MAX_CHANNELS
ANONYMOUS_SHARE = 16
ANONYMOUS_OPENS = 20.0
ANONYMOUS_BURST = 40.0
RECHECK = 5.0
TOKEN_PARAM = "sandloop_token"
COOKIE = "sandloop_preview"
#: Headers whose value, when it is a sandloop key, never reaches a sandbox.
_KEY_HEADERS = {b"authorization", b"x-api-key"}
_SANDLOOP_KEY = re.compile(rb"(?:^|\s)e2b_[0-9a-f]{64}\s*$")


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
    host: str = ""
    query_token: str = ""
    #: The keyed origin's parts: the token id's hex and the HMAC.
    key: tuple[str, str] = ("", "")
    #: An answer given without reaching the sandbox (the path form's redirect).
    answer: bytes = b""


@dataclass
class Grant:
    """Who a relay serves: the owner's token (its id), or an anonymous visitor of a public E2B
    sandbox; and, for a token given once in the query, the redirect to the keyed origin."""

    reach: Reach | None
    token_id: str | None
    answer: bytes = b""
    extra: list[tuple[bytes, bytes]] = field(default_factory=list)


def _parse_head(head: bytes) -> tuple[str, str, str, dict[str, str]] | None:
    """(method, target, version, headers lower-cased) of a request head (only to route it: the
    relay parses it again with h11)."""
    try:
        text = head.decode("latin-1")
        lines = re.split(r"\r?\n", text)
        method, target, version = lines[0].split(" ")
    except ValueError:
        return None
    headers: dict[str, str] = {}
    for line in lines[1:]:
        if not line:
            break
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return method, target, version, headers


def _strip_token(query: str) -> tuple[str, str]:
    """(the query without ``sandloop_token``, the token) of ``?a=b&sandloop_token=...``."""
    pairs = parse_qsl(query.lstrip("?"), keep_blank_values=True)
    token = next((v for k, v in pairs if k == TOKEN_PARAM), "")
    rest = [(k, v) for k, v in pairs if k != TOKEN_PARAM]
    return (("?" + urlencode(rest)) if rest else ""), token


def answer(status: int, reason: str, headers: list[tuple[str, str]], body: bytes = b"") -> bytes:
    """A whole answer that closes its connection (written by us, never from a sandbox's bytes)."""
    lines = [f"HTTP/1.1 {status} {reason}", *(f"{k}: {v}" for k, v in headers)]
    lines += [f"Content-Length: {len(body)}", "Connection: close", "Cache-Control: no-store"]
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1") + body


def refusal(status: int, message: str) -> bytes:
    reason = {
        400: "Bad Request",
        401: "Unauthorized",
        403: "Forbidden",
        404: "Not Found",
        421: "Misdirected Request",
        429: "Too Many Requests",
        502: "Bad Gateway",
        503: "Service Unavailable",
    }
    body = json.dumps({"code": status, "message": message}).encode() + b"\n"
    return answer(status, reason.get(status, "Error"), [("Content-Type", "application/json")], body)


def clean_request(request: h11.Request) -> h11.Request:
    """``request`` without the owner's credentials: a sandloop key in ``Authorization`` or
    ``X-API-Key``, the preview cookie, E2B's traffic access token, ``?sandloop_token=``."""
    headers = []
    for name, value in request.headers:
        if name == b"e2b-traffic-access-token":
            continue
        if name in _KEY_HEADERS and _SANDLOOP_KEY.search(value):
            continue
        if name == b"cookie":
            kept = [p for p in value.split(b";") if p.strip().partition(b"=")[0] != COOKIE.encode()]
            value = b";".join(kept).strip()
            if not value:
                continue
        headers.append((name, value))
    path, _, query = request.target.partition(b"?")
    if TOKEN_PARAM.encode() in query:
        rest, _ = _strip_token(query.decode("latin-1"))
        path += rest.encode("latin-1")
    elif query:
        path += b"?" + query
    return h11.Request(method=request.method, target=path, headers=headers, http_version=request.http_version)


class Preview:
    def __init__(self, api: Api, e2b: E2B | None, domain: str = "localhost") -> None:
        self.api, self.e2b, self.domain = api, e2b, domain.lower().strip(".")
        #: "https" when the server is served with TLS (``lifecycle.serve_forever``): the path
        #: form's redirect keeps the scheme.
        self.scheme = "http"
        #: The key of keyed origins: this process's, so a restart voids them all.
        self._secret = secrets.token_bytes(32)
        self._opens: dict[str, tuple[float, float]] = {}  # sandbox -> (anonymous opens allowed, when)
        self._opens_lock = threading.Lock()

    # -- which requests are previews -----------------------------------------------------------
    def match(self, head: bytes) -> Target | None:
        parsed = _parse_head(head)
        if parsed is None:
            return None
        method, target, version, headers = parsed
        host = headers.get("host", "").lower()
        keyed = KEYED_FORM.match(host)
        if keyed and keyed.group(5) == self.domain and int(keyed.group(1)) not in E2B_PORTS:
            _, _, query = target.partition("?")
            _, token = _strip_token(query)
            found = Target(keyed.group(2), int(keyed.group(1)), head, headers, host, token)
            found.key = (keyed.group(3), keyed.group(4))
            return found
        by_host = HOST_FORM.match(host)
        if by_host and by_host.group(3) == self.domain and int(by_host.group(1)) not in E2B_PORTS:
            _, _, query = target.partition("?")
            _, token = _strip_token(query)
            return Target(by_host.group(2), int(by_host.group(1)), head, headers, host, token)
        by_path = PATH_FORM.match(target)
        if by_path:
            session_id, port = by_path.group(1), int(by_path.group(2))
            server_port = re.search(r":\d+$", host)
            location = (
                f"{self.scheme}://{port}-{session_id}.{self.domain}{server_port.group(0) if server_port else ''}"
                f"{by_path.group(3) or '/'}{by_path.group(4) or ''}"
            )
            found = Target(session_id, port, head, headers, host)
            found.answer = answer(
                307,
                "Temporary Redirect",
                [("Location", location), ("Referrer-Policy", "no-referrer"), ("Content-Type", "text/plain")],
                f"previews are served on their own origin: {location.split('?')[0]}\n".encode(),
            )
            return found
        return None

    # -- access --------------------------------------------------------------------------------
    def preview_key(self, token_id: str, session_id: str, port: int) -> str:
        """The keyed origin's label: good for this sandbox and port only, while the token lives."""
        mac = hmac.new(self._secret, f"{token_id}\0{session_id}\0{port}".encode(), hashlib.sha256).hexdigest()
        return f"k{token_id.removeprefix('tok_')}{mac[:24]}"

    def _key_token(self, target: Target) -> str | None:
        """The token id a valid keyed origin of this target names."""
        hexid, mac = target.key
        if not hexid:
            return None
        token_id = "tok_" + hexid
        wanted = self.preview_key(token_id, target.session_id, target.port)
        return token_id if hmac.compare_digest(f"k{hexid}{mac}", wanted) else None

    def _token_id(self, target: Target) -> tuple[str | None, bool]:
        """(the id of a live token the request carries, whether it carried any credential). A
        bearer that is not a sandloop key may be the app's own: the keyed origin still counts."""
        auth = target.headers.get("authorization", "")
        carried = False
        for secret in (auth[7:].strip() if auth.lower().startswith("bearer ") else "", target.query_token):
            if secret:
                carried = True
                token = self.api.tokens.verify(secret)
                if token is not None:
                    return token.id, True
        keyed = self._key_token(target)
        if keyed is not None and self.api.tokens.get(keyed) is not None:
            return keyed, True
        return None, carried or bool(target.key[0])

    def token_alive(self, token_id: str) -> bool:
        return self.api.tokens.get(token_id) is not None

    def _metered(self, session_id: str) -> None:
        """An anonymous open of this sandbox's ports, or 429 past its rate."""
        now = time.monotonic()
        with self._opens_lock:
            allowed, when = self._opens.get(session_id, (ANONYMOUS_BURST, now))
            allowed = min(ANONYMOUS_BURST, allowed + (now - when) * ANONYMOUS_OPENS)
            if allowed < 1:
                raise Refused(
                    429, f"sandbox {session_id}: too many connections opened without its token; try again later"
                )
            self._opens[session_id] = (allowed - 1, now)
            if len(self._opens) > 10_000:  # forget the quiet ones
                for sid, (_, seen) in list(self._opens.items()):
                    if now - seen > 60:
                        del self._opens[sid]

    def authorize(self, target: Target) -> Grant:
        """Who this request is, and the sandbox's reach (blocking: run it on a thread).

        Raises:
            Refused: not allowed, or the sandbox cannot be reached.
        """
        sid = target.session_id
        box = self.e2b.registry.get(sid) if self.e2b is not None else None
        token_id, carried = self._token_id(target)
        owner = self.api.tokens.owner_of(sid)
        if token_id is not None and owner == token_id:
            grant = Grant(None, token_id)
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
            grant = Grant(None, None)
            if not traffic:
                self._metered(sid)
        elif owner is None:
            raise Refused(404, f"no sandbox {sid}")
        else:
            why = "the token does not own it" if token_id is not None else "send a token that owns it"
            raise Refused(
                401 if token_id is None and not carried else 404 if token_id is not None else 401,
                f"sandbox {sid}: {why} (Authorization: Bearer <token>, or ?{TOKEN_PARAM}=<token> once in a browser)",
            )
        if target.query_token:
            if grant.token_id is None:
                raise Refused(401, f"sandbox {sid}: the {TOKEN_PARAM} given does not own it")
            grant.answer = self._to_keyed(target, grant.token_id)
            return grant
        if box is not None and self.e2b is not None:
            from sandloop.server.e2b.service import E2BError

            try:
                self.e2b.for_traffic(sid)  # gone or past its timeout: refused; paused: woken (auto-resume)
            except E2BError as exc:
                raise Refused(502 if exc.status in (404, 502) else exc.status, exc.message) from None
        grant.reach = self._reach(sid)
        return grant

    def _to_keyed(self, target: Target, token_id: str) -> bytes:
        """A visit with the token in its query: a redirect to the same page on the preview's keyed
        origin, without the token (``no-referrer``: it leaves no trace in the next page's Referer)."""
        parsed = _parse_head(target.head)
        path, _, query = (parsed[1] if parsed else "/").partition("?")
        rest, _ = _strip_token(query)
        server_port = re.search(r":\d+$", target.host)
        origin = (
            f"{self.scheme}://{target.port}-{target.session_id}."
            f"{self.preview_key(token_id, target.session_id, target.port)}.{self.domain}"
            f"{server_port.group(0) if server_port else ''}"
        )
        return answer(
            303 if parsed and parsed[0] not in ("GET", "HEAD") else 307,
            "Temporary Redirect",
            [("Location", origin + path + rest), ("Referrer-Policy", "no-referrer"), ("Content-Type", "text/plain")],
            b"this preview's own origin, without the token\n",
        )

    def _reach(self, session_id: str) -> Reach:
        reach = live_reach(session_id)
        if reach is not None:
            return reach
        try:
            session = self.api.root.attach_session(session_id, resume=False)
            try:
                return session._reach()
            finally:
                session.let_go()
        except ReachError as exc:
            raise Refused(503, f"sandbox {session_id}: {exc}") from None
        except SandboxError as exc:
            raise Refused(502, f"sandbox {session_id} cannot be reached: {exc}") from None

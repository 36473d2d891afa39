"""The first thing every HTTP request meets (ASGI middleware, outside the routes).

In this order, before any route, dependency or JSON parser sees the request:

1. the body cap for the route: a declared ``Content-Length`` over it is refused (413) unread; a
   body without one (chunked) is counted while it streams in and refused the moment it passes
   the cap, so nothing larger than the cap is ever held in memory;
2. authentication of protected paths from the ``Authorization`` header alone: a request without
   a valid token is refused (401) before a byte of its body is read; the token is handed on in
   ``scope["state"]["token"]``;
3. the body budget (``BodyBudget``): a request that declares a body of more than 64 KiB takes a
   place for it before a byte is read (one without a declared length, once 64 KiB have come in):
   at most as many at once per caller as its token's ``max_concurrent`` (a sandbox's own traffic:
   4), and at most ``BodyBudget.total`` bytes of such bodies across all callers; past either it
   is refused (429 / 503 with ``Retry-After``) unread.
   Before, bodies were read and only then counted against the token: 24 concurrent 16 MiB uploads
   from a 4-at-once token took the server from 75 to 835 MiB;
4. security headers on every response (CSP, ``X-Frame-Options``, ``nosniff``, no referrer).

Used by the HTTP API and by MCP's streamable HTTP transport, with the same token store.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sandloop.server.tokens import Token, TokenStore

SECURITY_HEADERS = [
    # Scripts, styles and fonts only from this origin (the playground and /docs serve their own
    # assets); inline styles are allowed for the editor and Swagger UI's generated markup. Frames
    # may show other origins: the playground's port preview is served on its own origin.
    (
        b"content-security-policy",
        b"default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data: blob:; "
        b"connect-src 'self'; frame-src 'self' http: https:; frame-ancestors 'none'; base-uri 'none'; "
        b"form-action 'self'",
    ),
    (b"x-frame-options", b"DENY"),
    (b"x-content-type-options", b"nosniff"),
    (b"referrer-policy", b"no-referrer"),
]


class _BodyTooLarge(Exception):
    pass


#: A body up to this size is not budgeted (headers, small JSON): the per-route cap bounds it.
SMALL_BODY = 64 * 1024


class BodyBudget:
    """Places for large request bodies: per caller (``limit`` at once) and in total (bytes).
    Used from the event loop's thread only (ASGI middleware), so no lock is needed."""

    def __init__(self, total: int = 256 * 1024 * 1024) -> None:
        self.total = total
        self.used = 0
        self._by_caller: dict[str, int] = {}

    def take(self, caller: str, limit: int, size: int) -> str | None:
        """Take a place for ``size`` bytes, or say why not (None: taken)."""
        if self._by_caller.get(caller, 0) >= limit:
            return f"this token allows {limit} uploads (bodies over {SMALL_BODY // 1024} KiB) at once"
        if self.used + size > self.total:
            return "the server holds as many request bodies as it may; retry shortly"
        self._by_caller[caller] = self._by_caller.get(caller, 0) + 1
        self.used += size
        return None

    def give_back(self, caller: str, size: int) -> None:
        self.used -= size
        left = self._by_caller.get(caller, 0) - 1
        if left > 0:
            self._by_caller[caller] = left
        else:
            self._by_caller.pop(caller, None)


#: Large bodies at once for a caller that is not a token (a sandbox's own envd traffic).
DEFAULT_BODIES_AT_ONCE = 4


def _json(
    status: int, code: str, message: str, headers: Sequence[tuple[bytes, bytes]] = (), *, numeric: bool = False
) -> list[Message]:
    body = json.dumps({"code": status if numeric else code, "message": message}).encode()
    return [
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                *headers,
                *SECURITY_HEADERS,
            ],
        },
        {"type": "http.response.body", "body": body},
    ]


def bearer_token(tokens: TokenStore, authorization: str, api_key: str = "") -> Token | str:
    """The token a header names (``Authorization: Bearer``, or E2B's ``X-API-Key``), or the
    reason it is refused."""
    if api_key and not authorization:
        if not api_key.startswith("e2b_") or not all(c in "0123456789abcdef" for c in api_key[4:]) or len(api_key) < 8:
            return "malformed API key: keys look like e2b_ followed by hex (`sandloop tokens create NAME`)"
        token = tokens.verify(api_key)
        return token if token is not None else "unknown or revoked API key"
    scheme, _, secret = authorization.partition(" ")
    if scheme.lower() != "bearer" or not secret.strip():
        return "send Authorization: Bearer <token> (create one with `sandloop tokens create NAME`)"
    token = tokens.verify(secret.strip())
    return token if token is not None else "unknown or revoked token"


class RequestGuard:
    """``RequestGuard(app, tokens, body_cap=..., protected=...)``.

    ``body_cap(method, path)`` gives the largest body a route accepts; ``protected(path)`` says
    whether it needs a token. ``authenticate(headers, scope)`` replaces the token check: it returns
    what the routes get in ``scope["state"]["token"]``, or the reason to refuse (a string).
    ``numeric_codes``: a refusal's ``code`` is its HTTP status (E2B's envd says ``{"code": 401}``).
    """

    def __init__(
        self,
        app: ASGIApp,
        tokens: TokenStore,
        *,
        body_cap: Callable[[str, str], int],
        protected: Callable[[str], bool],
        on_reject: Callable[[str], Any] | None = None,
        authenticate: Callable[[dict[bytes, bytes], Scope], object] | None = None,
        bodies: BodyBudget | None = None,
        numeric_codes: bool = False,
    ) -> None:
        self.numeric_codes = numeric_codes
        self.app, self.tokens, self.body_cap, self.protected = app, tokens, body_cap, protected
        self.bodies = bodies or BodyBudget()
        self.authenticate = authenticate or (
            lambda headers, scope: bearer_token(
                self.tokens,
                headers.get(b"authorization", b"").decode("latin-1"),
                headers.get(b"x-api-key", b"").decode("latin-1"),
            )
        )
        self.on_reject = on_reject or (lambda code: None)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        method, path = scope["method"], scope["path"]
        headers = {k.lower(): v for k, v in scope["headers"]}
        cap = self.body_cap(method, path)

        async def refuse(status: int, code: str, message: str, extra: Sequence[tuple[bytes, bytes]] = ()) -> None:
            self.on_reject(code)
            for message_ in _json(status, code, message, extra, numeric=self.numeric_codes):
                await send(message_)

        declared = headers.get(b"content-length")
        if declared is not None:
            if not declared.isdigit():
                await refuse(400, "invalid_request", "Content-Length must be a number of bytes")
                return
            if int(declared) > cap:
                await refuse(413, "too_large", f"this route accepts bodies up to {cap} bytes")
                return
        found: object = None
        if self.protected(path):
            found = self.authenticate(headers, scope)
            if isinstance(found, str):
                await refuse(401, "unauthorized", found, [(b"www-authenticate", b"Bearer")])
                return
            scope.setdefault("state", {})["token"] = found
        if isinstance(found, Token):
            caller, limit = f"token:{found.id}", found.max_concurrent
        else:
            caller, limit = f"other:{found!r}", DEFAULT_BODIES_AT_ONCE
        declared_size = int(declared) if declared is not None else 0
        if declared_size > SMALL_BODY:  # declared: its place is taken before a byte is read
            why = self.bodies.take(caller, limit, declared_size)
            if why is not None:
                await self._refuse_body(refuse, why)
                return
            try:
                await self._guarded(scope, receive, send, cap, refuse)
            finally:
                self.bodies.give_back(caller, declared_size)
            return
        # No declared length (chunked; a streaming RPC's small frames): a place is taken, for the
        # cap, only once more than SMALL_BODY has come in.
        await self._guarded(scope, receive, send, cap, refuse, lazy=(caller, limit))

    async def _refuse_body(self, refuse: Any, why: str) -> None:
        busy = why.startswith("the server")
        await refuse(503 if busy else 429, "busy" if busy else "too_many_concurrent", why, [(b"retry-after", b"1")])

    async def _guarded(
        self,
        scope: Scope,
        receive: Receive,
        send: Send,
        cap: int,
        refuse: Any,
        lazy: tuple[str, int] | None = None,
    ) -> None:
        received = 0
        started = rejected = placed = False

        async def counted_receive() -> Message:
            nonlocal received, rejected, placed
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if lazy is not None and not placed and received > SMALL_BODY:
                    why = self.bodies.take(lazy[0], lazy[1], cap)
                    if why is not None:
                        if not started:
                            await self._refuse_body(refuse, why)
                            rejected = True
                        raise _BodyTooLarge
                    placed = True
                if received > cap:
                    if not started:
                        # Answer now: the app turns a failed body read into its own 400, which
                        # is dropped below, as is everything else it sends after this.
                        await refuse(413, "too_large", f"this route accepts bodies up to {cap} bytes")
                        rejected = True
                    raise _BodyTooLarge
            return message

        async def send_with_headers(message: Message) -> None:
            nonlocal started
            if rejected:
                return
            if message["type"] == "http.response.start":
                started = True
                present = {k.lower() for k, _ in message.get("headers", [])}
                message = {
                    **message,
                    "headers": [*message.get("headers", []), *(h for h in SECURITY_HEADERS if h[0] not in present)],
                }
            await send(message)

        try:
            await self.app(scope, counted_receive, send_with_headers)
        except Exception:
            if not rejected:
                raise
        finally:
            if placed and lazy is not None:
                self.bodies.give_back(lazy[0], cap)

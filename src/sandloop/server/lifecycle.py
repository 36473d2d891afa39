"""Work a server must do when it stops, whatever ASGI app it serves.

uvicorn answers SIGTERM by running the app's lifespan shutdown and then re-raising the signal,
so code after ``uvicorn.run`` never runs: cleanup belongs in the lifespan (measured: a ``finally``
after ``uvicorn.run`` left the warm pool's containers behind).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TYPE_CHECKING

from starlette.concurrency import run_in_threadpool
from starlette.types import ASGIApp, Message, Receive, Scope, Send

if TYPE_CHECKING:
    from sandloop.server.preview import Preview


def at_shutdown(app: ASGIApp, cleanup: Callable[[], None]) -> ASGIApp:
    """``app``, with ``cleanup`` run (in a thread) when the server's lifespan shutdown begins."""

    async def wrapped(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "lifespan":
            await app(scope, receive, send)
            return

        async def receive_and_clean() -> Message:
            message = await receive()
            if message["type"] == "lifespan.shutdown":
                await run_in_threadpool(cleanup)
            return message

        await app(scope, receive_and_clean, send)

    return wrapped


#: Seconds a connection may take to send a whole request head (and a new one after its last
#: answer): past it, the connection is closed. uvicorn waits forever for a head that never ends
#: (measured: 200 half-sent unauthenticated requests held for 90 s and more).
HEAD_TIMEOUT_SECONDS = 30.0


def serve_forever(
    app: ASGIApp,
    host: str,
    port: int,
    head_timeout: float = HEAD_TIMEOUT_SECONDS,
    preview: Preview | None = None,
    tls: tuple[str, str] | None = None,
) -> None:
    """uvicorn on ``host:port``: its h11 protocol with a timeout for request heads, the process's
    descriptor limit raised (the egress proxy holds two per connection it relays)."""
    import uvicorn

    from sandloop.runtime.egress.host import raise_open_files

    raise_open_files()
    cert, key = tls or (None, None)
    if preview is not None and tls:
        preview.scheme = "https"
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level="info",
        http=http_protocol(head_timeout, preview),
        ssl_certfile=cert,
        ssl_keyfile=key,
    )


def http_protocol(seconds: float = HEAD_TIMEOUT_SECONDS, preview: Preview | None = None) -> type:
    """uvicorn's h11 protocol with a timeout for request heads and, given a ``preview``, its
    requests handed to the sandboxes they name."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    from sandloop.server.preview import MAX_HEAD
    from sandloop.server.relay import Relay

    class HeadTimeoutProtocol(H11Protocol):
        """uvicorn's h11 protocol; a request head not whole within ``seconds`` closes the connection."""

        _head_timer: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm()

        _head = b""

        def data_received(self, data: bytes) -> None:
            # (not while h11 holds part of a head: a pipelined request's first bytes were dropped
            # when the next packet looked like a preview's head, issue 52 finding 10)
            if (
                preview is not None
                and self.conn.their_state is h11.IDLE
                and not self._head_pending()
                and not self.conn.trailing_data[0]
            ):
                # at a request's start: a preview's head hands the connection over (server/preview.py)
                data, self._head = self._head + data, b""
                end = data.find(b"\r\n\r\n")
                if end < 0 and len(data) <= MAX_HEAD:
                    self._head = data  # the rest of the head is still to come
                    self._arm()
                    return
                target = preview.match(data[: end + 4]) if 0 <= end < MAX_HEAD else None  # past it: h11 refuses
                if target is not None:
                    self._disarm()
                    self._unset_keepalive_if_required()
                    Relay(preview, target, self.transport, data[end + 4 :], closed=lambda: self.connection_lost(None))
                    return
            super().data_received(data)
            if self.conn.their_state is h11.IDLE:  # a head begun and not yet whole
                self._arm()
            else:
                self._disarm()

        def _head_pending(self) -> bool:
            """An answer still being sent: what comes now is pipelined, h11's to queue."""
            return self.cycle is not None and not self.cycle.response_complete

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            if self._head_timer is None:
                self._head_timer = self.loop.call_later(seconds, self._expire)

        def _disarm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None

        def _expire(self) -> None:
            self._head_timer = None
            busy = self.cycle is not None and not self.cycle.response_complete
            if not busy and self.conn.their_state is h11.IDLE and not self.transport.is_closing():
                self.transport.close()

    return HeadTimeoutProtocol

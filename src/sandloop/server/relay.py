"""A preview's connection, once ``lifecycle.py``'s protocol handed it over (``preview.py`` says
which requests are previews and who may make them): one client connection relayed to one sandbox
port through the session's reach (``runtime/reach/``), both directions parsed with h11 and sent
again, the owner's credentials taken out of every request, paced by the channel's credit.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable

import h11
from starlette.concurrency import run_in_threadpool

from sandloop.runtime.reach.mux import WINDOW, Channel, PortClosed, ReachError
from sandloop.server.preview import (
    ANONYMOUS_SHARE,
    IDLE,
    MAX_ANSWER_HEAD,
    MAX_BYTES,
    MAX_HEAD,
    RECHECK,
    Preview,
    Refused,
    Target,
    clean_request,
    refusal,
)

log = logging.getLogger(__name__)


def _closes(response: h11.Response) -> bool:
    """Whether the server inside ends its connection after this answer."""
    words = b",".join(v for k, v in response.headers if k == b"connection").lower()
    return b"close" in words or (response.http_version == b"1.0" and b"keep-alive" not in words)


class Relay(asyncio.Protocol):
    """One client connection handed over to one sandbox port: authorized on a thread, opened
    without waiting on one, then requests and answers parsed and re-sent (bytes as they are
    after a ``101``), idle-timed, capped, and paced by the channel's window."""

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
        self.open = False  # the agent connected the port
        self.raw = False  # past a 101: bytes as they are
        self.down = h11.Connection(h11.SERVER, max_incomplete_event_size=MAX_HEAD)  # the client
        self.up = h11.Connection(h11.CLIENT, max_incomplete_event_size=MAX_ANSWER_HEAD)  # the sandbox
        self.answering = False  # an answer's head went to the client
        self.token_id: str | None = None
        self.bytes = 0
        self.last = time.monotonic()
        self.closed = False
        self.writable = True
        self._scheduled = False
        transport.set_protocol(self)
        transport.pause_reading()
        if target.answer:  # the path form: a redirect to the host form, nothing relayed
            transport.write(target.answer)
            self.closed = True
            transport.close()
            self._idle: asyncio.TimerHandle | None = None
            self._done()
            return
        self.down.receive_data(target.head + rest)
        self.loop.create_task(self._open())
        self._idle = self.loop.call_later(min(IDLE, RECHECK), self._check)

    async def _open(self) -> None:
        try:
            grant = await run_in_threadpool(self.preview.authorize, self.target)
            if self.closed:
                return
            if grant.answer:
                self.transport.write(grant.answer)
                self._close()
                return
            assert grant.reach is not None
            self.token_id = grant.token_id
            share = ANONYMOUS_SHARE if grant.token_id is None else None
            self.channel = grant.reach.begin_connect(self.target.port, on_ready=self._wake, share=share)
            self.channel.on_credit = self._wake
        except Refused as exc:
            self._refuse(exc.status, exc.message)
            return
        except ReachError as exc:
            self._refuse(503, f"sandbox {self.target.session_id}: {exc}")
            return
        except Exception as exc:  # noqa: BLE001 - the client gets an answer, the log the cause
            log.exception("preview of %s:%d failed", self.target.session_id, self.target.port)
            self._refuse(502, f"the preview failed ({type(exc).__name__}); the server's log has the details")
            return
        self._step()

    def _wake(self) -> None:  # on the agent's reader thread: output, an answer, or credit
        if not self._scheduled:
            self._scheduled = True
            with contextlib.suppress(RuntimeError):  # the loop closed: the server is stopping
                self.loop.call_soon_threadsafe(self._step)

    def _step(self) -> None:
        """Whatever can move now: the open's answer, then the sandbox's bytes, then the client's."""
        self._scheduled = False
        if self.closed or self.channel is None:
            return
        try:
            if not self.open and self.channel.answered:
                try:
                    self.channel.opened()
                except PortClosed as exc:
                    self._refuse(502, f"sandbox {self.target.session_id}: {exc}: start a server on it first")
                    return
                except ReachError as exc:
                    self._refuse(503, f"sandbox {self.target.session_id}: {exc}")
                    return
                self.open = True
            if self.open:
                self._from_sandbox()
            if not self.closed:
                self._from_client()  # before the open's answer too: the head goes behind the open
        except ReachError:
            self._close()

    # -- client -> sandbox -----------------------------------------------------------------------
    def data_received(self, data: bytes) -> None:
        self.last = time.monotonic()
        self.bytes += len(data)
        if self.bytes > MAX_BYTES:
            self._close()
            return
        if self.raw:
            self._offer(data)
            return
        self.down.receive_data(data)
        self._from_client()

    def eof_received(self) -> bool:
        if self.raw:
            if self.channel is not None:
                with contextlib.suppress(ReachError):
                    self.channel.end_input()
        else:
            self.down.receive_data(b"")
            self._from_client()
        return True  # keep the write side open for the answer

    def _offer(self, data: bytes) -> None:
        if not data or self.channel is None:
            return
        if not self.channel.offer(data):  # its window is full: the client waits for credit
            self.transport.pause_reading()

    def _from_client(self) -> None:
        """The client's requests, cleaned, to the sandbox, as far as the window allows."""
        if self.closed or self.channel is None:
            if len(self.down.trailing_data[0]) > WINDOW:
                self.transport.pause_reading()
            return
        if self.raw:  # (what came behind the upgrade went on at the switch)
            if self.channel.room and not self.transport.is_closing():
                self.transport.resume_reading()
            return
        while not self.raw and self.channel.room:
            try:
                event = self.down.next_event()
            except h11.RemoteProtocolError as exc:
                self._refuse(400, f"not a request this preview can relay: {exc}")
                return
            if event is h11.NEED_DATA:
                break
            if event is h11.PAUSED:  # the next request waits for this answer's end
                if len(self.down.trailing_data[0]) > WINDOW:
                    self.transport.pause_reading()
                return
            if isinstance(event, h11.Request):
                if self._host(event) != self.target.host:
                    self._refuse(421, "a relayed connection serves one preview: open a new connection for another")
                    return
                if self.token_id is not None and not self.preview.token_alive(self.token_id):
                    self._refuse(401, "the token that opened this preview was revoked")
                    return
                event = clean_request(event)
            if isinstance(event, h11.ConnectionClosed):
                self.channel.end_input()
                return
            assert isinstance(event, h11.Event)  # (NEED_DATA and PAUSED were handled above)
            try:
                out = self.up.send(event)
            except h11.LocalProtocolError as exc:
                self._refuse(400, f"not a request this preview can relay: {exc}")
                return
            if out:
                self._offer(out)
        if self.channel.room and not self.transport.is_closing():
            self.transport.resume_reading()

    @staticmethod
    def _host(request: h11.Request) -> str:
        return next((v.decode("latin-1").lower() for k, v in request.headers if k == b"host"), "")

    # -- sandbox -> client -----------------------------------------------------------------------
    def _from_sandbox(self) -> None:
        if self.closed or self.channel is None or not self.writable:
            return
        data, ended = self.channel.take()
        if data:
            self.last = time.monotonic()
            self.bytes += len(data)
        if self.raw:
            if data:
                self.transport.write(data)
            if ended or self.bytes > MAX_BYTES:
                self._close()
            return
        if data:  # (b"" is h11's end of the stream)
            self.up.receive_data(data)
        if ended:
            self.up.receive_data(b"")
        while not self.closed:
            try:
                event = self.up.next_event()
            except h11.RemoteProtocolError as exc:
                if not self.answering:
                    self._refuse(
                        502, f"the server on port {self.target.port} in the sandbox did not answer in HTTP ({exc})"
                    )
                else:
                    self._close()
                return
            if event is h11.NEED_DATA or event is h11.PAUSED:
                break
            if isinstance(event, h11.ConnectionClosed):
                self._close()
                return
            if isinstance(event, h11.Response | h11.InformationalResponse):
                # re-made: h11 speaks HTTP/1.1 to the client whatever the server inside spoke
                headers = list(event.headers)
                if isinstance(event, h11.Response) and _closes(event):  # the client is told it ends too
                    headers.append((b"connection", b"close"))
                event = type(event)(status_code=event.status_code, headers=headers, reason=event.reason)
            assert isinstance(event, h11.Event)
            try:
                out = self.down.send(event)
            except h11.LocalProtocolError as exc:
                if not self.answering or isinstance(event, h11.Response):
                    self._refuse(502, f"the server in the sandbox sent an answer that cannot be relayed ({exc})")
                else:
                    self._close()
                return
            self.answering = self.answering or isinstance(event, h11.Response)
            if out:
                self.transport.write(out)
            if self.up.their_state is h11.SWITCHED_PROTOCOL:  # a 101: bytes as they are from here
                self.raw = True
                rest = self.up.trailing_data[0]
                if rest:
                    self.transport.write(rest)
                self._offer(self.down.trailing_data[0])
                if ended:
                    self._close()
                return
            if isinstance(event, h11.EndOfMessage):
                self._next_cycle()
        if self.bytes > MAX_BYTES:
            self._close()

    def _next_cycle(self) -> None:
        """An answer ended: the next request on this connection, or its end."""
        self.answering = False
        if self.down.our_state is h11.MUST_CLOSE or self.up.their_state is h11.MUST_CLOSE:
            self._close()
            return
        if self.down.their_state is h11.DONE and self.up.our_state is h11.DONE:
            self.down.start_next_cycle()
            self.up.start_next_cycle()

    def pause_writing(self) -> None:
        self.writable = False

    def resume_writing(self) -> None:
        self.writable = True
        self._step()

    # -- end --------------------------------------------------------------------------------------
    def _refuse(self, status: int, message: str) -> None:
        if not self.transport.is_closing() and not self.answering:
            self.transport.write(refusal(status, message))
        self._close()

    def _check(self) -> None:
        """Every RECHECK seconds: the token still lives, the connection is not idle."""
        if self.closed:
            return
        if self.token_id is not None and not self.preview.token_alive(self.token_id):
            self._close()  # revoked (issue 52 finding 11)
            return
        quiet = time.monotonic() - self.last
        if quiet >= IDLE:
            self._close()
        else:
            self._idle = self.loop.call_later(min(RECHECK, IDLE - quiet), self._check)

    def connection_lost(self, exc: Exception | None) -> None:
        self._close()

    def _close(self) -> None:
        if self.closed:
            return
        self.closed = True
        if self._idle is not None:
            self._idle.cancel()
        if self.channel is not None:
            self.channel.on_ready = self.channel.on_credit = None
            self.channel.close()
        if not self.transport.is_closing():
            self.transport.close()
        self._done()

    def _done(self) -> None:
        if self._on_closed is not None:  # the server's own bookkeeping of the connection
            with contextlib.suppress(Exception):
                self._on_closed()

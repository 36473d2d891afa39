"""The host's end of a reach into a running sandbox: one agent (``agent.py``) started in it, many
channels over its one byte stream -- connections to the sandbox's own loopback ports, terminals.

Flow control is per channel, by credit (issue 52: one upload into a server that read nothing
froze the whole API for 60 s, because the relay waited on the event loop for the agent's one
buffer, and the agent stopped reading its stream for all channels while one was full):

- host -> sandbox: at most ``WINDOW`` bytes of a channel's input are in flight until the agent
  says (``CREDIT``) it handed them to the socket or terminal. ``Channel.send`` waits for credit
  (up to ``STALL`` seconds: a program that reads nothing); ``Channel.offer`` never waits and says
  whether the window is still open, for callers on an event loop (``on_credit`` wakes them);
- sandbox -> host: a connection's agent stops reading its socket once ``WINDOW`` bytes are not yet
  taken here, so the reader thread never waits for a slow client and one full channel never
  holds the others. A terminal nobody watches keeps its last ``BUFFER`` bytes, as a scrollback.

What the agent sends is untrusted (code in the sandbox can write to the agent's stream): a
frame longer than ``MAX_FRAME``, a payload that does not parse, or a connection's output past
its window ends the reach as a broken agent, never the server's memory or its reader thread. A
sandbox has at most ``MAX_CHANNELS`` open at once.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import struct
import threading
from collections.abc import Callable
from importlib import resources
from typing import Any

from sandloop.contract import SandboxError
from sandloop.runtime.base import ExecStream

log = logging.getLogger(__name__)

HEADER = struct.Struct(">BII")
TCP, PTY, DATA, EOF, CLOSE, RESIZE, SIGNAL, OPENED, REFUSED, EXIT, CREDIT = range(1, 12)
#: What starts the agent inside a sandbox: a short loader on the image's python that reads the
#: agent's source from its stdin (10 digits of length, then the source: ``AGENT_PRELUDE``, the
#: first bytes ``Reach`` sends), so the sandbox's process list shows one line, not the source.
AGENT_NAME = "sandloop-reach-agent"
#: The loader first makes the agent non-dumpable (``prctl(PR_SET_DUMPABLE, 0)``): its
#: ``/proc/<pid>/fd`` and ``mem`` are then root's, so the sandbox's code (its user, no
#: capabilities) can neither reopen the agent's stream to forge frames nor write its memory
#: (both were done on runc, reopening on gVisor too: issue 52 finding 4).
_LOADER = f"""# {AGENT_NAME}
import os
try:
    import ctypes
    ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0)
except Exception:
    pass
def take(n):
    got = b""
    while len(got) < n:
        chunk = os.read(0, n - len(got))
        if not chunk:
            raise SystemExit(0)
        got += chunk
    return got
exec(compile(take(int(take(10))), "{AGENT_NAME}", "exec"))
"""
AGENT_ARGV = ["python3", "-I", "-S", "-c", _LOADER]
_SOURCE = resources.files("sandloop.runtime.reach").joinpath("agent.py").read_bytes()
AGENT_PRELUDE = b"%010d" % len(_SOURCE) + _SOURCE
MAX_CHANNELS = 64
BUFFER = 4 * 1024 * 1024
#: Bytes of one channel in flight each way before the other end gives credit.
WINDOW = 256 * 1024
#: The longest frame the agent may send (its data frames are at most 64 KiB).
MAX_FRAME = 256 * 1024
STALL = 30.0
CREDIT_COUNT = struct.Struct(">I")
#: Frames queued for the agent at most (the channels' windows and their control frames).
MAX_QUEUED = MAX_CHANNELS * (WINDOW + MAX_FRAME)
#: Longest the agent takes to open a port or start a terminal.
OPEN_TIMEOUT = 15.0
FRAME_DATA = 64 * 1024


class ReachError(SandboxError):
    """The sandbox cannot be reached this way (nothing listens on the port, the agent is gone)."""


class PortClosed(ReachError):
    """Nothing listens on that port inside the sandbox."""


class _Broken(Exception):
    """What the agent sent breaks the protocol (a forged or corrupt stream)."""


class Channel:
    """One connection (or terminal) through the agent. Bytes arrive in order; ``b""`` at the end."""

    def __init__(self, reach: Reach, number: int) -> None:
        self.reach, self.number = reach, number
        self._chunks: collections.deque[bytes] = collections.deque()
        self._held = 0
        self._eof = False
        self._closed = False
        self._why = ""
        self._cond = threading.Condition()
        self._opened: dict[str, Any] | None = None
        self._refused: str | None = None
        #: Input sent and not yet credited by the agent; output taken and not yet credited to it.
        self._in_flight = 0
        self._credit_due = 0
        #: Called (on the agent's reader thread) whenever there is something to take.
        self.on_ready: Callable[[], None] | None = None
        #: Called (on the agent's reader thread) when the agent took input: ``offer`` may go on.
        self.on_credit: Callable[[], None] | None = None
        #: Opened within a share of the channels (``Reach.begin_connect``'s ``share``).
        self.shared = False

    # -- the reader thread's side (never waits: one channel cannot hold the others) ------------
    def _deliver(self, data: bytes) -> None:
        with self._cond:
            if self._closed:
                return
            if self.kind == PTY:  # a terminal nobody watches keeps its last BUFFER bytes, as a scrollback
                while self._chunks and self._held + len(data) > BUFFER:
                    self._held -= len(self._chunks.popleft())
            elif self._held + len(data) > WINDOW + MAX_FRAME:
                raise _Broken(f"channel {self.number} was sent {self._held + len(data)} bytes past its window")
            self._chunks.append(data)
            self._held += len(data)
            self._cond.notify_all()
        self._ready()

    def _credited(self, count: int) -> None:
        with self._cond:
            self._in_flight = max(0, self._in_flight - count)
            self._cond.notify_all()
        if self.on_credit is not None:
            with contextlib.suppress(Exception):
                self.on_credit()

    def _end(self, why: str = "") -> None:
        with self._cond:
            self._eof = True
            self._why = self._why or why
            self._cond.notify_all()
        self._ready()
        if self.on_credit is not None:  # a sender waiting for room learns that there is none
            with contextlib.suppress(Exception):
                self.on_credit()

    def _answer(self, opened: dict[str, Any] | None, refused: str | None) -> None:
        with self._cond:
            self._opened, self._refused = opened, refused
            self._cond.notify_all()
        self._ready()

    def _ready(self) -> None:
        if self.on_ready is not None:
            with contextlib.suppress(Exception):
                self.on_ready()

    @property
    def answered(self) -> bool:
        """The agent said whether the port or terminal opened (or the reach ended)."""
        with self._cond:
            return self._opened is not None or self._refused is not None or self._eof

    def opened(self) -> dict[str, Any]:
        """What the agent answered to the open, once ``answered``.

        Raises:
            PortClosed: nothing listens on the port.
            ReachError: refused otherwise, or the agent is gone.
        """
        with self._cond:
            if self._refused is not None:
                raise PortClosed(self._refused) if self.kind == TCP else ReachError(self._refused)
            if self._opened is None:
                raise ReachError(self._why or "the sandbox went away")
            return self._opened

    def _wait_open(self, timeout: float) -> dict[str, Any]:
        with self._cond:
            if not self._cond.wait_for(
                lambda: not (self._opened is None and self._refused is None) or self._eof, timeout
            ):
                raise ReachError(f"the sandbox did not answer within {timeout:.0f} s")
        return self.opened()

    kind = TCP

    # -- the user's side -----------------------------------------------------------------------
    def take(self) -> tuple[bytes, bool]:
        """What has arrived (without waiting) and whether the output has ended."""
        with self._cond:
            data = b"".join(self._chunks)
            self._chunks.clear()
            self._held = 0
            self._cond.notify_all()
            ended = self._eof and not self._chunks
            credit = 0
            if data and self.kind == TCP and not self._closed:
                self._credit_due += len(data)
                if self._credit_due >= WINDOW // 4:  # see agent.py: no stall below a quarter window
                    credit, self._credit_due = self._credit_due, 0
        if credit:
            self.reach._send_quietly(CREDIT, self.number, CREDIT_COUNT.pack(credit))
        return data, ended

    def recv(self, timeout: float | None = None) -> bytes:
        """The next bytes, waiting up to ``timeout`` (None: until some come); ``b""`` at the end.

        Raises:
            TimeoutError: nothing came in time.
        """
        with self._cond:
            if not self._cond.wait_for(lambda: self._chunks or self._eof, timeout):
                raise TimeoutError("nothing came from the sandbox in time")
        data, _ = self.take()
        return data

    @property
    def ended(self) -> bool:
        with self._cond:
            return self._eof and not self._chunks

    @property
    def why(self) -> str:
        return self._why

    def send(self, data: bytes, timeout: float = STALL) -> None:
        """Sends ``data``, waiting for credit when ``WINDOW`` bytes are in flight.

        Raises:
            ReachError: the channel is closed, the agent is gone, or the sandbox read none of
                its input for ``timeout`` seconds.
        """
        view = memoryview(data)
        while view:
            with self._cond:
                room = self._cond.wait_for(
                    lambda: self._in_flight < WINDOW or self._closed or not self.reach.alive, timeout
                )
                if self._closed or not self.reach.alive:
                    raise ReachError(self._why or "the channel is closed")
                if not room:
                    raise ReachError(f"the sandbox read none of its input for {timeout:.0f} s")
                count = min(len(view), FRAME_DATA, WINDOW - self._in_flight)
                self._in_flight += count
            self.reach._send(DATA, self.number, bytes(view[:count]))
            view = view[count:]

    def offer(self, data: bytes) -> bool:
        """Sends ``data`` now, never waiting (for a caller on an event loop); whether the window
        is still open. Once it says False, send no more until ``on_credit`` is called and
        ``room`` is True again.

        Raises:
            ReachError: the channel is closed or the agent is gone.
        """
        with self._cond:
            if self._closed or not self.reach.alive:
                raise ReachError(self._why or "the channel is closed")
            self._in_flight += len(data)
        view = memoryview(data)
        while view:
            self.reach._send(DATA, self.number, bytes(view[:FRAME_DATA]))
            view = view[FRAME_DATA:]
        return self.room

    @property
    def room(self) -> bool:
        """Whether input sent now would be within the window."""
        with self._cond:
            return self._in_flight < WINDOW

    def end_input(self) -> None:
        self.reach._send(EOF, self.number)

    def close(self) -> None:
        with self._cond:
            if self._closed:
                return
            self._closed = self._eof = True
            self._chunks.clear()
            self._cond.notify_all()
        self.reach._forget(self.number)


class Terminal(Channel):
    """A program on a terminal inside the sandbox: its output, its input, its size, its end."""

    kind = PTY

    def __init__(self, reach: Reach, number: int) -> None:
        super().__init__(reach, number)
        self.pid = 0
        self.exit_code: int | None = None

    def _exited(self, code: int) -> None:
        with self._cond:
            self.exit_code = code
            self._cond.notify_all()
        self._ready()

    def resize(self, cols: int, rows: int) -> None:
        self.reach._send(RESIZE, self.number, json.dumps({"cols": int(cols), "rows": int(rows)}).encode())

    def signal(self, number: int) -> None:
        self.reach._send(SIGNAL, self.number, str(int(number)).encode())

    def wait(self, timeout: float | None = None) -> int:
        """Its exit code (minus the signal that ended it) once it ended.

        Raises:
            TimeoutError: it still runs.
        """
        with self._cond:
            if not self._cond.wait_for(lambda: self.exit_code is not None or self._closed, timeout):
                raise TimeoutError(f"terminal {self.pid} still runs")
            if self.exit_code is None:
                raise ReachError(self._why or f"terminal {self.pid} was closed before it ended")
            return self.exit_code


class Reach:
    """One sandbox's agent and its channels, over a stream started with ``AGENT_ARGV``. ``alive``
    is False once its stream ended (the sandbox went, or the agent was killed); every channel has
    then ended."""

    def __init__(self, stream: ExecStream, max_channels: int = MAX_CHANNELS) -> None:
        self.stream = stream
        self.max_channels = max_channels
        self._channels: dict[int, Channel] = {}
        self._lock = threading.Lock()
        self._numbers = iter(range(1, 1 << 31))
        self._out: collections.deque[bytes] = collections.deque()
        self._out_held = 0
        self._out_cond = threading.Condition()
        self.alive = True
        self._out.append(AGENT_PRELUDE)  # the agent itself, read by AGENT_ARGV's loader
        self._reader = threading.Thread(target=self._read, name="reach-reader", daemon=True)
        self._writer = threading.Thread(target=self._write, name="reach-writer", daemon=True)
        self._reader.start()
        self._writer.start()

    # -- opening -------------------------------------------------------------------------------
    def connect(self, port: int, timeout: float = OPEN_TIMEOUT, first: bytes = b"") -> Channel:
        """A connection to ``port`` on the sandbox's loopback. ``first``: bytes sent on it at once,
        behind the request to connect (a request's head: no round trip to the agent between the
        two; dropped there if nothing listens).

        Raises:
            PortClosed: nothing listens there.
            ReachError: too many channels open, or the agent is gone.
        """
        channel = self.begin_connect(port, first)
        try:
            channel._wait_open(timeout)
        except BaseException:
            channel.close()
            raise
        return channel

    def begin_connect(
        self,
        port: int,
        first: bytes = b"",
        on_ready: Callable[[], None] | None = None,
        share: int | None = None,
    ) -> Channel:
        """``connect`` without waiting (for a caller on an event loop): the channel at once,
        ``on_ready`` called on the reader thread when the agent answers (``Channel.answered``,
        then ``Channel.opened()``) and whenever there is output. ``share``: the most channels
        opened with a share may hold at once (anonymous visitors' part of ``max_channels``).

        Raises:
            ReachError: too many channels open (or the share's), or the agent is gone.
        """
        if not 1 <= int(port) <= 65535:
            raise ReachError(f"port must be 1-65535, got {port}")
        channel = self._made(Channel, share)
        channel.on_ready = on_ready
        try:
            self._send(TCP, channel.number, str(int(port)).encode())
            if first:
                channel.offer(first)
        except BaseException:
            channel.close()
            raise
        return channel

    def terminal(
        self,
        cols: int = 80,
        rows: int = 24,
        cmd: list[str] | None = None,
        envs: dict[str, str] | None = None,
        cwd: str | None = None,
        timeout: float = OPEN_TIMEOUT,
    ) -> Terminal:
        """A program (default: a login bash) on a new ``cols`` x ``rows`` terminal."""
        spec = {"cmd": cmd, "cols": cols, "rows": rows, "envs": envs or {}, "cwd": cwd}
        made = self._made(Terminal, None)
        assert isinstance(made, Terminal)
        try:
            self._send(PTY, made.number, json.dumps(spec).encode())
            made._wait_open(timeout)
        except BaseException:
            made.close()
            raise
        made.pid = int((made._opened or {}).get("pid", 0))
        return made

    def _made(self, kind: type[Channel], share: int | None) -> Channel:
        with self._lock:
            if not self.alive:
                raise ReachError("the sandbox's agent is gone")
            if len(self._channels) >= self.max_channels:
                raise ReachError(
                    f"this sandbox has {self.max_channels} connections and terminals open (the most at once): "
                    "close one first"
                )
            if share is not None and sum(c.shared for c in self._channels.values()) >= share:
                raise ReachError(
                    f"this sandbox has {share} connections open for visitors without its token (the most at "
                    "once): try again later, or send its token"
                )
            channel = kind(self, next(self._numbers))
            channel.shared = share is not None
            self._channels[channel.number] = channel
        return channel

    def open_count(self) -> int:
        with self._lock:
            return len(self._channels)

    # -- the stream ----------------------------------------------------------------------------
    def _send(self, kind: int, number: int, payload: bytes = b"") -> None:
        """Queues a frame for the writer thread; never waits (each channel's input is bounded by
        its window; the queue as a whole by ``MAX_QUEUED``, past which the agent reads nothing).

        Raises:
            ReachError: the agent is gone or reads nothing.
        """
        frame = HEADER.pack(kind, number, len(payload)) + payload
        with self._out_cond:
            if not self.alive:
                raise ReachError("the sandbox's agent is gone")
            if self._out_held > MAX_QUEUED:
                raise ReachError("the sandbox's agent reads none of what it is sent")
            self._out.append(frame)
            self._out_held += len(frame)
            self._out_cond.notify_all()

    def _send_quietly(self, kind: int, number: int, payload: bytes = b"") -> None:
        with contextlib.suppress(ReachError):
            self._send(kind, number, payload)

    def _write(self) -> None:
        try:
            while True:
                with self._out_cond:
                    self._out_cond.wait_for(lambda: self._out or not self.alive)
                    if not self._out:
                        return
                    frames = list(self._out)
                    self._out.clear()
                    self._out_held = 0
                    self._out_cond.notify_all()
                self.stream.write(b"".join(frames))
        except OSError:
            self._gone("the stream to the sandbox broke")

    def _read(self) -> None:
        buf = bytearray()
        why = "the sandbox's agent ended (the sandbox stopped, or was replaced)"
        try:
            while True:
                data = self.stream.read(256 * 1024)
                if not data:
                    break
                buf += data
                while len(buf) >= HEADER.size:
                    kind, number, length = HEADER.unpack_from(buf)
                    if length > MAX_FRAME:
                        raise _Broken(f"a frame of {length} bytes (at most {MAX_FRAME})")
                    if len(buf) < HEADER.size + length:
                        break
                    payload = bytes(buf[HEADER.size : HEADER.size + length])
                    del buf[: HEADER.size + length]
                    self._dispatch(kind, number, payload)
        except OSError:
            pass
        except (_Broken, ValueError, TypeError, struct.error, AttributeError) as exc:
            # Code in the sandbox can write to the agent's stream: what it sends is never trusted
            # further than this (issue 52 finding 4: a forged length grew the server's memory to
            # 1.6 GiB; a malformed frame killed this thread and left every channel waiting).
            why = f"the sandbox's agent broke the protocol ({exc}): its connections were closed"
            log.warning("reach into a sandbox: %s", why)
            threading.Thread(target=self.stream.close, name="reach-close", daemon=True).start()
        self._gone(why)

    def _dispatch(self, kind: int, number: int, payload: bytes) -> None:
        with self._lock:
            channel = self._channels.get(number)
        if channel is None:
            return
        if kind == DATA:
            channel._deliver(payload)
        elif kind == CREDIT:
            (count,) = CREDIT_COUNT.unpack(payload)
            channel._credited(count)
        elif kind == EOF:
            channel._end()
        elif kind == OPENED:
            opened = json.loads(payload or b"{}")
            if not isinstance(opened, dict):
                raise _Broken("an answer that is not an object")
            channel._answer(opened, None)
        elif kind == REFUSED:
            channel._answer(None, payload.decode(errors="replace")[:1000])
        elif kind == EXIT and isinstance(channel, Terminal):
            channel._exited(int(payload))
        elif kind not in (DATA, CREDIT, EOF, OPENED, REFUSED, EXIT):
            raise _Broken(f"a frame of unknown kind {kind}")

    def _close_quietly(self, number: int) -> None:
        self._send_quietly(CLOSE, number)

    def _forget(self, number: int) -> None:
        with self._lock:
            known = self._channels.pop(number, None) is not None
        if known and self.alive:
            self._close_quietly(number)

    def _gone(self, why: str) -> None:
        with self._lock:
            self.alive = False
            channels = list(self._channels.values())
        with self._out_cond:
            self._out_cond.notify_all()
        for channel in channels:
            channel._end(why)
            if isinstance(channel, Terminal) and channel.exit_code is None:
                channel._closed = True
                with channel._cond:
                    channel._cond.notify_all()

    def close(self) -> None:
        """Ends the agent (its connections close, its terminals hang up) and frees the stream."""
        with self._lock:
            self.alive = False
            channels = list(self._channels.values())
            self._channels.clear()
        with self._out_cond:
            self._out_cond.notify_all()
        for channel in channels:
            channel._end("closed")
        self.stream.close()

"""The host's end of a reach into a running sandbox: one agent (``agent.py``) started in it, many
channels over its one byte stream -- connections to the sandbox's own loopback ports, terminals.

Every wait is bounded and every buffer capped: a channel holds at most ``BUFFER`` bytes nobody has
read (a terminal then drops its oldest output; a connection makes the agent's stream wait up to
``STALL`` seconds for its reader, and is closed: one slow reader cannot hold a sandbox's other
channels for longer), input waits up to
``STALL`` seconds for room (an agent whose program reads nothing), and a sandbox has at most
``MAX_CHANNELS`` open at once.
"""

from __future__ import annotations

import collections
import contextlib
import json
import struct
import threading
import time
from collections.abc import Callable
from importlib import resources
from typing import Any

from sandloop.contract import SandboxError
from sandloop.runtime.base import ExecStream

HEADER = struct.Struct(">BII")
TCP, PTY, DATA, EOF, CLOSE, RESIZE, SIGNAL, OPENED, REFUSED, EXIT = range(1, 11)
#: What starts the agent inside a sandbox: a short loader on the image's python that reads the
#: agent's source from its stdin (10 digits of length, then the source: ``AGENT_PRELUDE``, the
#: first bytes ``Reach`` sends), so the sandbox's process list shows one line, not the source.
AGENT_NAME = "sandloop-reach-agent"
_LOADER = f"""# {AGENT_NAME}
import os
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
STALL = 30.0
#: Longest the agent takes to open a port or start a terminal.
OPEN_TIMEOUT = 15.0
FRAME_DATA = 64 * 1024


class ReachError(SandboxError):
    """The sandbox cannot be reached this way (nothing listens on the port, the agent is gone)."""


class PortClosed(ReachError):
    """Nothing listens on that port inside the sandbox."""


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
        #: Called (on the agent's reader thread) whenever there is something to take.
        self.on_ready: Callable[[], None] | None = None

    # -- the reader thread's side --------------------------------------------------------------
    def _deliver(self, data: bytes) -> None:
        with self._cond:
            if self.kind == PTY:  # a terminal nobody watches keeps its last BUFFER bytes, as a scrollback
                while self._chunks and self._held + len(data) > BUFFER:
                    self._held -= len(self._chunks.popleft())
            deadline = time.monotonic() + STALL
            while self._held >= BUFFER and not self._closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    self._why = f"closed: nobody read its output for {STALL:.0f} s"
                    self._closed = self._eof = True
                    self._chunks.clear()
                    self.reach._close_quietly(self.number)
                    break
                self._cond.wait(left)
            if not self._closed:
                self._chunks.append(data)
                self._held += len(data)
            self._cond.notify_all()
        self._ready()

    def _end(self, why: str = "") -> None:
        with self._cond:
            self._eof = True
            self._why = self._why or why
            self._cond.notify_all()
        self._ready()

    def _answer(self, opened: dict[str, Any] | None, refused: str | None) -> None:
        with self._cond:
            self._opened, self._refused = opened, refused
            self._cond.notify_all()

    def _ready(self) -> None:
        if self.on_ready is not None:
            with contextlib.suppress(Exception):
                self.on_ready()

    def _wait_open(self, timeout: float) -> dict[str, Any]:
        with self._cond:
            answered = self._cond.wait_for(
                lambda: not (self._opened is None and self._refused is None) or self._eof, timeout
            )
            if not answered:
                raise ReachError(f"the sandbox did not answer within {timeout:.0f} s")
            if self._refused is not None:
                raise PortClosed(self._refused) if self.kind == TCP else ReachError(self._refused)
            if self._opened is None:
                raise ReachError(self._why or "the sandbox went away")
            return self._opened

    kind = TCP

    # -- the user's side -----------------------------------------------------------------------
    def take(self) -> tuple[bytes, bool]:
        """What has arrived (without waiting) and whether the output has ended."""
        with self._cond:
            data = b"".join(self._chunks)
            self._chunks.clear()
            self._held = 0
            self._cond.notify_all()
            return data, self._eof and not self._chunks

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

    def send(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            self.reach._send(DATA, self.number, bytes(view[:FRAME_DATA]))
            view = view[FRAME_DATA:]

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
        if not 1 <= int(port) <= 65535:
            raise ReachError(f"port must be 1-65535, got {port}")
        return self._open(Channel, TCP, str(int(port)).encode(), timeout, first)

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
        made = self._open(Terminal, PTY, json.dumps(spec).encode(), timeout)
        assert isinstance(made, Terminal)
        made.pid = int((made._opened or {}).get("pid", 0))
        return made

    def _open(self, kind: type[Channel], op: int, payload: bytes, timeout: float, first: bytes = b"") -> Channel:
        with self._lock:
            if not self.alive:
                raise ReachError("the sandbox's agent is gone")
            if len(self._channels) >= self.max_channels:
                raise ReachError(
                    f"this sandbox has {self.max_channels} connections and terminals open (the most at once): "
                    "close one first"
                )
            channel = kind(self, next(self._numbers))
            self._channels[channel.number] = channel
        try:
            self._send(op, channel.number, payload)
            if first:
                channel.send(first)
            channel._wait_open(timeout)
        except BaseException:
            channel.close()
            raise
        return channel

    def open_count(self) -> int:
        with self._lock:
            return len(self._channels)

    # -- the stream ----------------------------------------------------------------------------
    def _send(self, kind: int, number: int, payload: bytes = b"") -> None:
        frame = HEADER.pack(kind, number, len(payload)) + payload
        with self._out_cond:
            deadline = time.monotonic() + STALL
            while self._out_held >= BUFFER and self.alive:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise ReachError(f"the sandbox read none of its input for {STALL:.0f} s")
                self._out_cond.wait(left)
            if not self.alive:
                raise ReachError("the sandbox's agent is gone")
            self._out.append(frame)
            self._out_held += len(frame)
            self._out_cond.notify_all()

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
        try:
            while True:
                data = self.stream.read(256 * 1024)
                if not data:
                    break
                buf += data
                while len(buf) >= HEADER.size:
                    kind, number, length = HEADER.unpack_from(buf)
                    if len(buf) < HEADER.size + length:
                        break
                    payload = bytes(buf[HEADER.size : HEADER.size + length])
                    del buf[: HEADER.size + length]
                    self._dispatch(kind, number, payload)
        except OSError:
            pass
        self._gone("the sandbox's agent ended (the sandbox stopped, or was replaced)")

    def _dispatch(self, kind: int, number: int, payload: bytes) -> None:
        with self._lock:
            channel = self._channels.get(number)
        if channel is None:
            return
        if kind == DATA:
            channel._deliver(payload)
        elif kind == EOF:
            channel._end()
        elif kind == OPENED:
            channel._answer(json.loads(payload or b"{}"), None)
        elif kind == REFUSED:
            channel._answer(None, payload.decode(errors="replace"))
        elif kind == EXIT and isinstance(channel, Terminal):
            channel._exited(int(payload))

    def _close_quietly(self, number: int) -> None:
        with contextlib.suppress(ReachError):
            self._send(CLOSE, number)

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

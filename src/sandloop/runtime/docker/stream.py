"""Docker's attach socket as a protocol ``Channel``: the 8-byte frame demux is the only part of
the launcher's byte stream that is Docker's own (``runtime/protocol.py`` knows the rest)."""

from __future__ import annotations

import contextlib
import socket
from typing import Any

from sandloop.contract import EngineUnavailable
from sandloop.runtime.streams import readable


class FrameDemux:
    """Incremental parser of Docker's multiplexed stream: 8-byte headers (stream, 0, 0, 0, length)
    then payload. Yields ``(stream, bytes)`` as they arrive, so a frame is never buffered whole."""

    def __init__(self) -> None:
        self._header = bytearray()
        self._remaining = 0
        self._stream = 0

    def feed(self, data: bytes) -> list[tuple[int, bytes]]:
        out: list[tuple[int, bytes]] = []
        view = memoryview(data)
        while view:
            if self._remaining == 0:
                need = 8 - len(self._header)
                self._header += view[:need]
                view = view[need:]
                if len(self._header) < 8:
                    break
                self._stream = self._header[0]
                self._remaining = int.from_bytes(self._header[4:8], "big")
                self._header.clear()
                continue
            take = view[: self._remaining]
            self._remaining -= len(take)
            view = view[len(take) :]
            out.append((self._stream, bytes(take)))
        return out


def raw_socket(attached: Any) -> socket.socket:
    sock: socket.socket = getattr(attached, "_sock", attached)
    return sock


def close_quietly(attached: Any) -> None:
    with contextlib.suppress(Exception):
        raw_socket(attached).close()
    with contextlib.suppress(Exception):
        attached.close()


class SocketChannel:
    """Reads of one attach socket, demultiplexed. Lives as long as the connection: a session's
    interpreter sends many results over it, and a frame may straddle two of them."""

    def __init__(self, attached: Any) -> None:
        self.attached = attached
        self.sock = raw_socket(attached)
        self.demux = FrameDemux()
        #: Chunks read while checking the connection between requests (``drain``).
        self.pending: list[tuple[int, bytes]] = []

    def read(self, timeout: float) -> list[tuple[int, bytes]] | None:
        if self.pending:
            chunks, self.pending = self.pending, []
            return chunks
        ready = readable([self.sock.fileno()], timeout)
        if not ready:
            return []
        try:
            data = self.sock.recv(256 * 1024)
        except (BlockingIOError, InterruptedError):
            return []
        except OSError as exc:
            raise EngineUnavailable(f"lost the connection to the sandbox: {exc}") from exc
        if not data:
            return None
        return self.demux.feed(data)

    def drain(self, limit: int = 32 * 1024 * 1024) -> bool:
        """Read what is waiting without blocking, keeping it for the next ``read``; False at EOF.

        A launcher waiting for its program writes nothing, so there a readable socket means EOF. A
        session's interpreter may have written between cells (a thread printing late): that is
        kept, not mistaken for a dead connection."""
        kept = sum(len(chunk) for _, chunk in self.pending)
        while kept <= limit:
            try:
                ready = readable([self.sock.fileno()], 0)
                if not ready:
                    return True
                data = self.sock.recv(256 * 1024)
            except (OSError, ValueError):
                return False
            if not data:
                return False
            chunks = self.demux.feed(data)
            self.pending += chunks
            kept += len(data)
        return True

    def close(self) -> None:
        close_quietly(self.attached)

"""A direct sandbox's stdout and stderr pipes as a protocol ``Channel`` (no framing: one pipe
per stream, EOF when both are closed)."""

from __future__ import annotations

import contextlib
import os

from sandloop.runtime.streams import readable


class PipeChannel:
    def __init__(self, stdout_fd: int, stderr_fd: int) -> None:
        self._fds: dict[int, int] = {stdout_fd: 1, stderr_fd: 2}
        for fd in self._fds:
            os.set_blocking(fd, False)
        #: Chunks read while checking the sandbox between requests (``drain``).
        self.pending: list[tuple[int, bytes]] = []

    def _read_ready(self, timeout: float) -> list[tuple[int, bytes]]:
        ready = readable(list(self._fds), timeout)
        out: list[tuple[int, bytes]] = []
        for fd in ready:
            try:
                data = os.read(fd, 256 * 1024)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                data = b""
            if data:
                out.append((self._fds[fd], data))
            else:
                self._fds.pop(fd)
                with contextlib.suppress(OSError):
                    os.close(fd)
        return out

    def read(self, timeout: float) -> list[tuple[int, bytes]] | None:
        if self.pending:
            chunks, self.pending = self.pending, []
            return chunks
        if not self._fds:
            return None
        chunks = self._read_ready(timeout)
        if not chunks and not self._fds:
            return None
        return chunks

    def drain(self, limit: int = 32 * 1024 * 1024) -> bool:
        """Read what is waiting without blocking, keeping it for the next ``read``; False at EOF."""
        kept = sum(len(chunk) for _, chunk in self.pending)
        while kept <= limit and self._fds:
            before = len(self._fds)
            chunks = self._read_ready(0)
            if len(self._fds) < before:
                return False
            if not chunks:
                return True
            self.pending += chunks
            kept += sum(len(c) for _, c in chunks)
        return bool(self._fds)

    def close(self) -> None:
        for fd in list(self._fds):
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()

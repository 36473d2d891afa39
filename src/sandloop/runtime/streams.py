"""One sandbox's two output streams as the launcher wire gives them meaning: each kept up to its
cap while it is read (``CappedStream``), watched for the launcher's end line and a session's
displays (``EndWatch``), both of a request together (``Collector``), its displays kept in their
place in stdout and stderr (``DisplayOrder``). The rest of the wire, the requests and the results
made from what was collected, is ``protocol.py``.
"""

from __future__ import annotations

import base64
import collections
import io
import json
import math
import select
from collections.abc import Callable
from typing import Any

#: The launcher's end line: END_MARKER + nonce + b":" + status [+ b":" + payload] + b"\n".
END_MARKER = b"\0\x1esandloop-exit:"
STDOUT, STDERR = 1, 2


class ChunkReader(io.RawIOBase):
    """A file over an iterator of byte chunks: tarfile's stream mode over a build's archive
    (``docker/builder.py``), ``http.client`` over a reach channel (``reach/request.py``)."""

    def __init__(self, chunks: Any) -> None:
        self._chunks, self._pending = chunks, b""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        while not self._pending:
            try:
                self._pending = next(self._chunks)
            except StopIteration:
                return 0
        n = min(len(buffer), len(self._pending))
        buffer[:n] = self._pending[:n]
        self._pending = self._pending[n:]
        return n


def readable(fds: list[int], timeout: float | None) -> list[int]:
    """Which of ``fds`` can be read within ``timeout`` seconds (None: wait). ``poll``, not
    ``select``: a server holding hundreds of sessions has descriptors past select's 1024."""
    poller = select.poll()
    for fd in fds:
        poller.register(fd, select.POLLIN)
    wait = None if timeout is None else max(0, math.ceil(timeout * 1000))
    return [fd for fd, _ in poller.poll(wait)]


class CappedStream:
    """Keeps the first ``limit`` bytes of a stream and counts the rest, never storing it."""

    __slots__ = ("data", "dropped", "limit", "on_kept")

    def __init__(self, limit: int, on_kept: Callable[[bytes], None] | None = None) -> None:
        self.limit = limit
        self.data = bytearray()
        self.dropped = 0
        #: Called with each piece of kept output as it arrives (streaming it to a caller).
        self.on_kept = on_kept

    def feed(self, chunk: bytes | memoryview) -> None:
        room = self.limit - len(self.data)
        if room > 0:
            kept = bytes(chunk[:room])
            self.data += kept
            self.dropped += max(0, len(chunk) - room)
            if self.on_kept is not None and kept:
                self.on_kept(kept)
        else:
            self.dropped += len(chunk)

    def text(self) -> str:
        return self.data.decode("utf-8", errors="replace")

    def base64_if_binary(self) -> str | None:
        """The exact bytes, for output that text() could only show with replacement characters."""
        try:
            self.data.decode("utf-8")
        except UnicodeDecodeError:
            return base64.b64encode(self.data).decode()
        return None


#: A displayed output of a session's interpreter, on its stdout (``kernel_python.py``).
OUTPUT_MARKER = b"\0\x1esandloop-output:"
MARKER_PREFIX = b"\0\x1esandloop-"
#: Bytes of one marked line kept (a cell's outputs ride on them); past this its payload is lost.
MAX_END_LINE = 32 * 1024 * 1024
#: Bytes of streamed outputs one cell may hand the host; past this they are counted, not kept
#: (code in the sandbox that learns its cell's nonce could otherwise stream without end).
MAX_OUTPUT_BYTES = 32 * 1024 * 1024


class DisplayOrder:
    """A display's place in both of a cell's streams. The engine forwards stdout and stderr
    independently, so what a cell wrote to stderr before a display may be read after the display's
    line on stdout, and what it wrote after, before. The interpreter writes a mark
    (``OUTPUT_MARKER<nonce>:`` and nothing more) on stderr just before each display line on stdout;
    the two watches meet there: stdout stops at display k until stderr has read mark k, and stderr
    stops after mark k until stdout has shown display k. What a caller sees is then the order the
    cell wrote in, whichever stream the engine delivered first."""

    __slots__ = ("marks", "open", "shown")

    def __init__(self) -> None:
        self.marks = 0  # marks read on stderr
        self.shown = 0  # display lines read on stdout
        #: The streams no longer meet (one ended, or a wait outgrew its bound): each goes on alone.
        self.open = False


class EndWatch:
    """Passes one stream's bytes to its sink until the launcher's end line appears in it.

    A few bytes are held back so a line split across reads is still found. A session
    interpreter's stdout also carries its displayed outputs, one line each
    (``OUTPUT_MARKER<nonce>:<base64 JSON>``): they are taken out of the stream, kept in
    ``outputs`` and handed to ``on_display`` as they come; its stderr carries their marks
    (``marks=True``). Where the two meet (``DisplayOrder``) the rest of a stream waits in ``stalled``
    until ``resume`` finds the other side there.
    """

    def __init__(
        self,
        sink: CappedStream,
        marker: bytes | None,
        on_display: Callable[[bytes], None] | None = None,
        order: DisplayOrder | None = None,
        marks: bool = False,
    ) -> None:
        self.sink = sink
        self.marker = marker
        self.output_marker = None if marker is None else OUTPUT_MARKER + marker[len(END_MARKER) :]
        self.on_display = on_display
        self.order = order
        self.marks = marks
        #: What waits where the streams meet, as it was read (chunks, so going on past each
        #: display copies only its own read, never the rest again); None when not waiting.
        self.stalled: collections.deque[bytes] | None = None
        self.stalled_bytes = 0
        self.held = bytearray()
        self.status: int | None = None
        self.payload = b""
        self.outputs: list[dict[str, Any]] = []
        self.output_bytes = 0
        self.outputs_dropped = 0
        #: Output after the end line (a thread still printing). A one-shot run drops it with its
        #: sandbox; a session's interpreter shows it with the next cell (``Collector.reset``).
        self.after = bytearray()

    def _may_go(self) -> bool:
        order = self.order
        if order is None or order.open:
            return True
        # stdout at display k: stderr has read mark k; stderr past mark k: stdout has shown display k
        return order.shown >= order.marks if self.marks else order.marks > order.shown

    def resume(self) -> bool:
        """Go on with what waited where the streams meet, if the other side is there now (True)."""
        if self.stalled is None or not self._may_go():
            return False
        queued, self.stalled, self.stalled_bytes = self.stalled, None, 0
        while queued:
            self.feed(queued.popleft())
            if self.stalled is not None:  # the next meeting: the rest waits behind it
                for chunk in queued:
                    self._stall(chunk)
                break
        return True

    def _stall(self, chunk: bytes | memoryview) -> None:
        if self.stalled is None:
            self.stalled = collections.deque()
        self.stalled.append(bytes(chunk))
        self.stalled_bytes += len(chunk)
        if self.stalled_bytes > MAX_END_LINE + self.sink.limit and self.order is not None:
            self.order.open = True  # the other side is not coming (the cell closed its stderr)

    def feed(self, chunk: bytes | memoryview) -> None:
        if self.stalled is not None:
            self._stall(chunk)
            return
        if self.status is not None:
            if len(self.after) < self.sink.limit:
                self.after += chunk[: self.sink.limit - len(self.after)]
            return
        if self.marker is None:
            self.sink.feed(chunk)
            return
        if isinstance(chunk, memoryview):
            chunk = bytes(chunk)
        if self.held[:1] == b"\0" and len(self.held) > len(MARKER_PREFIX) and b"\n" not in chunk:
            # the middle of a long marked line (a cell's outputs): keep it, without copying it again
            if len(self.held) + len(chunk) <= MAX_END_LINE:
                self.held += chunk
            return
        data = bytes(self.held) + chunk
        self.held = bytearray()
        assert self.output_marker is not None
        while data:
            at = data.find(b"\0")
            if at < 0:
                self.sink.feed(data)
                return
            self.sink.feed(data[:at])
            data = data[at:]
            marker = self.marker if data.startswith(self.marker) else None
            if marker is None and data.startswith(self.output_marker):
                marker = self.output_marker
            if marker is None:
                if self.marker.startswith(data) or self.output_marker.startswith(data):
                    self.held = bytearray(data)  # the start of a marker: the rest comes next
                    return
                self.sink.feed(data[:1])  # a NUL of the program's own
                data = data[1:]
                continue
            end = data.find(b"\n")
            if end < 0:  # the line has not all arrived yet
                self.held = bytearray(data[:MAX_END_LINE])
                return
            if marker is self.output_marker and self.order is not None and not self.marks:
                if not self._may_go():
                    self._stall(data)  # display k, until stderr has read mark k
                    return
                self.order.shown += 1
            line, data = data[len(marker) : end], data[end + 1 :]
            if marker is self.output_marker:
                if not self.marks:
                    self._display(line)
                elif self.order is not None:
                    self.order.marks += 1
                    if not self._may_go():
                        self._stall(data)  # past mark k, until display k is shown
                        return
                continue
            status, _, payload = line.partition(b":")
            try:
                self.status = int(status)
                self.payload = payload
            except ValueError:
                self.sink.feed(marker + line + b"\n")  # not ours after all
                continue
            if self.order is not None:
                self.order.open = True  # this stream has ended: the other goes on alone
            self.feed(data)  # what follows the end line goes to ``after``
            return

    def _display(self, line: bytes) -> None:
        if self.output_bytes + len(line) > MAX_OUTPUT_BYTES:
            self.outputs_dropped += 1
            return
        self.output_bytes += len(line)
        try:
            output = json.loads(base64.b64decode(line))
        except ValueError:
            return
        if isinstance(output, dict):
            self.outputs.append(output)
            if self.on_display is not None:
                self.on_display(json.dumps(output).encode())

    def flush(self) -> None:
        if self.order is not None:
            self.order.open = True
            self.resume()
        if self.held:
            self.sink.feed(bytes(self.held))
            self.held = bytearray()


class Collector:
    """Both streams of one request: routes chunks, watches for the end lines.

    The engine forwards the two streams independently, so a request is over only when both have
    ended (``exit_status`` is then set); a session's displays keep their place in both
    (``DisplayOrder``).
    """

    def __init__(
        self,
        stdout: CappedStream,
        stderr: CappedStream,
        nonce: str | None,
        on_display: Callable[[bytes], None] | None = None,
    ) -> None:
        self.stdout, self.stderr = stdout, stderr
        marker = None if nonce is None else END_MARKER + nonce.encode() + b":"
        order = None if marker is None else DisplayOrder()
        self._watches = {
            STDOUT: EndWatch(stdout, marker, on_display, order),
            STDERR: EndWatch(stderr, marker, order=order, marks=True),
        }

    @property
    def outputs(self) -> list[dict[str, Any]]:
        """What a session's interpreter displayed during the request, as it streamed it."""
        return self._watches[STDOUT].outputs

    @property
    def exit_status(self) -> int | None:
        out, err = self._watches[STDOUT].status, self._watches[STDERR].status
        return err if out is not None and err is not None else None

    @property
    def payload(self) -> bytes:
        """What the stdout end line carried after the status (a cell's value and charts)."""
        return self._watches[STDOUT].payload

    def feed(self, stream: int, chunk: bytes | memoryview) -> None:
        watch = self._watches.get(stream)
        if watch is not None:
            watch.feed(chunk)
            self._settle()

    def _settle(self) -> None:
        """Let each stream go on past where it met the other, in turns, until neither can (a loop,
        not callbacks between the two: a read with thousands of displays nests nothing)."""
        out, err = self._watches[STDOUT], self._watches[STDERR]
        while out.resume() | err.resume():
            pass

    def flush(self) -> None:
        """End of the stream: whatever was held back was the program's own output."""
        for watch in self._watches.values():
            watch.flush()
        self._settle()

    def next(
        self,
        stdout: CappedStream,
        stderr: CappedStream,
        nonce: str,
        on_display: Callable[[bytes], None] | None = None,
    ) -> Collector:
        """A collector for the next request on the same connection; output that came after this
        request's end lines goes to the new sinks first."""
        following = Collector(stdout, stderr, nonce, on_display)
        for stream, watch in self._watches.items():
            if watch.after:
                following.feed(stream, bytes(watch.after))
        return following

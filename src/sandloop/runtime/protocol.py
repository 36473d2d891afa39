"""The launcher wire protocol, both directions. The other half runs in the sandbox:
``images/recipe/launcher.py`` (one program) and ``images/recipe/kernel.py`` (a session's cells).

To the launcher, on its stdin: ``SANDLOOP1 <n>\\n`` (n zero-padded to 8 digits), an n-byte JSON
header, the code, and for a run the program's own stdin until EOF.

From it: the program's stdout and stderr, each ended by the end line
``END_MARKER <nonce> : <status> [: <payload>] \\n`` once the program is done (the payload, on
stdout only, carries a cell's value and charts). The nonce is fresh per request, so code can forge
an end line only for a status it could produce anyway.

A backend only moves bytes: it turns its transport (Docker's attach socket, a subprocess's pipes,
a remote stream) into a ``Channel`` of ``(stream, chunk)`` reads. Everything that gives those bytes
meaning is here: framing requests, spotting end lines split across reads, capping what is kept
*while reading*, and assembling ``ExecutionResult`` / ``CellResult`` (httpx's cut: the transport
moves bytes, the layer above knows the protocol).
"""

from __future__ import annotations

import base64
import collections
import contextlib
import functools
import json
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from sandloop.contract import ARTIFACT_FORMATS, Artifact, CellError, CellResult, ExecutionResult, Output, SandboxLimits

if TYPE_CHECKING:
    from sandloop.runtime.base import RunRequest

#: Where the launcher writes the program inside the sandbox (on the /tmp tmpfs).
STAGING_DIR = "/tmp/sandloop"
#: The launcher's end line: END_MARKER + nonce + b":" + status [+ b":" + payload] + b"\n".
END_MARKER = b"\0\x1esandloop-exit:"
PREAMBLE = b"SANDLOOP1 "
STDOUT, STDERR = 1, 2


def new_nonce() -> str:
    return secrets.token_hex(8)


def _frame(header: dict[str, Any], body: bytes) -> bytes:
    encoded = json.dumps(header).encode()
    return PREAMBLE + b"%08d\n" % len(encoded) + encoded + body


def encode_run(
    request: RunRequest,
    nonce: str = "",
    *,
    staging_dir: str = STAGING_DIR,
    cwd: str | None = None,
    env: Mapping[str, str] | None = None,
    ca_pem: str | None = None,
) -> bytes:
    """What the launcher reads on its stdin for one run: header, code, then the program's stdin.
    ``staging_dir`` and ``cwd`` are paths as the sandbox sees them (a backend may map them).
    ``env`` is set for the program (secrets' placeholders, never their values); ``ca_pem`` is a CA
    the program's TLS clients must trust (the egress proxy's, when it reads a run's requests)."""
    header = {
        "argv": list(request.language.command),
        "file": f"{staging_dir}/{request.language.file_name}",
        "code": len(request.code),
        "cwd": cwd or request.cwd,
        "inproc": request.language.inproc and request.language.image is None,
        "nonce": nonce,
    }
    if env:
        header["env"] = dict(env)
    if ca_pem:
        header["ca"] = ca_pem
    return _frame(header, request.code + request.stdin)


def encode_cell(
    code: str,
    nonce: str,
    *,
    env: Mapping[str, str] | None = None,
    ca_pem: str | None = None,
    options: Mapping[str, Any] | None = None,
) -> bytes:
    """One frame for a session's interpreters (``launcher.py --kernel``, see ``kernel.py``):
    ``env`` (set for this cell only) and ``ca_pem`` as for a run; ``options`` the rest of the
    header: ``op`` (cell, create, restart, remove, list), ``context``, ``language``, ``cwd``, and
    an ``env`` of the caller's own, under the secrets' placeholders."""
    data = code.encode()
    header: dict[str, Any] = {"code": len(data), "nonce": nonce}
    extra = dict(options or {})
    merged = {**(extra.pop("env", None) or {}), **(env or {})}
    header.update({k: v for k, v in extra.items() if v is not None})
    if merged:
        header["env"] = merged
    if ca_pem:
        header["ca"] = ca_pem
    return _frame(header, data)


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


class Channel(Protocol):
    """A backend's transport to one sandbox's launcher, as the protocol sees it."""

    def read(self, timeout: float) -> Iterable[tuple[int, bytes]] | None:
        """``(stream, chunk)`` pairs that arrived within ``timeout`` seconds (empty if none did);
        None once the sandbox closed its output (EOF)."""
        ...


def collect(channel: Channel, collector: Collector, deadline: float) -> bool:
    """Read until both end lines or EOF (True), or until ``deadline`` (False)."""
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        chunks = channel.read(remaining)
        if chunks is None:
            return True
        for stream, chunk in chunks:
            collector.feed(stream, chunk)
        if collector.exit_status is not None:
            return True


def cell_collector(
    previous: Collector | None, limit: int, nonce: str, on_output: Callable[[str, bytes], None] | None = None
) -> Collector:
    """The collector for a session interpreter's next cell; output a thread printed after the
    previous cell's end line comes first. ``on_output("stdout" | "stderr", data)`` sees the kept
    output as it arrives."""
    on_display = None
    if on_output is None:
        stdout, stderr = CappedStream(limit), CappedStream(limit)
    else:
        emit = on_output
        stdout = CappedStream(limit, lambda data: emit("stdout", data))
        stderr = CappedStream(limit, lambda data: emit("stderr", data))
        on_display = lambda data: emit("display", data)  # noqa: E731 - one output's JSON
    if previous is None:
        return Collector(stdout, stderr, nonce, on_display)
    return previous.next(stdout, stderr, nonce, on_display)


def await_cell(
    channel: Channel,
    collector: Collector,
    *,
    interrupt_after: float,
    grace: float,
    interrupt: Callable[[], None],
    cancel: threading.Event | None = None,
) -> tuple[bool, bool]:
    """Collect a cell's output; past ``interrupt_after`` (or once ``cancel`` is set: the caller
    went away) call ``interrupt()`` (SIGINT: the interpreter's state survives) and wait ``grace``
    more seconds. Returns (timed_out, gone): ``gone`` when the interpreter did not answer or
    died, so the caller replaces it."""
    deadline = time.monotonic() + interrupt_after
    if cancel is None:
        finished = collect(channel, collector, deadline)
    else:
        while not (finished := collect(channel, collector, min(deadline, time.monotonic() + 0.25))):
            if cancel.is_set() or time.monotonic() >= deadline:
                break
    if finished:
        return False, collector.exit_status is None  # EOF without an end line: it died (OOM, exit)
    with contextlib.suppress(Exception):  # an interpreter that cannot be signalled is replaced below
        interrupt()
    collect(channel, collector, time.monotonic() + grace)
    return True, collector.exit_status is None


def run_program(
    channel: Channel,
    request: RunRequest,
    *,
    send: Callable[[bytes], None],
    exit_status: Callable[[int | None], tuple[int, bool]],
    stop: Callable[[], None],
    started: float,
    backend: str,
    env: Mapping[str, str] | None = None,
    ca_pem: str | None = None,
) -> ExecutionResult:
    """One run in a started sandbox, whatever carries the bytes: ``send`` the program, collect
    capped output until the end lines, EOF or the deadline, then the exit status. Below 128 it is
    the launcher's own report (a program's chosen exit; no need to wait for the teardown); 128+N
    means killed by signal N (137 may be the OOM killer), and EOF without an end line means the
    launcher died, so those ask the backend: ``exit_status(reported)`` gives (code, oom_killed).
    At the deadline ``stop()`` kills the sandbox and the result is -1, timed out."""
    deadline = time.monotonic() + request.timeout_seconds
    nonce = new_nonce()
    send(encode_run(request, nonce, env=env, ca_pem=ca_pem))
    emit = request.on_output
    limit = request.limits.output_limit
    collector = Collector(
        CappedStream(limit, emit and functools.partial(emit, "stdout")),
        CappedStream(limit, emit and functools.partial(emit, "stderr")),
        nonce,
    )
    finished = collect(channel, collector, deadline)
    collector.flush()
    status = collector.exit_status
    if finished and status is not None and status < 128:
        exit_code, oom_killed = status, False
    elif finished:
        exit_code, oom_killed = exit_status(status)
    else:
        stop()
        exit_code, oom_killed = -1, False
    return execution_result(
        request,
        collector,
        exit_code=exit_code,
        timed_out=not finished,
        oom_killed=oom_killed,
        started=started,
        backend=backend,
    )


def execution_result(
    request: RunRequest,
    collector: Collector,
    *,
    exit_code: int,
    timed_out: bool,
    oom_killed: bool,
    started: float,
    backend: str | None = None,
) -> ExecutionResult:
    out, err = collector.stdout, collector.stderr
    return ExecutionResult(
        **_streams(out, err),
        exit_code=exit_code,
        duration_seconds=time.monotonic() - started,
        timed_out=timed_out,
        oom_killed=oom_killed,
        language=request.language.name,
        timeout_seconds=request.timeout_seconds,
        limits=request.limits,
        backend=backend,
    )


def cell_result(
    collector: Collector,
    *,
    limits: SandboxLimits,
    timeout_seconds: float,
    timed_out: bool,
    oom_killed: bool,
    interpreter_restarted: bool,
    started: float,
) -> CellResult:
    """A cell's result; its value and charts come from the stdout end line's payload. The exit
    code: -1 when interrupted for time, else the status the interpreter reported, else 137 for an
    OOM kill, else 1 (it died without saying)."""
    collector.flush()
    status = collector.exit_status
    exit_code = -1 if timed_out else status if status is not None else 137 if oom_killed else 1
    reply = cell_reply(collector)
    value, omitted, error = reply.get("value"), int(reply.get("value_omitted") or 0), None
    outputs = [Output(**o) for o in [*collector.outputs, *(reply.get("outputs") or ())] if isinstance(o, dict)]
    if isinstance(reply.get("error"), dict):
        error = CellError(**reply["error"])
    return CellResult(
        **_streams(collector.stdout, collector.stderr),
        exit_code=exit_code,
        duration_seconds=time.monotonic() - started,
        timed_out=timed_out,
        oom_killed=oom_killed,
        timeout_seconds=timeout_seconds,
        limits=limits,
        value=value,
        value_omitted_chars=omitted,
        artifacts=artifacts_of(outputs),
        error=error,
        interpreter_restarted=interpreter_restarted or bool(reply.get("restarted")),
        sandbox_replaced=interpreter_restarted,
        outputs=outputs,
        execution_count=reply.get("execution_count"),
        context=reply["context"] if isinstance(reply.get("context"), str) else None,
        reply={k: reply[k] for k in ("context", "contexts", "removed", "refused") if k in reply},
        language=str(reply.get("language") or "python"),
    )


def cell_reply(collector: Collector) -> dict[str, Any]:
    """The payload of a session interpreter's end line (``{}`` when there was none)."""
    if collector.exit_status is None or not collector.payload:
        return {}
    try:
        reply = json.loads(base64.b64decode(collector.payload))
    except ValueError:
        return {}
    return reply if isinstance(reply, dict) else {}


def artifacts_of(outputs: Sequence[Output]) -> list[Artifact]:
    """The files among a cell's outputs (figures, images, PDFs), decoded, in order."""
    found: list[Artifact] = []
    for output in outputs:
        for mime, suffix in ARTIFACT_FORMATS.items():
            value = output.data.get(mime)
            if not isinstance(value, str):
                continue
            try:
                data = value.encode() if mime == "image/svg+xml" else base64.b64decode(value)
            except ValueError:
                continue
            stem = "figure" if "Figure" in (output.text or "") else "image"
            found.append(Artifact(name=f"{stem}-{len(found) + 1}.{suffix}", mime_type=mime, data=data))
            break
    return found


def _streams(out: CappedStream, err: CappedStream) -> dict[str, Any]:
    return {
        "stdout": out.text(),
        "stderr": err.text(),
        "stdout_base64": out.base64_if_binary(),
        "stderr_base64": err.base64_if_binary(),
        "stdout_truncated": out.dropped > 0,
        "stderr_truncated": err.dropped > 0,
        "stdout_dropped_bytes": out.dropped,
        "stderr_dropped_bytes": err.dropped,
    }

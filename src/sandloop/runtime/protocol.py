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
meaning is here and in ``streams.py``: framing requests (here), spotting end lines split across
reads and capping what is kept *while reading* (streams.py), and assembling ``ExecutionResult`` /
``CellResult`` (here; httpx's cut: the transport moves bytes, the layer above knows the protocol).
"""

from __future__ import annotations

import base64
import contextlib
import functools
import json
import secrets
import threading
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Protocol

from sandloop.contract import ARTIFACT_FORMATS, Artifact, CellError, CellResult, ExecutionResult, Output, SandboxLimits
from sandloop.runtime.streams import (  # the streams' names, as the wire's (backends use them from here)
    CappedStream,
    Collector,
)

if TYPE_CHECKING:
    from sandloop.runtime.base import RunRequest

#: Where the launcher writes the program inside the sandbox (on the /tmp tmpfs).
STAGING_DIR = "/tmp/sandloop"
PREAMBLE = b"SANDLOOP1 "


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

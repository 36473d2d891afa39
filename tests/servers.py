"""Real servers on loopback for tests: uvicorn in a thread, or ``sandloop serve`` in a subprocess."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import uvicorn

from sandloop.server.lifecycle import http_protocol


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_in_thread(app) -> Iterator[str]:
    """``app`` under a real uvicorn on 127.0.0.1; yields its base URL."""
    port = free_port()
    # the protocol `sandloop serve` runs (request heads timed, preview URLs handed to sandboxes)
    protocol = http_protocol(preview=getattr(getattr(app, "state", None), "preview", None))
    srv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", http=protocol))
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.started, "uvicorn did not start within 30 s"
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        srv.should_exit = True
        thread.join(10)


def server_log(proc: subprocess.Popen, tail: int = 4000) -> str:
    """The end of what a server started by ``sandloop_process`` wrote to stderr (for failure messages)."""
    try:
        return Path(proc.log_path).read_text(errors="replace")[-tail:]  # type: ignore[attr-defined]
    except OSError:
        return ""


def wait_for_port(port: int, proc: subprocess.Popen, patience: float = 60) -> None:
    deadline = time.monotonic() + patience
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"the server exited: {server_log(proc)}"
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise AssertionError(f"nothing listened on port {port} within {patience} s")


@contextlib.contextmanager
def sandloop_process(
    *args: str, home: Path, env: dict[str, str] | None = None
) -> Iterator[tuple[int, subprocess.Popen]]:
    """``sandloop ARGS --port P`` as a subprocess with its own SANDLOOP_HOME; yields (port, process).

    Its stderr goes to a temporary file (a pipe nobody reads would stall a chatty server);
    ``server_log(proc)`` gives its tail for a failure message.
    """
    port = free_port()
    log = tempfile.NamedTemporaryFile(prefix="sandloop-serve-", suffix=".log", delete=False)  # noqa: SIM115
    proc = subprocess.Popen(
        [sys.executable, "-m", "sandloop", *args, "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=log,
        env={**os.environ, "SANDLOOP_HOME": str(home), **(env or {})},
    )
    log.close()
    proc.log_path = log.name  # type: ignore[attr-defined]
    try:
        wait_for_port(port, proc)
        yield port, proc
    finally:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(10)
        Path(log.name).unlink(missing_ok=True)


def rss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


def sse_events(response) -> Iterator[tuple[str | None, dict]]:
    """``(event, data)`` of a server-sent-events response, as each arrives."""
    import json

    kind = None
    for line in response.iter_lines():
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            yield kind, json.loads(line[6:])


@contextlib.contextmanager
def e2b_environment(url: str, key: str) -> Iterator[None]:
    """E2B's SDKs pointed at a sandloop server (``E2B_API_URL``, ``E2B_SANDBOX_URL``,
    ``E2B_API_KEY``) for the block; the environment as it was afterwards."""
    names = ("E2B_API_URL", "E2B_SANDBOX_URL", "E2B_API_KEY")
    saved = {k: os.environ.get(k) for k in names}
    os.environ.update(E2B_API_URL=url, E2B_SANDBOX_URL=url, E2B_API_KEY=key)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

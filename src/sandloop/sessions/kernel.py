"""Client side of a session's stateful Python interpreter (``launcher.py --kernel`` in the image).

One long-lived container per session, found by label, so another process can attach to it. Each
cell is sent framed on stdin; the result ends with the launcher's end line on both streams, the
stdout one carrying the value and artifacts. A timeout first interrupts the cell (SIGINT: the
state survives); if the interpreter does not come back within a grace period, or it died (OOM),
it is removed and the next cell starts a fresh one, which the result says.
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import json
import os
import secrets
import select
import time
from collections.abc import Iterator
from pathlib import Path

from sandloop.contract import Artifact, CellResult, SandboxLimits
from sandloop.runtime.base import EXIT_MARKER, SandboxSpec
from sandloop.runtime.docker_engine import DockerBackend, LiveSandbox, _CappedStream, _close_quietly, _Demuxer

INTERRUPT_GRACE_SECONDS = 3.0
MAX_RESULT_BYTES = 32 * 1024 * 1024


class Kernel:
    def __init__(
        self, backend: DockerBackend, spec: SandboxSpec, session_id: str, lock_path: Path, lifetime: float
    ) -> None:
        self.backend = backend
        self.spec = spec
        self.session_id = session_id
        self.lock_path = lock_path
        self.lifetime = lifetime
        self._sandbox: LiveSandbox | None = None
        self._demux: _Demuxer | None = None

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """One cell at a time per session, across processes."""
        with open(self.lock_path, "a+") as f:
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(f, fcntl.LOCK_UN)

    @staticmethod
    def _pending_output(sandbox: LiveSandbox) -> bytes | None:
        """What the interpreter wrote between cells (a thread printing after its cell returned),
        or None when the connection is gone. Before, any byte waiting here read as a dead
        connection, so late output was dropped with it."""
        pending = bytearray()
        while True:
            try:
                ready, _, _ = select.select([sandbox.sock], [], [], 0)
                if not ready:
                    return bytes(pending)
                chunk = sandbox.sock.recv(256 * 1024)
            except (OSError, ValueError):
                return None
            if not chunk:
                return None
            pending += chunk
            if len(pending) > MAX_RESULT_BYTES:  # a thread flooding between cells: keep the head
                return bytes(pending)

    def _connect(self) -> tuple[LiveSandbox, bytes]:
        """The interpreter's connection, and output it wrote since the last cell."""
        if self._sandbox is not None:
            pending = self._pending_output(self._sandbox)
            if pending is not None:
                return self._sandbox, pending
        self._drop(remove=False)
        label = f"sandloop.session={self.session_id}"
        running = [cid for cid in self.backend.find_running(label) if self._is_kernel(cid)]
        if running:
            self._sandbox = self.backend.attach(running[0], self.spec)
        else:
            self._sandbox = self.backend.launch(self.spec, purpose="kernel", lifetime_seconds=self.lifetime)
        self._demux = None
        return self._sandbox, b""

    def _is_kernel(self, container_id: str) -> bool:
        labels = self.backend.api.inspect_container(container_id)["Config"].get("Labels") or {}
        return labels.get("sandloop.purpose") == "kernel"

    def _drop(self, remove: bool) -> None:
        if self._sandbox is not None:
            if remove:
                self.backend.destroy(self._sandbox)
            else:
                _close_quietly(self._sandbox.attached)
        self._sandbox = None
        self._demux = None

    def run(self, code: str, timeout_seconds: float, limits: SandboxLimits) -> CellResult:
        started = time.monotonic()
        with self._locked():
            sandbox, pending = self._connect()
            nonce = secrets.token_hex(8)
            header = json.dumps({"code": len(code.encode()), "nonce": nonce}).encode()
            payload = b"SANDLOOP1 %08d\n" % len(header) + header + code.encode()
            stdout, stderr = _CappedStream(limits.output_limit), _CappedStream(limits.output_limit)
            marker = EXIT_MARKER + nonce.encode() + b":"
            if self._demux is None:
                self._demux = _Demuxer(stdout, stderr, marker)
            else:
                self._demux.reset(stdout, stderr, marker)
            demux = self._demux
            if pending:  # late output of the previous cell's threads: shown with this cell's
                demux.feed(pending)
            sandbox.sock.sendall(payload)
            finished = self.backend._pump(sandbox.sock, time.monotonic() + timeout_seconds, demux)
            timed_out = restarted = oom = False
            if not finished:
                timed_out = True
                with contextlib.suppress(Exception):
                    self.backend.api.kill(sandbox.id, signal="SIGINT")
                finished = self.backend._pump(sandbox.sock, time.monotonic() + INTERRUPT_GRACE_SECONDS, demux)
                if demux.exit_status is None:
                    restarted = True
            elif demux.exit_status is None:  # EOF: the interpreter died (OOM, or killed itself)
                restarted = True
                with contextlib.suppress(Exception):
                    state = self.backend.api.inspect_container(sandbox.id).get("State", {})
                    oom = bool(state.get("OOMKilled"))
            demux.flush()
            status = demux.exit_status
            value, omitted, artifacts = None, 0, []
            if status is not None and demux.payload:
                result = json.loads(base64.b64decode(demux.payload))
                value = result.get("value")
                omitted = int(result.get("value_omitted") or 0)
                artifacts = [
                    Artifact(name=a["name"], mime_type=a["mime"], data=base64.b64decode(a["data"]))
                    for a in result.get("artifacts", [])
                ]
            if restarted:
                self._drop(remove=True)
            if timed_out:
                exit_code = -1
            elif status is not None:
                exit_code = status
            else:
                exit_code = 137 if oom else 1
            return CellResult(
                stdout=stdout.text(),
                stderr=stderr.text(),
                stdout_base64=stdout.base64_if_binary(),
                stderr_base64=stderr.base64_if_binary(),
                exit_code=exit_code,
                duration_seconds=time.monotonic() - started,
                timed_out=timed_out,
                oom_killed=oom,
                stdout_truncated=stdout.dropped > 0,
                stderr_truncated=stderr.dropped > 0,
                stdout_dropped_bytes=stdout.dropped,
                stderr_dropped_bytes=stderr.dropped,
                language="python",
                timeout_seconds=timeout_seconds,
                limits=limits,
                value=value,
                value_omitted_chars=omitted,
                artifacts=artifacts,
                interpreter_restarted=restarted,
            )

    def close(self) -> None:
        """Detach; the interpreter keeps running for other processes (until the session ends)."""
        self._drop(remove=False)

    def shutdown(self) -> None:
        self._drop(remove=True)


def lock_file(directory: Path) -> Path:
    path = directory / "kernel.lock"
    if not path.exists():
        with contextlib.suppress(OSError):
            path.touch(mode=0o600)
            os.chmod(path, 0o600)
    return path


__all__ = ["Kernel", "lock_file"]

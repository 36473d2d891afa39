"""``FakeBackend``: a real backend with no isolation, for tests of code built on sandloop.

Like httpx's ``MockTransport``, it is a backend in full: each sandbox is a local subprocess
running the image's own entry point (``images/recipe/start.py``: the launcher, or with
``--kernel`` a session's interpreter) over the same wire protocol (``runtime/protocol.py``), so the pool,
sessions, the HTTP API and MCP run their real code paths with no engine. Labels are kept in
memory; workspaces are directories under ``<home>/fake/``.

It isolates **nothing**: the code runs as the calling user on this host, with no memory, CPU or
network limit (``info().isolated`` is False). Isolation is proven against a real engine only.

    from sandloop import Sandloop, Settings
    with Sandloop(Settings(backend="fake", home=tmp_path)) as sl:
        assert sl.run_code("print(1)").stdout == "1\\n"
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import select
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandloop.contract import CellResult, ExecutionResult, InvalidArgument, SandboxError, SandboxLimits
from sandloop.contract.egress import Secret
from sandloop.paths import default_home
from sandloop.recipe_hash import RECIPE_DIR
from sandloop.runtime import protocol, streams
from sandloop.runtime.base import BackendInfo, Owned, RunRequest, SandboxSpec, WorkspaceRef
from sandloop.runtime.labels import LABEL_PREFIX, SESSION_LABEL, owner_labels

_ids = itertools.count(1)


class PipeChannel:
    """A subprocess's stdout and stderr pipes as a protocol ``Channel``."""

    def __init__(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None and proc.stderr is not None
        self._fds = {proc.stdout.fileno(): streams.STDOUT, proc.stderr.fileno(): streams.STDERR}
        self.pending: list[tuple[int, bytes]] = []

    def read(self, timeout: float) -> list[tuple[int, bytes]] | None:
        if self.pending:
            chunks, self.pending = self.pending, []
            return chunks
        if not self._fds:
            return None
        ready, _, _ = select.select(list(self._fds), [], [], timeout)
        out = []
        for fd in ready:
            data = os.read(fd, 256 * 1024)
            if data:
                out.append((self._fds[fd], data))
            else:
                del self._fds[fd]  # this stream closed
        if not out and not self._fds:
            return None
        return out

    def drain(self) -> bool:
        """Keep what is waiting for the next read; False once both streams are closed."""
        while self._fds:
            chunks = self.read(0)
            if chunks is None:
                return False
            if not chunks:
                return True
            self.pending += chunks
        return False


@dataclass(eq=False)
class FakeSandbox:
    id: str
    spec: SandboxSpec
    started_at: float
    proc: subprocess.Popen[bytes]
    channel: PipeChannel
    directory: Path
    labels: dict[str, str]
    used: bool = False
    collector: streams.Collector | None = None
    writer: threading.Thread | None = field(default=None, repr=False)


class FakeBackend:
    name = "fake"

    def __init__(self, home: Path | None = None, *, python: str = sys.executable) -> None:
        self.root = (home or default_home()) / "fake"
        self.root.mkdir(parents=True, exist_ok=True)
        self.python = python
        self._lock = threading.Lock()
        self._sandboxes: dict[str, FakeSandbox] = {}
        self._workspaces: dict[str, tuple[Path, dict[str, str]]] = {}  # name -> (directory, labels)

    # -- sandboxes ----------------------------------------------------------------------------
    def _path_for(self, sandbox_dir: Path, spec: SandboxSpec, path: str) -> str:
        """A sandbox path on this host: /tmp is the sandbox's own directory, a mount point its workspace."""
        for name, target in spec.volumes:
            if path == target or path.startswith(target + "/"):
                return str(self._workspace_dir(name)) + path[len(target) :]
        if path == "/tmp" or path.startswith("/tmp/"):
            return str(sandbox_dir / "tmp") + path[len("/tmp") :]
        return path

    def _workspace_dir(self, name: str) -> Path:
        with self._lock:
            found = self._workspaces.get(name)
        if found is None:
            raise SandboxError(f"no workspace {name} on this fake backend")
        return found[0]

    def launch(self, spec: SandboxSpec, *, purpose: str, lifetime_seconds: float) -> FakeSandbox:
        if spec.limits.egress:  # its processes have the host's network: it must not pretend to hold them
            raise InvalidArgument(
                "the test double (fake backend) has no egress proxy: use the docker or oci backend for egress"
            )
        sandbox_id = f"fake-{os.getpid()}-{next(_ids)}"
        directory = self.root / sandbox_id
        (directory / "tmp").mkdir(parents=True)
        workspace = next((str(self._workspace_dir(n)) for n, t in spec.volumes if t == "/workspace"), "/workspace")
        env = {
            "PATH": os.environ.get("PATH", "/usr/bin:/bin"),
            "HOME": str(directory / "tmp"),
            "LANG": "C.UTF-8",
            "PYTHONUNBUFFERED": "1",
            "PYTHONDONTWRITEBYTECODE": "1",
            "MPLBACKEND": "Agg",
            "SANDLOOP_WORKSPACE": workspace,  # where the in-sandbox file helper finds /workspace
        }
        proc = subprocess.Popen(
            [self.python, str(RECIPE_DIR / "start.py"), *spec.command],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            cwd=self._path_for(directory, spec, spec.cwd),
            env=env,
            start_new_session=True,  # its own process group: destroy kills the whole tree
        )
        labels = {**owner_labels(purpose, lifetime_seconds), **dict(spec.labels)}
        sandbox = FakeSandbox(sandbox_id, spec, time.monotonic(), proc, PipeChannel(proc), directory, labels)
        with self._lock:
            self._sandboxes[sandbox_id] = sandbox
        return sandbox

    def run(self, request: RunRequest) -> ExecutionResult:
        started = time.monotonic()
        sandbox = self.launch(request.spec, purpose="run", lifetime_seconds=request.timeout_seconds)
        try:
            return self.execute(sandbox, request, started=started)
        finally:
            self.destroy(sandbox)

    def execute(self, sandbox: FakeSandbox, request: RunRequest, *, started: float | None = None) -> ExecutionResult:
        if sandbox.used:
            raise SandboxError("internal error: a sandbox was handed out twice")
        sandbox.used = True
        started = time.monotonic() if started is None else started
        deadline = time.monotonic() + request.timeout_seconds
        nonce = protocol.new_nonce()
        payload = protocol.encode_run(
            request,
            nonce,
            staging_dir=str(sandbox.directory / "tmp" / "sandloop"),
            cwd=self._path_for(sandbox.directory, sandbox.spec, request.cwd),
        )
        sandbox.writer = threading.Thread(target=self._write, args=(sandbox, payload), daemon=True)
        sandbox.writer.start()
        emit = request.on_output
        limit = request.limits.output_limit
        collector = streams.Collector(
            streams.CappedStream(limit, emit and functools.partial(emit, "stdout")),
            streams.CappedStream(limit, emit and functools.partial(emit, "stderr")),
            nonce,
        )
        finished = protocol.collect(sandbox.channel, collector, deadline)
        collector.flush()
        status = collector.exit_status
        if not finished:
            self._kill(sandbox)
            exit_code = -1
        elif status is not None and status < 128:
            exit_code = status
        else:
            try:
                rc = sandbox.proc.wait(10)
            except subprocess.TimeoutExpired:
                self._kill(sandbox)
                rc = -signal.SIGKILL
            exit_code = 128 - rc if rc < 0 else rc
        return protocol.execution_result(
            request,
            collector,
            exit_code=exit_code,
            timed_out=not finished,
            oom_killed=False,
            started=started,
            backend="fake",
        )

    @staticmethod
    def _write(sandbox: FakeSandbox, payload: bytes) -> None:
        stdin = sandbox.proc.stdin
        assert stdin is not None
        with contextlib.suppress(OSError, ValueError):
            stdin.write(payload)
            stdin.close()

    def run_cell(
        self,
        kernel: FakeSandbox,
        code: str,
        *,
        limits: SandboxLimits,
        interrupt_after: float,
        grace: float,
        secrets: Mapping[str, Secret] | None = None,
        on_output: Callable[[str, bytes], None] | None = None,
        cancel: threading.Event | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> CellResult:
        if secrets:
            raise InvalidArgument("the test double (fake backend) has no egress proxy: secrets need docker or oci")
        started = time.monotonic()
        nonce = protocol.new_nonce()
        collector = kernel.collector = protocol.cell_collector(kernel.collector, limits.output_limit, nonce, on_output)
        stdin = kernel.proc.stdin
        assert stdin is not None
        try:
            stdin.write(protocol.encode_cell(code, nonce, options=options))
            stdin.flush()
        except OSError:
            pass  # the interpreter is gone: collecting sees EOF and the result says so
        timed_out, gone = protocol.await_cell(
            kernel.channel,
            collector,
            interrupt_after=interrupt_after,
            grace=grace,
            interrupt=lambda: kernel.proc.send_signal(signal.SIGINT),
            cancel=cancel,
        )
        return protocol.cell_result(
            collector,
            limits=limits,
            timeout_seconds=interrupt_after,
            timed_out=timed_out,
            oom_killed=False,
            interpreter_restarted=gone,
            started=started,
        )

    def find_kernel(self, session_id: str, spec: SandboxSpec) -> FakeSandbox | None:
        """This backend's running interpreter of the session (in this process only)."""
        with self._lock:
            for sandbox in self._sandboxes.values():
                labels = sandbox.labels
                ours = labels.get(SESSION_LABEL) == session_id and labels.get(f"{LABEL_PREFIX}purpose") == "kernel"
                if ours and sandbox.proc.poll() is None:
                    return sandbox
        return None

    def is_alive(self, sandbox: FakeSandbox) -> bool:
        return sandbox.proc.poll() is None and sandbox.channel.drain()

    def has_image(self, image: str) -> bool:
        return True

    def detach(self, sandbox: FakeSandbox) -> None:
        """The interpreter keeps running; ``find_kernel`` hands the same one out again."""

    def destroy(self, sandbox: FakeSandbox) -> None:
        with self._lock:
            self._sandboxes.pop(sandbox.id, None)
        self._kill(sandbox)
        for pipe in (sandbox.proc.stdin, sandbox.proc.stdout, sandbox.proc.stderr):
            if pipe is not None:
                with contextlib.suppress(Exception):
                    pipe.close()
        if sandbox.writer is not None:
            sandbox.writer.join(5)
        shutil.rmtree(sandbox.directory, ignore_errors=True)

    @staticmethod
    def _kill(sandbox: FakeSandbox) -> None:
        with contextlib.suppress(OSError):
            os.killpg(sandbox.proc.pid, signal.SIGKILL)
        with contextlib.suppress(Exception):
            sandbox.proc.wait(10)

    def info(self) -> BackendInfo:
        return BackendInfo(
            name=self.name,
            version="1",
            runtimes=("runc", "runsc"),  # accepted and ignored: nothing here isolates
            quotas_enforced=False,
            isolated=False,
            details={"python": self.python},
        )

    def image_builder(self) -> None:
        """The test double builds no templates (its sandboxes are local processes)."""
        return None

    def close(self) -> None:
        with self._lock:
            sandboxes = list(self._sandboxes.values())
        for sandbox in sandboxes:
            if sandbox.labels.get(f"{LABEL_PREFIX}purpose") != "kernel":
                self.destroy(sandbox)

    # -- workspaces ---------------------------------------------------------------------------
    def create_workspace(self, session_id: str, quota_bytes: int, owner_uid_gid: str) -> WorkspaceRef:
        name = f"fake-ws-{session_id}"
        directory = self.root / name
        directory.mkdir(parents=True, exist_ok=True)
        labels = {f"{LABEL_PREFIX}owner": f"session:{session_id}", SESSION_LABEL: session_id}
        with self._lock:
            self._workspaces[name] = (directory, labels)
        return WorkspaceRef(name, quota_enforced=False)

    def ensure_workspace(self, session_id: str, ref: WorkspaceRef) -> None:
        directory = self.root / ref.name
        directory.mkdir(parents=True, exist_ok=True)
        labels = {f"{LABEL_PREFIX}owner": f"session:{session_id}", SESSION_LABEL: session_id}
        with self._lock:
            self._workspaces.setdefault(ref.name, (directory, labels))

    def workspace_on_host(self, session_id: str, ref: WorkspaceRef) -> Path | None:
        directory = self.root / ref.name
        return directory if directory.is_dir() else None

    def delete_workspace(self, session_id: str) -> None:
        name = f"fake-ws-{session_id}"
        with self._lock:
            self._workspaces.pop(name, None)
        shutil.rmtree(self.root / name, ignore_errors=True)

    # -- housekeeping -------------------------------------------------------------------------
    def owned(self) -> list[Owned]:
        with self._lock:
            out = [Owned("sandbox", s.id, dict(s.labels)) for s in self._sandboxes.values()]
            out += [Owned("workspace", name, dict(labels)) for name, (_, labels) in self._workspaces.items()]
        return out

    def remove(self, item: Owned) -> str | None:
        if item.kind == "sandbox":
            with self._lock:
                sandbox = self._sandboxes.get(item.id)
            if sandbox is not None:
                self.destroy(sandbox)
        else:
            with self._lock:
                found = self._workspaces.pop(item.id, None)
            if found is not None:
                shutil.rmtree(found[0], ignore_errors=True)
        return None

    def remove_labelled(self, label: str, value: str) -> int:
        with self._lock:
            found = [s for s in self._sandboxes.values() if s.labels.get(label) == value]
        for sandbox in found:
            self.destroy(sandbox)
        return len(found)

    def retry_removals(self) -> int:
        return 0

    def sweep_orphans(self, min_age: float | None = None) -> int:
        return 0  # its sandboxes are this process's children: none can be orphaned

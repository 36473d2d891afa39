"""The Docker engine backend (dockerd, with runc or runsc).

Each run: create a hardened container (stdin open, log driver none), attach to it *before*
starting it, start it, send the launcher payload on stdin, read the multiplexed stdout/stderr
stream against a wall-clock deadline while capping what is kept, then collect the exit status.
The container is force-removed whatever happened; cleanup never raises.
"""

from __future__ import annotations

import contextlib
import datetime
import logging
import socket
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import docker
import docker.errors
from sandloop.contract import (
    CellResult,
    EngineUnavailable,
    ExecutionResult,
    InvalidArgument,
    SandboxError,
    SandboxLimits,
)
from sandloop.contract.egress import Secret
from sandloop.paths import default_home
from sandloop.runtime import pagecache, protocol, streams
from sandloop.runtime.base import BackendInfo, RunRequest, SandboxSpec, WorkspaceRef
from sandloop.runtime.cgroup import memory_oom_kills
from sandloop.runtime.docker.builder import DockerBuilder
from sandloop.runtime.docker.errors import engine_errors
from sandloop.runtime.docker.exec import DockerExecStream
from sandloop.runtime.docker.hardening import container_config, egress_relayed
from sandloop.runtime.docker.health import EngineBreaker
from sandloop.runtime.docker.housekeeping import DockerHousekeeping
from sandloop.runtime.docker.stream import SocketChannel
from sandloop.runtime.docker.workspace import DockerWorkspaces, can_enforce_quotas
from sandloop.runtime.egress import EgressProxy
from sandloop.runtime.egress.host import egress_state, kernel_egress_key
from sandloop.runtime.labels import LABEL_PREFIX, SESSION_LABEL

log = logging.getLogger(__name__)

#: Payloads up to this size are written inline; larger ones from a thread (the code may never read
#: its stdin, and a blocked write must not hold up the deadline).
_INLINE_PAYLOAD = 64 * 1024
_LIVE: set[str] = set()
#: Docker refuses memory limits below 6 MiB.
MIN_MEMORY_BYTES = 6 * 1024 * 1024
#: How long a sandbox that died whole by SIGKILL waits for the engine's word on an OOM kill.
OOM_EVENT_WAIT = 10.0


@dataclass(eq=False)
class LiveSandbox:
    """A started container whose launcher waits for a program (or, for a session's interpreter,
    for cells). A run's sandbox is used once, then destroyed."""

    id: str
    channel: SocketChannel
    spec: SandboxSpec
    started_at: float
    used: bool = False
    writer: threading.Thread | None = None
    #: A session interpreter's collector for its last cell (output after its end line carries over).
    collector: streams.Collector | None = None
    #: Its key with the egress proxy, when it has an allowlist.
    egress: str | None = None
    #: Interrupts its cell (SIGINT to its PID 1); None: through the engine. A sandbox the engine
    #: does not know (a direct session interpreter, ``runtime/oci/kernels.py``) brings its own,
    #: with its memory cgroup's path below the controller's root.
    interrupt: Callable[[], None] | None = None
    cgroup: str = ""

    @property
    def sock(self) -> socket.socket:
        return self.channel.sock


class DockerBackend(DockerHousekeeping):
    """Runs each request in a fresh, hardened, single-use container on a Docker engine."""

    name = "docker"

    def __init__(
        self,
        base_url: str | None = None,
        *,
        call_timeout: float = 30.0,
        home: Path | None = None,
        egress_hosts: Mapping[str, str] | None = None,
        egress_upstream_ca: Path | None = None,
    ) -> None:
        self._base_url = base_url
        self._egress_hosts = dict(egress_hosts or {})
        self._egress_upstream_ca = egress_upstream_ca
        self._home = home or default_home()
        self._egress: EgressProxy | None = None
        self._call_timeout = call_timeout
        self._api: docker.APIClient | None = None
        self._lock = threading.Lock()
        self.workspaces = DockerWorkspaces(lambda: self.api, home or default_home())
        #: Containers whose removal failed (engine down or overloaded), retried by ``retry_removals``,
        #: with how many times each failed.
        self._graveyard: dict[str, int] = {}
        self._graveyard_lock = threading.Lock()
        #: Containers the engine keeps refusing to remove (dead, root busy): reported once, not retried.
        self.unremovable: dict[str, str] = {}
        #: Containers launched in this process (by any backend object) and not yet removed: never
        #: swept as orphans. Process-wide, as the owner label is the process's.
        self._live = _LIVE
        self.breaker = EngineBreaker(self._ping, self._recover)

    # -- engine connection -------------------------------------------------------------------
    @property
    def api(self) -> docker.APIClient:
        with self._lock:
            if self._api is None:
                with engine_errors():
                    if self._base_url:
                        client = docker.APIClient(
                            base_url=self._base_url, version="auto", timeout=self._call_timeout, max_pool_size=64
                        )
                    else:
                        client = docker.from_env(timeout=int(self._call_timeout), max_pool_size=64).api
                    # No proxy settings from the environment: the engine's socket takes none, and
                    # requests re-read them on every call by iterating os.environ, which raises
                    # KeyError when another thread changes the environment meanwhile (ci11: a pool
                    # refill failed on pytest's PYTEST_CURRENT_TEST; 1,034 of 1,500 calls, measured).
                    client.trust_env = False
                    client.ping()
                self._api = client
            return self._api

    def _ping(self) -> None:
        self.api.ping()

    def _recover(self) -> None:
        """The engine answers again: retry failed removals, remove what the outage orphaned."""
        self.retry_removals()
        self.sweep_orphans()

    @property
    def egress(self) -> EgressProxy:
        """The egress proxy, started on first use (a sandbox with an allowlist)."""
        with self._lock:
            if self._egress is None:
                self._egress = EgressProxy(
                    egress_state(),
                    hosts=self._egress_hosts,
                    ca_dir=self._home / "egress-ca",
                    upstream_ca=str(self._egress_upstream_ca) if self._egress_upstream_ca else None,
                )
                self._egress.collect_garbage()
            return self._egress

    def _egress_dirs(self) -> EgressProxy:
        """The proxy if this process runs one, else a view of the sockets' directories that serves
        nothing (housekeeping must not start a proxy, or collect garbage, to remove a directory)."""
        return self._egress or EgressProxy(egress_state())

    def image_builder(self) -> DockerBuilder:
        """Template build steps on this engine (``runtime/docker/builder.py``)."""
        return DockerBuilder(lambda: self.api)

    def close(self) -> None:
        with self._lock:
            if self._egress is not None:
                self._egress.shutdown()
                self._egress = None
            if self._api is not None:
                with contextlib.suppress(Exception):
                    self._api.close()
                self._api = None

    def engine_info(self) -> dict[str, Any]:
        """The engine's own ``docker info``."""
        with engine_errors():
            info: dict[str, Any] = self.api.info()
        return info

    def info(self) -> BackendInfo:
        raw = self.engine_info()
        return BackendInfo(
            name=self.name,
            version=str(raw.get("ServerVersion", "?")),
            runtimes=tuple(sorted(raw.get("Runtimes") or {})),
            quotas_enforced=can_enforce_quotas(),
            isolated=True,
            min_memory_bytes=MIN_MEMORY_BYTES,
            details={
                "storage driver": str(raw.get("Driver", "?")),
                "cgroup": f"v{raw.get('CgroupVersion', '?')} ({raw.get('CgroupDriver', '?')})",
                "default runtime": str(raw.get("DefaultRuntime", "?")),
            },
        )

    def has_image(self, image: str) -> bool:
        with engine_errors(image):
            try:
                self.api.inspect_image(image)
            except docker.errors.ImageNotFound:
                return False
            return True

    def prefetch_image(self, image: str, *, wait: bool = False, force: bool = False) -> None:
        """Read the image's programs and libraries into the page cache from the host, once in a
        while per process (see ``runtime/pagecache.py``: otherwise a memory hog can thrash on its own code
        until the timeout instead of being OOM-killed). Only where the engine's storage is local."""

        def layer_dirs() -> list[Path]:
            data = self.api.inspect_image(image).get("GraphDriver") or {}
            if data.get("Name") not in ("overlay2", "overlay"):
                return []
            fields = data.get("Data") or {}
            dirs = [*(fields.get("LowerDir") or "").split(":"), fields.get("UpperDir") or ""]
            return [Path(d) for d in dirs if d and Path(d).is_dir()]

        pagecache.prefetch_once(f"docker:{image}", layer_dirs, wait=wait, force=force)

    # -- one run -----------------------------------------------------------------------------
    def run(self, request: RunRequest) -> ExecutionResult:
        """Cold path: launch a sandbox for this request, run it, destroy it (always)."""
        started = time.monotonic()
        sandbox: LiveSandbox | None = None
        try:
            sandbox = self.launch(request.spec, purpose="run", lifetime_seconds=request.timeout_seconds)
            return self.execute(sandbox, request, started=started)
        finally:
            if sandbox is not None:
                self.destroy(sandbox)

    def launch(self, spec: SandboxSpec, *, purpose: str, lifetime_seconds: float) -> LiveSandbox:
        """Create, attach to and start a sandbox whose launcher then waits for a program."""
        self.breaker.check()
        try:
            api = self.api
        except EngineUnavailable as exc:
            self.breaker.failed(exc)
            raise
        self.prefetch_image(spec.image)
        container_id: str | None = None
        attached: Any = None
        egress: str | None = None
        try:
            egress_dir = None
            if spec.limits.egress:
                session = dict(spec.labels).get(SESSION_LABEL)
                if purpose == "kernel" and session:  # outlives this process: owned by its session
                    egress = kernel_egress_key(session)
                    self.egress.close(egress)  # what a replaced interpreter left
                    egress_dir = str(self.egress.open(egress, spec.limits.egress, owner=f"session:{session}"))
                else:
                    egress = f"e-{uuid.uuid4().hex[:20]}"
                    egress_dir = str(self.egress.open(egress, spec.limits.egress))
            with self._watch(), engine_errors(spec.image, spec.limits.runtime):
                kwargs = container_config(api, spec, purpose, lifetime_seconds, egress_dir)
                if spec.command:
                    # A long-lived interpreter: stdin must stay open when one attached client goes.
                    config = api.create_container_config(**kwargs)
                    config["StdinOnce"] = False
                    container_id = api.create_container_from_config(config)["Id"]
                else:
                    container_id = api.create_container(**kwargs)["Id"]
                with self._graveyard_lock:
                    self._live.add(container_id)
                attached = api.attach_socket(container_id, params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1})
                api.start(container_id)
                if egress is not None and not egress_relayed(spec.limits):
                    self.egress.listen_in(egress, int(api.inspect_container(container_id)["State"]["Pid"]))
            return LiveSandbox(container_id, SocketChannel(attached), spec, time.monotonic(), egress=egress)
        except BaseException:
            if attached is not None:
                SocketChannel(attached).close()
            if container_id is not None:
                self._remove(container_id)
            if egress is not None:
                self.egress.close(egress)
            raise

    def is_alive(self, sandbox: LiveSandbox) -> bool:
        """Whether the connection is open; what the sandbox wrote meanwhile is kept for the next read."""
        return sandbox.channel.drain()

    def execute(self, sandbox: LiveSandbox, request: RunRequest, *, started: float | None = None) -> ExecutionResult:
        """Send the program to a started sandbox and collect the result. Single use: destroy after."""
        if sandbox.used:
            raise SandboxError("internal error: a sandbox was handed out twice")
        sandbox.used = True
        started = time.monotonic() if started is None else started

        def send(payload: bytes) -> None:
            sandbox.writer = self._send(sandbox.sock, payload)

        def exit_status(reported: int | None) -> tuple[int, bool]:
            with engine_errors(request.image, request.limits.runtime):
                return self._exit_status(sandbox.id, reported)

        def stop() -> None:
            # Stop reading first: a program still flooding its output keeps the engine blocked
            # writing to this stream, and the engine finishes a kill only after its stream
            # copiers do (seen: kill hung for the whole 30 s call timeout).
            sandbox.channel.close()
            with engine_errors(request.image, request.limits.runtime), contextlib.suppress(docker.errors.APIError):
                self.api.kill(sandbox.id)

        env, ca_pem = self._arm(sandbox, request.secrets)  # the code sees placeholders only
        result = protocol.run_program(
            sandbox.channel,
            request,
            send=send,
            exit_status=exit_status,
            stop=stop,
            started=started,
            backend=self.name,
            env=env,
            ca_pem=ca_pem,
        )
        if sandbox.egress is not None:
            result = result.model_copy(update={"egress": self.egress.attempts(sandbox.egress)})
        return result

    def exec_stream(self, kernel: LiveSandbox, argv: list[str]) -> DockerExecStream:
        with engine_errors(kernel.spec.image, kernel.spec.limits.runtime):
            return DockerExecStream(self.api, kernel.id, argv)

    # -- a session's interpreter ---------------------------------------------------------------
    def run_cell(
        self,
        kernel: LiveSandbox,
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
        nonce = protocol.new_nonce()
        env, ca_pem = self._arm(kernel, secrets)
        collector = kernel.collector = protocol.cell_collector(kernel.collector, limits.output_limit, nonce, on_output)
        try:
            return self._cell(
                kernel, code, nonce, env, ca_pem, collector, limits, interrupt_after, grace, cancel, options
            )
        finally:
            if env and kernel.egress is not None:  # a secret lives for its cell (issue 27 #6)
                self.egress.disarm(kernel.egress, env)

    def _cell(
        self,
        kernel: LiveSandbox,
        code: str,
        nonce: str,
        env: dict[str, str] | None,
        ca_pem: str | None,
        collector: Any,
        limits: SandboxLimits,
        interrupt_after: float,
        grace: float,
        cancel: threading.Event | None,
        options: Mapping[str, Any] | None = None,
    ) -> CellResult:
        started = time.monotonic()
        seen_before = self.egress.attempt_count(kernel.egress) if kernel.egress else 0
        cgroup = kernel.cgroup or f"docker/{kernel.id}"
        oom_before = memory_oom_kills(cgroup)
        try:
            kernel.sock.sendall(protocol.encode_cell(code, nonce, env=env, ca_pem=ca_pem, options=options))
        except OSError as exc:
            # The stream broke under us (the engine died or restarted). Part of the cell may have
            # reached the interpreter, which would then read the next cell as the rest of this
            # one: it cannot be trusted again, so the result says it is replaced (seen in the
            # chaos suite: a raw BrokenPipeError escaped here and the caller lost the session).
            log.warning("session interpreter %s: the cell could not be sent (%s): replacing it", kernel.id[:12], exc)
            timed_out, gone = False, True
        else:
            timed_out, gone = protocol.await_cell(
                kernel.channel,
                collector,
                interrupt_after=interrupt_after,
                grace=grace,
                interrupt=kernel.interrupt or (lambda: self.api.kill(kernel.id, signal="SIGINT")),
                cancel=cancel,
            )
        oom = False
        if gone and not timed_out:
            oom = memory_oom_kills(cgroup) > oom_before  # exact while the cgroup is there
            if not oom and not kernel.cgroup:
                with contextlib.suppress(Exception):
                    # its stream ended: the container is exiting (a bounded wait: an engine that
                    # lost the stream while the container lives must not hold the cell)
                    waited = self.api.wait(kernel.id, timeout=min(self._call_timeout, OOM_EVENT_WAIT))
                    exit_code = int(waited.get("StatusCode", -1))
                    oom = self._engine_saw_oom(kernel.id, wait=exit_code == 137)
        result = protocol.cell_result(
            collector,
            limits=limits,
            timeout_seconds=interrupt_after,
            timed_out=timed_out,
            oom_killed=oom,
            interpreter_restarted=gone,
            started=started,
        )
        # one context was killed and replaced (kernel.py): by the memory limit if the container's
        # memory cgroup counted an OOM kill during the cell
        context_killed = result.interpreter_restarted and not result.sandbox_replaced and result.exit_code == 137
        if context_killed and memory_oom_kills(cgroup) > oom_before:
            result = result.model_copy(update={"oom_killed": True})
        if kernel.egress is not None:  # what this cell tried (as seen by this process)
            cell_attempts = self.egress.attempts(kernel.egress, settle=0.1)[seen_before:]
            result = result.model_copy(update={"egress": cell_attempts})
        return result

    def _arm(
        self, sandbox: LiveSandbox, secrets: Mapping[str, Secret] | None
    ) -> tuple[dict[str, str] | None, str | None]:
        """Secrets' placeholders for a program's environment, and the CA it must trust."""
        if not secrets:
            return None, None
        if sandbox.egress is None:
            raise InvalidArgument("secrets need an egress allowlist that names their hosts (limits.egress)")
        return self.egress.arm(sandbox.egress, secrets), self.egress.authority.cert_pem

    def find_kernel(self, session_id: str, spec: SandboxSpec) -> LiveSandbox | None:
        with engine_errors(spec.image, spec.limits.runtime):
            found = self.api.containers(
                filters={
                    "label": [f"{SESSION_LABEL}={session_id}", f"{LABEL_PREFIX}purpose=kernel"],
                    "status": "running",
                }
            )
            with self._graveyard_lock:  # one condemned while the engine was away is not reused
                found = [c for c in found if c["Id"] not in self._graveyard]
            if not found:
                return None
            attached = self.api.attach_socket(
                found[0]["Id"], params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1}
            )
        sandbox = LiveSandbox(found[0]["Id"], SocketChannel(attached), spec, time.monotonic())
        if spec.limits.egress:  # serve its egress from this process too
            try:
                sandbox.egress = kernel_egress_key(session_id)
                self.egress.reopen(sandbox.egress, spec.limits.egress)
                if not egress_relayed(spec.limits):
                    with engine_errors(spec.image, spec.limits.runtime):
                        pid = int(self.api.inspect_container(sandbox.id)["State"]["Pid"])
                    self.egress.listen_in(sandbox.egress, pid)
            except (OSError, SandboxError) as exc:
                log.warning(
                    "session %s: cannot serve its interpreter's egress (%s): starting a new one", session_id, exc
                )
                self.destroy(sandbox)
                return None
        return sandbox

    def detach(self, sandbox: LiveSandbox) -> None:
        sandbox.channel.close()
        if sandbox.egress is not None:
            self.egress.release(sandbox.egress)  # the interpreter lives on; the next attach serves it

    def destroy(self, sandbox: LiveSandbox) -> None:
        """Close the stream and force-remove the container. Best effort: never raises."""
        sandbox.channel.close()
        if sandbox.writer is not None:
            sandbox.writer.join(5)  # closing the socket unblocks a write the code never read
        self._remove(sandbox.id)
        if sandbox.egress is not None:
            self.egress.close(sandbox.egress)

    @staticmethod
    def _send(sock: socket.socket, payload: bytes) -> threading.Thread | None:
        def write() -> None:
            try:
                sock.sendall(payload)
                sock.shutdown(socket.SHUT_WR)
            except OSError:
                pass  # the container exited or was killed before reading everything

        if len(payload) <= _INLINE_PAYLOAD:
            write()
            return None
        thread = threading.Thread(target=write, name="sandloop-stdin", daemon=True)
        thread.start()
        return thread

    def _exit_status(self, container_id: str, reported: int | None = None) -> tuple[int, bool]:
        status = self.api.wait(container_id, timeout=self._call_timeout)
        code = int(status.get("StatusCode", -1)) if reported is None else reported
        oom = False
        if code != 0:
            # The launcher died with the sandbox (nothing reported): under runsc the kernel's OOM
            # killer takes the whole Sentry, and the engine may record it after the exit.
            oom = self._engine_saw_oom(container_id, wait=code == 137 and reported is None)
        return code, oom

    def _engine_saw_oom(self, container_id: str, *, wait: bool) -> bool:
        """Whether the engine recorded an OOM kill of this (exited) container.

        The engine's OOM event can be handled after the exit (seen under runsc in CI: 137 with
        ``OOMKilled`` false, and the container's memory cgroup, with its exact count, already
        removed by the runtime's delete). With ``wait`` the engine's event log is read from the
        container's creation until its ``oom`` event or ``OOM_EVENT_WAIT`` seconds: the wait is
        paid only by a sandbox that died whole by SIGKILL without the engine saying why yet.
        """
        state = self.api.inspect_container(container_id)
        if state.get("State", {}).get("OOMKilled"):
            return True
        if not wait:
            return False
        created = _timestamp(state.get("Created")) or time.time() - 3600
        events = self.api.events(
            since=int(created) - 1,
            until=int(time.time() + OOM_EVENT_WAIT),
            filters={"container": container_id, "event": "oom"},
            decode=True,
        )
        try:
            return any(True for _ in events)
        finally:
            events.close()

    # -- workspaces ---------------------------------------------------------------------------
    def create_workspace(self, session_id: str, quota_bytes: int, owner_uid_gid: str) -> WorkspaceRef:
        return self.workspaces.create(session_id, quota_bytes, owner_uid_gid)

    def ensure_workspace(self, session_id: str, ref: WorkspaceRef) -> None:
        self.workspaces.ensure(session_id, ref)

    def delete_workspace(self, session_id: str) -> None:
        self.workspaces.delete(session_id)
        self._egress_dirs().close(kernel_egress_key(session_id))  # its interpreter's, if it had an allowlist

    def workspace_on_host(self, session_id: str, ref: WorkspaceRef) -> Path | None:
        return self.workspaces.on_host(session_id, ref)


def _timestamp(text: str | None) -> float | None:
    """Seconds since the epoch of the engine's RFC 3339 time (nanoseconds cut to micro)."""
    if not text:
        return None
    head = text.rstrip("Z").partition(".")[0]
    try:
        return datetime.datetime.fromisoformat(head).replace(tzinfo=datetime.UTC).timestamp()
    except ValueError:
        return None

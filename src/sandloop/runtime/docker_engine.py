"""The Docker engine backend. The only module in sandloop that imports ``docker``.

Each run: create a hardened container (stdin open, log driver none), attach to it *before*
starting it, start it, send the launcher payload on stdin, read the multiplexed stdout/stderr
stream against a wall-clock deadline while capping what is kept, then collect the exit status.
The container is force-removed in a ``finally`` whatever happened; cleanup never raises.

Docker and requests exceptions are mapped to sandloop's errors in exactly one place,
``engine_errors()``.
"""

from __future__ import annotations

import base64
import contextlib
import functools
import json
import logging
import os
import secrets
import select
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from importlib import resources
from typing import Any

import docker
import docker.errors
import requests.exceptions
from docker.types import LogConfig, Mount, Ulimit

from sandloop.contract import (
    EngineUnavailable,
    ExecutionResult,
    ImageMissing,
    InvalidLimits,
    RuntimeUnavailable,
    SandboxError,
)
from sandloop.runtime.base import EXIT_MARKER, RunRequest, SandboxSpec
from sandloop.runtime.labels import LABEL_PREFIX, owner_alive, owner_id, owner_labels  # noqa: F401

log = logging.getLogger(__name__)

#: Seconds any single engine call may take before we give up on the engine.
ENGINE_CALL_TIMEOUT = float(os.environ.get("SANDLOOP_ENGINE_TIMEOUT", "30"))
#: Payloads up to this size are written inline; larger ones from a thread (the code may never read
#: its stdin, and a blocked write must not hold up the deadline).
_INLINE_PAYLOAD = 64 * 1024
#: The environment every sandbox gets. Nothing from the host's environment is passed in.
SANDBOX_ENV = {
    "PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin",
    "HOME": "/tmp",
    "LANG": "C.UTF-8",
    "PYTHONUNBUFFERED": "1",
    "PYTHONDONTWRITEBYTECODE": "1",
    "MPLBACKEND": "Agg",
    "MPLCONFIGDIR": "/tmp/.matplotlib",
}


@contextlib.contextmanager
def engine_errors(image: str | None = None, runtime: str | None = None) -> Iterator[None]:
    """Map docker-py and requests exceptions to sandloop's ``SandboxError`` tree."""
    try:
        yield
    except SandboxError:
        raise
    except docker.errors.ImageNotFound as exc:
        raise ImageMissing(
            f"image {image!r} is not on this Docker engine. Build it with `sandloop images build` (or `make images`)."
        ) from exc
    except docker.errors.APIError as exc:
        text = str(exc.explanation or exc)
        lowered = text.lower()
        if "runtime" in lowered and ("unknown" in lowered or "not found" in lowered or "no such" in lowered):
            raise RuntimeUnavailable(
                f"the Docker engine has no {runtime!r} runtime ({text}). Register gVisor with "
                "scripts/engine-up.sh, or use runtime='runc'."
            ) from exc
        if exc.status_code == 404 and "image" in lowered:
            raise ImageMissing(
                f"image {image!r} is not on this Docker engine. Build it with `sandloop images build`."
            ) from exc
        if exc.status_code is not None and 400 <= exc.status_code < 500 and exc.status_code != 404:
            raise InvalidLimits(f"the Docker engine refused these limits: {text}") from exc
        raise EngineUnavailable(f"the Docker engine failed: {text}") from exc
    except (requests.exceptions.ConnectionError, requests.exceptions.Timeout) as exc:
        raise EngineUnavailable(
            f"the Docker engine did not answer ({type(exc).__name__}). Start it with "
            "scripts/engine-up.sh (or your system's service manager) and check `docker info`."
        ) from exc
    except docker.errors.DockerException as exc:
        raise EngineUnavailable(
            f"cannot reach a Docker engine: {exc}. Start one with scripts/engine-up.sh, "
            "or set DOCKER_HOST, then check `docker info`."
        ) from exc


class _CappedStream:
    """Keeps the first ``limit`` bytes of a stream and counts the rest, never storing it."""

    __slots__ = ("data", "dropped", "limit", "on_kept")

    def __init__(self, limit: int, on_kept: Any = None) -> None:
        self.limit = limit
        self.data = bytearray()
        self.dropped = 0
        #: Called with each piece of kept output as it arrives (streaming to a caller).
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


class _EndWatch:
    """Passes one stream's bytes to its sink until the launcher's end-of-run line appears in it.

    A few bytes are held back so a line split across frames is still found.
    """

    def __init__(self, sink: _CappedStream, marker: bytes | None) -> None:
        self.sink = sink
        self.marker = marker
        self.held = b""
        self.status: int | None = None
        self.payload = b""
        #: Output after the end line (a thread still printing). A one-shot run drops it with its
        #: sandbox; a session's interpreter shows it with the next cell (``_Demuxer.reset``).
        self.after = bytearray()

    def feed(self, chunk: bytes | memoryview) -> None:
        if self.status is not None:
            if len(self.after) < self.sink.limit:
                self.after += chunk[: self.sink.limit - len(self.after)]
            return
        if self.marker is None:
            self.sink.feed(chunk)
            return
        data = self.held + bytes(chunk)
        at = data.find(self.marker)
        if at >= 0:
            end = data.find(b"\n", at)
            self.sink.feed(data[:at])
            if end < 0:  # the status digits have not all arrived yet
                self.held = data[at:]
                return
            self.held = b""
            status, _, payload = data[at + len(self.marker) : end].partition(b":")
            try:
                self.status = int(status)
                self.payload = payload
            except ValueError:
                self.sink.feed(data[at : end + 1])  # not ours after all
                self.feed(data[end + 1 :])
                return
            self.feed(data[end + 1 :])  # kept in self.after
            return
        cut = max(0, len(data) - (len(self.marker) - 1))
        nul = data.find(b"\0", cut)
        cut = nul if nul >= 0 else len(data)
        self.sink.feed(data[:cut])
        self.held = data[cut:]

    def flush(self) -> None:
        if self.held:
            self.sink.feed(self.held)
            self.held = b""


class _Demuxer:
    """Incremental parser for Docker's multiplexed attach stream (8-byte frame headers).

    Routes payload bytes as they arrive, so a frame is never buffered whole. The launcher ends
    each stream with its end-of-run line (``marker``); the engine forwards the two streams
    independently, so the run is over only when both have ended (``exit_status`` is then set).
    """

    def __init__(self, stdout: _CappedStream, stderr: _CappedStream, marker: bytes | None = None) -> None:
        self._watches = {1: _EndWatch(stdout, marker), 2: _EndWatch(stderr, marker)}
        self._header = bytearray()
        self._remaining = 0
        self._watch: _EndWatch | None = None

    @property
    def exit_status(self) -> int | None:
        out, err = self._watches[1].status, self._watches[2].status
        return err if out is not None and err is not None else None

    @property
    def payload(self) -> bytes:
        """What the stdout end line carried after the status (a kernel's cell result)."""
        return self._watches[1].payload

    def reset(self, stdout: _CappedStream, stderr: _CappedStream, marker: bytes) -> None:
        """Watch for the next end line on the same connection (keeps the frame parser's state).
        Output that came after the previous end line goes to the new sinks first."""
        old = self._watches
        self._watches = {1: _EndWatch(stdout, marker), 2: _EndWatch(stderr, marker)}
        for fd, watch in old.items():
            if watch.after:
                self._watches[fd].feed(bytes(watch.after))

    def feed(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            if self._remaining == 0:
                need = 8 - len(self._header)
                self._header += view[:need]
                view = view[need:]
                if len(self._header) < 8:
                    return
                self._watch = self._watches.get(self._header[0])
                self._remaining = int.from_bytes(self._header[4:8], "big")
                self._header.clear()
                continue
            take = view[: self._remaining]
            self._remaining -= len(take)
            view = view[len(take) :]
            if self._watch is not None:
                self._watch.feed(take)

    def flush(self) -> None:
        """End of stream: whatever was held back was the program's own output."""
        for watch in self._watches.values():
            watch.flush()


def _raw_socket(attached: Any) -> socket.socket:
    return getattr(attached, "_sock", attached)


def _close_quietly(attached: Any) -> None:
    with contextlib.suppress(Exception):
        _raw_socket(attached).close()
    with contextlib.suppress(Exception):
        attached.close()


@dataclass(eq=False)
class LiveSandbox:
    """A started container whose launcher is waiting for one program. Used once, then destroyed."""

    id: str
    attached: Any
    spec: SandboxSpec
    started_at: float
    used: bool = False
    writer: threading.Thread | None = None

    @property
    def sock(self) -> socket.socket:
        return _raw_socket(self.attached)


@functools.cache
def _sandloop_seccomp() -> str:
    return json.dumps(json.loads(resources.files("sandloop.runtime").joinpath("seccomp.json").read_text()))


def seccomp_options(profile: str) -> list[str]:
    """security_opt entries for a profile name: sandloop's own (see scripts/make-seccomp.py)."""
    return [f"seccomp={_sandloop_seccomp()}"] if profile == "sandloop" else []


#: Containers whose removal failed (engine down or overloaded), retried by any backend in this
#: process (``retry_removals``), so one closed dispatcher's leftovers are not orphaned.
_graveyard: set[str] = set()
_graveyard_lock = threading.Lock()


class DockerBackend:
    """Runs each request in a fresh, hardened, single-use container on a Docker engine."""

    def __init__(self, base_url: str | None = None, *, call_timeout: float = ENGINE_CALL_TIMEOUT) -> None:
        self._base_url = base_url
        self._call_timeout = call_timeout
        self._api: docker.APIClient | None = None
        self._lock = threading.Lock()

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
                    client.ping()
                self._api = client
            return self._api

    def close(self) -> None:
        with self._lock:
            if self._api is not None:
                with contextlib.suppress(Exception):
                    self._api.close()
                self._api = None

    def info(self) -> dict[str, Any]:
        with engine_errors():
            return self.api.info()

    def image_exists(self, image: str) -> bool:
        with engine_errors(image):
            try:
                self.api.inspect_image(image)
            except docker.errors.ImageNotFound:
                return False
            return True

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
        api = self.api
        container_id: str | None = None
        attached: Any = None
        try:
            with engine_errors(spec.image, spec.limits.runtime):
                kwargs = self.container_config(spec, purpose, lifetime_seconds)
                if spec.command:
                    # A long-lived interpreter: stdin must stay open when one attached client goes.
                    config = api.create_container_config(**kwargs)
                    config["StdinOnce"] = False
                    container_id = api.create_container_from_config(config)["Id"]
                else:
                    container_id = api.create_container(**kwargs)["Id"]
                attached = api.attach_socket(container_id, params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1})
                api.start(container_id)
            return LiveSandbox(container_id, attached, spec, time.monotonic())
        except BaseException:
            if attached is not None:
                _close_quietly(attached)
            if container_id is not None:
                self._remove(container_id)
            raise

    def is_alive(self, sandbox: LiveSandbox) -> bool:
        """A waiting launcher writes nothing: a readable socket means EOF (the sandbox died)."""
        try:
            ready, _, _ = select.select([sandbox.sock], [], [], 0)
        except (OSError, ValueError):
            return False
        return not ready

    def execute(self, sandbox: LiveSandbox, request: RunRequest, *, started: float | None = None) -> ExecutionResult:
        """Send the program to a started sandbox and collect the result. Single use: destroy after."""
        if sandbox.used:
            raise SandboxError("internal error: a sandbox was handed out twice")
        sandbox.used = True
        started = time.monotonic() if started is None else started
        limits = request.limits
        sock = sandbox.sock
        deadline = time.monotonic() + request.timeout_seconds
        nonce = secrets.token_hex(8)
        sandbox.writer = self._send(sock, request.payload(nonce))
        emit = request.on_output
        stdout = _CappedStream(limits.output_limit, emit and functools.partial(emit, "stdout"))
        stderr = _CappedStream(limits.output_limit, emit and functools.partial(emit, "stderr"))
        demux = _Demuxer(stdout, stderr, EXIT_MARKER + nonce.encode() + b":")
        finished = self._pump(sock, deadline, demux)
        demux.flush()
        with engine_errors(request.image, limits.runtime):
            if finished and demux.exit_status is not None and demux.exit_status < 128:
                # The launcher reported an exit the program chose: no need to wait for the
                # container's teardown. 128+N means killed by signal N (137 may be the OOM
                # killer), so those ask the engine.
                exit_code, oom_killed = demux.exit_status, False
            elif finished:
                exit_code, oom_killed = self._exit_status(sandbox.id, demux.exit_status)
            else:
                # Stop reading first: a program still flooding its output keeps the engine
                # blocked writing to this stream, and the engine finishes a kill only after its
                # stream copiers do (seen: kill hung for the whole 30 s call timeout).
                _close_quietly(sandbox.attached)
                with contextlib.suppress(docker.errors.APIError):
                    self.api.kill(sandbox.id)
                exit_code, oom_killed = -1, False
        return ExecutionResult(
            stdout=stdout.text(),
            stderr=stderr.text(),
            stdout_base64=stdout.base64_if_binary(),
            stderr_base64=stderr.base64_if_binary(),
            exit_code=exit_code,
            duration_seconds=time.monotonic() - started,
            timed_out=not finished,
            oom_killed=oom_killed,
            stdout_truncated=stdout.dropped > 0,
            stderr_truncated=stderr.dropped > 0,
            stdout_dropped_bytes=stdout.dropped,
            stderr_dropped_bytes=stderr.dropped,
            language=request.language.name,
            timeout_seconds=request.timeout_seconds,
            limits=limits,
        )

    def destroy(self, sandbox: LiveSandbox) -> None:
        """Close the stream and force-remove the container. Best effort: never raises."""
        _close_quietly(sandbox.attached)
        if sandbox.writer is not None:
            sandbox.writer.join(5)  # closing the socket unblocks a write the code never read
        self._remove(sandbox.id)

    def container_config(self, spec: SandboxSpec, purpose: str = "run", lifetime_seconds: float = 60) -> dict[str, Any]:
        """create_container keyword arguments: every isolation control in ``SandboxLimits``."""
        limits = spec.limits
        api = self.api
        ulimits = [Ulimit(name="nofile", soft=limits.open_files, hard=limits.open_files)]
        pids_limit = limits.pids
        if limits.runtime == "runsc":
            # Under gVisor the pids cgroup counts the Sentry's host threads and ptrace stubs, not
            # the code's processes: 63 forks need ~400 host pids, and hitting the cgroup limit
            # crashes the whole sandbox (exit 2). The Sentry enforces RLIMIT_NPROC per sandbox
            # (threads included), so that is the code's ceiling; the cgroup stays as a backstop.
            # (Under runc RLIMIT_NPROC would count every uid-65534 process on the host: not used.)
            ulimits.append(Ulimit(name="nproc", soft=limits.pids, hard=limits.pids))
            pids_limit = limits.pids * 8 + 128
        host_config = api.create_host_config(
            network_mode="bridge" if limits.network else "none",
            mem_limit=limits.memory_bytes,
            memswap_limit=limits.memory_swap_bytes,
            nano_cpus=int(limits.cpus * 1e9),
            pids_limit=pids_limit,
            read_only=limits.read_only,
            tmpfs={"/tmp": f"rw,nosuid,nodev,size={limits.tmpfs_bytes},nr_inodes={limits.tmpfs_inodes},mode=1777"},
            cap_drop=["ALL"],
            security_opt=["no-new-privileges:true", *seccomp_options(limits.seccomp)],
            ipc_mode="private",
            ulimits=ulimits,
            mounts=[Mount(target, volume, type="volume", read_only=False) for volume, target in spec.volumes],
            # Output reaches us over the attach stream; a log driver would copy a flood to disk.
            log_config=LogConfig(type=LogConfig.types.NONE),
            runtime=limits.runtime,
        )
        return {
            "image": spec.image,
            "command": list(spec.command) or None,
            "stdin_open": True,  # docker-py also sets StdinOnce: our EOF closes the code's stdin
            "user": limits.user,
            "environment": dict(SANDBOX_ENV),
            "working_dir": spec.cwd,
            "hostname": "sandbox",
            "network_disabled": not limits.network,
            "labels": {**owner_labels(purpose, lifetime_seconds), **dict(spec.labels)},
            "host_config": host_config,
        }

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

    @staticmethod
    def _pump(sock: socket.socket, deadline: float, demux: _Demuxer) -> bool:
        """Read the attach stream until EOF (True) or the deadline (False)."""
        while True:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return False
            ready, _, _ = select.select([sock], [], [], remaining)
            if not ready:
                return False
            try:
                data = sock.recv(256 * 1024)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError as exc:
                raise EngineUnavailable(f"lost the connection to the sandbox: {exc}") from exc
            if not data:
                return True
            demux.feed(data)
            if demux.exit_status is not None:
                return True

    def _exit_status(self, container_id: str, reported: int | None = None) -> tuple[int, bool]:
        status = self.api.wait(container_id, timeout=self._call_timeout)
        code = int(status.get("StatusCode", -1)) if reported is None else reported
        oom = False
        if code != 0:
            state = self.api.inspect_container(container_id).get("State", {})
            oom = bool(state.get("OOMKilled"))
        return code, oom

    def list_labelled(self, label: str) -> list[tuple[str, str, dict[str, str]]]:
        """(kind, id, labels) of every container and volume carrying ``label``."""
        with engine_errors():
            out = [
                ("container", c["Id"], c.get("Labels") or {})
                for c in self.api.containers(all=True, filters={"label": label})
            ]
            volumes = self.api.volumes(filters={"label": label}).get("Volumes") or []
            out += [("volume", v["Name"], v.get("Labels") or {}) for v in volumes]
        return out

    def create_volume(self, name: str, labels: dict[str, str], driver_opts: dict[str, str] | None) -> None:
        with engine_errors():
            self.api.create_volume(name, driver="local", driver_opts=driver_opts, labels=labels)

    def remove_containers_labelled(self, label: str) -> int:
        with engine_errors():
            found = self.api.containers(all=True, filters={"label": label})
        for c in found:
            self._remove(c["Id"])
        return len(found)

    def find_running(self, label: str) -> list[str]:
        with engine_errors():
            return [c["Id"] for c in self.api.containers(filters={"label": label, "status": "running"})]

    def attach(self, container_id: str, spec: SandboxSpec) -> LiveSandbox:
        """Attach to an already running sandbox (a session's interpreter started by another process)."""
        with engine_errors(spec.image, spec.limits.runtime):
            attached = self.api.attach_socket(container_id, params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1})
        return LiveSandbox(container_id, attached, spec, time.monotonic())

    def remove_labelled(self, kind: str, item_id: str) -> None:
        if kind == "container":
            self._remove(item_id)
        else:
            try:
                self.api.remove_volume(item_id, force=True)
            except docker.errors.NotFound:
                pass
            except Exception as exc:  # noqa: BLE001 - reaping is best effort
                log.warning("could not remove volume %s: %s", item_id, exc)

    def _remove(self, container_id: str) -> bool:
        """Best effort: never raises, so it cannot mask the error that got us here. A removal that
        failed (engine down or overloaded) is remembered and retried by ``retry_removals``."""
        try:
            self.api.remove_container(container_id, force=True, v=True)
        except docker.errors.NotFound:
            pass
        except Exception as exc:  # noqa: BLE001 - cleanup must not raise
            log.warning("could not remove container %s: %s (will retry)", container_id[:12], exc)
            with _graveyard_lock:
                _graveyard.add(container_id)
            return False
        with _graveyard_lock:
            _graveyard.discard(container_id)
        return True

    def retry_removals(self) -> int:
        """Retry removals that failed earlier; returns how many are still pending."""
        with _graveyard_lock:
            pending = list(_graveyard)
        for container_id in pending:
            self._remove(container_id)
        with _graveyard_lock:
            return len(_graveyard)


class DockerImages:
    """Image operations the offline build needs (import a rootfs tarball, build a Dockerfile)."""

    def __init__(self, backend: DockerBackend) -> None:
        self._backend = backend

    def exists(self, image: str) -> bool:
        return self._backend.image_exists(image)

    def import_rootfs(self, stream: Any, image: str) -> None:
        repository, _, tag = image.partition(":")
        with engine_errors(image):
            self._backend.api.import_image(src=stream, repository=repository, tag=tag or "latest", stream_src=True)

    def build(self, context_dir: str, image: str, buildargs: dict[str, str], on_line: Any = None) -> None:
        with engine_errors(image):
            for chunk in self._backend.api.build(
                path=context_dir,
                tag=image,
                buildargs=buildargs,
                network_mode="none",
                rm=True,
                forcerm=True,
                decode=True,
                timeout=3600,  # a long build must not hit the engine's per-call limit
            ):
                if "error" in chunk:
                    raise SandboxError(f"building {image} failed: {chunk['error'].strip()}")
                line = chunk.get("stream", "").rstrip()
                if line and on_line is not None:
                    on_line(line)

    def tag(self, image: str, alias: str) -> None:
        repository, _, tag = alias.partition(":")
        with engine_errors(image):
            self._backend.api.tag(image, repository, tag or "latest")

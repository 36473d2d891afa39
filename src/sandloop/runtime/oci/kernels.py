"""Session interpreters that runsc starts directly, and their memory checkpoints (issue 25).

A session's interpreter on gVisor is started here rather than through Docker when the direct
backend runs that spec's shape: Docker's own config for the spec (captured once, ``config.py``),
with the session's workspace bound at its mount points, runsc under ``shim.py`` (which holds the
interpreter's stdio so it outlives the process that started it, and serves it on a Unix socket in
the bundle in Docker's attach framing), so the cells travel exactly as they do to Docker's
containers (``DockerBackend.run_cell`` over a ``SocketChannel``).

Owning the runsc root is what makes memory snapshots possible: ``checkpoint`` writes the
sandbox's whole state (every process, its memory, open files, sockets) to a directory with
``runsc checkpoint`` (the sandbox stops: this runsc's ``--leave-running`` kills the container) and
keeps beside it what lives outside the sandbox: the host tmpfs that is its ``/tmp`` (gVisor reopens
host files by path on restore) and the facts a restore must match (runsc's version, the image,
the CPU). ``restore`` starts a new sandbox from such a directory, under a new id, with the
workspace of whichever session it now belongs to bound at the same container paths: a session
resumed, or a fork with its own copy.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from sandloop.contract import SandboxError, SnapshotIncompatible
from sandloop.paths import tree_size
from sandloop.runtime.base import SandboxSpec
from sandloop.runtime.docker import LiveSandbox
from sandloop.runtime.docker.stream import SocketChannel
from sandloop.runtime.docker.workspace import volume_name
from sandloop.runtime.labels import LABEL_PREFIX, SESSION_LABEL
from sandloop.runtime.oci.bundle import new_config
from sandloop.runtime.oci.shim import NOT_YET, QUOTA_AFTER, apply_pending_quota
from sandloop.runtime.tmpfs import mount_host_tmpfs

if TYPE_CHECKING:
    from sandloop.runtime.base import Owned, WorkspaceRef
    from sandloop.runtime.oci.config import Templates
    from sandloop.runtime.oci.store import RootfsStore


class DirectHost(Protocol):
    """What the interpreters need of the backend that starts them (``backend.OCIBackend``)."""

    state: Path
    store: RootfsStore
    templates: Templates
    cgroup_parent: str

    def runtime_argv(self, runtime: str) -> list[str]: ...

    def workspace_on_host(self, session_id: str, ref: WorkspaceRef) -> Path | None: ...

    def hostname_file(self) -> Path: ...

    def own_memory_cgroup(self, sandbox_id: str, config: dict[str, Any]) -> None: ...

    def delete_direct(self, sandbox_id: str, runtime: str) -> None: ...

    def direct_bundles(self) -> list[Owned]: ...


SHIM = str(Path(__file__).with_name("shim.py"))
SOCKET = "attach.sock"
#: Where a checkpoint keeps the sandbox's memory image (runsc's files), its /tmp and its facts.
IMAGE, TMP, FACTS = "image", "tmp", "facts.json"


@dataclass(eq=False)
class DirectKernel(LiveSandbox):
    """A session interpreter runsc started directly (its bundle holds its config and socket)."""

    bundle: Path = Path()
    #: Restored without its CPU quota, not yet given it (``throttle``).
    quota_pending: bool = False
    #: What started it: runsc, or runc (without a Docker engine; no memory checkpoints).
    runtime: str = "runsc"


def is_kernel_spec(spec: SandboxSpec) -> bool:
    return bool(spec.command) and spec.command[0] == "--kernel"


def host_facts(image_id: str) -> dict[str, str]:
    """What a memory image is only valid with: the runsc that wrote it, the image its root file
    system came from, and the CPU (a restored program may use every instruction the old one had)."""
    return {**_machine_facts(), "image": image_id}


@functools.cache
def _machine_facts() -> dict[str, str]:
    """runsc's version and the CPU, read once per process (a runsc start per checkpoint was not needed)."""
    version = subprocess.run(["runsc", "--version"], capture_output=True, text=True, check=False).stdout
    cpu = ""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("model name", "flags")):
                cpu += line.split(":", 1)[1].strip() + "\n"
            if line.strip() == "":
                break
    return {"runsc": version.splitlines()[0] if version else "", "cpu": hashlib.sha256(cpu.encode()).hexdigest()[:16]}


class ProcessStream:
    """A host process's stdin and stdout as an ``ExecStream`` (a runtime's ``exec`` of a program
    inside a sandbox): its pipes, or one end of a socket pair given to it as both (``sock``)."""

    def __init__(self, process: subprocess.Popen[bytes], sock: socket.socket | None = None) -> None:
        self.process, self.sock = process, sock
        if sock is None:
            assert process.stdin is not None and process.stdout is not None
            self._in, self._out = process.stdin, process.stdout

    def read(self, n: int) -> bytes:
        if self.sock is not None:
            return self.sock.recv(n)
        return os.read(self._out.fileno(), n)

    def write(self, data: bytes) -> None:
        try:
            if self.sock is not None:
                self.sock.sendall(data)
            else:
                self._in.write(data)
        except ValueError as exc:  # closed meanwhile
            raise BrokenPipeError(str(exc)) from None

    def close(self) -> None:
        if self.sock is not None:
            with contextlib.suppress(OSError):
                self.sock.shutdown(socket.SHUT_WR)  # the program's stdin ends
        with contextlib.suppress(OSError, AttributeError):
            self._in.close()
        try:
            self.process.wait(5)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait(30)
        with contextlib.suppress(OSError, AttributeError):
            self._out.close()
        if self.sock is not None:
            self.sock.close()


class DirectKernels:
    """The direct backend's session interpreters (see the module docstring)."""

    def __init__(self, backend: DirectHost) -> None:
        self.backend = backend

    def _runtime(self, runtime: str, *args: str) -> list[str]:
        root = self.backend.state / "runtime" / runtime
        return [*self.backend.runtime_argv(runtime), "--root", str(root), *args]

    def _runsc(self, *args: str) -> list[str]:
        return self._runtime("runsc", *args)

    def bind_workspaces(self, config: dict[str, Any], volumes: tuple[tuple[str, str], ...]) -> None:
        """Each session workspace of ``volumes`` bound at its mount point, as Docker binds a named volume."""
        for volume, destination in volumes:
            source = self._workspace_dir(volume)
            config["mounts"].append(
                {"destination": destination, "type": "bind", "source": str(source), "options": ["rbind", "rprivate"]}
            )

    def _workspace_dir(self, volume: str) -> Path:
        """The host directory behind a session's workspace volume (its loop mount)."""
        prefix = volume_name("")
        if not volume.startswith(prefix):
            raise SandboxError(f"{volume} is not a session workspace")
        session_id = volume[len(prefix) :]
        from sandloop.runtime.base import WorkspaceRef

        found = self.backend.workspace_on_host(session_id, WorkspaceRef(volume, True))
        if found is None:
            raise SandboxError(f"the workspace of session {session_id} is not mounted on this host")
        return found

    # -- start ---------------------------------------------------------------------------------
    def launch(self, spec: SandboxSpec, *, purpose: str, lifetime_seconds: float) -> DirectKernel:
        return self._start(spec, purpose, lifetime_seconds, None)

    def restore(self, spec: SandboxSpec, directory: Path, *, lifetime_seconds: float) -> DirectKernel:
        """A new interpreter from ``checkpoint``'s directory, with ``spec``'s workspace.

        Raises:
            SnapshotIncompatible: the image was made by another runsc, from another image, or
                on another CPU.
        """
        try:
            facts = json.loads((directory / FACTS).read_text())
        except (OSError, ValueError) as exc:
            raise SnapshotIncompatible(f"the memory snapshot in {directory} is incomplete ({exc})") from None
        here = host_facts(self.backend.store.image_id(spec.image))
        for key, what in (("runsc", "runsc version"), ("image", "image"), ("cpu", "CPU")):
            if facts.get(key) != here[key]:
                raise SnapshotIncompatible(
                    f"this memory snapshot was made with another {what} ({facts.get(key)!r}, here {here[key]!r}): "
                    "it cannot be restored on this host; resume it where it was made, or start a new session"
                )
        return self._start(spec, "kernel", lifetime_seconds, directory)

    def _start(self, spec: SandboxSpec, purpose: str, lifetime_seconds: float, image: Path | None) -> DirectKernel:
        backend = self.backend
        runtime = spec.limits.runtime  # runc only without an engine (OCIBackend.why_not_direct)
        rootfs = backend.store.rootfs(spec.image)
        template = backend.templates.get(replace(spec, volumes=()))
        sandbox_id, bundle, config = new_config(
            backend.state, backend.hostname_file(), template, rootfs, spec, purpose, lifetime_seconds, runtime
        )
        bundles = bundle.parent
        cpu = (config["linux"].get("resources") or {}).get("cpu") or {}
        quota_after = ""
        if image is not None and cpu.get("quota"):
            # Loading the memory image (the Sentry decompresses it) is sandloop's work, not the
            # code's: at the session's 0.5 CPU it was most of a resume. Its quota comes with the
            # first answer (``throttle``), or as soon as any process finds it (``find``).
            quota_after = f"{int(cpu['quota'])} {int(cpu.get('period') or 100_000)}"
            cpu.pop("quota")
        self.bind_workspaces(config, spec.volumes)
        bundles.mkdir(parents=True, exist_ok=True)
        tmp = bundles / f".{sandbox_id}"
        tmp.mkdir(mode=0o700)
        (tmp / "config.json").write_text(json.dumps(config))
        if quota_after:
            (tmp / QUOTA_AFTER).write_text(quota_after)
        tmp.rename(bundle)
        listener: socket.socket | None = None
        try:
            if runtime == "runsc":
                mount_host_tmpfs(bundle / "tmp", spec.limits)
                backend.own_memory_cgroup(sandbox_id, config)
            if image is not None and (image / TMP).is_dir():  # the /tmp it had, file for file
                subprocess.run(["cp", "-a", f"{image / TMP}/.", str(bundle / "tmp")], check=True, capture_output=True)
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(str(bundle / SOCKET))
            os.chmod(bundle / SOCKET, 0o600)
            listener.listen(16)
            verb = ["run"] if image is None else ["restore", "--image-path", str(image / IMAGE)]
            if runtime == "runc":  # its state (and the cgroup's OOM counter) kept until deleted
                verb.append("--keep")
            argv = self._runtime(runtime, *verb, "--bundle", str(bundle), "--pid-file", str(bundle / "pid"), sandbox_id)
            log_file = open(bundle / "shim.log", "wb")  # noqa: SIM115 - handed to the holder
            with log_file:
                subprocess.run(
                    [sys.executable, "-S", "-E", SHIM, str(listener.fileno()), str(bundle / "shim.pid"), *argv],
                    stdin=subprocess.DEVNULL,
                    stdout=log_file,
                    stderr=log_file,
                    pass_fds=(listener.fileno(),),
                    check=True,
                    timeout=30,
                )
            listener.close()
            listener = None
            return self._connect(sandbox_id, bundle, spec)
        except BaseException as exc:
            if listener is not None:
                listener.close()
            self.backend.delete_direct(sandbox_id, runtime)
            if isinstance(exc, subprocess.CalledProcessError | OSError):
                raise SandboxError(f"could not start the session's interpreter under {runtime}: {exc}") from exc
            raise

    def _connect(self, sandbox_id: str, bundle: Path, spec: SandboxSpec) -> DirectKernel:
        runtime = spec.limits.runtime
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            sock.connect(str(bundle / SOCKET))
        except OSError:
            sock.close()
            raise
        return DirectKernel(
            sandbox_id,
            SocketChannel(sock),
            spec,
            time.monotonic(),
            interrupt=lambda: self._signal(runtime, sandbox_id, "2"),
            cgroup=f"{self.backend.cgroup_parent}/{sandbox_id}",
            bundle=bundle,
            quota_pending=(bundle / QUOTA_AFTER).exists(),  # once a connection, not once a cell
            runtime=runtime,
        )

    def _signal(self, runtime: str, sandbox_id: str, signal: str) -> None:
        subprocess.run(self._runtime(runtime, "kill", sandbox_id, signal), capture_output=True, timeout=30, check=False)

    # -- find, stop ----------------------------------------------------------------------------
    def find(self, session_id: str, spec: SandboxSpec) -> DirectKernel | None:
        """This session's running interpreter, connected (from any process on this host)."""
        for item in self.backend.direct_bundles():
            labels = item.labels
            if labels.get(SESSION_LABEL) != session_id or labels.get(f"{LABEL_PREFIX}purpose") != "kernel":
                continue
            bundle = self.backend.state / "bundles" / item.id
            try:
                found = self._connect(item.id, bundle, spec)
            except OSError:  # its holder is gone: so is the interpreter
                self.backend.delete_direct(item.id, spec.limits.runtime)
                continue
            self.throttle(found)  # a restore whose restorer died before its first answer
            return found
        return None

    def throttle(self, kernel: DirectKernel) -> None:
        """Give a restored interpreter the CPU quota its restore ran without (``shim.py``'s
        ``apply_pending_quota``, read back). One that cannot be given it is removed: no sandbox
        runs code without its limits."""
        if not kernel.quota_pending:
            return
        why = apply_pending_quota(str(kernel.bundle))
        if why == NOT_YET:  # found while its restore is still starting: its first answer applies it
            return
        if why:
            self.destroy(kernel)
            raise SandboxError(f"could not give the restored interpreter its CPU quota ({why}); it was removed")
        kernel.quota_pending = False

    def exec_stream(self, kernel: DirectKernel, argv: list[str]) -> ProcessStream:
        """``argv`` started in the running interpreter's sandbox by its runtime's ``exec``, as the
        interpreter's own process spec (user, capabilities, limits, no new privileges) says."""
        try:
            process = {**json.loads((kernel.bundle / "config.json").read_text())["process"], "args": argv}
        except (OSError, ValueError, KeyError) as exc:
            raise SandboxError(f"session interpreter {kernel.id} is gone ({exc})") from None
        process.update(cwd="/workspace", terminal=False)
        spec = kernel.bundle / "reach-process.json"
        spec.write_text(json.dumps(process))
        command = self._runtime(kernel.runtime, "exec", "--process", str(spec), kernel.id)
        # One socket as the program's stdin and stdout, not two pipes: a pipe can be reopened
        # through /proc/<pid>/fd by the sandbox's own code (gVisor let it even with the agent
        # non-dumpable: issue 52 finding 4), a socket cannot (ENXIO).
        ours, theirs = socket.socketpair()
        try:
            started = subprocess.Popen(command, stdin=theirs.fileno(), stdout=theirs.fileno(), bufsize=0)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        return ProcessStream(started, ours)

    def destroy(self, kernel: DirectKernel) -> None:
        kernel.channel.close()
        self.backend.delete_direct(kernel.id, kernel.runtime)

    # -- memory --------------------------------------------------------------------------------
    def checkpoint(self, kernel: DirectKernel, directory: Path) -> int:
        """Write the interpreter's whole state to ``directory`` (made here); the sandbox stops and
        is removed. Its size in bytes.

        The checkpoint, the copy of ``/tmp`` and the facts file (written last: it marks the
        directory whole) run in a process of their own session, so one that kills this process
        (a server's SIGKILL) does not cut them short: ``wait_for_checkpoint`` then waits for it.

        Raises:
            SandboxError: runsc could not checkpoint it (the interpreter still runs).
        """
        directory.mkdir(parents=True, exist_ok=False, mode=0o700)
        (directory / IMAGE).mkdir(mode=0o700)
        (directory / f"{FACTS}.pending").write_text(
            json.dumps(host_facts(self.backend.store.image_id(kernel.spec.image)))
        )
        script = (
            'set -e; "$@"; cp -a "$SANDLOOP_BUNDLE/tmp" "$SANDLOOP_DIR/tmp"; '
            'mv "$SANDLOOP_DIR/{0}.pending" "$SANDLOOP_DIR/{0}"'
        )
        proc = subprocess.Popen(
            ["sh", "-c", script.format(FACTS), "sandloop-checkpoint"]
            + self._runsc("checkpoint", "--image-path", str(directory / IMAGE), kernel.id),
            env={**os.environ, "SANDLOOP_BUNDLE": str(kernel.bundle), "SANDLOOP_DIR": str(directory)},
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        (directory / "checkpointer.pid").write_text(str(proc.pid))
        unthrottle(self.backend.cgroup_parent, kernel.id)
        _, stderr = proc.communicate(timeout=900)
        kernel.channel.close()
        if proc.returncode != 0:
            shutil.rmtree(directory, ignore_errors=True)
            raise SandboxError(f"runsc could not checkpoint the interpreter: {stderr.strip()[-500:]}")
        # The stopped sandbox's `runsc run` cleans up its own state as it exits (then its holder
        # does): a `runsc delete` before that waited ~5 s for it.
        wait_for_holder(holder_pid(kernel.bundle))
        self.backend.delete_direct(kernel.id, "runsc")
        return tree_size(directory)


def _running(pid: int, marker: str) -> bool:
    """Whether process ``pid`` runs (not a zombie) with ``marker`` in its command line."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z" and marker.encode() in Path(f"/proc/{pid}/cmdline").read_bytes()
    except (OSError, IndexError):
        return False


def unthrottle(parent: str, sandbox_id: str) -> None:
    """Lift a sandbox's CPU quota: its checkpoint (compressing its memory) runs in its own Sentry,
    and is sandloop's work, not the code's (measured: 0.5 CPU made a 100 MB pause take 7.6 s)."""
    with contextlib.suppress(OSError):
        Path(f"/sys/fs/cgroup/cpu/{parent}/{sandbox_id}/cpu.cfs_quota_us").write_text("-1")


def holder_pid(bundle: Path) -> int:
    """The pid of the shim holding a bundle's interpreter (0: none)."""
    try:
        return int((bundle / "shim.pid").read_text())
    except (OSError, ValueError):
        return 0


def wait_for_holder(pid: int, seconds: float = 30) -> None:
    """Wait until a shim has exited (it does once its sandbox is gone, closing every connection:
    a client then sees EOF, never a half-dead interpreter)."""
    deadline = time.monotonic() + seconds
    while pid and _running(pid, SHIM) and time.monotonic() < deadline:
        time.sleep(0.01)


def checkpoint_whole(directory: Path) -> bool:
    """Whether ``checkpoint`` finished writing ``directory``; first waits for a checkpoint still
    being written there by a process whose caller was killed (its process lives on)."""
    with contextlib.suppress(OSError, ValueError):
        pid = int((directory / "checkpointer.pid").read_text())
        while _running(pid, "sandloop-checkpoint"):
            time.sleep(0.1)
    return (directory / FACTS).is_file()


__all__ = [
    "DirectKernel",
    "DirectKernels",
    "checkpoint_whole",
    "holder_pid",
    "host_facts",
    "is_kernel_spec",
    "wait_for_holder",
]

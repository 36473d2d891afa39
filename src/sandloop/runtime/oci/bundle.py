"""A direct sandbox's bundle and process, as the OCI backend (``backend.py``), its teardown
(``teardown.py``) and its session interpreters (``kernels.py``) share them: the ``DirectSandbox``
record, the bundle's config and labels, its cgroups, the process on the launcher's three pipes,
and killing or removing what a sandbox left.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandloop.contract import SandboxError
from sandloop.runtime.base import Owned, SandboxSpec
from sandloop.runtime.cgroup import make_v1
from sandloop.runtime.labels import LABEL_PREFIX, owner_labels
from sandloop.runtime.oci.config import binds_host_tmp, render
from sandloop.runtime.oci.stream import PipeChannel
from sandloop.runtime.tmpfs import unmount_host_tmpfs

RUNTIME_LABEL = f"{LABEL_PREFIX}oci.runtime"
#: The runtimes this backend starts itself (others go to Docker).
DIRECT_RUNTIMES = ("runc", "runsc")
SUBREAPER = str(Path(__file__).with_name("subreaper.py"))
#: Where the direct sandboxes' cgroups go (Docker's go under /docker).
CGROUP_PARENT = "sandloop"
#: A payload this small is written to the sandbox's stdin inline; a larger one by a thread.
INLINE_PAYLOAD = 64 * 1024


@dataclass(eq=False)
class DirectSandbox:
    id: str
    proc: subprocess.Popen[bytes]
    channel: PipeChannel
    stdin_fd: int
    spec: SandboxSpec
    started_at: float
    runtime: str
    bundle: Path
    used: bool = False
    destroyed: bool = False
    destroyed_at: float = 0.0
    writer: threading.Thread | None = None


def cgroup_dirs(sandbox_id: str) -> list[Path]:
    base = Path("/sys/fs/cgroup")
    if not base.is_dir():
        return []
    return [p for p in (c / CGROUP_PARENT / sandbox_id for c in base.iterdir()) if p.is_dir()]


#: The host tmpfs that is a runsc (or bwrap) sandbox's /tmp, inside its bundle (runtime/tmpfs.py),
#: and a bwrap sandbox's /dev/shm.
HOST_TMP, HOST_SHM = "tmp", "shm"
#: ``DirectSandbox.runtime`` of a runc-class sandbox started from bwrap.py's translation (by
#: bubblewrap or by the C starter, starter.py: the same sandbox, torn down the same way).
BWRAP = "bwrap"
#: ``runc_with``'s value for the C starter (starter.py).
STARTER = "starter"


def remove_cgroup(directory: Path, attempts: int, wait: float) -> bool:
    """rmdir a cgroup, retrying while it still has tasks; True once it is gone."""
    for _ in range(attempts):
        try:
            directory.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            time.sleep(wait)
    return False


def bundle_labels(bundle: Path) -> dict[str, str] | None:
    """A bundle's labels (its config's annotations), or None when its config cannot be read."""
    try:
        return json.loads((bundle / "config.json").read_text()).get("annotations") or {}
    except (OSError, ValueError):
        return None


def remove_tree(path: Path) -> None:
    """rmtree that also survives a file appearing meanwhile (the runtime's last log line); a
    bundle's host tmpfs mounts are detached first (rmtree would only empty them)."""
    unmount_host_tmpfs(path / HOST_TMP)
    unmount_host_tmpfs(path / HOST_SHM)
    for _ in range(3):
        shutil.rmtree(path, ignore_errors=True)
        if not path.exists():
            return
        time.sleep(0.01)


def new_config(
    state: Path,
    hostname_file: Path,
    template: Mapping[str, Any],
    rootfs: Path,
    spec: SandboxSpec,
    purpose: str,
    lifetime_seconds: float,
    runtime: str,
) -> tuple[str, Path, dict[str, Any]]:
    """A new sandbox's id, bundle path (not yet made) and config: Docker's, per-run fields filled."""
    sandbox_id = f"sandloop-{uuid.uuid4().hex[:20]}"
    labels = {**owner_labels(purpose, lifetime_seconds), **dict(spec.labels), RUNTIME_LABEL: runtime}
    bundle = state / "bundles" / sandbox_id
    config = render(
        template,
        rootfs=rootfs,
        hostname_file=hostname_file,
        cgroups_path=f"/{CGROUP_PARENT}/{sandbox_id}",
        annotations=labels,
        host_tmp=bundle / HOST_TMP if binds_host_tmp(template) else None,
    )
    return sandbox_id, bundle, config


def start_on_pipes(
    start: Callable[[tuple[int, int, int]], subprocess.Popen[bytes]],
    sandbox_id: str,
    spec: SandboxSpec,
    runtime: str,
    bundle: Path,
) -> DirectSandbox:
    """``start((stdin, stdout, stderr))``: the sandbox's process on the launcher's three pipes,
    whose child ends are closed once it has them. On any failure every pipe is closed and the
    bundle removed; a ``SandboxError`` gains what the process said on stderr (bwrap's own
    words), an ``OSError`` (the runtime would not start) becomes one."""
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    try:
        proc = start((in_r, out_w, err_w))
    except BaseException as exc:
        os.close(err_w)
        said = b""
        if isinstance(exc, SandboxError):
            os.set_blocking(err_r, False)
            with contextlib.suppress(OSError):
                said = os.read(err_r, 4096)
        for fd in (in_r, in_w, out_r, out_w, err_r):
            os.close(fd)
        remove_tree(bundle)
        if isinstance(exc, OSError):
            raise SandboxError(f"could not start {runtime}: {exc}") from exc
        if said:
            raise SandboxError(f"{exc}: {said.decode(errors='replace').strip()}") from exc
        raise
    for fd in (in_r, out_w, err_w):
        os.close(fd)
    return DirectSandbox(sandbox_id, proc, PipeChannel(out_r, err_r), in_w, spec, time.monotonic(), runtime, bundle)


def own_memory_cgroup(sandbox_id: str, config: dict[str, Any]) -> None:
    """runsc, unlike runc, has no ``--keep``: it removes the cgroups it made when the sandbox
    exits, and with them the ``oom_kill`` counter. So the memory cgroup is made here, with the
    limits of Docker's config, before runsc starts: runsc joins a cgroup that exists without
    touching its settings (hence the read-back: a memory cgroup without its limit must never
    run code) and leaves it for the teardown (``teardown.py``) to read and remove."""
    make_v1(CGROUP_PARENT, sandbox_id, config["linux"].get("resources") or {}, ("memory",))


def raise_if_runtime_failed(sandbox: DirectSandbox) -> None:
    """runc writes its own failures (not the program's) to the log in the bundle."""
    try:
        lines = (sandbox.bundle / "runtime.log").read_text().splitlines()
    except OSError:
        return
    for line in lines:
        with contextlib.suppress(ValueError):
            entry = json.loads(line)
            if entry.get("level") in ("error", "fatal"):
                raise SandboxError(f"{sandbox.runtime} could not start the sandbox: {entry.get('msg')}")


def send_payload(sandbox: DirectSandbox, payload: bytes) -> threading.Thread | None:
    def write() -> None:
        fd, sandbox.stdin_fd = sandbox.stdin_fd, -1
        try:
            view = memoryview(payload)
            while view:
                view = view[os.write(fd, view) :]
        except OSError:
            pass  # the sandbox exited or was killed before reading everything
        finally:
            with contextlib.suppress(OSError):
                os.close(fd)

    if len(payload) <= INLINE_PAYLOAD:
        write()
        return None
    thread = threading.Thread(target=write, name="sandloop-stdin", daemon=True)
    thread.start()
    return thread


def kill(sandbox: DirectSandbox) -> None:
    """SIGKILL the container's PID 1 (the kernel then kills the whole PID namespace)."""
    kill_pid_file(sandbox.bundle, sandbox.id)


def kill_pid_file(bundle: Path, sandbox_id: str) -> None:
    with contextlib.suppress(OSError, ValueError):
        pid = int((bundle / "pid").read_text())
        cgroup = Path(f"/proc/{pid}/cgroup").read_text()
        if sandbox_id in cgroup:  # never a reused pid
            os.kill(pid, signal.SIGKILL)


def list_bundles(state: Path, skip: set[str] | frozenset[str] = frozenset()) -> list[Owned]:
    """The direct sandboxes' bundles under ``state`` (not half-made ones, nor those in ``skip``), with their labels."""
    out: list[Owned] = []
    directory = state / "bundles"
    if not directory.is_dir():
        return out
    for bundle in directory.iterdir():
        if bundle.name.startswith(".") or bundle.name in skip:
            continue
        out.append(Owned("sandbox", bundle.name, bundle_labels(bundle) or {}))
    return out

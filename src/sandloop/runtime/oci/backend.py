"""``OCIBackend``: single-use runs started by runc or runsc directly, without dockerd on their path.

A run: render Docker's own config for the spec into a fresh bundle, ``runc run --keep`` it as our
child with the launcher's stdin/stdout/stderr on pipes (the launcher then waits for its program,
exactly as under Docker), speak the launcher protocol over the pipes, take the exit status from
the launcher's end line (or runc's exit code), read the cgroup's ``oom_kill`` counter before the
state is deleted, and tear down (kill, ``runc delete``, remove the bundle) on a background thread.

Who reaps: each ``runc run`` is our child (``subprocess`` waits for it); the container's own
processes are reaped by tini, its PID 1. If this process dies, the launchers see EOF on stdin and
exit; the stopped states and bundles keep their annotations (the labels), so the reaper finds and
removes them by owner like Docker's containers.

runsc: no ``--keep``, so the memory cgroup is made here with the config's limits first (runsc
joins it as it is and leaves it), and runsc runs under ``subreaper.py``, which reaps the sandbox
and gofer processes runsc leaves behind.

What goes to Docker instead (``DockerBackend``, the same limits): sessions (workspaces and
interpreters), ``network=True``, runtimes this backend does not start directly, and every run on
a host where parity with Docker cannot be established (not root, another cgroup mode or driver,
a config with hooks, AppArmor or SELinux). ``info()`` and ``sandloop doctor`` say which.

Without an engine (``engine=false``): the configs are made here (``generate.py``), images come from
the store (``store.py``'s refs), every session sandbox is direct (workspaces are bound in by
``kernels.bind_workspaces``; interpreters held by ``shim.py`` under runc or runsc), and what needs
Docker (networks, egress, templates, Docker's built-in seccomp profile) is refused with why.
"""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from sandloop.contract import CellResult, EngineUnavailable, ExecutionResult, HostDiskFull, SandboxError, SandboxLimits
from sandloop.contract.egress import Secret
from sandloop.runtime import pagecache, protocol
from sandloop.runtime.base import (
    NO_DOCKER,
    BackendInfo,
    ExecStream,
    ImageBuilder,
    Owned,
    RunRequest,
    SandboxSpec,
    WorkspaceRef,
)
from sandloop.runtime.cgroup import memory_oom_kills
from sandloop.runtime.docker import DockerBackend, LiveSandbox
from sandloop.runtime.oci import bwrap, starter
from sandloop.runtime.oci.bundle import (
    BWRAP,
    CGROUP_PARENT,
    HOST_TMP,
    STARTER,
    SUBREAPER,
    DirectSandbox,
    kill,
    list_bundles,
    new_config,
    own_memory_cgroup,
    raise_if_runtime_failed,
    remove_tree,
    send_payload,
    start_on_pipes,
)
from sandloop.runtime.oci.config import (
    Templates,
    binds_host_tmp,
    derived,
    docker_bundle_config,
    parity_problems,
)
from sandloop.runtime.oci.generate import docker_config
from sandloop.runtime.oci.host_check import check_host, config_salt
from sandloop.runtime.oci.kernels import DirectKernel, DirectKernels, checkpoint_whole, is_kernel_spec
from sandloop.runtime.oci.store import RootfsStore
from sandloop.runtime.oci.teardown import Teardowns
from sandloop.runtime.tmpfs import mount_host_tmpfs

log = logging.getLogger(__name__)

#: What the direct backend hands to Docker even where it could run directly.
THROUGH_DOCKER = (
    "runc sessions' interpreters, sessions' single runs and file calls, network=True, egress allowlists, other runtimes"
)
#: What needs a Docker engine even where every run is direct (docs/runtimes.md, "What still needs Docker").
NEEDS_DOCKER = (
    "with an engine: building the runtime image and templates (the store exports them from Docker), the first "
    "run of each sandbox shape (its config is Docker's, captured once), sessions' workspaces (Docker volumes); "
    "without one (engine=false): none of these, see docs/runtimes.md"
)

#: What a backend without an engine (engine=false) refuses (docs/runtimes.md, "Without Docker").
WITHOUT_ENGINE = "network=True, egress allowlists, templates, seccomp='docker-default'"
NO_ENGINE_HINT = (
    "runs and sessions on runc and runsc work without it; for the rest, start Docker and drop engine=false "
    "from SANDLOOP_BACKEND"
)


class OCIBackend:
    """Runs through runc directly where Docker parity holds; everything else through Docker."""

    name = "oci"

    def __init__(
        self,
        docker: DockerBackend,
        *,
        store: Path = Path("/var/lib/sandloop/oci"),
        state: Path = Path("/run/sandloop/oci"),
        fallback: bool = True,
        teardown_threads: int = 2,
        runc_with: str = "runc",
        engine: bool = True,
    ) -> None:
        self.docker = docker
        #: False: no Docker engine on this host (or not to be used): every run is direct, configs
        #: are made here (generate.py), images come from the store; what needs an engine is refused.
        self.engine = engine
        if not engine:  # workspaces are their loop mounts, bound in here (kernels.bind_workspaces)
            docker.workspaces.volumes = False
        #: What starts runc-class sandboxes: runc itself, or where bwrap.py's translation of Docker's
        #: config has no gap, the C starter (starter.py: the whole start in one program) or
        #: bubblewrap (bwrap.py); the starter falls back to bubblewrap, bubblewrap to runc.
        self.runc_with = runc_with
        self._bwrap = bwrap.bwrap_path() if runc_with in (BWRAP, STARTER) else None
        if runc_with == BWRAP and self._bwrap is None:
            log.warning("runc_with=bwrap, but bwrap is not installed (apt-get install bubblewrap): runc starts them")
        self.workspaces = docker.workspaces
        self.state = state
        self.fallback = fallback
        self._store_full_said = -1e9  # when the store's full disk was last logged
        self.store = RootfsStore(store / "images", lambda: self.docker.api, engine=engine)
        #: Programs compiled here (bwrap.exec_helper): on the store's disk, not /run (often noexec).
        self.helpers = store / "bin"
        self.templates = Templates(store / "templates", self._capture, self._salt)
        self.kernels = DirectKernels(self)
        self.cgroup_parent = CGROUP_PARENT
        self._problem: str | None = None
        self._checked = False
        self._check_lock = threading.Lock()
        self._runtimes: dict[str, list[str]] = {}
        self._spec_problems: dict[SandboxSpec, str] = {}
        # how to call a runtime, as the host check found it (not runtime_argv: the check's own
        # garbage collection deletes through this)
        self.teardowns = Teardowns(state, lambda name: list(self._runtimes.get(name, [name])), teardown_threads)
        #: How long the last teardowns took, from ``destroy`` to nothing left (benchmarks).
        self.teardown_seconds = self.teardowns.teardown_seconds

    # -- parity ------------------------------------------------------------------------------
    def host_problem(self) -> str | None:
        """Why this host cannot start sandboxes directly with Docker's parity (None: it can)."""
        with self._check_lock:
            if not self._checked:
                self._problem = self._check_host()
                self._checked = True
                if self._problem:
                    log.warning("direct OCI runs are off: %s", self._problem)
                else:
                    self.collect_garbage()
            return self._problem

    def collect_garbage(self) -> list[str]:
        """At start-up: exported stores whose image is gone, bundles a crash left half-made,
        empty cgroups of sandboxes with no bundle (``Teardowns.collect_garbage``)."""
        return self.teardowns.collect_garbage(self.store.gc)

    def _check_host(self) -> str | None:
        return check_host(self.docker.engine_info() if self.engine else None, self._runtimes)

    def _salt(self) -> str:
        return config_salt(self.docker.engine_info() if self.engine else None, self._runtimes)

    def _capture(self, spec: SandboxSpec) -> dict[str, Any]:
        """Docker's config for ``spec``, read from the bundle of a container Docker started (made
        here, as Docker would, without an engine)."""
        if not self.engine:
            return docker_config(spec, self.store.image_config(spec.image))
        sandbox = self.docker.launch(spec, purpose="template", lifetime_seconds=30)
        try:
            found = docker_bundle_config(sandbox.id)
        finally:
            self.docker.destroy(sandbox)
        if found is None:
            raise SandboxError("could not find the bundle Docker handed its runtime (containerd's state directory)")
        return found

    def why_not_direct(self, spec: SandboxSpec) -> str | None:
        """None when this spec runs directly; else why it goes to Docker."""
        problem = self.host_problem()
        if problem:
            return problem
        if spec.limits.runtime not in self._runtimes:
            return f"runtime {spec.limits.runtime} runs through Docker"
        if spec.limits.network:
            return "network=True runs through Docker"
        if spec.limits.egress:
            return "egress allowlists run through Docker"
        if spec.volumes or spec.command:
            # Without an engine every session sandbox is direct; with one, gVisor's interpreters
            # (for their memory checkpoints), and the rest goes through Docker.
            if self.engine and not (is_kernel_spec(spec) and spec.limits.runtime == "runsc"):
                return "sessions' runs, and interpreters on runc, run through Docker"
            spec = replace(spec, volumes=())  # bound here as Docker binds them (kernels.py)
        if not self.engine and spec.limits.seccomp != "sandloop":
            return f"seccomp={spec.limits.seccomp!r} is Docker's built-in profile"
        key = replace(spec, labels=())
        if key not in self._spec_problems:
            self._spec_problems[key] = "; ".join(parity_problems(self.templates.get(spec)))
        return self._spec_problems[key] or None

    def _direct(self, spec: SandboxSpec) -> bool:
        why = self.why_not_direct(spec)
        if why is None:
            return True
        if not self.engine:
            raise EngineUnavailable(f"{why}; this backend runs without Docker (engine=false): {NO_ENGINE_HINT}")
        if not self.fallback and not (spec.volumes or spec.command or spec.limits.network or spec.limits.egress):
            raise SandboxError(f"the direct OCI backend cannot run this: {why} (set fallback to use Docker)")
        return False

    # -- engine-level ------------------------------------------------------------------------
    def info(self) -> BackendInfo:
        problem = self.host_problem()
        if not self.engine:
            return BackendInfo(
                name=self.name,
                version=f"no engine; {', '.join(sorted(self._runtimes)) or 'no runtime'}",
                runtimes=tuple(sorted(self._runtimes)) if problem is None else (),
                quotas_enforced=False,
                isolated=True,
                details={
                    "direct runs": "off: " + problem if problem else ", ".join(sorted(self._runtimes)),
                    "runc-class started by": self.runc_starter(),
                    "engine": "none (engine=false): configs made here, images from the store",
                    NO_DOCKER: WITHOUT_ENGINE,
                },
            )
        inner = self.docker.info()
        direct = "off: " + problem if problem else ", ".join(sorted(self._runtimes))
        return BackendInfo(
            name=self.name,
            version=inner.version,
            runtimes=inner.runtimes,
            quotas_enforced=inner.quotas_enforced,
            isolated=True,
            min_memory_bytes=inner.min_memory_bytes,
            details={
                **inner.details,
                "direct runs": direct,
                "runc-class started by": self.runc_starter(),
                "through Docker": "everything" if problem else THROUGH_DOCKER,
                "needs Docker": NEEDS_DOCKER,
            },
        )

    def has_image(self, image: str) -> bool:
        return self.docker.has_image(image) if self.engine else self.store.has(image)

    def image_builder(self) -> ImageBuilder | None:
        """Templates are Docker images here; the store exports each by its id on first use
        (None without an engine: templates are built by Docker)."""
        return self.docker.image_builder() if self.engine else None

    def close(self) -> None:
        self.drain(30)
        self.teardowns.close()
        if self.engine:
            self.docker.close()

    # -- one run -----------------------------------------------------------------------------
    def run(self, request: RunRequest) -> ExecutionResult:
        started = time.monotonic()
        sandbox: DirectSandbox | LiveSandbox | None = None
        try:
            sandbox = self.launch(request.spec, purpose="run", lifetime_seconds=request.timeout_seconds)
            return self.execute(sandbox, request, started=started)
        finally:
            if sandbox is not None:
                self.destroy(sandbox)

    def launch(self, spec: SandboxSpec, *, purpose: str, lifetime_seconds: float) -> DirectSandbox | LiveSandbox:
        if not self._direct(spec):
            return self.docker.launch(spec, purpose=purpose, lifetime_seconds=lifetime_seconds)
        if is_kernel_spec(spec):
            return self.kernels.launch(spec, purpose=purpose, lifetime_seconds=lifetime_seconds)
        try:
            rootfs = self.store.rootfs(spec.image)
        except HostDiskFull as exc:  # the store's disk is full: Docker's own may not be
            if not self.fallback or not self.engine:
                raise
            now = time.monotonic()
            if now - self._store_full_said > 60:
                self._store_full_said = now
                log.warning("running through Docker until the store can be exported: %s", exc)
            return self.docker.launch(spec, purpose=purpose, lifetime_seconds=lifetime_seconds)
        self._prefetch(rootfs)
        self.teardowns.sweep_once()
        template = self.templates.get(replace(spec, volumes=()))
        runtime: str = spec.limits.runtime
        # a workspace bound in (a session's run without an engine) is a mount bwrap's translation
        # does not make: runc starts those
        if runtime == "runc" and self.translates() and not spec.volumes and not self.bwrap_gaps(template):
            runtime = BWRAP
        sandbox_id, bundle, config = new_config(
            self.state, self.hostname_file(), template, rootfs, spec, purpose, lifetime_seconds, runtime
        )
        self.kernels.bind_workspaces(config, spec.volumes)
        host_tmp = bundle / HOST_TMP if binds_host_tmp(template) else None
        bundles = bundle.parent
        bundles.mkdir(parents=True, exist_ok=True)
        tmp = bundles / f".{sandbox_id}"
        tmp.mkdir(mode=0o700)
        (tmp / "config.json").write_text(json.dumps(config))
        if runtime == BWRAP:  # bwrap runs as the sandbox's user: it must reach its mounts (not list)
            (tmp / "config.json").chmod(0o600)
            tmp.chmod(0o711)
        tmp.rename(bundle)
        if runtime == BWRAP:
            return self._launch_bwrap(config, rootfs, bundle, sandbox_id, spec)
        if host_tmp is not None:
            try:
                mount_host_tmpfs(host_tmp, spec.limits)
            except BaseException:
                remove_tree(bundle)
                raise
        argv = [
            *self._runtimes[runtime],
            "--root",
            str(self.state / "runtime" / runtime),
            "--log",
            str(bundle / "runtime.log"),
            "--log-format",
            "json",
            "run",
            *(["--keep"] if runtime == "runc" else []),
            "--bundle",
            str(bundle),
            "--pid-file",
            str(bundle / "pid"),
            sandbox_id,
        ]
        if runtime == "runsc":
            try:
                own_memory_cgroup(sandbox_id, config)
            except BaseException:
                remove_tree(bundle)
                raise
            argv = [sys.executable, "-S", "-E", SUBREAPER, *argv]

        def start(stdio: tuple[int, int, int]) -> subprocess.Popen[bytes]:
            return subprocess.Popen(argv, stdin=stdio[0], stdout=stdio[1], stderr=stdio[2], start_new_session=True)

        return start_on_pipes(start, sandbox_id, spec, runtime, bundle)

    @staticmethod
    def own_memory_cgroup(sandbox_id: str, config: dict[str, Any]) -> None:
        own_memory_cgroup(sandbox_id, config)

    def runtime_argv(self, runtime: str) -> list[str]:
        """How to call ``runtime`` (its path and the arguments the engine registered it with)."""
        self.host_problem()  # knows the runtimes' paths
        return list(self._runtimes.get(runtime, [runtime]))

    def starter(self) -> str | None:
        """The C starter (``starter.py``), when ``runc_with=starter`` and it runs here (compiled
        and checked on first use)."""
        return starter.starter_path(self.helpers) if self.runc_with == STARTER else None

    def translates(self) -> bool:
        """Whether runc-class sandboxes start from bwrap.py's translation (by the starter or bwrap)."""
        return self.starter() is not None or self._bwrap is not None

    def runc_starter(self) -> str:
        """What starts runc-class sandboxes here, in words (``sandloop doctor``)."""
        if self.starter() is not None:
            return "the C starter (runtime/oci/starter.c, bwrap.py's translation; runc where it cannot translate)"
        if self.runc_with == STARTER and self._bwrap is not None:
            return "bubblewrap: the C starter could not be compiled or run here (see the log; needs cc)"
        if self._bwrap is not None:
            return "bubblewrap (runtime/oci/bwrap.py; runc for a config it cannot translate)"
        if self.runc_with == BWRAP:
            return "runc: bubblewrap is not installed (apt-get install bubblewrap)"
        return "runc"

    def bwrap_gaps(self, template: Mapping[str, Any]) -> str:
        """Why bubblewrap cannot start this template's sandboxes ('' when it can)."""
        return derived(template, "bwrap gaps", lambda t: "; ".join(bwrap.gaps(t)))

    def _launch_bwrap(
        self, config: dict[str, Any], rootfs: Path, bundle: Path, sandbox_id: str, spec: SandboxSpec
    ) -> DirectSandbox:
        # the C starter where it runs here, else bubblewrap: the same description, the same place
        starter_path = self.starter()
        if starter_path is not None:
            starts = functools.partial(starter.start, starter=starter_path)
        else:
            assert self._bwrap is not None
            starts = functools.partial(bwrap.start, bwrap=self._bwrap, exec_as=bwrap.exec_helper(self.helpers))

        def start(stdio: tuple[int, int, int]) -> subprocess.Popen[bytes]:
            return starts(
                config,
                rootfs=rootfs,
                bundle=bundle,
                hostname_file=self.hostname_file(),
                cgroup_parent=CGROUP_PARENT,
                sandbox_id=sandbox_id,
                stdio=stdio,
            )

        return start_on_pipes(start, sandbox_id, spec, BWRAP, bundle)

    @staticmethod
    def _prefetch(rootfs: Path, *, wait: bool = False, force: bool = False) -> None:
        # Direct runs map their programs from the store, not from Docker's layers: those are the
        # pages that must be the host's (see runtime/pagecache.py).
        pagecache.prefetch_once(f"oci:{rootfs}", lambda: [rootfs], wait=wait, force=force)

    def prefetch_image(self, image: str, *, wait: bool = False, force: bool = False) -> None:
        """Read the image's programs into the page cache from the host (the store's copy and
        Docker's layers, since both serve runs)."""
        if self.engine:
            self.docker.prefetch_image(image, wait=wait, force=force)
        if self.host_problem() is None:
            with contextlib.suppress(HostDiskFull):  # then runs go through Docker (see launch)
                self._prefetch(self.store.rootfs(image), wait=wait, force=force)

    def is_alive(self, sandbox: DirectSandbox | LiveSandbox) -> bool:
        if isinstance(sandbox, LiveSandbox):
            return self.docker.is_alive(sandbox)
        return sandbox.proc.poll() is None and sandbox.channel.drain()

    def execute(
        self, sandbox: DirectSandbox | LiveSandbox, request: RunRequest, *, started: float | None = None
    ) -> ExecutionResult:
        if isinstance(sandbox, LiveSandbox):
            return self.docker.execute(sandbox, request, started=started)
        if sandbox.used:
            raise SandboxError("internal error: a sandbox was handed out twice")
        sandbox.used = True
        started = time.monotonic() if started is None else started

        def send(payload: bytes) -> None:
            sandbox.writer = send_payload(sandbox, payload)

        def stop() -> None:
            sandbox.channel.close()
            kill(sandbox)

        return protocol.run_program(
            sandbox.channel,
            request,
            send=send,
            exit_status=lambda reported: self._exit_status(sandbox, reported),
            stop=stop,
            started=started,
            backend=self.name,
        )

    def _exit_status(self, sandbox: DirectSandbox, reported: int | None) -> tuple[int, bool]:
        try:
            code = sandbox.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            kill(sandbox)
            code = sandbox.proc.wait(timeout=10)
        if reported is None and code < 0:
            raise SandboxError(
                f"{sandbox.runtime}'s process for this sandbox was killed (signal {-code}) before the program "
                "finished; nothing ran to completion: run it again"
            )
        if reported is None and code != 0:
            raise_if_runtime_failed(sandbox)
        if reported is not None:
            code = reported
        # ``--keep`` keeps the cgroup until ``runc delete``: its counter says whether the kernel's
        # OOM killer fired in this sandbox (a program's own SIGKILL or exit(137) does not count).
        return code, code != 0 and memory_oom_kills(f"{CGROUP_PARENT}/{sandbox.id}") > 0

    # -- sessions: through Docker ---------------------------------------------------------------
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
        try:
            return self.docker.run_cell(
                kernel,
                code,
                limits=limits,
                interrupt_after=interrupt_after,
                grace=grace,
                secrets=secrets,
                on_output=on_output,
                cancel=cancel,
                options=options,
            )
        finally:
            if isinstance(kernel, DirectKernel):  # a restore's first answer: its CPU quota now
                self.kernels.throttle(kernel)

    def find_kernel(self, session_id: str, spec: SandboxSpec) -> LiveSandbox | None:
        if self.host_problem() is None:
            found = self.kernels.find(session_id, spec)
            if found is not None:
                return found
        return self.docker.find_kernel(session_id, spec) if self.engine else None

    def exec_stream(self, kernel: LiveSandbox, argv: list[str]) -> ExecStream:
        if isinstance(kernel, DirectKernel):
            return self.kernels.exec_stream(kernel, argv)
        return self.docker.exec_stream(kernel, argv)

    # -- memory snapshots (kernels.py) ---------------------------------------------------------
    def checkpoint_problem(self, kernel: DirectSandbox | LiveSandbox) -> str | None:
        """Why this interpreter's memory cannot be checkpointed (None: it can)."""
        if isinstance(kernel, DirectKernel) and kernel.runtime == "runsc":
            return None
        if kernel.spec.limits.runtime != "runsc":
            return (
                "runc keeps no memory here (CRIU 3.17, the only one Debian 12 has, fails `criu check` on this "
                "kernel): only gVisor (runtime='runsc') sessions keep their memory"
            )
        return f"this interpreter runs through Docker ({self.why_not_direct(kernel.spec)})"

    def checkpoint(self, kernel: DirectSandbox | LiveSandbox, directory: Path) -> int:
        problem = self.checkpoint_problem(kernel)
        if problem or not isinstance(kernel, DirectKernel):
            raise SandboxError(problem or "not a direct interpreter")
        return self.kernels.checkpoint(kernel, directory)

    def restore(self, spec: SandboxSpec, directory: Path, *, lifetime_seconds: float) -> LiveSandbox:
        return self.kernels.restore(spec, directory, lifetime_seconds=lifetime_seconds)

    @staticmethod
    def checkpoint_whole(directory: Path) -> bool:
        return checkpoint_whole(directory)

    def detach(self, sandbox: DirectSandbox | LiveSandbox) -> None:
        if isinstance(sandbox, LiveSandbox):
            self.docker.detach(sandbox)
        else:
            self.destroy(sandbox)  # a direct sandbox has no one to outlive us with

    # -- teardown ----------------------------------------------------------------------------
    def destroy(self, sandbox: DirectSandbox | LiveSandbox) -> None:
        """Hand the sandbox to a teardown thread (kill, wait, delete state, remove bundle)."""
        if isinstance(sandbox, DirectKernel):
            self.kernels.destroy(sandbox)
            return
        if isinstance(sandbox, LiveSandbox):
            self.docker.destroy(sandbox)
            return
        self.teardowns.hand_over(sandbox)

    def sweep_dead_owners(self) -> int:
        """Remove what dead owner processes of this host left (``Teardowns.sweep_dead_owners``)."""
        return self.teardowns.sweep_dead_owners()

    def delete_direct(self, sandbox_id: str, runtime: str) -> None:
        """Remove a direct sandbox by id: its processes, runtime state, cgroups and bundle."""
        self.teardowns.delete(sandbox_id, runtime)

    def drain(self, timeout: float) -> bool:
        """Wait until every handed-over teardown is done (at shutdown)."""
        return self.teardowns.drain(timeout)

    @functools.cache  # noqa: B019 - one per backend, lives as long as it
    def hostname_file(self) -> Path:
        path = self.state / "hostname"
        if not path.is_file():
            self.state.mkdir(parents=True, exist_ok=True)
            tmp = self.state / f".hostname-{uuid.uuid4().hex[:8]}"
            tmp.write_text("sandbox\n")
            tmp.chmod(0o644)
            tmp.rename(path)
        return path

    # -- workspaces: Docker's ------------------------------------------------------------------
    def create_workspace(self, session_id: str, quota_bytes: int, owner_uid_gid: str) -> WorkspaceRef:
        return self.docker.create_workspace(session_id, quota_bytes, owner_uid_gid)

    def ensure_workspace(self, session_id: str, ref: WorkspaceRef) -> None:
        self.docker.ensure_workspace(session_id, ref)

    def delete_workspace(self, session_id: str) -> None:
        self.docker.delete_workspace(session_id)

    def workspace_on_host(self, session_id: str, ref: WorkspaceRef) -> Path | None:
        return self.docker.workspace_on_host(session_id, ref)

    # -- housekeeping --------------------------------------------------------------------------
    def direct_bundles(self) -> list[Owned]:
        """The direct sandboxes (and session interpreters) on this host, with their labels."""
        return list_bundles(self.state, self.teardowns.dying)

    def owned(self) -> list[Owned]:
        return (self.docker.owned() if self.engine else []) + self.direct_bundles()

    def remove(self, item: Owned) -> str | None:
        if item.kind == "sandbox" and (self.state / "bundles" / item.id).is_dir():
            self.host_problem()  # knows the runtimes' paths
            return self.teardowns.remove(item)
        return self.docker.remove(item) if self.engine else None

    def remove_labelled(self, label: str, value: str) -> int:
        n = self.docker.remove_labelled(label, value) if self.engine else 0
        for item in self.direct_bundles():
            if item.labels.get(label) == value:
                self.remove(item)
                n += 1
        return n

    def retry_removals(self) -> int:
        # Teardowns still queued or running count as pending removals: a dispatcher's close (also
        # at interpreter exit) and settle() wait for them, so a short-lived process (the CLI)
        # leaves no stopped state, cgroup or bundle behind.
        return (self.docker.retry_removals() if self.engine else 0) + self.teardowns.pending

    def sweep_orphans(self, min_age: float | None = None) -> int:
        # Direct sandboxes need no engine, so no outage orphans them: the engine's containers only.
        return self.docker.sweep_orphans(min_age) if self.engine else 0

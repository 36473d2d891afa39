"""Every isolation control in ``SandboxLimits``, as a Docker container configuration."""

from __future__ import annotations

import functools
import json
import os
from importlib import resources
from typing import Any

from docker.types import DriverConfig, LogConfig, Mount, Ulimit
from sandloop.contract import SandboxLimits
from sandloop.runtime.base import SandboxSpec
from sandloop.runtime.egress.host import SANDBOX_DIR, sandbox_env
from sandloop.runtime.labels import LABEL_PREFIX, owner_labels
from sandloop.runtime.tmpfs import host_tmpfs_needed, tmp_options

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


@functools.cache
def _sandloop_seccomp() -> str:
    return json.dumps(json.loads(resources.files("sandloop.runtime.docker").joinpath("seccomp.json").read_text()))


def seccomp_options(profile: str) -> list[str]:
    """security_opt entries for a profile name: sandloop's own (see scripts/make-seccomp.py)."""
    return [f"seccomp={_sandloop_seccomp()}"] if profile == "sandloop" else []


#: The label of the host tmpfs volume that is a runsc sandbox's /tmp (runtime/tmpfs.py).
TMPFS_LABEL = f"{LABEL_PREFIX}tmpfs"

#: The runsc runtime entry for sandboxes with an egress allowlist: still ``--network=none``, plus
#: ``--host-uds=open`` so the sandbox can connect to the one host Unix socket mounted into it (its
#: egress proxy's). Registered by scripts/engine-up.sh beside plain ``runsc``.
RUNSC_EGRESS = "runsc-egress"


def egress_relayed(limits: SandboxLimits) -> bool:
    """Whether a sandbox with an allowlist reaches the proxy through the launcher's relay and the
    mounted socket (gVisor, or no root to enter its network namespace) rather than directly."""
    return limits.runtime == "runsc" or os.geteuid() != 0


def container_config(
    api: Any, spec: SandboxSpec, purpose: str = "run", lifetime_seconds: float = 60, egress_dir: str | None = None
) -> dict[str, Any]:
    """create_container keyword arguments for ``spec`` (``egress_dir``: its egress proxy's socket
    directory, for a sandbox with an allowlist)."""
    limits = spec.limits
    mounts = [Mount(target, volume, type="volume", read_only=False) for volume, target in spec.volumes]
    environment = dict(SANDBOX_ENV)
    runtime: str = limits.runtime
    if egress_dir is not None:
        relayed = egress_relayed(limits)
        if relayed:
            mounts.append(Mount(SANDBOX_DIR, egress_dir, type="bind", read_only=True))
        environment.update(sandbox_env(relayed))
        runtime = RUNSC_EGRESS if runtime == "runsc" else runtime
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
    tmpfs: dict[str, str] = {}
    if host_tmpfs_needed(limits):
        # gVisor's own tmpfs ignores nr_inodes (runtime/tmpfs.py): an anonymous local volume is a
        # host tmpfs with every option, removed with the container (remove_container(v=True)).
        options = {"type": "tmpfs", "device": "tmpfs", "o": f"{tmp_options(limits)},nosuid,nodev"}
        # labelled, so that one left dangling (its container removed without v=True, by a crash
        # or by hand) is found and removed by the reaper (DockerBackend.owned)
        mounts.append(
            Mount("/tmp", None, type="volume", driver_config=DriverConfig("local", options), labels={TMPFS_LABEL: "1"})
        )
    else:
        tmpfs["/tmp"] = f"rw,nosuid,nodev,{tmp_options(limits)}"
    host_config = api.create_host_config(
        network_mode="bridge" if limits.network else "none",
        mem_limit=limits.memory_bytes,
        memswap_limit=limits.memory_swap_bytes,
        nano_cpus=int(limits.cpus * 1e9),
        pids_limit=pids_limit,
        read_only=limits.read_only,
        tmpfs=tmpfs,
        cap_drop=["ALL"],
        security_opt=["no-new-privileges:true", *seccomp_options(limits.seccomp)],
        ipc_mode="private",
        ulimits=ulimits,
        mounts=mounts,
        # Output reaches us over the attach stream; a log driver would copy a flood to disk.
        log_config=LogConfig(type=LogConfig.types.NONE),
        runtime=runtime,
    )
    return {
        "image": spec.image,
        "command": list(spec.command) or None,
        "stdin_open": True,  # docker-py also sets StdinOnce: our EOF closes the code's stdin
        "user": limits.user,
        "environment": environment,
        "working_dir": spec.cwd,
        "hostname": "sandbox",
        "network_disabled": not limits.network,
        "labels": {**owner_labels(purpose, lifetime_seconds), **dict(spec.labels)},
        "host_config": host_config,
    }

"""Whether this host can start sandboxes directly with Docker's parity, and with which runtimes;
and the salt of every captured config (what, when it changes, makes each template new).

With an engine its info decides: cgroup v1 with the cgroupfs driver, no AppArmor or SELinux
profiles, and the runtimes it registers that are installed here. Without one (engine=false) the
host's mounts and PATH do (runsc with the arguments scripts/engine-up.sh registers it with).
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import json
import os
import shutil
from importlib import resources
from pathlib import Path
from typing import Any

from sandloop.runtime.oci.bundle import DIRECT_RUNTIMES

#: The arguments runsc gets without an engine (scripts/engine-up.sh registers it with Docker so).
RUNSC_ARGS = ("--platform=ptrace", "--network=none")


def check_host(engine_info: dict[str, Any] | None, runtimes: dict[str, list[str]]) -> str | None:
    """Why direct starts are off here (None: they are on); fills ``runtimes`` with how to call
    each one found (its path and arguments). ``engine_info``: the engine's, None without one."""
    if os.geteuid() != 0:
        return "the direct backend needs root (it starts runc itself)"
    if engine_info is None:
        return _check_without_engine(runtimes)
    raw = engine_info
    if str(raw.get("CgroupVersion")) != "1" or raw.get("CgroupDriver") != "cgroupfs":
        return (
            f"only cgroup v1 with the cgroupfs driver is verified (this engine: "
            f"v{raw.get('CgroupVersion')} {raw.get('CgroupDriver')})"
        )
    if (raw.get("SecurityOptions") or []) and any("apparmor" in o or "selinux" in o for o in raw["SecurityOptions"]):
        return "the engine applies AppArmor or SELinux profiles, which the direct backend does not load"
    for name, entry in (raw.get("Runtimes") or {}).items():
        if name in DIRECT_RUNTIMES:
            path = shutil.which(entry.get("path") or name)
            if path:
                runtimes[name] = [path, *(entry.get("runtimeArgs") or [])]
    if not runtimes:
        return f"none of {', '.join(DIRECT_RUNTIMES)} is registered with the engine and installed"
    return None


def _check_without_engine(runtimes: dict[str, list[str]]) -> str | None:
    """What the engine's info says otherwise: cgroup v1 (read from the host's mounts), and the
    runtimes found on PATH."""
    mounts = Path("/proc/self/mounts").read_text().split("\n")
    if not any(line.split()[1:3] == ["/sys/fs/cgroup/memory", "cgroup"] for line in mounts if line):
        return "only cgroup v1 (a memory hierarchy at /sys/fs/cgroup/memory) is verified"
    for name, args in (("runc", []), ("runsc", list(RUNSC_ARGS))):
        path = shutil.which(name)
        if path:
            runtimes[name] = [path, *args]
    if "runc" not in runtimes:
        return "runc is not installed (apt-get install runc)"
    return None


def config_salt(engine_info: dict[str, Any] | None, runtimes: dict[str, list[str]]) -> str:
    """What shapes a captured config besides the spec: with an engine, its version and runtimes,
    this distribution's version and the seccomp profile and hardening code; without one, the code
    that makes the configs here and the profile."""
    if engine_info is None:  # the configs are made here: this code and the profile shape them
        code = b"".join(
            resources.files(pkg).joinpath(name).read_bytes()
            for pkg, name in (("sandloop.runtime.docker", "seccomp.json"), ("sandloop.runtime.oci", "generate.py"))
        )
        return json.dumps(["made here", runtimes, hashlib.sha256(code).hexdigest()], sort_keys=True)
    docker_dir = resources.files("sandloop.runtime.docker")
    seccomp = b"".join(docker_dir.joinpath(name).read_bytes() for name in ("seccomp.json", "hardening.py"))
    try:  # the installed distribution's version (importing the package root would run upward)
        version = importlib.metadata.version("sandloop")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    return json.dumps(
        [engine_info.get("ServerVersion"), engine_info.get("Runtimes"), version, hashlib.sha256(seccomp).hexdigest()],
        sort_keys=True,
    )

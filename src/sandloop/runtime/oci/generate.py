"""Docker's config for a spec, made here: what a host without a Docker engine runs (issue 26).

Where an engine runs, the direct backend captures the config Docker hands runc (``config.py``).
Without one, this module makes the same document from the same inputs: the container settings
``docker/hardening.py`` gives Docker for the spec, the image's own config (env, entrypoint, cwd)
and what dockerd 20.10 adds by itself (moby's ``oci/defaults.go``, ``daemon/oci_linux.go`` and
``profiles/seccomp``: its default mounts, devices, masked and read-only paths, sysctls, the
seccomp profile filtered by architecture and capabilities, tmpfs options merged as its
``MergeTmpfsOptions`` merges them). ``tests/integration/test_oci.py`` checks it field by field
against a config Docker made for the same specs (``config.diff``): nothing here may differ from
Docker's but the per-run fields.

What cannot be made without Docker is refused (``Unmakeable``): Docker's built-in seccomp profile
(``seccomp="docker-default"``), networks, egress and named volumes.
"""

from __future__ import annotations

import functools
import json
import platform
from collections.abc import Mapping, Sequence
from importlib import resources
from typing import Any

from sandloop.contract import SandboxError, SandboxLimits
from sandloop.runtime.base import SandboxSpec
from sandloop.runtime.tmpfs import host_tmpfs_needed, tmp_options

#: The hostname every sandbox gets (hardening.container_config's ``hostname``).
HOSTNAME = "sandbox"
#: The PATH dockerd puts first in every container's environment.
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
#: /dev/shm's size when the container does not set one (dockerd's default).
SHM_BYTES = 64 * 1024 * 1024
#: Filled in per run (config.PER_RUN_FIELDS): a placeholder until then.
PER_RUN = "per-run"

#: moby's ``oci.DefaultLinuxSpec`` mounts (devpts, sysfs, cgroup, mqueue, shm), as dockerd 20.10
#: writes them for a container without privileges.
_BASE_MOUNTS: tuple[dict[str, Any], ...] = (
    {"destination": "/proc", "type": "proc", "source": "proc", "options": ["nosuid", "noexec", "nodev"]},
    {
        "destination": "/dev",
        "type": "tmpfs",
        "source": "tmpfs",
        "options": ["nosuid", "strictatime", "mode=755", "size=65536k"],
    },
    {
        "destination": "/dev/pts",
        "type": "devpts",
        "source": "devpts",
        "options": ["nosuid", "noexec", "newinstance", "ptmxmode=0666", "mode=0620", "gid=5"],
    },
    {"destination": "/sys", "type": "sysfs", "source": "sysfs", "options": ["nosuid", "noexec", "nodev", "ro"]},
    {
        "destination": "/sys/fs/cgroup",
        "type": "cgroup",
        "source": "cgroup",
        "options": ["ro", "nosuid", "noexec", "nodev"],
    },
    {"destination": "/dev/mqueue", "type": "mqueue", "source": "mqueue", "options": ["nosuid", "noexec", "nodev"]},
)
#: Character devices dockerd allows every container (and the one it denies: /dev/net/tun).
_DEVICES: tuple[tuple[bool, int, int], ...] = (
    (True, 1, 5),
    (True, 1, 3),
    (True, 1, 9),
    (True, 1, 8),
    (True, 5, 0),
    (True, 5, 1),
    (False, 10, 229),
)
MASKED_PATHS = (
    "/proc/asound",
    "/proc/acpi",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
)
READONLY_PATHS = ("/proc/bus", "/proc/fs", "/proc/irq", "/proc/sys", "/proc/sysrq-trigger")
SYSCTLS = {"net.ipv4.ip_unprivileged_port_start": "0", "net.ipv4.ping_group_range": "0 2147483647"}
#: seccomp's name for this machine's architecture, and moby's (the profile's ``arches``).
_ARCHES = {"x86_64": ("SCMP_ARCH_X86_64", "amd64"), "aarch64": ("SCMP_ARCH_AARCH64", "arm64")}


class Unmakeable(SandboxError):
    """The spec asks for what only a Docker engine gives."""


def merge_tmpfs_options(options: Sequence[str]) -> list[str]:
    """moby's ``mount.MergeTmpfsOptions``: the last of each key (``size``) or flag pair
    (``rw``/``ro``) wins, in the order of their last appearance."""
    inverse = {"ro": "rw", "rw": "ro", "suid": "nosuid", "nosuid": "suid", "dev": "nodev", "nodev": "dev"}
    inverse |= {"exec": "noexec", "noexec": "exec", "sync": "async", "async": "sync"}
    inverse |= {"atime": "noatime", "noatime": "atime", "diratime": "nodiratime", "nodiratime": "diratime"}
    seen_flags: set[str] = set()
    seen_keys: set[str] = set()
    kept: list[str] = []
    for option in reversed(options):
        key, has_value, _ = option.partition("=")
        if has_value:
            if key in seen_keys:
                continue
            seen_keys.add(key)
        else:
            if option in seen_flags:
                continue
            seen_flags.add(option)
            if option in inverse:
                seen_flags.add(inverse[option])
        kept.append(option)
    return kept[::-1]


@functools.cache
def _profile() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads(resources.files("sandloop.runtime.docker").joinpath("seccomp.json").read_text())
    return loaded


def seccomp(profile: Mapping[str, Any], capabilities: Sequence[str] = (), machine: str | None = None) -> dict[str, Any]:
    """moby's ``setupSeccomp``: a Docker seccomp profile as the OCI config's ``linux.seccomp``,
    for this machine's architecture and a container holding ``capabilities``."""
    machine = machine or platform.machine()
    if machine not in _ARCHES:
        raise Unmakeable(f"no seccomp architecture is known for {machine}")
    scmp_arch, arch = _ARCHES[machine]
    out: dict[str, Any] = {"defaultAction": profile["defaultAction"]}
    if profile.get("defaultErrnoRet"):
        out["defaultErrnoRet"] = profile["defaultErrnoRet"]
    arches = list(profile.get("architectures") or [])
    for entry in profile.get("archMap") or []:
        if entry["architecture"] == scmp_arch:
            arches += [entry["architecture"], *entry.get("subArchitectures", [])]
            break
    if arches:
        out["architectures"] = arches
    rules = []
    for rule in profile["syscalls"]:
        excludes, includes = rule.get("excludes") or {}, rule.get("includes") or {}
        if arch in (excludes.get("arches") or []) or set(excludes.get("caps") or []) & set(capabilities):
            continue
        if includes.get("arches") and arch not in includes["arches"]:
            continue
        if not set(includes.get("caps") or []) <= set(capabilities):
            continue
        if excludes.get("minKernel") or includes.get("minKernel"):
            raise Unmakeable("the seccomp profile has kernel-version conditions, which are not translated here")
        made: dict[str, Any] = {"names": list(rule.get("names") or [rule["name"]]), "action": rule["action"]}
        if rule.get("errnoRet") is not None:
            made["errnoRet"] = rule["errnoRet"]
        args = [
            {
                "index": a["index"],
                "value": a["value"],
                **({"valueTwo": a["valueTwo"]} if a.get("valueTwo") else {}),
                "op": a["op"],
            }
            for a in rule.get("args") or []
        ]
        if args:
            made["args"] = args
        rules.append(made)
    if rules:
        out["syscalls"] = rules
    return out


def _environment(image_env: Sequence[str], user_env: Mapping[str, str]) -> list[str]:
    """dockerd's order: PATH and HOSTNAME first, then the container's own variables, then the
    image's that the container does not set."""
    merged = [f"{k}={v}" for k, v in user_env.items()]
    keys = set(user_env)
    merged += [e for e in image_env if e.partition("=")[0] not in keys]
    out = {"PATH": DEFAULT_PATH, "HOSTNAME": HOSTNAME}
    for entry in merged:
        key, _, value = entry.partition("=")
        out[key] = value
    return [f"{k}={v}" for k, v in out.items()]


def _user(limits: SandboxLimits) -> dict[str, Any]:
    uid, _, gid = limits.user.partition(":")  # numeric, as SandboxLimits checks
    return {"uid": int(uid), "gid": int(gid), "additionalGids": [int(gid)]}


def docker_config(spec: SandboxSpec, image: Mapping[str, Any]) -> dict[str, Any]:
    """The config dockerd 20.10 hands runc for ``spec`` (its per-run fields placeholders).

    ``image``: the image's config as ``docker inspect`` gives it under ``Config`` (``Env``,
    ``Entrypoint``, ``Cmd``, ``WorkingDir``).

    Raises:
        Unmakeable: the spec needs Docker (its built-in seccomp profile, a network, volumes).
    """
    from sandloop.runtime.docker.hardening import SANDBOX_ENV

    limits = spec.limits
    if limits.network or limits.egress:
        raise Unmakeable("a network or an egress allowlist needs Docker's networking")
    if spec.volumes:
        raise Unmakeable("named volumes are Docker's: bind a workspace's host directory instead")
    if limits.seccomp != "sandloop":
        raise Unmakeable(f"seccomp={limits.seccomp!r} is Docker's built-in profile; without Docker use 'sandloop'")
    rlimits = [{"type": "RLIMIT_NOFILE", "hard": limits.open_files, "soft": limits.open_files}]
    pids = limits.pids
    if limits.runtime == "runsc":  # as hardening.container_config (why: there)
        rlimits.append({"type": "RLIMIT_NPROC", "hard": limits.pids, "soft": limits.pids})
        pids = limits.pids * 8 + 128
    entrypoint = list(image.get("Entrypoint") or [])
    args = entrypoint + (list(spec.command) if spec.command else list(image.get("Cmd") or []))
    if not args:
        raise Unmakeable(f"the image {spec.image} has neither an entrypoint nor a command")
    mounts = [dict(m, options=list(m["options"])) for m in _BASE_MOUNTS]
    mounts.append(
        {
            "destination": "/dev/shm",
            "type": "tmpfs",
            "source": "shm",
            "options": ["nosuid", "noexec", "nodev", "mode=1777", f"size={SHM_BYTES}"],
        }
    )
    if host_tmpfs_needed(limits):  # Docker's is an anonymous tmpfs volume, bound in
        mounts.append({"destination": "/tmp", "type": "bind", "source": PER_RUN, "options": ["rbind"]})
    else:
        data = f"rw,nosuid,nodev,{tmp_options(limits)}".split(",")
        options = merge_tmpfs_options(["noexec", "nosuid", "nodev", "rprivate", *data])
        mounts.append({"destination": "/tmp", "type": "tmpfs", "source": "tmpfs", "options": options})
    hostname_options = ["rbind", "ro", "rprivate"] if limits.read_only else ["rbind", "rprivate"]
    mounts.append({"destination": "/etc/hostname", "type": "bind", "source": PER_RUN, "options": hostname_options})
    devices: list[dict[str, Any]] = [{"allow": False, "access": "rwm"}]
    devices += [{"allow": a, "type": "c", "major": ma, "minor": mi, "access": "rwm"} for a, ma, mi in _DEVICES]
    period = 100000
    return {
        "ociVersion": "1.0.2-dev",
        "process": {
            "user": _user(limits),
            "args": args,
            "env": _environment(image.get("Env") or [], SANDBOX_ENV),
            "cwd": spec.cwd or image.get("WorkingDir") or "/",
            "capabilities": {},
            "rlimits": rlimits,
            "noNewPrivileges": True,
            "oomScoreAdj": 0,
        },
        "root": {"path": PER_RUN, **({"readonly": True} if limits.read_only else {})},
        "hostname": HOSTNAME,
        "mounts": mounts,
        "hooks": {},
        "linux": {
            "sysctl": dict(SYSCTLS),
            "resources": {
                "devices": devices,
                "memory": {"limit": limits.memory_bytes, "swap": limits.memory_swap_bytes, "disableOOMKiller": False},
                "cpu": {"shares": 0, "quota": int(limits.cpus * 1e9) * period // 10**9, "period": period},
                "pids": {"limit": pids},
                "blockIO": {"weight": 0},
            },
            "cgroupsPath": PER_RUN,
            "namespaces": [{"type": t} for t in ("mount", "network", "uts", "pid", "ipc")],
            "seccomp": seccomp(_profile()),
            "maskedPaths": list(MASKED_PATHS),
            "readonlyPaths": list(READONLY_PATHS),
        },
    }

"""The host's cgroup files, read where a limit's effect is exact (cgroup v1, cgroupfs)."""

from __future__ import annotations

import contextlib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NamedTuple

from sandloop.contract import SandboxError


def memory_oom_kills(cgroup: str) -> int:
    """The kernel's OOM kills in the memory cgroup ``cgroup`` (relative to the memory hierarchy,
    e.g. ``docker/<id>``), or 0 when it is gone or unreadable."""
    try:
        text = Path(f"/sys/fs/cgroup/memory/{cgroup}/memory.oom_control").read_text()
    except OSError:
        return 0
    for line in text.splitlines():
        if line.startswith("oom_kill "):
            try:
                return int(line.split()[1])
            except (IndexError, ValueError):
                return 0
    return 0


#: cgroup v1's hierarchies (cgroupfs, as Docker's engine here uses them).
V1 = Path("/sys/fs/cgroup")


class Limits(NamedTuple):
    """One cgroup of a sandbox and the files written in it, in order (value, read back ≤ it)."""

    directory: Path
    writes: tuple[tuple[str, int], ...]


def plan_v1(parent: str, name: str, resources: Mapping[str, Any], controllers: Sequence[str]) -> list[Limits]:
    """The sandbox's cgroups ``<controller>/<parent>/<name>`` and what to write in each, from the OCI
    config's ``resources`` (memory+swap, CPU quota, pids): made by ``make_v1`` here, or by the C
    starter (``runtime/oci/starter.c``) from the same plan.

    Raises:
        SandboxError: a limit a sandbox must never run without is missing from the config.
    """
    out: list[Limits] = []
    for controller in controllers:
        writes: list[tuple[str, int]] = []
        if controller == "memory":
            memory = resources.get("memory") or {}
            if not memory.get("limit"):
                raise SandboxError("refusing to start a sandbox without a memory limit in its config")
            writes.append(("memory.limit_in_bytes", int(memory["limit"])))
            if memory.get("swap"):
                writes.append(("memory.memsw.limit_in_bytes", int(memory["swap"])))
        elif controller == "cpu":
            cpu = resources.get("cpu") or {}
            if cpu.get("quota"):
                writes.append(("cpu.cfs_period_us", int(cpu.get("period") or 100_000)))
                writes.append(("cpu.cfs_quota_us", int(cpu["quota"])))
            if cpu.get("shares"):
                writes.append(("cpu.shares", int(cpu["shares"])))
        elif controller == "pids":
            limit = (resources.get("pids") or {}).get("limit")
            if not limit:
                raise SandboxError("refusing to start a sandbox without a pids limit in its config")
            writes.append(("pids.max", int(limit)))
        out.append(Limits(V1 / controller / parent / name, tuple(writes)))
    return out


def make_v1(parent: str, name: str, resources: Mapping[str, Any], controllers: Sequence[str]) -> list[Path]:
    """The sandbox's cgroups made (``plan_v1``), each limit read back: a sandbox must never run
    without them. On any failure nothing made is left.

    Raises:
        SandboxError: a limit is missing from the config or did not take.
    """
    plan = plan_v1(parent, name, resources, controllers)
    made: list[Path] = []
    try:
        for cgroup in plan:
            cgroup.directory.mkdir(parents=True)
            made.append(cgroup.directory)
            for key, value in cgroup.writes:
                (cgroup.directory / key).write_text(str(value))
                if int((cgroup.directory / key).read_text()) > value:  # the kernel rounds a memory limit down
                    raise OSError(f"{key} did not take")
    except OSError as exc:
        remove(made)
        raise SandboxError(f"could not set the sandbox's cgroup limits: {exc}") from exc
    except BaseException:
        remove(made)
        raise
    return made


def join(directories: Sequence[Path], pid: int) -> None:
    """Move ``pid`` into each cgroup (its children to come follow it)."""
    for d in directories:
        (d / "cgroup.procs").write_text(str(pid))


def remove(directories: Sequence[Path]) -> None:
    """rmdir each (empty) cgroup; one still in use stays (the reaper retries)."""
    for d in directories:
        with contextlib.suppress(OSError):
            d.rmdir()

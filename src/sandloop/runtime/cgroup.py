"""The host's cgroup files, read where a limit's effect is exact (cgroup v1, cgroupfs)."""

from __future__ import annotations

from pathlib import Path


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

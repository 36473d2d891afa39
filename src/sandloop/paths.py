"""Where sandloop keeps its state on this host (sessions' records and workspaces, tokens)."""

from __future__ import annotations

import contextlib
import os
import subprocess
from pathlib import Path


def default_home() -> Path:
    """``$SANDLOOP_HOME``, else /var/lib/sandloop as root, else the user's data directory. Read
    by ``Settings`` (``home``) and by a backend built without one."""
    if os.environ.get("SANDLOOP_HOME"):
        return Path(os.environ["SANDLOOP_HOME"])
    if os.geteuid() == 0:
        return Path("/var/lib/sandloop")
    return Path(os.environ.get("XDG_DATA_HOME", Path.home() / ".local/share")) / "sandloop"


def tree_size(path: Path) -> int:
    """Bytes a directory's files take on disk (what a snapshot costs its owner)."""
    total = 0
    for dirpath, _, files in os.walk(path):
        for name in files:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except OSError:
                continue
    return total


def unmount_below(root: Path) -> None:
    """Detach whatever is mounted below ``root`` (a build that died may leave proc or sys mounted
    in its target): never rmtree through a mount."""
    with contextlib.suppress(OSError):
        mounts = [ln.split()[1] for ln in Path("/proc/mounts").read_text().splitlines()]
        for mnt in sorted((m for m in mounts if m.startswith(str(root) + "/")), reverse=True):
            subprocess.run(["umount", "-l", mnt], check=False, capture_output=True)

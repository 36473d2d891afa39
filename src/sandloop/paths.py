"""Where sandloop keeps its state on this host (sessions' records and workspaces, tokens)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import uuid
from pathlib import Path


def default_home() -> Path:
    """``$SANDLOOP_HOME``, else /var/lib/sandloop as root, else the user's data directory. Read
    by ``Settings`` (``home``) and by a backend built without one."""
    if os.environ.get("SANDLOOP_HOME"):
        return Path(os.environ["SANDLOOP_HOME"])
    if os.geteuid() == 0:
        return Path("/var/lib/sandloop")
    return Path(os.environ.get("XDG_DATA_HOME", Path.home() / ".local/share")) / "sandloop"


def write_atomically(path: Path, data: str | bytes, mode: int = 0o600) -> None:
    """Replace ``path`` whole: a reader sees the old content or the new, never a part. Each writer
    (thread or process) writes a temporary file of its own beside it and the last rename wins
    (one shared temporary name let two writers interleave into a damaged file: seen in CI, a
    session record with a stray ``}`` after two requests touched it at once). The directory
    must exist: a writer never brings back one that was removed."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:12]}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
        os.chmod(tmp, mode)  # whatever the umask took away
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise


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

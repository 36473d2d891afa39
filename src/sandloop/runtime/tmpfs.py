"""A sandbox's ``/tmp``: one tmpfs with its size, inode cap and mode, on every backend and runtime.

Under runc the container's own tmpfs mount carries ``nr_inodes`` and the host kernel enforces it.
Under gVisor (runsc 20221219) a tmpfs mount is the Sentry's own, and the Sentry drops every option
but mode/size/uid/gid: measured, 40,000 empty files and no ENOSPC, so ``tmpfs_inodes`` held
nothing. So under runsc ``/tmp`` is a tmpfs made by the *host* kernel (with ``nr_inodes``) and
bound into the sandbox; gVisor reaches it through its gofer and the host's ENOSPC comes back to
the code (measured: ENOSPC at the cap; small-file I/O ~2x slower than the Sentry's tmpfs).
Docker makes that host tmpfs as an anonymous ``local`` volume (removed with the container); the
direct backend mounts it itself inside the sandbox's bundle (``mount_host_tmpfs``).
"""

from __future__ import annotations

import ctypes
import functools
import os
from pathlib import Path

from sandloop.contract import SandboxError, SandboxLimits

MS_NOSUID, MS_NODEV, MS_NOEXEC = 2, 4, 8
MNT_DETACH = 2


def tmp_options(limits: SandboxLimits) -> str:
    """The tmpfs data for ``/tmp`` (without the flags)."""
    return f"size={limits.tmpfs_bytes},nr_inodes={limits.tmpfs_inodes},mode=1777"


def host_tmpfs_needed(limits: SandboxLimits) -> bool:
    """Whether ``/tmp`` must be a host tmpfs bound in (the runtime ignores ``nr_inodes``)."""
    return limits.runtime == "runsc"


@functools.cache
def libc() -> ctypes.CDLL:
    """The C library, loaded once (mount, umount2, setns: calls Python's os module lacks here)."""
    return ctypes.CDLL(None, use_errno=True)


def mount_host_tmpfs(target: Path, options: SandboxLimits | str, flags: int = MS_NOSUID | MS_NODEV) -> None:
    """Mount a fresh tmpfs at ``target`` (made here): ``options`` is a limits' size, inode cap and
    mode, or a mount's data (``size=...,nr_inodes=...,mode=...``); ``flags`` the mount flags.

    Raises:
        SandboxError: the host refused the mount (not root, or out of memory).
    """
    target.mkdir(mode=0o700)
    data = (tmp_options(options) if isinstance(options, SandboxLimits) else options).encode()
    if libc().mount(b"tmpfs", str(target).encode(), b"tmpfs", flags, data) != 0:
        err = ctypes.get_errno()
        raise SandboxError(f"could not mount the sandbox's /tmp at {target}: {os.strerror(err)} (run as root)")


def unmount_host_tmpfs(target: Path) -> None:
    """Detach the tmpfs at ``target`` if one is mounted there; never raises (its memory goes with
    the last reference)."""
    if target.is_mount():
        libc().umount2(str(target).encode(), MNT_DETACH)

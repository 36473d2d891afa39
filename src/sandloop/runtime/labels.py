"""Labels on everything sandloop creates: who owns it, what it is for, when it expires.

The reaper trusts only these. ``sandloop.owner`` is ``host:pid:start-time`` so that a reused pid
is not mistaken for a live owner.
"""

from __future__ import annotations

import os
import socket
import time

LABEL_PREFIX = "sandloop."
#: Carried by every sandbox and workspace of a session.
SESSION_LABEL = f"{LABEL_PREFIX}session"
#: The process (host:pid:start time) or ``session:ID`` that owns a sandbox.
OWNER_LABEL = f"{LABEL_PREFIX}owner"


def _process_start_time(pid: int) -> str:
    """The kernel's start time of a process (clock ticks since boot): tells a reused pid apart."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return "0"


_own: tuple[int, str] = (0, "")


def owner_id(pid: int | None = None) -> str:
    """``host:pid:start-time`` of a process; the reaper checks whether that process still lives.
    This process's own is read once (per pid: a forked child reads its own), not at every start."""
    global _own
    if pid is None:
        me = os.getpid()
        if _own[0] != me:
            _own = (me, f"{socket.gethostname()}:{me}:{_process_start_time(me)}")
        return _own[1]
    return f"{socket.gethostname()}:{pid}:{_process_start_time(pid)}"


def owner_alive(owner: str) -> bool | None:
    """True/False for an owner on this host; None when it is another host's (cannot tell)."""
    try:
        host, pid, start = owner.rsplit(":", 2)
    except ValueError:
        return None
    if host != socket.gethostname():
        return None
    return pid.isdigit() and _process_start_time(int(pid)) == start and start != "0"


def owner_labels(purpose: str, lifetime_seconds: float) -> dict[str, str]:
    now = time.time()
    return {
        f"{LABEL_PREFIX}owner": owner_id(),
        f"{LABEL_PREFIX}purpose": purpose,
        f"{LABEL_PREFIX}created": f"{now:.0f}",
        f"{LABEL_PREFIX}expires": f"{now + lifetime_seconds + 60:.0f}",
    }

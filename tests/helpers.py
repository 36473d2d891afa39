"""Helpers for tests that talk to the real engine."""

from __future__ import annotations

import contextlib
import os

import docker

from sandloop.runtime.labels import owner_id

OWNER = owner_id()


def our_containers(patience: float = 60.0) -> list:
    """Leftovers: containers this process created (by owner label), running or not, other than
    the warm sandboxes waiting in pools. Waits for pending and retried removals (an overloaded
    engine can time a removal out; sandloop retries it), up to ``patience`` seconds."""
    import time

    from sandloop.pool.dispatcher import live_dispatchers

    deadline = time.monotonic() + patience
    while True:
        pooled: set[str] = set()
        for dispatcher in live_dispatchers():
            assert dispatcher.settle(60), "used sandboxes were not destroyed, or pools not refilled, within 60 s"
            pooled |= dispatcher.pooled_ids()
        client = docker.from_env()
        try:
            found = client.containers.list(all=True, filters={"label": f"sandloop.owner={OWNER}"})
        finally:
            client.close()
        left = [c for c in found if c.id not in pooled]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(1)


def host_temp_entries() -> set[str]:
    found = set()
    for d in ("/tmp", "/var/tmp"):
        with contextlib.suppress(OSError):
            found |= {f"{d}/{n}" for n in os.listdir(d) if n.startswith("sandloop")}
    return found


#: Python snippet: proves loopback is the only interface before trying anything, so a failing
#: test never sends a packet (with no route, connect() fails inside the kernel).
ONLY_LOOPBACK_GUARD = r"""
import os, sys
ifaces = sorted(os.listdir("/sys/class/net")) if os.path.isdir("/sys/class/net") else None
if ifaces is None:
    ifaces = sorted(l.split(":")[0].strip() for l in open("/proc/net/dev").read().splitlines()[2:])
if ifaces != ["lo"]:
    print("INTERFACES", ifaces)
    sys.exit(3)
"""

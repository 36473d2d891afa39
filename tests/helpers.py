"""Helpers for tests that talk to the real engine."""

from __future__ import annotations

import contextlib
import os
import socket

import docker

OWNER = f"{socket.gethostname()}:{os.getpid()}"


def our_containers() -> list:
    """Containers this test process created (by sandloop's owner label), running or not."""
    client = docker.from_env()
    try:
        return client.containers.list(all=True, filters={"label": f"sandloop.owner={OWNER}"})
    finally:
        client.close()


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

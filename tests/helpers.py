"""Helpers for tests that talk to the real engine."""

from __future__ import annotations

import contextlib
import os

import docker

from sandloop.runtime.labels import owner_id

OWNER = owner_id()


#: Where the direct OCI backend keeps its bundles (settings' default).
OCI_BUNDLES = "/run/sandloop/oci/bundles"


def direct_sandboxes(owned=lambda owner: owner == OWNER) -> list[str]:
    """Bundles of direct (OCI backend) sandboxes whose ``sandloop.owner`` passes ``owned``
    (default: this process)."""
    import json
    from pathlib import Path

    found = []
    for config in Path(OCI_BUNDLES).glob("*/config.json"):
        with contextlib.suppress(OSError, ValueError):
            if owned(json.loads(config.read_text()).get("annotations", {}).get("sandloop.owner", "")):
                found.append(config.parent.name)
    return found


def owned_by_pid(*pids: int):
    """An ``owned`` predicate for ``direct_sandboxes``: any of these processes."""
    return lambda owner: any(f":{pid}:" in owner for pid in pids)


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
            found = client.containers.list(all=True, sparse=True, filters={"label": f"sandloop.owner={OWNER}"})
        finally:
            client.close()
        left = [c for c in found if c.id not in pooled]
        left += [name for name in direct_sandboxes() if name not in pooled]
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(1)


def host_temp_entries() -> set[str]:
    """sandloop's entries in the host's temp folders, but a template build's scratch folder of
    another live process (``sandloop-template-<pid>-...``: a test worker beside this one builds
    too; seen failing a leak check on 4 workers). Ours, and those of a dead owner, count."""
    found = set()
    for d in ("/tmp", "/var/tmp"):
        with contextlib.suppress(OSError):
            found |= {f"{d}/{n}" for n in os.listdir(d) if n.startswith("sandloop") and not _another_live_build(n)}
    return found


def _another_live_build(name: str) -> bool:
    from sandloop.images.templates.build import SCRATCH_PREFIX

    pid = name.removeprefix(SCRATCH_PREFIX).split("-", 1)[0]
    if not name.startswith(SCRATCH_PREFIX) or not pid.isdigit() or int(pid) == os.getpid():
        return False
    return os.path.exists(f"/proc/{pid}")


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


def _cpu_usage_file(container_id: str) -> str | None:
    """The host's CPU-time counter for a container's cgroup (v1 cgroupfs, or v2)."""
    candidates = (
        f"/sys/fs/cgroup/cpuacct/docker/{container_id}/cpuacct.usage",  # v1, ns
        f"/sys/fs/cgroup/cpu,cpuacct/docker/{container_id}/cpuacct.usage",
        f"/sys/fs/cgroup/system.slice/docker-{container_id}.scope/cpu.stat",  # v2 + systemd, usec
        f"/sys/fs/cgroup/docker/{container_id}/cpu.stat",  # v2 + cgroupfs
        f"/sys/fs/cgroup/cpuacct/sandloop/{container_id}/cpuacct.usage",  # the direct OCI backend
        f"/sys/fs/cgroup/cpu,cpuacct/sandloop/{container_id}/cpuacct.usage",
    )
    return next((p for p in candidates if os.path.exists(p)), None)


def _cpu_seconds(path: str) -> float:
    with open(path) as f:
        text = f.read()
    if path.endswith("cpuacct.usage"):
        return int(text) / 1e9
    usage = next(line.split()[1] for line in text.splitlines() if line.startswith("usage_usec"))
    return int(usage) / 1e6


def busiest_container_cpu_share(window: float = 2.0, patience: float = 120.0, work: float = 0.5) -> float:
    """CPUs used by this process's busiest running sandbox, read from the host's cgroup.

    Waits until one of our sandboxes has burned ``work`` CPU-seconds while watched (by work done,
    not by a rate: on a busy host a capped sandbox may get far less than its cap, and an idle
    pooled one never gets there), then measures its cgroup's CPU time over ``window`` seconds of
    the host's clock. This is the exact measure of a CPU quota: gVisor's clock inside the sandbox
    reads up to 0.91 of a CPU where this reads 0.50 (measured here).
    """
    import time

    client = docker.from_env()
    try:

        def snapshot() -> dict[str, float]:
            out = {}
            running = client.api.containers(filters={"label": f"sandloop.owner={OWNER}", "status": "running"})
            for container_id in [c["Id"] for c in running] + direct_sandboxes():
                path = _cpu_usage_file(container_id)
                if path is not None:
                    with contextlib.suppress(OSError, StopIteration, ValueError):
                        out[path] = _cpu_seconds(path)
            return out

        deadline = time.monotonic() + patience
        base: dict[str, float] = {}  # each sandbox's CPU time when first seen
        while True:
            now = snapshot()
            for p, used in now.items():
                base.setdefault(p, used)
            burned = {p: now[p] - base[p] for p in now}
            busy = [p for p, cpu in burned.items() if cpu >= work]
            if not busy:
                assert time.monotonic() < deadline, f"no sandbox of ours burned {work} CPU-s within {patience} s"
                time.sleep(0.25)
                continue
            path = max(busy, key=burned.__getitem__)
            try:
                start, t0 = _cpu_seconds(path), time.monotonic()
                time.sleep(window)
                return (_cpu_seconds(path) - start) / (time.monotonic() - t0)
            except OSError:  # it ended within the window: another test's sandbox going, not ours
                assert time.monotonic() < deadline, f"every busy sandbox of ours ended within {window} s"
                base = {}
    finally:
        client.close()


def read_until(channel, want: bytes, seconds: float = 60.0) -> bytes:
    """What a reach channel or terminal (``runtime/reach/mux.py``) showed until ``want``, bounded:
    past ``seconds``, or at its end without it, the failure says what it did show."""
    import time

    seen = b""
    deadline = time.monotonic() + seconds
    while want not in seen:
        try:
            chunk = channel.recv(max(0.1, deadline - time.monotonic()))
        except TimeoutError:
            raise AssertionError(f"no {want!r} within {seconds:.0f} s; it showed {seen[-500:]!r}") from None
        if not chunk:
            raise AssertionError(f"no {want!r} before its end; it showed {seen[-500:]!r}")
        seen += chunk
    return seen

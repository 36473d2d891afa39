"""Chaos: a sandbox the engine cannot remove (its root file system is held or protected).

Made for real: a file in the container's writable layer is set immutable (``chattr +i``), so
Docker's removal fails with EPERM and leaves the container "Removal In Progress" -- the state the
engine restart under load left behind (there the overlay root was busy in another mount namespace).
Another process's ``sandloop reap`` and ``sandloop doctor`` must report it once, with what to do,
and exit non-zero; not loop on it; and remove it once it can be removed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys

import docker
import pytest

from sandloop.runtime.labels import owner_labels
from sandloop.settings import Settings

pytestmark = [
    pytest.mark.chaos,
    pytest.mark.docker,
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("chattr"), reason="needs root and chattr"),
]


def sandloop(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "sandloop", *args], capture_output=True, text=True, timeout=180)


@pytest.fixture
def stuck_container():
    client = docker.from_env()
    image = Settings().runtime_image()
    container = client.containers.create(
        image, entrypoint=["/bin/sh"], command=["-c", "echo held > /tmp/held"], labels=owner_labels("run", 60)
    )
    held = None
    try:
        container.start()
        container.wait(timeout=60)
        upper = container.attrs["GraphDriver"]["Data"]["UpperDir"]
        held = os.path.join(upper, "tmp", "held")
        subprocess.run(["chattr", "+i", held], check=True)
        with pytest.raises(docker.errors.APIError):
            container.remove(force=True)
        container.reload()
        yield container, held
    finally:
        if held is not None:
            subprocess.run(["chattr", "-i", held], check=False)
        with contextlib.suppress(docker.errors.NotFound):
            container.remove(force=True)
        client.close()


def test_reap_and_doctor_report_what_the_engine_cannot_remove(stuck_container):
    container, held = stuck_container
    assert container.status in ("removing", "dead"), container.status  # the engine's own word
    short = container.id[:12]

    r = sandloop("reap")  # another process; the container's owner (this one) is alive
    assert r.returncode == 1, (r.stdout, r.stderr)
    assert f"could not remove sandbox {short}" in r.stderr and "operation not permitted" in r.stderr, r.stderr
    assert "restart the engine" in r.stderr and "Traceback" not in r.stderr
    assert r.stderr.count("could not remove") == 1  # once: no retry loop behind the report

    r = sandloop("doctor", "--no-smoke")
    line = next(line for line in r.stdout.splitlines() if "leftovers" in line)
    assert "failed" in line, r.stdout
    assert short in r.stdout.replace("\n", "")

    subprocess.run(["chattr", "-i", held], check=True)  # the operator fixes the cause
    r = sandloop("reap")
    assert r.returncode == 0 and "could not remove" not in r.stderr, (r.stdout, r.stderr)
    with pytest.raises(docker.errors.NotFound):
        container.reload()
    r = sandloop("doctor", "--no-smoke")
    line = next(line for line in r.stdout.splitlines() if "leftovers" in line)
    assert "ok" in line, r.stdout

"""Chaos: no Docker engine at all. dockerd is stopped (SIGTERM, and gone) and a backend without
an engine (``engine=false``, the image built without Docker) runs code on runc and runsc and a
session's cells, then the engine is brought back with scripts/engine-up.sh (issue 26)."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time

import pytest

from sandloop import SandboxLimits, Sandloop, Settings
from sandloop.images.build import build_rootfs
from sandloop.settings import OCIConfig
from tests.chaos.load import pid_of
from tests.chaos.test_engine_restart import ENGINE_UP
from tests.integration.test_no_docker import STORE

pytestmark = [
    pytest.mark.chaos,
    pytest.mark.docker,
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("dockerd"), reason="needs root and a local dockerd"),
]


@pytest.mark.timeout(600)
def test_runs_and_sessions_while_dockerd_is_stopped():
    build_rootfs(store=STORE, progress=lambda line: None)  # cached: built by test_no_docker.py
    pid = pid_of("dockerd")
    if pid is None:
        pytest.skip("dockerd is not a local process here")
    os.kill(pid, signal.SIGTERM)
    try:
        for _ in range(600):  # dockerd stops its containers first: gone, not just signalled
            if pid_of("dockerd") is None:
                break
            time.sleep(0.1)
        assert pid_of("dockerd") is None, "dockerd did not stop"
        root = Sandloop(Settings(backend=OCIConfig(engine=False, store=STORE), pool_size=1))
        try:
            for runtime in ("runc", "runsc"):
                result = root.run_code("import os; print(os.getuid())", limits=SandboxLimits(runtime=runtime))
                assert result.ok and result.stdout == "65534\n", (runtime, result)
            with root.create_session() as session:
                assert session.run_cell("x = 20").ok
                assert session.run_cell("print(x * 2 + 2)").stdout == "42\n"
            assert root.dispatcher.settle(60)
        finally:
            root.close()
        assert pid_of("dockerd") is None  # nothing above started it again
    finally:
        subprocess.run(["bash", str(ENGINE_UP)], check=True, capture_output=True, timeout=180)

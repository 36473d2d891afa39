"""A host without Docker (issue 26): the runtime image built straight into the direct backend's
store (``sandloop images build --no-docker``), configs made here (runtime/oci/generate.py) and
proven equal to Docker's field by field, and runs on the C starter, runc and runsc by a backend whose
Docker engine is a dead socket (``engine=false``): it works, never asks the engine, refuses what
needs one in the user's words, and leaves nothing behind."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from sandloop import SandboxLimits, Sandloop, Settings
from sandloop.contract import EngineUnavailable, SandboxError
from sandloop.images.build import build_rootfs
from sandloop.runtime.base import SandboxSpec
from sandloop.runtime.docker import DockerBackend
from sandloop.runtime.oci import OCIBackend
from sandloop.runtime.oci.config import diff
from sandloop.runtime.oci.generate import docker_config
from sandloop.runtime.oci.store import BUILT, IMAGE_CONFIG
from sandloop.settings import OCIConfig, runtime_image
from tests.helpers import direct_sandboxes

# The image is built here without Docker (debootstrap, wheels: minutes on a busy machine), bounded
# by its own steps, not by the per-test timeout.
pytestmark = [pytest.mark.skipif(os.geteuid() != 0, reason="the direct backend needs root"), pytest.mark.timeout(1200)]

#: Its own store, so that Docker-made exports of the same image never stand in for the build.
STORE = Path("/var/lib/sandloop/oci-no-docker")
#: A Docker engine that is not there: any call to it fails.
DEAD = "unix:///nonexistent/docker.sock"
NO_ENGINE = json.dumps({"type": "oci", "engine": False, "store": str(STORE), "base_url": DEAD})


@pytest.fixture(scope="module")
def built() -> str:
    """The runtime image built without Docker (once per recipe: cached in STORE)."""
    lines: list[str] = []
    return build_rootfs(store=STORE, progress=lines.append)


@pytest.fixture(scope="module")
def root(built):
    settings = Settings(backend=OCIConfig(engine=False, store=STORE, base_url=DEAD), pool_size=0)
    sl = Sandloop(settings)
    yield sl
    sl.close()


def _image_dir(image: str) -> Path:
    ref = next(json.loads(p.read_text()) for p in (STORE / "images/refs").iterdir() if image in p.read_text())
    return STORE / "images" / ref["id"]


@pytest.mark.docker
@pytest.mark.parametrize(
    "spec_kw",
    [
        {},
        {"limits": {"memory": "128m", "cpus": 1.5, "pids": 32, "open_files": 256, "tmpfs_size": "16m"}},
        {"limits": {"runtime": "runsc", "tmpfs_inodes": 999}},
        {"limits": {"runtime": "runsc"}, "cwd": "/workspace", "command": ("--kernel",)},
        {"limits": {"read_only": False, "memory_swap": "512m"}, "cwd": "/home/user"},
    ],
    ids=["defaults", "other-limits", "runsc", "runsc-kernel", "writable-swap"],
)
def test_the_config_made_here_is_dockers_field_by_field(spec_kw):
    """What a host without Docker runs is what Docker would hand runc for the same spec."""
    oci = OCIBackend(DockerBackend())
    try:
        assert oci.host_problem() is None
        limits = SandboxLimits(**spec_kw.get("limits", {})).for_container()
        spec = SandboxSpec(runtime_image(), limits, spec_kw.get("cwd", "/tmp"), command=spec_kw.get("command", ()))
        made = docker_config(spec, oci.store.image_config(spec.image))
        assert diff(made, oci._capture(spec)) == []
    finally:
        oci.close()


@pytest.mark.docker
def test_the_image_built_without_docker_is_the_one_docker_builds(built):
    """Same files (paths, modes, owners, link targets) and the same config as Docker's export."""
    here = _image_dir(built)
    assert (here / BUILT).is_file()
    docker = OCIBackend(DockerBackend())
    try:
        theirs = docker.store.rootfs(built)
        config = docker.store.image_config(built)
    finally:
        docker.close()
    mine = json.loads((here / IMAGE_CONFIG).read_text())
    assert {k: mine[k] for k in ("Env", "Entrypoint", "Cmd", "WorkingDir")} == {
        k: config.get(k) for k in ("Env", "Entrypoint", "Cmd", "WorkingDir")
    }

    def tree(top: Path) -> dict[str, tuple[int, int, int, str]]:
        out = {}
        for dirpath, dirs, files in os.walk(top):
            for name in dirs + files:
                path = Path(dirpath, name)
                st = path.lstat()
                link = os.readlink(path) if path.is_symlink() else ""
                out[str(path.relative_to(top))] = (st.st_mode, st.st_uid, st.st_gid, link)
        return out

    a, b = tree(here / "rootfs"), tree(theirs)
    assert sorted(set(a) ^ set(b)) == []
    different = [p for p in a if a[p] != b[p] and not p.startswith(("tmp", "var/log", "var/cache"))]
    assert different == []


def test_runs_without_an_engine_on_every_starter_with_the_controls(root):
    # /workspace is world-writable in the image: only the read-only root can refuse it
    probe = (
        "import os, socket\n"
        "try:\n    open('/workspace/x', 'w'); rw = 'wrote'\nexcept OSError as e:\n    rw = e.strerror\n"
        "print(os.getuid(), os.getgid(), socket.gethostname(), rw, ','.join(n for _, n in socket.if_nameindex()),\n"
        "      open('/proc/self/status').read().split('CapEff:')[1].split()[0], sep='|')"
    )
    for runtime in ("runc", "runsc"):
        result = root.run_code(probe, limits=SandboxLimits(runtime=runtime))
        assert result.ok, result.stderr
        seen = result.stdout.strip().split("|")
        assert seen == ["65534", "65534", "sandbox", "Read-only file system", "lo", "0000000000000000"], runtime
    assert root.backend.runc_starter().startswith("the C starter")


def test_limits_hold_without_an_engine(root):
    hog = "b = bytearray(400 * 1024 * 1024); print('survived')"
    for runtime in ("runc", "runsc"):
        result = root.run_code(hog, limits=SandboxLimits(runtime=runtime, memory="128m"))
        assert result.oom_killed and "survived" not in result.stdout, (runtime, result)
    slow = root.run_code("import time; time.sleep(30)", timeout_seconds=1)
    assert slow.timed_out


def test_runc_itself_starts_them_too(built):
    """runc_with=runc: the made config handed to runc itself, not translated for bubblewrap."""
    backend = OCIConfig(engine=False, store=STORE, base_url=DEAD, runc_with="runc")
    sl = Sandloop(Settings(backend=backend, pool_size=0))
    try:
        r = sl.run_code("import os; print(os.getuid(), open('/proc/1/cmdline').read().split(chr(0))[0])")
        assert r.ok and r.stdout == "65534 /usr/bin/tini\n", r
        assert sl.backend.runc_starter() == "runc"
    finally:
        sl.close()


@pytest.mark.parametrize("runtime", ["runc", "runsc"])
def test_sessions_without_an_engine(root, runtime):
    """Workspaces are loop mounts bound in (no volume), interpreters held by the shim under runc
    or runsc, runs and file calls direct; pause keeps memory on gVisor and picklable state on runc
    (and says which); a fork has its own workspace; nothing is left after delete."""
    session = root.create_session(SandboxLimits(runtime=runtime))
    sid = session.id
    try:
        assert session.run_cell("import numpy as np; a = np.arange(10); g = iter(range(5)); next(g)").ok
        session.write_file("notes.txt", b"kept")
        ran = session.run(
            "import os; print(os.getuid(), open('/workspace/notes.txt').read(), os.listdir('/home/user'))"
        )
        assert ran.stdout == "65534 kept ['notes.txt']\n", ran
        kind = session.pause()
        assert kind == ("memory" if runtime == "runsc" else "state")
        session.resume()
        assert session.run_cell("print(a.sum())").stdout == "45\n"
        if runtime == "runsc":  # a generator mid-way lives on only in memory
            assert session.run_cell("print(next(g))").stdout == "1\n"
        (child,) = session.fork(1)
        try:
            child.write_file("notes.txt", b"child's")
            assert child.run_cell("print(a.sum())").stdout == "45\n"
            assert session.read_file("notes.txt") == b"kept"
        finally:
            child.delete()
    finally:
        session.delete()
    assert not (root.settings.home / "sessions" / sid / "workspace.img").exists()
    assert [line for line in Path("/proc/mounts").read_text().splitlines() if sid in line] == []
    assert root.dispatcher.settle(60)
    assert [b for b in Path("/run/sandloop/oci/bundles").iterdir() if sid in (b / "config.json").read_text()] == []


def test_what_needs_docker_is_refused_in_the_users_words(root):
    with pytest.raises(EngineUnavailable, match=r"network=True .*engine=false"):
        root.run_code("print(1)", limits=SandboxLimits(network=True))
    with pytest.raises(EngineUnavailable, match=r"egress .*engine=false"):
        root.run_code("print(1)", limits=SandboxLimits(egress=["pypi.org"]))
    with pytest.raises(EngineUnavailable, match=r"docker-default.*engine=false"):
        root.run_code("print(1)", limits=SandboxLimits(seccomp="docker-default"))
    with pytest.raises(SandboxError, match=r"templates .*engine=false"):
        root.run_code("print(1)", template="mine:v1")
    assert root.backend.image_builder() is None


def test_nothing_is_left_and_the_engine_was_never_asked(root):
    before = set(direct_sandboxes())  # this process's (other workers run beside it)
    for runtime in ("runc", "runsc"):
        assert root.run_code("print(1)", limits=SandboxLimits(runtime=runtime)).ok
    assert root.dispatcher.settle(60)
    after = set(direct_sandboxes())
    assert sorted(after - before) == []
    with pytest.raises(EngineUnavailable):  # the engine these runs were given is not there
        root.backend.docker.engine_info()


def test_the_cli_without_an_engine(built):
    env = {**os.environ, "SANDLOOP_BACKEND": NO_ENGINE, "DOCKER_HOST": DEAD}
    run = subprocess.run(
        [sys.executable, "-m", "sandloop", "run", "--runtime", "runsc", "-c", "print(6 * 7)"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert run.returncode == 0 and run.stdout == "42\n", run.stderr
    doctor = subprocess.run(
        [sys.executable, "-m", "sandloop", "doctor"], capture_output=True, text=True, env=env, timeout=180
    )
    assert doctor.returncode == 0, doctor.stdout + doctor.stderr
    assert "without Docker" in doctor.stdout and "run on runsc" in doctor.stdout
    net = subprocess.run(
        [sys.executable, "-m", "sandloop", "run", "--network", "-c", "print(1)"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert net.returncode != 0 and "engine=false" in net.stderr and "Traceback" not in net.stderr

    def cli(*args: str) -> str:
        done = subprocess.run(
            [sys.executable, "-m", "sandloop", *args], capture_output=True, text=True, env=env, timeout=180
        )
        assert done.returncode == 0, (args, done.stderr)
        return done.stdout

    # a session across processes (its interpreter held by the shim, not by any one of them)
    sid = cli("session", "create").strip()
    try:
        cli("session", "cell", sid, "-c", "x = 6 * 7")
        assert "picklable" in cli("session", "pause", sid) + cli("session", "resume", sid)
        assert cli("session", "cell", sid, "-c", "print(x)") == "42\n"
    finally:
        cli("session", "rm", sid)
    again = subprocess.run(
        [sys.executable, "-m", "sandloop", "images", "build", "--no-docker"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert again.returncode == 0 and "up to date" in again.stderr + again.stdout, again.stderr

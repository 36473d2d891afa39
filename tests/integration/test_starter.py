"""The C starter (runtime/oci/starter.c) as a program: what it refuses and says, the status it
exits with, that its sandbox dies with it, and that a failed start leaves nothing (no process,
cgroup or mount). Its sandboxes beside runc's and bubblewrap's, control by control, are in
test_bwrap.py (every test there runs for both); these start the host's own root read-only."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from sandloop.contract import SandboxError
from sandloop.runtime.cgroup import V1
from sandloop.runtime.oci import bwrap, starter
from sandloop.runtime.oci.bundle import remove_tree

pytestmark = pytest.mark.skipif(os.geteuid() != 0, reason="the starter runs as root")


@pytest.fixture(scope="module")
def program(tmp_path_factory) -> str:
    path = starter.starter_path(Path("/var/lib/sandloop/test-bin"))
    if path is None:
        pytest.skip("no C compiler here")
    return path


def sandbox_part(*program: str) -> list[str]:
    """The probe's own sandbox (the host's root, read-only), running ``program``."""
    at = starter.PROBE.index("--")
    return [*starter.PROBE[:at], "--", *program]


def run(path: str, *args: str, info: bool = False, timeout: float = 60) -> tuple[int, str, str]:
    """The starter's exit status, stderr and what it wrote to ``--info-fd``."""
    r, w = os.pipe()
    try:
        extra = ["--info-fd", str(w)] if info else []
        argv = [path, *args]
        if info:
            at = argv.index("--unshare-user")
            argv[at:at] = extra
        done = subprocess.run(argv, capture_output=True, text=True, pass_fds=(w,), timeout=timeout)
        os.close(w)
        w = -1
        said = os.read(r, 4096).decode()
        return done.returncode, done.stderr, said
    finally:
        os.close(r)
        if w >= 0:
            os.close(w)


@pytest.mark.parametrize(
    "args, words",
    [
        (["--unshare-pid", "--", "/bin/true"], "unknown host option --unshare-pid"),
        (["--cgroup"], "--cgroup needs 1 argument"),
        (["--set", "pids.max", "10"], "bad cgroup file pids.max"),
        (["--sysctl", "net.ipv4.ping_group_range", "0 0"], "before --netns"),
        (["--user", "65534", "65534", "65534", "--frob", "--", "/bin/true"], "unknown option --frob"),
        (["--user", "65534", "65534", "65534", "--unshare-pid", "--as-pid-1"], "no PROGRAM after --"),
        (["--user", "65534", "65534", "65534", "--unshare-pid", "--", "/bin/true"], "only --as-pid-1"),
        (["--user", "x", "65534", "65534"], "bad uid: x"),
        (["--mount-tmpfs", "relative", "0", "size=1m"], "bad tmpfs directory relative"),
    ],
)
def test_a_bad_description_is_refused_with_its_reason(program, args, words):
    code, err, _ = run(program, *args)
    assert code == 125 and words in err, (code, err)


def test_no_user_no_sandbox(program):
    code, err, _ = run(program, "--netns", "--", "/bin/true")
    assert code == 125 and "no --user: a sandbox never runs as the caller" in err


def test_the_program_runs_as_the_user_in_its_namespaces_and_its_status_comes_back(program):
    code, err, info = run(program, *sandbox_part("/bin/sh", "-c", "exit 7"), info=True)
    assert code == 7, err
    assert json.loads(info)["child-pid"] > 1
    script = "id -u; cat /proc/self/uid_map; echo $$; grep CapBnd /proc/self/status"
    out = subprocess.run(
        [program, *sandbox_part("/bin/sh", "-c", script)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    uid, uid_map, pid, bounding = out.stdout.splitlines()
    assert (uid, uid_map.split(), pid, bounding.split()[1]) == ("65534", ["65534", "65534", "1"], "1", "0" * 16)


def test_the_environment_is_exactly_what_was_set_with_pwd_as_bubblewrap_sets_it(program):
    many = [a for i in range(2000) for a in ("--setenv", f"V{i}", str(i))]
    many += ["--setenv", "V7", "again", "--setenv", "PWD", "/nowhere"]  # a later one wins, as in bubblewrap
    at = starter.PROBE.index("--")
    argv = [program, *starter.PROBE[:at], *many, "--chdir", "/tmp", "--", "/usr/bin/env"]
    out = subprocess.run(argv, capture_output=True, text=True, timeout=60, env={"LEAK": "1"})
    assert out.returncode == 0, out.stderr
    seen = dict(line.split("=", 1) for line in out.stdout.splitlines())
    assert seen == {**{f"V{i}": str(i) for i in range(2000)}, "V7": "again", "PWD": "/tmp"}
    assert len(out.stdout.splitlines()) == 2001


def test_a_program_that_cannot_start_says_so_and_nothing_is_written_to_the_info_fd(program):
    code, err, info = run(program, *sandbox_part("/nonexistent/program"), info=True)
    assert code == 125 and "cannot execute /nonexistent/program" in err and info == ""
    bad_bind = [*starter.PROBE[: starter.PROBE.index("--")], "--ro-bind", "/nonexistent", "/mnt", "--", "/bin/true"]
    code, err, info = run(program, *bad_bind, info=True)
    assert code == 125 and "cannot bind /oldroot/nonexistent" in err and info == ""


@contextlib.contextmanager
def sleeping(program: str) -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """The starter running ``sleep 300`` in its sandbox: it (the monitor) and the sandbox's pid."""
    r, w = os.pipe()
    argv = [program, *sandbox_part("/bin/sleep", "300")]
    argv[argv.index("--unshare-user") : argv.index("--unshare-user")] = ["--info-fd", str(w)]
    monitor = subprocess.Popen(argv, pass_fds=(w,))
    os.close(w)
    try:
        yield monitor, json.loads(os.read(r, 4096))["child-pid"]
    finally:
        os.close(r)
        if monitor.poll() is None:
            monitor.kill()
            monitor.wait(30)


def test_a_killed_program_is_128_plus_its_signal(program):
    with sleeping(program) as (monitor, child):
        os.kill(child, signal.SIGKILL)  # from outside: PID 1 ignores its own
        assert monitor.wait(30) == 128 + signal.SIGKILL


def test_the_sandbox_dies_with_its_monitor(program):
    with sleeping(program) as (monitor, child):
        assert Path(f"/proc/{child}/cmdline").read_bytes().startswith(b"/bin/sleep")
        monitor.send_signal(signal.SIGKILL)
        monitor.wait(30)
        deadline = time.monotonic() + 30
        while Path(f"/proc/{child}").exists() and b"sleep" in Path(f"/proc/{child}/cmdline").read_bytes():
            assert time.monotonic() < deadline, "the sandbox outlived its monitor"
            time.sleep(0.01)


def test_a_failed_start_leaves_no_process_cgroup_or_mount(program, tmp_path):
    """The host part ran (cgroups made and joined, tmpfs mounted), then the sandbox could not be
    set up: the error carries the starter's words, and what the caller removes leaves nothing."""
    config = {
        "process": {"user": {"uid": 65534, "gid": 65534}, "args": ["/bin/true"], "env": [], "cwd": "/", "rlimits": []},
        "hostname": "sandbox",
        "root": {"path": "/nonexistent-rootfs", "readonly": True},
        "mounts": [],
        "linux": {
            "resources": {"memory": {"limit": 64 << 20}, "pids": {"limit": 16}},
            "seccomp": {"defaultAction": "SCMP_ACT_ALLOW"},
            "sysctl": {"net.ipv4.ping_group_range": "0 2147483647"},
        },
    }
    bundle = tmp_path / "bundle"
    bundle.mkdir(mode=0o711)
    bundle.chmod(0o711)
    tmp_path.chmod(0o711)
    hostname = tmp_path / "hostname"
    hostname.write_text("sandbox\n")
    sandbox_id = f"sandloop-test-{uuid.uuid4().hex[:8]}"
    err_r, err_w = os.pipe()
    try:
        with pytest.raises(SandboxError, match="could not set up the sandbox"):
            starter.start(
                config,
                starter=program,
                rootfs=Path("/nonexistent-rootfs"),
                bundle=bundle,
                hostname_file=hostname,
                cgroup_parent="sandloop",
                sandbox_id=sandbox_id,
                stdio=(subprocess.DEVNULL, subprocess.DEVNULL, err_w),
            )
        os.close(err_w)
        err_w = -1
        said = os.read(err_r, 4096).decode()
        assert "cannot bind /oldroot/nonexistent-rootfs" in said
        assert (bundle / "tmp").is_mount()  # the host part had run
        assert not [d for d in V1.glob(f"*/sandloop/{sandbox_id}")]  # removed by start()
        remove_tree(bundle)  # what the backend does with a bundle whose start failed
        assert str(bundle) not in Path("/proc/self/mountinfo").read_text()
        assert not bundle.exists()
    finally:
        os.close(err_r)
        if err_w >= 0:
            os.close(err_w)


def test_a_limit_the_config_lacks_is_refused_before_anything_runs(program, tmp_path):
    config = {"process": {"user": {"uid": 65534, "gid": 65534}}, "linux": {"resources": {}, "seccomp": {}}}
    with pytest.raises(SandboxError, match="without a memory limit"):
        starter.start(
            config,
            starter=program,
            rootfs=Path("/"),
            bundle=tmp_path,
            hostname_file=tmp_path / "h",
            cgroup_parent="sandloop",
            sandbox_id="sandloop-never",
            stdio=(0, 1, 2),
        )
    assert not (tmp_path / "tmp").exists() and not list(V1.glob("*/sandloop/sandloop-never"))


def test_the_translation_is_what_the_starter_reads():
    """bwrap.py's command line, less bwrap's path and ``--block-fd``, is the starter's sandbox part."""
    config = {
        "process": {"user": {"uid": 65534, "gid": 65534}, "args": ["/bin/true"], "env": ["A=1"], "cwd": "/tmp"},
        "hostname": "sandbox",
        "linux": {"maskedPaths": [], "readonlyPaths": []},
    }
    common = dict(rootfs=Path("/r"), tmp=Path("/t"), shm=Path("/s"), hostname_file=Path("/h"), seccomp=5, info=6)
    for_bwrap = bwrap.argv(config, bwrap="/usr/bin/bwrap", block=7, **common)  # type: ignore[arg-type]
    for_starter = bwrap.argv(config, bwrap="x", block=None, **common)  # type: ignore[arg-type]
    at = for_bwrap.index("--block-fd")
    assert for_bwrap[1:at] + for_bwrap[at + 2 :] == for_starter[1:]

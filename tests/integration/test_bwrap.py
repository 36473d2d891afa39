"""runc-class sandboxes started from bwrap.py's translation (by bubblewrap, and by the C starter,
runtime/oci/starter.c, which reads the same command line) beside runc started directly, on the
same captured Docker config: every control seen from inside gives runc's answer, the user, the
limits and the namespaces read from the host, the seccomp filter's behaviour on what the profile
denies, OOM, timeouts, nothing left behind, the reaper, and the fallback to runc. Every test that
takes ``pair`` runs once for each of the two."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from sandloop import SandboxLimits
from sandloop.runtime.docker import DockerBackend
from sandloop.runtime.oci import DirectSandbox, OCIBackend
from sandloop.runtime.oci import bwrap as bwrap_mod
from tests.integration.test_oci import PROBES, STATE, _leftovers, _request

pytestmark = pytest.mark.skipif(bwrap_mod.bwrap_path() is None, reason="bubblewrap is not installed")
#: What starts the translated sandboxes (``runc_with``): bubblewrap, and the C starter.
STARTERS = ["bwrap", "starter"]


@pytest.fixture(scope="module", params=STARTERS)
def pair(request):
    """The same engine's templates, two ways of starting them: runc, and the translation started
    by ``request.param``."""
    docker = DockerBackend()
    runc, bwrap = OCIBackend(docker), OCIBackend(docker, runc_with=request.param)
    assert runc.host_problem() is None and bwrap.host_problem() is None
    # the starter here is the real one: a host with a C compiler must not fall back unseen
    assert (bwrap.starter() is not None) == (request.param == "starter")
    yield runc, bwrap
    bwrap.drain(30)
    runc.close()


def _started_by(oci: OCIBackend, limits: SandboxLimits | None = None) -> DirectSandbox:
    sandbox = oci.launch(_request("x", limits=limits).spec, purpose="run", lifetime_seconds=60)
    assert isinstance(sandbox, DirectSandbox)
    return sandbox


SYSCALLS = textwrap.dedent(
    r"""
    import ctypes, errno, json, os, socket
    libc = ctypes.CDLL(None, use_errno=True)
    def call(nr, *args):
        return "ok" if libc.syscall(nr, *args) >= 0 else errno.errorcode[ctypes.get_errno()]
    out = {
        "mount": call(165, b"none", b"/tmp", b"tmpfs", 0, None),
        "keyctl": call(250, 0),
        "bpf": call(321, 0, 0, 0),
        "ptrace_attach_1": call(101, 16, 1, 0, 0),
        "unshare_user": call(272, 0x10000000),
        "clone_newns": call(272, 0x00020000),
        "pid1": open("/proc/1/cmdline").read().split("\0")[0],
        "ifaces": [name for _, name in socket.if_nameindex()],
        "sys": sorted(os.listdir("/sys")),
        "cgroups": sorted(os.listdir("/sys/fs/cgroup")),
        "memory_limit": open("/sys/fs/cgroup/memory/memory.limit_in_bytes").read().strip(),
    }
    s = socket.socket()
    s.bind(("127.0.0.1", 80))  # Docker's sysctl: unprivileged ports from 0
    out["bind_80"] = "ok"
    print(json.dumps(out, sort_keys=True))
    """
)


def test_every_probe_gives_runcs_answer(pair):
    runc, bwrap = pair
    a, b = runc.run(_request(PROBES)), bwrap.run(_request(PROBES))
    assert a.ok and b.ok, (a.stderr, b.stderr)
    a, b = json.loads(a.stdout), json.loads(b.stdout)
    mounts_a, mounts_b = a.pop("mounts"), b.pop("mounts")
    # refused both ways, with another errno: setuid(0) is EINVAL where uid 0 is not mapped (the
    # user namespace) and EPERM under runc; /proc/sys is EACCES to a user namespace, EROFS to runc
    assert (a.pop("setuid"), b.pop("setuid")) == ("EPERM", "EINVAL")
    # (the C starter binds /proc/sys read-only whoever could write it, as Docker's readonlyPaths do)
    assert (a.pop("write_proc_sys"), b.pop("write_proc_sys")) == ("EROFS", "EROFS" if bwrap.starter() else "EACCES")
    # bwrap's /dev also has a "core" link to /proc/kcore (masked, and absent on this kernel)
    assert set(b.pop("devices")) - {"core"} == set(a.pop("devices"))
    assert a == b
    for target in ("/tmp", "/dev/shm", "/proc", "/etc/hostname"):
        assert mounts_a[target][1] == mounts_b[target][1] or target == "/etc/hostname", target
    assert "ro" in mounts_b["/"][1]
    assert mounts_b["/sys"][0] == "tmpfs" and "ro" in mounts_b["/sys"][1]
    c, d = runc.run(_request(SYSCALLS)), bwrap.run(_request(SYSCALLS))
    assert c.ok and d.ok, (c.stderr, d.stderr)
    c, d = json.loads(c.stdout), json.loads(d.stdout)
    assert d["sys"] == ["devices", "fs"]  # stricter than Docker's read-only sysfs: the CPUs, its cgroups
    c.pop("sys"), d.pop("sys")
    assert set(d.pop("cgroups")) <= set(c.pop("cgroups"))  # its own, as Docker shows them (runc: all)
    assert c == d  # the memory limit it reads there too
    assert d["pid1"] == "/usr/bin/tini" and d["ifaces"] == ["lo"]
    assert {d[k] for k in ("mount", "keyctl", "bpf", "ptrace_attach_1", "unshare_user", "clone_newns")} == {"EPERM"}


DEV = textwrap.dedent(
    r"""
    import errno, json, os
    def attempt(f):
        try:
            f()
            return "ok"
        except OSError as e:
            return errno.errorcode[e.errno]
    def shm():
        with open("/dev/shm/x", "w") as f:
            f.write("x")
        os.unlink("/dev/shm/x")
    def pty():
        master, slave = os.openpty()
        os.write(master, b"hi\n")
        assert os.read(slave, 3) == b"hi\n" and os.ttyname(slave).startswith("/dev/pts/")
    st, fs = os.stat("/dev"), os.statvfs("/dev")
    line = next(l.split() for l in open("/proc/self/mountinfo") if l.split()[4] == "/dev")
    print(json.dumps({
        "create": attempt(lambda: open("/dev/evil", "x")),
        "mkdir": attempt(lambda: os.mkdir("/dev/evil.d")),
        "chmod": attempt(lambda: os.chmod("/dev", 0o777)),
        "own": st.st_uid == os.getuid(),
        "mode": oct(st.st_mode & 0o7777),
        "options": line[5].split(","),
        "bytes": fs.f_blocks * fs.f_frsize,
        "inodes": fs.f_files,
        "shm": attempt(shm),
        "null": attempt(lambda: open("/dev/null", "w").write("x")),
        "pty": attempt(pty),
    }))
    """
)


def test_dev_is_not_the_sandbox_users_to_fill(pair):
    """Issue 52, finding 8: the starter's /dev was a tmpfs of the sandbox user's (its user
    namespace maps only 65534, so a tmpfs mounted there is 65534's: bwrap's, run as 65534, too),
    rw and uncapped (12 GiB, 3 M inodes here): sandbox code made 200,000 files in it in 3.9 s.
    runc's is root's. Inside the user namespace uid 0 is not mapped (a tmpfs cannot be given it,
    and an owner that is would read as 65534 anyway): what counts is that the owner's rights are
    void, the mount read-only (the user has no capability to remount it). /dev/shm, the devices
    and terminals still work."""
    runc, bwrap = pair
    a, b = runc.run(_request(DEV)), bwrap.run(_request(DEV))
    assert a.ok and b.ok, (a.stderr, b.stderr)
    a, b = json.loads(a.stdout), json.loads(b.stdout)
    # runc: root's 0755, so EACCES to 65534 (rw, 64 MiB)
    assert (a["create"], a["mkdir"], a["chmod"], a["own"], a["mode"]) == ("EACCES", "EACCES", "EPERM", False, "0o755")
    assert (b["create"], b["mkdir"], b["chmod"], b["mode"]) == ("EROFS", "EROFS", "EROFS", "0o755"), b
    assert "ro" in b["options"] and "nosuid" in b["options"] and "nodev" in b["options"], b
    if bwrap.starter():  # bwrap 0.8 cannot size its --dev (--size is for --tmpfs): read-only, it stays empty
        assert b["bytes"] <= 64 * 1024 and b["inodes"] <= 64, b
    for key in ("shm", "null", "pty"):
        assert a[key] == b[key] == "ok", (key, a, b)


def test_from_the_host_the_sandbox_is_65534_in_its_own_namespaces_and_cgroups(pair):
    """Read from the host while the user's program runs (it says so with a file in its /tmp, the
    bundle's host tmpfs): before that, bwrap's own setup may still be between its two user
    namespaces (CI read the intermediate one's map, ``0 65534 1``: bwrap's code, not the user's)."""
    import threading

    bwrap = pair[1]
    limits = SandboxLimits(memory="192m", cpus=0.5, pids=48, open_files=300)
    sandbox = _started_by(bwrap, limits)
    program = (  # runs until the host says stop (a file it puts in the same /tmp)
        "import os, time\nopen('/tmp/running', 'w').close()\n"
        "for _ in range(12000):\n    if os.path.exists('/tmp/stop'):\n        break\n    time.sleep(0.01)\n"
    )
    done: list[object] = []
    runner = threading.Thread(target=lambda: done.append(bwrap.execute(sandbox, _request(program, 150, limits))))
    runner.start()
    try:
        assert sandbox.runtime == "bwrap"
        deadline = time.monotonic() + 120
        while not (sandbox.bundle / "tmp" / "running").exists():
            assert time.monotonic() < deadline and runner.is_alive(), done
            time.sleep(0.02)
        cgroups = Path("/sys/fs/cgroup")
        mine = f"sandloop/{sandbox.id}"
        pids = (cgroups / "memory" / mine / "cgroup.procs").read_text().split()
        monitor = str(sandbox.proc.pid)  # bwrap's or the starter's own (they joined the cgroups first)
        joined_itself = bwrap.starter() is not None or bwrap_mod.exec_helper(bwrap.helpers) is not None
        assert (monitor in pids) == joined_itself
        if joined_itself:  # in the host's namespaces, as 65534 with nothing to gain
            status = Path(f"/proc/{monitor}/status").read_text()
            assert "\nUid:\t65534\t65534\t65534\t65534\n" in status and "\nCapEff:\t0000000000000000\n" in status
            assert "\nCapPrm:\t0000000000000000\n" in status and "\nNoNewPrivs:\t1\n" in status
            pids.remove(monitor)
        assert len(pids) >= 2  # tini and the launcher running the program
        for pid in pids:
            proc = Path(f"/proc/{pid}")
            status = dict(line.split(":\t", 1) for line in (proc / "status").read_text().splitlines() if ":\t" in line)
            assert status["Uid"].split() == ["65534"] * 4 and status["Gid"].split() == ["65534"] * 4
            assert (proc / "uid_map").read_text().split() == ["65534", "65534", "1"]  # never root on the host
            assert (proc / "gid_map").read_text().split() == ["65534", "65534", "1"]
            assert status["CapEff"].strip() == status["CapBnd"].strip() == "0000000000000000"
            for ns in ("user", "mnt", "pid", "net", "ipc", "uts", "cgroup"):
                assert os.readlink(proc / "ns" / ns) != os.readlink(f"/proc/self/ns/{ns}"), ns
            for controller in ("cpu", "pids"):
                assert pid in (cgroups / controller / mine / "cgroup.procs").read_text().split()
            limits_text = (proc / "limits").read_text()
            assert [line.split()[3:5] for line in limits_text.splitlines() if line.startswith("Max open files")] == [
                ["300", "300"]
            ]
        assert int((cgroups / "memory" / mine / "memory.limit_in_bytes").read_text()) == 192 * 1024**2
        assert int((cgroups / "memory" / mine / "memory.memsw.limit_in_bytes").read_text()) == 192 * 1024**2
        assert int((cgroups / "cpu" / mine / "cpu.cfs_quota_us").read_text()) == 50_000
        assert int((cgroups / "pids" / mine / "pids.max").read_text()) == 48
    finally:
        (sandbox.bundle / "tmp" / "stop").touch()
        runner.join(150)
        bwrap.destroy(sandbox)
    assert done and done[0].ok, done  # type: ignore[attr-defined]
    assert bwrap.drain(30)
    assert _leftovers([sandbox.id], "bwrap") == []


@pytest.mark.parametrize(
    "code, exit_code, oom",
    [
        ("x = bytearray(400 * 1024 * 1024)", 137, True),
        ("import os\nos.kill(os.getpid(), 9)", 137, False),
        ("import sys\nsys.exit(3)", 3, False),
    ],
    ids=["oom", "own-sigkill", "exit-3"],
)
def test_oom_is_told_apart_from_a_programs_own_kill(pair, code, exit_code, oom):
    r = pair[1].run(_request(code, limits=SandboxLimits(memory="128m")))
    assert (r.exit_code, r.oom_killed, r.timed_out) == (exit_code, oom, False), r


def test_the_pids_limit_holds_a_fork_bomb(pair):
    code = textwrap.dedent(
        """
        import os, time
        n = 0
        try:
            while True:
                if os.fork() == 0:
                    time.sleep(30)
                n += 1
        except OSError as e:
            print('stopped at', n, e.errno)
        """
    )
    r = pair[1].run(_request(code, timeout=20, limits=SandboxLimits(pids=16)))
    assert "stopped at" in r.stdout, r
    assert int(r.stdout.split()[2]) < 16


def test_a_timeout_kills_and_many_runs_leave_nothing(pair):
    bwrap = pair[1]
    sandbox = _started_by(bwrap)
    r = bwrap.execute(sandbox, _request("import time\nprint('started', flush=True)\ntime.sleep(60)", timeout=1.5))
    assert r.timed_out and r.stdout == "started\n" and r.duration_seconds < 10
    bwrap.destroy(sandbox)
    ids = [sandbox.id]
    for i in range(30):
        s = _started_by(bwrap)
        ids.append(s.id)
        try:
            assert bwrap.execute(s, _request(f"print({i})")).stdout == f"{i}\n"
        finally:
            bwrap.destroy(s)
    assert bwrap.drain(60)
    assert _leftovers(ids, "bwrap") == []
    rows = subprocess.run(["ps", "-eo", "stat=,ppid=,comm="], capture_output=True, text=True).stdout.splitlines()
    assert [r for r in rows if r.split()[0].startswith("Z") and r.split()[1] == str(os.getpid())] == []


def _owner_killed_mid_run(runc_with: str = "bwrap") -> str:
    """A process that started a sandbox from the translation (by ``runc_with``), SIGKILLed mid-run:
    its sandbox's id."""
    script = textwrap.dedent(
        """
        from sandloop.runtime.docker import DockerBackend
        from sandloop.runtime.oci import OCIBackend
        from sandloop.runner import build_request
        from sandloop.settings import runtime_image
        from sandloop import SandboxLimits
        b = OCIBackend(DockerBackend(), runc_with=RUNC_WITH)
        r = build_request("import time\\nprint('up', flush=True)\\ntime.sleep(300)", "python", 300,
                          limits=SandboxLimits(), image=runtime_image())
        s = b.launch(r.spec, purpose="run", lifetime_seconds=300)
        print(s.id, s.runtime, flush=True)
        b.execute(s, r)
        """
    )
    script = script.replace("RUNC_WITH", repr(runc_with))
    owner = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    assert owner.stdout is not None
    sandbox_id, runtime = owner.stdout.readline().split()
    assert runtime == "bwrap"
    deadline = time.monotonic() + 60
    while not (STATE / "bundles" / sandbox_id / "pid").exists():
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert (STATE / "bundles" / sandbox_id / "tmp").is_mount()
    owner.send_signal(signal.SIGKILL)
    owner.wait()
    return sandbox_id


def test_an_owner_killed_mid_run_is_reaped(pair):
    from sandloop.pool.reaper import reap

    sandbox_id = _owner_killed_mid_run(pair[1].runc_with)
    reap(pair[1])
    assert _leftovers([sandbox_id], "bwrap") == []


@pytest.mark.parametrize("runc_with", STARTERS)
def test_what_a_killed_owner_left_goes_at_the_next_process_first_run(runc_with):
    """A SIGKILLed ``sandloop run`` leaves its bundle, cgroups and tmpfs mounts (its processes die
    with it); the next process's first direct launch sweeps them off the request path, and a
    half-made bundle (``.ID``, killed before it started) of a dead owner too, never a live one's."""
    from sandloop.runtime.labels import OWNER_LABEL, owner_id

    sandbox_id = _owner_killed_mid_run(runc_with)
    assert (STATE / "bundles" / sandbox_id / "tmp").is_mount()
    dead = STATE / "bundles" / f".{sandbox_id}-half"
    alive = STATE / "bundles" / f".{sandbox_id}-mine"
    for half, owner in ((dead, f"{os.uname().nodename}:999999999:1"), (alive, owner_id())):
        half.mkdir()
        (half / "config.json").write_text(json.dumps({"annotations": {OWNER_LABEL: owner}}))
    try:
        fresh = OCIBackend(DockerBackend(), runc_with=runc_with)
        s = _started_by(fresh)
        try:
            assert fresh.execute(s, _request("print(7)")).stdout == "7\n"
        finally:
            fresh.destroy(s)
        assert fresh.drain(60)
        assert _leftovers([sandbox_id, s.id], "bwrap") == []
        assert not dead.exists() and alive.exists()
    finally:
        for half in (dead, alive):
            if half.exists():
                (half / "config.json").unlink()
                half.rmdir()


def test_what_the_translation_cannot_give_goes_to_runc(pair):
    runc, bwrap = pair
    sandbox = _started_by(runc)
    try:
        config = json.loads((sandbox.bundle / "config.json").read_text())
    finally:
        runc.destroy(sandbox)
    assert bwrap_mod.gaps(config) == []
    for change, said in [
        (lambda c: c["process"]["capabilities"].update(bounding=["CAP_NET_RAW"]), "capabilities"),
        (lambda c: c["process"]["user"].update(uid=0), "a root user"),
        (lambda c: c["mounts"].append({"destination": "/data", "type": "bind", "source": "/"}), "/data"),
        (lambda c: c["linux"].update(uidMappings=[{"containerID": 0, "hostID": 1000, "size": 1}]), "mappings"),
        (lambda c: c["linux"].pop("seccomp"), "seccomp"),
        (lambda c: c["root"].update(readonly=False), "writable root"),
        (lambda c: c.update(hooks={"prestart": [{"path": "/bin/true"}]}), "hooks"),
    ]:
        changed = copy.deepcopy(config)
        change(changed)
        assert any(said in gap for gap in bwrap_mod.gaps(changed)), said
        assert bwrap.bwrap_gaps(changed)  # and the backend would start it with runc

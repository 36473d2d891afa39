"""The bwrap translation of Docker's config (runtime/oci/bwrap.py) without an engine: the command
line it makes, what it refuses to translate, and the seccomp program it compiles once."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from sandloop.runtime.cgroup import make_v1, remove
from sandloop.runtime.oci import bwrap

CONFIG = {
    "process": {
        "user": {"uid": 65534, "gid": 65534, "additionalGids": [65534]},
        "args": ["/usr/bin/tini", "--", "/usr/bin/python3", "/opt/sandloop/launcher.py"],
        "env": ["PATH=/usr/bin:/bin", "HOME=/tmp", "EQ=a=b"],
        "cwd": "/tmp",
        "capabilities": {},
        "rlimits": [{"type": "RLIMIT_NOFILE", "hard": 1024, "soft": 1024}],
        "noNewPrivileges": True,
    },
    "root": {"path": "/store/rootfs", "readonly": True},
    "hostname": "sandbox",
    "mounts": [
        {"destination": d, "type": "tmpfs", "options": ["size=65536k"]}
        for d in ("/proc", "/dev", "/dev/pts", "/sys", "/dev/mqueue", "/dev/shm", "/etc/hostname")
    ]
    + [{"destination": "/tmp", "type": "tmpfs", "options": ["noexec", "nosuid", "nodev", "size=1024", "mode=1777"]}],
    "hooks": {},
    "linux": {
        "namespaces": [{"type": t} for t in ("mount", "network", "uts", "pid", "ipc")],
        "maskedPaths": ["/proc/acpi", "/proc/timer_list", "/proc/no-such-path", "/sys/firmware"],
        "readonlyPaths": ["/proc/bus", "/proc/fs", "/proc/sys"],
        "sysctl": {"net.ipv4.ip_unprivileged_port_start": "0"},
        "resources": {"devices": [{"allow": False, "access": "rwm"}, {"allow": True, "major": 1, "minor": 3}]},
        "seccomp": {
            "defaultAction": "SCMP_ACT_ERRNO",
            "architectures": ["SCMP_ARCH_X86_64", "SCMP_ARCH_X86"],
            "syscalls": [
                {"names": ["read", "write", "exit_group", "no_such_syscall_here"], "action": "SCMP_ACT_ALLOW"},
                {
                    "names": ["personality"],
                    "action": "SCMP_ACT_ALLOW",
                    "args": [{"index": 0, "value": 8, "op": "SCMP_CMP_EQ"}],
                },
                {"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": 38},
            ],
        },
    },
}


def _argv(config: dict | None = None, **kw) -> list[str]:
    return bwrap.argv(
        config or CONFIG,
        bwrap="/usr/bin/bwrap",
        rootfs=Path("/store/rootfs"),
        tmp=Path("/b/tmp"),
        shm=Path("/b/shm"),
        hostname_file=Path("/b/hostname"),
        seccomp=7,
        info=8,
        block=9,
        **kw,
    )


def _pairs(argv: list[str], flag: str) -> list[str]:
    return [argv[i + 1] for i, a in enumerate(argv) if a == flag]


def test_the_command_line_carries_every_control():
    argv = _argv()
    for flag in ("--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts"):
        assert flag in argv
    assert "--unshare-cgroup" in argv and "--die-with-parent" in argv and "--as-pid-1" in argv
    assert _pairs(argv, "--uid") == ["65534"] and _pairs(argv, "--gid") == ["65534"]
    assert _pairs(argv, "--cap-drop") == ["ALL"] and _pairs(argv, "--hostname") == ["sandbox"]
    assert argv[argv.index("--ro-bind") + 1 : argv.index("--ro-bind") + 3] == ["/store/rootfs", "/"]
    assert argv[argv.index("/b/tmp") - 1 : argv.index("/b/tmp") + 2] == ["--bind", "/b/tmp", "/tmp"]
    assert _pairs(argv, "--seccomp") == ["7"] and _pairs(argv, "--block-fd") == ["9"]
    assert "--clearenv" in argv and _pairs(argv, "--setenv") == ["PATH", "HOME", "EQ"]
    assert argv[argv.index("EQ") + 1] == "a=b"
    assert argv[argv.index("--") + 1 :] == CONFIG["process"]["args"]
    # masked: a directory becomes an empty read-only tmpfs, a file /dev/null; what this kernel
    # lacks is skipped; /proc/fs (read-only under Docker) is masked; bwrap's --proc keeps
    # /proc/sys and /proc/bus read-only itself
    assert argv[argv.index("/proc/acpi") - 1 :][:4] == ["--tmpfs", "/proc/acpi", "--remount-ro", "/proc/acpi"]
    assert "/proc/no-such-path" not in argv and "/proc/sys" not in argv and "/proc/bus" not in argv
    if Path("/proc/timer_list").exists():
        assert argv[argv.index("/proc/timer_list") - 2 : argv.index("/proc/timer_list") + 1] == [
            "--ro-bind",
            "/dev/null",
            "/proc/timer_list",
        ]


def test_what_has_no_translation_is_named():
    assert bwrap.gaps(CONFIG) == []
    bad = {
        **CONFIG,
        "linux": {
            **CONFIG["linux"],
            "namespaces": [{"type": "network", "path": "/proc/1/ns/net"}, {"type": "time"}],
            "sysctl": {"kernel.shmmax": "1"},
            "devices": [{"path": "/dev/fuse"}],
            "resources": {"devices": [{"allow": True, "major": 10, "minor": 229}]},
        },
        "process": {**CONFIG["process"], "apparmorProfile": "docker-default", "noNewPrivileges": False},
    }
    said = "; ".join(bwrap.gaps(bad))
    for words in ("time", "joined by path", "kernel.shmmax", "/dev/fuse", "device 10:229", "AppArmor", "noNewPriv"):
        assert words in said, words


def test_the_seccomp_program_is_compiled_once_and_unknown_names_are_skipped():
    pytest.importorskip("pyseccomp")
    profile = CONFIG["linux"]["seccomp"]
    bpf = bwrap.compile_seccomp(profile)
    assert bpf and len(bpf) % 8 == 0  # struct sock_filter: 8 bytes an instruction
    assert bwrap.compile_seccomp(dict(profile)) is bpf  # the same profile: the cached program
    with pytest.raises(ValueError, match="SCMP_ACT_NOTIFY"):
        bwrap.compile_seccomp({**profile, "defaultAction": "SCMP_ACT_NOTIFY"})


def test_tmpfs_options_and_flags_come_from_the_config():
    tmp = CONFIG["mounts"][-1]
    assert bwrap.tmpfs_data(tmp) == "size=1024,mode=1777"
    assert bwrap.tmpfs_flags(tmp) == 2 | 4 | 8
    assert bwrap.tmpfs_flags({"options": []}) == 0


PROBE_IDS = [
    "/bin/sh",
    "-c",
    "id -u; id -g; id -G; ulimit -Sn; ulimit -Hn; grep -E '^(Uid|Gid|Groups):' /proc/self/status",
]


@pytest.mark.skipif(os.geteuid() != 0, reason="becoming another user needs root")
def test_exec_as_gives_what_prlimit_and_setpriv_give(tmp_path):
    """One exec (exec_as.c, compiled on first use) in place of util-linux's two: the same user,
    groups and limits, seen by the program they start."""
    helper = bwrap.exec_helper(tmp_path / "bin")
    if helper is None:
        pytest.skip("no C compiler here: prlimit and setpriv start bwrap sandboxes")
    assert bwrap.exec_helper(tmp_path / "bin") == helper  # compiled once
    assert [p.name for p in (tmp_path / "bin").iterdir()] == [Path(helper).name]  # no temporary left
    config = {
        **CONFIG,
        "process": {**CONFIG["process"], "user": {"uid": 65534, "gid": 65534, "additionalGids": [65534, 4]}},
    }
    config["process"]["rlimits"] = [{"type": "RLIMIT_NOFILE", "soft": 100, "hard": 200}]
    via_helper = subprocess.run([*bwrap.privileges(config, helper), *PROBE_IDS], capture_output=True, text=True)
    via_util_linux = subprocess.run([*bwrap.privileges(config), *PROBE_IDS], capture_output=True, text=True)
    assert via_helper.returncode == 0, via_helper.stderr
    assert via_helper.stdout == via_util_linux.stdout
    assert via_helper.stdout.split("\n")[:5] == ["65534", "65534", "65534 4", "100", "200"]


@pytest.mark.skipif(os.geteuid() != 0, reason="becoming another user needs root")
@pytest.mark.parametrize(
    ("args", "said"),
    [
        (["x", "1", "1", "--", "/bin/true"], "bad uid x"),
        (["1", "1", "1", "7=5", "--", "/bin/true"], "bad limit 7=5"),
        (["1", "1", "1", "99=5:5", "--", "/bin/true"], "bad resource 99"),
        (["1", "1", "1", "--", "true"], "no absolute PROGRAM"),
        (["65534", "65534", "65534", "--", "/no/such/program"], "cannot execute /no/such/program"),
        (["1", "1", "1", "/no/such/cgroup", "--", "/bin/true"], "cannot open /no/such/cgroup/tasks"),
        (["1", "1", "1", "net.ipv4.ip_forward=1", "--", "/bin/true"], "a sysctl before NETNS"),
        (["1", "1", "1", "NETNS", "net.ipv4/../../kernel/x=1", "--", "/bin/true"], "bad sysctl"),
        (["1", "1", "1", "NETNS", "net.no.such.key=1", "--", "/bin/true"], "cannot write the sysctl net.no.such.key"),
    ],
)
def test_exec_as_refuses_bad_input_before_anything_runs(tmp_path, args, said):
    helper = bwrap.exec_helper(tmp_path / "bin")
    if helper is None:
        pytest.skip("no C compiler here")
    done = subprocess.run([helper, *args], capture_output=True, text=True)
    assert done.returncode == 125 and said in done.stderr, done.stderr


@pytest.mark.skipif(os.geteuid() != 0, reason="making cgroups needs root")
def test_exec_as_joins_the_cgroups_itself_before_it_becomes_the_user(tmp_path):
    """Each directory given is joined by the helper's own thread ("0" to ``tasks``), so the program
    it executes (bwrap) and all it starts are born in the sandbox's cgroups, with the limits."""
    helper = bwrap.exec_helper(tmp_path / "bin")
    if helper is None:
        pytest.skip("no C compiler here")
    name = f"sandloop-test-{os.getpid()}"
    made = make_v1(
        "", name, {"memory": {"limit": 64 * 1024**2, "swap": 64 * 1024**2}, "pids": {"limit": 9}}, ("memory", "pids")
    )
    try:
        config = {**CONFIG, "process": {**CONFIG["process"], "user": {"uid": 65534, "gid": 65534}}}
        prefix = bwrap.privileges(config, helper, made)
        assert bwrap.joins_cgroups(prefix, helper) and not bwrap.joins_cgroups(bwrap.privileges(config), None)
        seen = subprocess.run(
            [*prefix, "/bin/sh", "-c", "id -u; cat /proc/self/cgroup"], capture_output=True, text=True
        )
        assert seen.returncode == 0, seen.stderr
        lines = seen.stdout.splitlines()
        assert lines[0] == "65534"
        joined = {line.split(":")[1]: line.split(":")[2] for line in lines[1:]}
        assert joined["memory"] == joined["pids"] == f"/{name}"
    finally:
        remove(made)
    assert not any(d.exists() for d in made)


@pytest.mark.skipif(os.geteuid() != 0, reason="making a network namespace needs root")
def test_exec_as_makes_the_network_namespace_with_dockers_sysctls(tmp_path):
    """``NETNS``: the program starts in a network namespace of its own with only ``lo``, up, and
    the config's net sysctls written there (not in the host's); bwrap is then told not to make one."""
    helper = bwrap.exec_helper(tmp_path / "bin")
    if helper is None:
        pytest.skip("no C compiler here")
    config = {**CONFIG, "process": {**CONFIG["process"], "user": {"uid": 65534, "gid": 65534}}}
    config["linux"] = {**CONFIG["linux"], "sysctl": {**CONFIG["linux"]["sysctl"], "net.ipv4.ping_group_range": "0 7"}}
    prefix = bwrap.privileges(config, helper)
    assert bwrap.makes_netns(prefix) and not bwrap.makes_netns(bwrap.privileges(config))
    assert "--unshare-net" not in _argv(config, unshare_net=False) and "--unshare-net" in _argv(config)
    probe = (
        "import os, socket\n"
        "print(os.readlink('/proc/self/ns/net'))\n"
        "print(sorted(n for _, n in socket.if_nameindex()))\n"
        "print(open('/proc/sys/net/ipv4/ip_unprivileged_port_start').read().strip())\n"
        "print(open('/proc/sys/net/ipv4/ping_group_range').read().split())\n"
        "s = socket.socket(); s.bind(('127.0.0.1', 80)); s.listen()\n"
        "c = socket.create_connection(('127.0.0.1', 80)); print(os.getuid(), c.getpeername()[1])\n"
    )
    if not os.access("/usr/bin/python3", os.X_OK):
        pytest.skip("no system python3 for uid 65534 to run")
    seen = subprocess.run([*prefix, "/usr/bin/python3", "-c", probe], capture_output=True, text=True)
    assert seen.returncode == 0, seen.stderr
    ns, names, port_start, ping, served = seen.stdout.splitlines()
    assert ns != os.readlink("/proc/self/ns/net")
    assert names == "['lo']" and port_start == "0" and ping == "['0', '7']" and served == "65534 80"
    assert Path("/proc/sys/net/ipv4/ping_group_range").read_text().split() != ["0", "7"]  # not the host's


def test_without_a_compiler_prlimit_and_setpriv_are_used(tmp_path, monkeypatch):
    monkeypatch.setattr(bwrap.shutil, "which", lambda name: None)
    assert bwrap.exec_helper(tmp_path / "none") is None
    assert bwrap.privileges(CONFIG, None)[:2] == [bwrap.PRLIMIT, "--nofile=1024:1024"]
    broken = tmp_path / "broken.c"
    broken.write_text("int main( {")
    monkeypatch.undo()
    monkeypatch.setattr(bwrap, "EXEC_AS_SOURCE", broken)
    if bwrap.shutil.which("cc") or bwrap.shutil.which("gcc"):
        assert bwrap.exec_helper(tmp_path / "bin") is None  # a failed compile: said, nothing left
        assert list((tmp_path / "bin").iterdir()) == []


@pytest.mark.skipif(os.geteuid() != 0, reason="mounting a noexec tmpfs needs root")
def test_a_helper_that_cannot_run_where_it_was_built_is_not_used(tmp_path, caplog):
    """/run is noexec on many hosts: a helper compiled where it cannot run is never handed out."""
    if not (bwrap.shutil.which("cc") or bwrap.shutil.which("gcc")):
        pytest.skip("no C compiler here")
    target = tmp_path / "noexec"
    target.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "noexec,size=4m", "tmpfs", str(target)], check=True)
    try:
        assert bwrap.exec_helper(target / "bin") is None
        assert "prlimit and setpriv start bwrap sandboxes" in caplog.text
    finally:
        subprocess.run(["umount", str(target)], check=True)

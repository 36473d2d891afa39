"""runc-class sandboxes started by bubblewrap: Docker's config for the spec, translated to bwrap.

The direct backend captures the OCI config Docker hands runc (``config.py``); this module turns
that same config into a ``bwrap`` command line, so every control comes from Docker's own choice
and nothing is restated by hand. What bwrap itself cannot set is done by the host around it,
while bwrap waits on ``--block-fd`` (its child made, namespaces set up, the program not started):

- **user**: bwrap runs as the config's uid/gid (65534) with no supplementary groups but the
  config's (``exec_as.c``, compiled on first use, after it set the config's rlimits; util-linux's
  ``prlimit`` then ``setpriv`` where there is no C compiler); in its user
  namespace the sandbox's uid is 65534 and, seen from the host, so is every process of it
  (``/proc/PID/uid_map`` reads ``65534 65534 1``). Never root on the host, unlike a bwrap
  started as root with a user namespace (which maps the sandbox to root).
- **namespaces**: user, mount, pid, net (only ``lo``), ipc, uts (hostname ``sandbox``), cgroup.
- **seccomp**: the config's profile compiled once with libseccomp (``pyseccomp``) to BPF and
  handed to bwrap (``--seccomp FD``): no per-run compile (runc compiles it every run).
- **capabilities**: none (``--cap-drop ALL``: every set empty, the bounding set too);
  ``no_new_privs`` is set by bwrap.
- **files**: the image's rootfs read-only; a new /proc with Docker's masked paths masked and
  ``/proc/{sys,sysrq-trigger,irq,bus}`` read-only (bwrap's own), ``/proc/fs`` masked; bwrap's
  minimal /dev (null, zero, full, random, urandom, tty, pts), read-only once made; /dev/mqueue;
  /tmp and /dev/shm as host tmpfs mounts with the config's size, inode cap, mode and
  ``noexec,nosuid,nodev`` (``runtime/tmpfs.py``); /etc/hostname; /sys is an empty read-only
  tmpfs but for ``/sys/devices/system/cpu`` and the sandbox's own cgroups at
  ``/sys/fs/cgroup/<controller>`` (read-only, as Docker shows them): stricter than Docker's
  read-only sysfs.
- **limits**: memory+swap, CPU quota, pids in cgroups the host makes (``runtime/cgroup.py``),
  joined by ``exec_as`` itself before it becomes bwrap (so bwrap's own process, its setup's
  kernel memory and one pid count against them, as runc's init does), or where there is no
  ``exec_as`` the host moves the waiting child in; ``RLIMIT_*`` set before bwrap starts (see
  **user**); the two network sysctls Docker sets (unprivileged ports from 0, ping) written in
  its network namespace. OOM is read from the memory cgroup's counter as for runc.

``gaps(config)`` lists what a config asks for that this translation does not reproduce (then the
run goes to runc, or is refused without fallback).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import json
import logging
import os
import resource
import shutil
import subprocess
import tempfile
import threading
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from sandloop.contract import SandboxError
from sandloop.runtime.cgroup import V1, join, make_v1, remove
from sandloop.runtime.tmpfs import MS_NODEV, MS_NOEXEC, MS_NOSUID, libc, mount_host_tmpfs

log = logging.getLogger(__name__)

#: The namespaces Docker's config asks for that this translation makes (it also makes user and
#: cgroup namespaces, which Docker's runc config on this host does not).
NAMESPACES = {"mount", "network", "uts", "pid", "ipc", "cgroup", "user"}
#: The mount destinations of Docker's config that are translated (others: a gap).
MOUNTS = {"/proc", "/dev", "/dev/pts", "/dev/mqueue", "/dev/shm", "/sys", "/sys/fs/cgroup", "/tmp", "/etc/hostname"}
#: bwrap's --dev makes these devices: Docker's allowed set is the same.
DEVICES = {(1, 3), (1, 5), (1, 7), (1, 8), (1, 9), (5, 0), (5, 1), (5, 2), (136, None)}
#: What /proc paths bwrap's --proc already makes read-only.
BWRAP_READONLY = {"/proc/sys", "/proc/sysrq-trigger", "/proc/irq", "/proc/bus"}
CLONE_NEWNET = 0x40000000
#: The sysctls Docker's config sets that are written in the sandbox's network namespace.
NET_SYSCTLS = ("net.ipv4.ip_unprivileged_port_start", "net.ipv4.ping_group_range")


PRLIMIT, SETPRIV = "/usr/bin/prlimit", "/usr/bin/setpriv"  # util-linux
#: prlimit's options, by the config's RLIMIT_* name.
PRLIMIT_OPTIONS = {"AS", "CORE", "CPU", "DATA", "FSIZE", "LOCKS", "MEMLOCK", "MSGQUEUE", "NICE", "NOFILE", "NPROC"}
PRLIMIT_OPTIONS |= {"RSS", "RTPRIO", "RTTIME", "SIGPENDING", "STACK"}
#: The kernel's number of each (what ``exec_as`` takes); RLIMIT_LOCKS is not in ``resource``.
RLIMIT_NUMBERS = {n: getattr(resource, f"RLIMIT_{n}") for n in PRLIMIT_OPTIONS if hasattr(resource, f"RLIMIT_{n}")}
RLIMIT_NUMBERS.setdefault("LOCKS", 10)


def bwrap_path() -> str | None:
    """bwrap, when it and util-linux's prlimit and setpriv are here (None: runc starts them)."""
    found = shutil.which("bwrap")
    return found if found and os.access(PRLIMIT, os.X_OK) and os.access(SETPRIV, os.X_OK) else None


def gaps(config: Mapping[str, Any]) -> list[str]:
    """What ``config`` asks for that the bwrap translation does not give (empty: none)."""
    out: list[str] = []
    linux = config.get("linux") or {}
    process = config.get("process") or {}
    kinds = {n.get("type") for n in linux.get("namespaces") or []}
    if kinds - NAMESPACES:
        out.append(f"namespaces {sorted(kinds - NAMESPACES)}")
    if any(n.get("path") for n in linux.get("namespaces") or []):
        out.append("a namespace joined by path")
    if linux.get("uidMappings") or linux.get("gidMappings"):
        out.append("user namespace mappings")
    caps = process.get("capabilities") or {}
    if any(caps.get(k) for k in ("bounding", "effective", "permitted", "inheritable", "ambient")):
        out.append("capabilities")
    if not process.get("noNewPrivileges"):
        out.append("no noNewPrivileges")
    user = process.get("user") or {}
    if not user.get("uid") or not user.get("gid"):
        out.append("a root user")
    if process.get("apparmorProfile") or process.get("selinuxLabel"):
        out.append("an AppArmor or SELinux label")
    if config.get("hooks") and any(config["hooks"].values()):
        out.append("hooks")
    if not (config.get("root") or {}).get("readonly"):
        out.append("a writable root")
    for m in config.get("mounts") or []:
        if m.get("destination") not in MOUNTS:
            out.append(f"the mount at {m.get('destination')}")
    for d in (linux.get("resources") or {}).get("devices") or []:
        if d.get("allow") and (d.get("major"), d.get("minor")) not in DEVICES and (d.get("major"), None) not in DEVICES:
            out.append(f"device {d.get('major')}:{d.get('minor')}")
    for d in linux.get("devices") or []:
        out.append(f"device node {d.get('path')}")
    sysctl = set((linux.get("sysctl") or {}).keys()) - set(NET_SYSCTLS)
    if sysctl:
        out.append(f"sysctls {sorted(sysctl)}")
    if "seccomp" not in linux:
        out.append("no seccomp profile")
    for limit in process.get("rlimits") or []:
        if not str(limit.get("type", "")).startswith("RLIMIT_") or limit["type"][7:] not in PRLIMIT_OPTIONS:
            out.append(f"rlimit {limit.get('type')}")
    return out


# -- seccomp ------------------------------------------------------------------------------------------
_ACTIONS = {"SCMP_ACT_ALLOW", "SCMP_ACT_ERRNO", "SCMP_ACT_KILL", "SCMP_ACT_KILL_PROCESS", "SCMP_ACT_KILL_THREAD"}
_ACTIONS |= {"SCMP_ACT_TRAP", "SCMP_ACT_LOG"}
_lock = threading.Lock()
_compiled: dict[str, bytes] = {}


def _action(seccomp: Any, name: str, errno_ret: int | None) -> Any:
    if name not in _ACTIONS:
        raise ValueError(f"seccomp action {name} is not supported by the bwrap translation")
    if name == "SCMP_ACT_ERRNO":
        return seccomp.ERRNO(errno_ret if errno_ret is not None else 1)  # runc's default: EPERM
    return getattr(seccomp, name[len("SCMP_ACT_") :])


def compile_seccomp(profile: Mapping[str, Any]) -> bytes:
    """The OCI seccomp profile as a BPF program (what runc loads), compiled once per profile.
    Unknown syscall names are skipped, as runc skips them."""
    key = hashlib.sha256(json.dumps(profile, sort_keys=True).encode()).hexdigest()
    with _lock:
        if key in _compiled:
            return _compiled[key]
    import pyseccomp as seccomp

    ops = {
        "SCMP_CMP_NE": seccomp.NE,
        "SCMP_CMP_LT": seccomp.LT,
        "SCMP_CMP_LE": seccomp.LE,
        "SCMP_CMP_EQ": seccomp.EQ,
        "SCMP_CMP_GE": seccomp.GE,
        "SCMP_CMP_GT": seccomp.GT,
        "SCMP_CMP_MASKED_EQ": seccomp.MASKED_EQ,
    }
    f = seccomp.SyscallFilter(_action(seccomp, profile["defaultAction"], profile.get("defaultErrnoRet")))
    # libseccomp's binary tree of syscall numbers (2.5+) in place of one comparison after another:
    # the same verdicts, but Docker's 352 names cost every syscall up to ~940 instructions in a
    # row; measured on python3 -c pass under bwrap: 3.7 ms more CPU than no filter, 0.9 with it
    with contextlib.suppress(Exception):  # an older libseccomp: the linear program
        f.set_attr(seccomp.Attr.CTL_OPTIMIZE, 2)
    for arch in profile.get("architectures") or []:
        with contextlib.suppress(Exception):  # the native one is there already
            f.add_arch(getattr(seccomp.Arch, arch[len("SCMP_ARCH_") :]))
    for rule in profile.get("syscalls") or []:
        action = _action(seccomp, rule["action"], rule.get("errnoRet"))
        args = [
            seccomp.Arg(a["index"], ops[a["op"]], a.get("value", 0), a.get("valueTwo", 0))
            for a in rule.get("args") or []
        ]
        for name in rule.get("names") or []:
            with contextlib.suppress(Exception):  # a syscall this libseccomp or arch does not know
                f.add_rule(action, name, *args)
    with tempfile.TemporaryFile() as out:
        f.export_bpf(out)
        out.seek(0)
        bpf = out.read()
    with _lock:
        _compiled[key] = bpf
    return bpf


def seccomp_fd(bpf: bytes) -> int:
    """A file descriptor bwrap reads the program from (its own: bwrap reads it to the end)."""
    fd = os.memfd_create("sandloop-seccomp", os.MFD_CLOEXEC)
    os.write(fd, bpf)
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


# -- the command line ---------------------------------------------------------------------------------
@functools.cache
def _exists(path: str) -> str:
    """'file', 'dir' or '' for a /proc or /sys path on this host's kernel."""
    p = Path(path)
    return "dir" if p.is_dir() else "file" if p.exists() else ""


def argv(
    config: Mapping[str, Any],
    *,
    bwrap: str,
    rootfs: Path,
    tmp: Path,
    shm: Path,
    hostname_file: Path,
    seccomp: int,
    info: int,
    block: int | None,
    cgroups: Sequence[Path] = (),
    unshare_net: bool = True,
) -> list[str]:
    """bwrap's command line for Docker's ``config`` (``gaps(config)`` empty); ``cgroups``: the
    sandbox's own cgroup directories, shown read-only at ``/sys/fs/cgroup/<controller>`` as
    Docker shows a container its own; ``unshare_net`` false when ``exec_as`` made the network
    namespace bwrap starts in (``privileges``)."""
    process = config["process"]
    user = process["user"]
    out = [
        bwrap,
        "--unshare-user",
        "--unshare-pid",
        *(["--unshare-net"] if unshare_net else []),
        "--unshare-ipc",
        "--unshare-uts",
        "--unshare-cgroup",
        "--uid",
        str(user["uid"]),
        "--gid",
        str(user["gid"]),
        "--hostname",
        str(config.get("hostname") or "sandbox"),
        "--die-with-parent",
        "--as-pid-1",  # the config's own PID 1 (tini) reaps, as under runc: no bwrap init
        "--new-session",
        "--cap-drop",
        "ALL",
        "--ro-bind",
        str(rootfs),
        "/",
        "--proc",
        "/proc",
        "--dev",
        "/dev",
        "--mqueue",
        "/dev/mqueue",
        "--bind",
        str(shm),
        "/dev/shm",
        # bwrap's /dev is a tmpfs of the user's (run as 65534, it mounts it as that uid) and
        # writable, half the RAM (12 GiB here): read-only once what goes under it is made, as the
        # starter's is (issue 52, finding 8); its devices, pts, shm and mqueue are their own mounts
        "--remount-ro",
        "/dev",
        "--bind",
        str(tmp),
        "/tmp",
        "--ro-bind",
        str(hostname_file),
        "/etc/hostname",
        "--tmpfs",
        "/sys",
        "--ro-bind",
        "/sys/devices/system/cpu",
        "/sys/devices/system/cpu",
    ]
    for d in cgroups:
        out += ["--ro-bind", str(d), f"/sys/fs/cgroup/{d.relative_to(V1).parts[0]}"]
    out += ["--remount-ro", "/sys"]
    linux = config.get("linux") or {}
    masked = [p for p in linux.get("maskedPaths") or [] if p.startswith("/proc/")]
    masked += [p for p in linux.get("readonlyPaths") or [] if p not in BWRAP_READONLY]
    for path in masked:
        kind = _exists(path)
        if kind == "dir":
            out += ["--tmpfs", path, "--remount-ro", path]
        elif kind == "file":
            out += ["--ro-bind", "/dev/null", path]
    out += ["--clearenv"]
    for pair in process.get("env") or []:
        name, _, value = pair.partition("=")
        out += ["--setenv", name, value]
    out += ["--chdir", process.get("cwd") or "/"]
    out += ["--seccomp", str(seccomp), "--info-fd", str(info)]
    out += [*(["--block-fd", str(block)] if block is not None else []), "--", *process["args"]]
    return out


# -- around it, while it waits ----------------------------------------------------------------------
def privileges(config: Mapping[str, Any], exec_as: str | None = None, cgroups: Sequence[Path] = ()) -> list[str]:
    """What runs before bwrap, exec'd in turn by this (root) process's child: the config's
    ``RLIMIT_*`` set on itself (the sandbox inherits them; ``prlimit`` on the waiting child from
    here would need CAP_SYS_RESOURCE, which this host withholds even from root: measured EPERM),
    then the config's uid, gid and groups. ``exec_as`` (``exec_as.c``, see ``exec_helper``) does
    both in one exec; without it util-linux's ``prlimit`` then ``setpriv`` do (two execs, ~1.4 ms
    more CPU). Either way no ``subprocess`` ``user=``, which forks this whole process (measured
    with a 150 MB server: 11.5 ms of the child's CPU and 9.8 of ours per start, against 4.3 and 0.4).
    ``exec_as`` also joins the sandbox's ``cgroups`` itself, before bwrap starts (see
    ``joins_cgroups``), and makes the sandbox's network namespace with Docker's net sysctls in it
    (``NETNS``: ``makes_netns``); util-linux's programs cannot, so then ``start`` moves bwrap's
    child in, bwrap makes the namespace and a thread of ours writes the sysctls in it."""
    process = config["process"]
    user = process["user"]
    uid, gid = int(user["uid"]), int(user["gid"])
    groups = ",".join(str(int(g)) for g in user.get("additionalGids") or [gid])
    rlimits = [
        (limit["type"][len("RLIMIT_") :], int(limit["soft"]), int(limit["hard"]))
        for limit in process.get("rlimits") or []
    ]
    if exec_as is not None and all(name in RLIMIT_NUMBERS for name, _, _ in rlimits):
        numbers = [f"{RLIMIT_NUMBERS[name]}={rlim(soft)}:{rlim(hard)}" for name, soft, hard in rlimits]
        net = ["NETNS", *(f"{key}={value}" for key, value in _net_sysctls(config).items())]
        return [exec_as, str(uid), str(gid), groups, *(str(d) for d in cgroups), *numbers, *net, "--"]
    limits = [f"--{name.lower()}={soft}:{hard}" for name, soft, hard in rlimits]
    prefix = [PRLIMIT, *limits, "--"] if limits else []
    return [*prefix, SETPRIV, f"--reuid={uid}", f"--regid={gid}", f"--groups={groups}", "--"]


def joins_cgroups(prefix: Sequence[str], exec_as: str | None) -> bool:
    """Whether ``privileges``' ``prefix`` joins the cgroups itself: ``exec_as`` writes "0" to each
    one's ``tasks`` (a thread moving itself: no wait for an RCU grace period, which moving bwrap's
    child by pid through ``cgroup.procs`` costs here, 3-12 ms a start). Then bwrap's own process
    is in the sandbox's cgroups too (one pid of the pids limit, its few hundred KiB of memory)."""
    return exec_as is not None and bool(prefix) and prefix[0] == exec_as


def makes_netns(prefix: Sequence[str]) -> bool:
    """Whether ``privileges``' ``prefix`` makes the sandbox's network namespace (``exec_as``'s
    ``NETNS``): then bwrap does not, and the sysctls are already written."""
    return "NETNS" in prefix[: prefix.index("--")] if "--" in prefix else False


def _net_sysctls(config: Mapping[str, Any]) -> dict[str, str]:
    return {k: v for k, v in ((config.get("linux") or {}).get("sysctl") or {}).items() if k.startswith("net.")}


def rlim(value: int) -> str:
    return "inf" if value < 0 or value == resource.RLIM_INFINITY else str(value)


EXEC_AS_SOURCE = Path(__file__).with_name("exec_as.c")
_helper_lock = threading.Lock()
_helpers: dict[tuple[Path, Path], str | None] = {}


def compiled(
    directory: Path,
    source_path: Path,
    probe: Callable[[str], list[str]],
    instead: str,
    flags: Sequence[str] = (),
) -> str | None:
    """The C program ``source_path`` compiled into ``directory`` (once per source), or None where
    there is no C compiler, it fails, or what it made does not run there (a ``noexec`` mount, a
    kernel without what it needs): ``probe(path)`` is a command that must exit 0; ``instead``
    says in the log what is used without it. ``flags`` are tried first (``-static``: no dynamic
    loader at every start), then left out if the compiler refuses them (no static C library)."""
    with _helper_lock:
        if (directory, source_path) in _helpers:
            return _helpers[directory, source_path]
        source = source_path.read_bytes()
        digest = hashlib.sha256(source + " ".join(flags).encode()).hexdigest()[:12]  # a new one per source and flags
        path = directory / f"{source_path.stem.replace('_', '-')}-{digest}"
        compiler = shutil.which("cc") or shutil.which("gcc")
        why = ""
        if not os.access(path, os.X_OK) and compiler:
            directory.mkdir(parents=True, exist_ok=True, mode=0o755)
            tmp = directory / f".{path.name}-{os.getpid()}-{threading.get_ident()}"
            for extra in ([*flags], []) if flags else ([],):
                done = subprocess.run(
                    [compiler, "-O2", "-Wall", *extra, "-o", str(tmp), "-x", "c", "-"],
                    input=source,
                    capture_output=True,
                    timeout=120,
                )
                if done.returncode == 0:
                    break
            if done.returncode == 0:
                tmp.chmod(0o755)
                tmp.rename(path)
            else:
                tmp.unlink(missing_ok=True)
                why = done.stderr.decode(errors="replace").strip()[-300:]
        found: str | None = None
        if os.access(path, os.X_OK):
            try:
                ran = subprocess.run(probe(str(path)), capture_output=True, timeout=30)
                found = str(path) if ran.returncode == 0 else None
                why = ran.stderr.decode(errors="replace").strip()[-300:]
            except OSError as exc:
                why = str(exc)
        if found is None and compiler:
            why = why or ("it was not made" if not path.exists() else "not executable there (a noexec mount?)")
            log.warning("%s cannot be used (%s): %s", path, why, instead)
        _helpers[directory, source_path] = found
        return found


def exec_helper(directory: Path) -> str | None:
    """``exec_as.c`` compiled into ``directory`` (``compiled``), or None: then ``prlimit`` and
    ``setpriv``. Its probe runs it as this user (a check of the program, not of a change of user)."""
    uid, gid = str(os.getuid()), str(os.getgid())
    probe = [uid, gid, gid, "--", "/bin/true"]
    return compiled(directory, EXEC_AS_SOURCE, lambda path: [path, *probe], "prlimit and setpriv start bwrap sandboxes")


def set_net_sysctls(pid: int, config: Mapping[str, Any]) -> None:
    """Docker's network sysctls, written in the sandbox's network namespace (a thread of its
    own enters it: a network namespace is per thread, and this one ends with the thread)."""
    wanted = _net_sysctls(config)
    if not wanted:
        return
    failure: list[BaseException] = []

    def enter_and_write() -> None:
        try:
            fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            try:
                if libc().setns(fd, CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns")
            finally:
                os.close(fd)
            for key, value in wanted.items():
                with open("/proc/sys/" + key.replace(".", "/"), "w") as f:
                    f.write(value)
        except BaseException as exc:  # noqa: BLE001 - reported to the launching thread
            failure.append(exc)

    thread = threading.Thread(target=enter_and_write, name="sandloop-bwrap-sysctl")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]


def read_child_pid(fd: int) -> int | None:
    """bwrap's ``--info-fd`` JSON (written once its child waits): the child's pid, or None when
    bwrap failed before (it then exits with its reason on stderr)."""
    chunks = []
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        chunks.append(chunk)
    try:
        return int(json.loads(b"".join(chunks) or b"{}")["child-pid"])
    except (ValueError, KeyError, TypeError):
        return None


#: The controllers a bwrap sandbox's cgroups are made in (runc makes them in every hierarchy;
#: these are the ones Docker's config sets limits in, plus cpuacct for its CPU time).
CONTROLLERS = ("memory", "cpu", "cpuacct", "pids")


def start(
    config: Mapping[str, Any],
    *,
    bwrap: str,
    rootfs: Path,
    bundle: Path,
    hostname_file: Path,
    cgroup_parent: str,
    sandbox_id: str,
    stdio: tuple[int, int, int],
    exec_as: str | None = None,
) -> subprocess.Popen[bytes]:
    """Start the sandbox: host tmpfs mounts and cgroups made, bwrap started as the config's user
    in its cgroups and its network namespace (``exec_as``; without it, once bwrap's child waits,
    the child is moved in and given its network sysctls); its pid written to ``bundle/pid``, then
    it is let go.
    Anything that fails leaves no process and no cgroup (the caller removes the bundle and its
    mounts).

    Raises:
        SandboxError: bwrap could not set the sandbox up (its own words), or a limit did not take.
    """
    linux = config.get("linux") or {}
    mounts = {m["destination"]: m for m in config.get("mounts") or []}
    tmp, shm = bundle / "tmp", bundle / "shm"
    mount_host_tmpfs(tmp, tmpfs_data(mounts.get("/tmp")), tmpfs_flags(mounts.get("/tmp")))
    mount_host_tmpfs(shm, tmpfs_data(mounts.get("/dev/shm")), tmpfs_flags(mounts.get("/dev/shm")))
    cgroups = make_v1(cgroup_parent, sandbox_id, linux.get("resources") or {}, CONTROLLERS)
    bpf = seccomp_fd(compile_seccomp(linux["seccomp"]))
    info_r, info_w = os.pipe2(os.O_CLOEXEC)
    block_r, block_w = os.pipe2(os.O_CLOEXEC)
    proc: subprocess.Popen[bytes] | None = None
    try:
        prefix = privileges(config, exec_as, cgroups)
        net_made = makes_netns(prefix)
        command = argv(
            config,
            bwrap=bwrap,
            rootfs=rootfs,
            tmp=tmp,
            shm=shm,
            hostname_file=hostname_file,
            seccomp=bpf,
            info=info_w,
            block=block_r,
            cgroups=cgroups,
            unshare_net=not net_made,
        )
        stdin, stdout, stderr = stdio
        proc = subprocess.Popen(
            [*prefix, *command],
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            pass_fds=(bpf, info_w, block_r),
            start_new_session=True,
        )
        os.close(info_w)
        info_w = -1
        child = read_child_pid(info_r)
        if child is None:
            proc.wait(timeout=30)
            raise SandboxError(f"bwrap could not set up the sandbox (exit {proc.returncode}): see its stderr")
        if not joins_cgroups(prefix, exec_as):
            join(cgroups, child)
        if not net_made:
            set_net_sysctls(child, config)
        (bundle / "pid").write_text(str(child))
        os.write(block_w, b"go")
        return proc
    except BaseException as exc:
        abandon(proc, cgroups, exc, "the bwrap sandbox")
        raise
    finally:
        close_all(bpf, info_r, info_w, block_r, block_w)


def abandon(proc: subprocess.Popen[bytes] | None, cgroups: Sequence[Path], exc: BaseException, what: str) -> None:
    """What a failed start made goes (its process killed and waited for, its cgroups removed);
    an ``OSError`` or ``ValueError`` is raised as a ``SandboxError`` about ``what``, anything else
    is left for the caller to raise."""
    if proc is not None and proc.poll() is None:
        proc.kill()
        proc.wait(timeout=30)
    remove(cgroups)
    if isinstance(exc, OSError | ValueError):
        raise SandboxError(f"could not start {what}: {exc}") from exc


def close_all(*fds: int) -> None:
    """Close each descriptor still open (-1: closed already)."""
    for fd in fds:
        if fd >= 0:
            with contextlib.suppress(OSError):
                os.close(fd)


def tmpfs_data(mount: Mapping[str, Any] | None) -> str:
    keep = ("size=", "nr_inodes=", "mode=")
    return ",".join(o for o in (mount or {}).get("options") or [] if o.startswith(keep)) or "size=64m,mode=1777"


def tmpfs_flags(mount: Mapping[str, Any] | None) -> int:
    options = set((mount or {}).get("options") or [])
    return (
        (MS_NOSUID if "nosuid" in options else 0)
        | (MS_NODEV if "nodev" in options else 0)
        | (MS_NOEXEC if "noexec" in options else 0)
    )

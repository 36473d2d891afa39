"""A bwrap-class sandbox started by one C program (``starter.c``) from one prepared description.

``bwrap.py`` translates Docker's config for bubblewrap; here the same translation (the same
command line, less ``--block-fd``) is handed, with the host's part before it, to
``sandloop-start``, which does the whole start in one process: the sandbox's cgroups made, their
limits written and read back and joined, the two host tmpfs mounts (``/tmp``, ``/dev/shm``), the
config's rlimits, the network namespace and Docker's net sysctls, the change to the config's user,
then the sandbox's namespaces, mounts, hostname, capabilities, ``no_new_privs``, seccomp and the
program; it stays as the sandbox's monitor (what bwrap's parent process is) and exits with the
program's status. Python makes no system call of the start but the pipes, one ``fork``+``exec``
and the pid file. Against Python, ``exec_as`` and bwrap (three programs, ~10 Python steps that
each cost a system call or more) the start is one program and one exec fewer (measured in
docs/benchmarks.md, "The start path in C").

Teardown is the same as bwrap's (``teardown.py``): the sandbox dies with its PID 1, the host
removes its cgroups and bundle (whose tmpfs mounts go first). The starter is compiled on first
use (``bwrap.compiled``) and checked by starting a real sandbox (``/bin/true`` in the host's own
root, read-only); where it cannot be compiled or does not run, bwrap starts the sandbox.
"""

from __future__ import annotations

import os
import subprocess
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from sandloop.contract import SandboxError
from sandloop.runtime.cgroup import Limits, plan_v1
from sandloop.runtime.oci import bwrap

SOURCE = Path(__file__).with_name("starter.c")
#: The probe's sandbox: the host's root read-only, every namespace, no filter (none compiled yet).
PROBE = [
    "--user", "65534", "65534", "65534",
    "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup",
    "--uid", "65534", "--gid", "65534", "--hostname", "sandbox", "--die-with-parent", "--as-pid-1",
    "--new-session", "--cap-drop", "ALL", "--ro-bind", "/", "/", "--proc", "/proc", "--dev", "/dev",
    "--mqueue", "/dev/mqueue", "--tmpfs", "/sys", "--remount-ro", "/sys", "--clearenv", "--chdir", "/",
    "--", "/bin/true",
]  # fmt: skip


def starter_path(directory: Path) -> str | None:
    """``starter.c`` compiled into ``directory``, or None (no C compiler, or it cannot start a
    sandbox on this host: then bwrap does)."""
    # static: the dynamic loader's work at every start is ~0.1-0.15 ms of wall time here (measured)
    probe = lambda path: [path, *PROBE]  # noqa: E731
    return bwrap.compiled(directory, SOURCE, probe, "bubblewrap starts the sandboxes", flags=["-static"])


def host_part(
    config: Mapping[str, Any], cgroups: list[Limits], tmpfs: list[tuple[Path, Mapping[str, Any] | None]]
) -> list[str]:
    """The starter's host options for ``config``: the cgroups made, written and joined first (so
    what follows is charged to the sandbox, as bwrap's set-up is), the tmpfs mounts, the
    rlimits, the network namespace and its sysctls, then the user (``--user`` ends the part)."""
    out: list[str] = []
    for cgroup in cgroups:
        out += ["--cgroup", str(cgroup.directory)]
        for key, value in cgroup.writes:
            out += ["--set", key, str(value)]
    out += ["--join"]
    for target, mount in tmpfs:
        out += ["--mount-tmpfs", str(target), str(bwrap.tmpfs_flags(mount)), bwrap.tmpfs_data(mount)]
    process = config["process"]
    for limit in process.get("rlimits") or []:
        name = str(limit["type"])[len("RLIMIT_") :]
        if name not in bwrap.RLIMIT_NUMBERS:
            raise SandboxError(f"the sandbox's config asks for {limit['type']}, which the starter does not know")
        soft, hard = bwrap.rlim(int(limit["soft"])), bwrap.rlim(int(limit["hard"]))
        out += ["--rlimit", str(bwrap.RLIMIT_NUMBERS[name]), soft, hard]
    out += ["--netns"]
    for key, value in (((config.get("linux") or {}).get("sysctl")) or {}).items():
        if key.startswith("net."):
            out += ["--sysctl", key, str(value)]
    user = process["user"]
    gid = int(user["gid"])
    groups = ",".join(str(int(g)) for g in user.get("additionalGids") or [gid])
    return [*out, "--user", str(int(user["uid"])), str(gid), groups]


def start(
    config: Mapping[str, Any],
    *,
    starter: str,
    rootfs: Path,
    bundle: Path,
    hostname_file: Path,
    cgroup_parent: str,
    sandbox_id: str,
    stdio: tuple[int, int, int],
) -> subprocess.Popen[bytes]:
    """Start the sandbox (what ``bwrap.start`` does, in one program): returns the starter, its
    monitor, once the sandbox's program runs; its pid is in ``bundle/pid``. Anything that fails
    leaves no process, cgroup or mount (the caller removes the bundle).

    Raises:
        SandboxError: the sandbox could not be set up (the starter's own words are on its stderr),
            or a limit is missing from the config.
    """
    linux = config.get("linux") or {}
    mounts = {m["destination"]: m for m in config.get("mounts") or []}
    plan = plan_v1(cgroup_parent, sandbox_id, linux.get("resources") or {}, bwrap.CONTROLLERS)
    directories = [c.directory for c in plan]
    bpf = bwrap.seccomp_fd(bwrap.compile_seccomp(linux["seccomp"]))
    info_r, info_w = os.pipe2(os.O_CLOEXEC)
    proc: subprocess.Popen[bytes] | None = None
    tmp, shm = bundle / "tmp", bundle / "shm"
    try:
        sandbox_part = bwrap.argv(
            config,
            bwrap=starter,
            rootfs=rootfs,
            tmp=tmp,
            shm=shm,
            hostname_file=hostname_file,
            seccomp=bpf,
            info=info_w,
            block=None,
            cgroups=directories,
            unshare_net=False,
        )
        host = host_part(config, plan, [(tmp, mounts.get("/tmp")), (shm, mounts.get("/dev/shm"))])
        stdin, stdout, stderr = stdio
        proc = subprocess.Popen(
            [starter, *host, *sandbox_part[1:]],
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            pass_fds=(bpf, info_w),
            start_new_session=True,
        )
        os.close(info_w)
        info_w = -1
        child = bwrap.read_child_pid(info_r)
        if child is None:
            proc.wait(timeout=30)
            raise SandboxError(f"the starter could not set up the sandbox (exit {proc.returncode}): see its stderr")
        (bundle / "pid").write_text(str(child))
        return proc
    except BaseException as exc:
        bwrap.abandon(proc, directories, exc, "the sandbox")
        raise
    finally:
        bwrap.close_all(bpf, info_r, info_w)

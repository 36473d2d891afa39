"""What a hostile or careless model writes, on runc and on runsc. Each case checks what the code
sees (the attack fails inside) and what the host sees (a correct result in bounded time, nothing
left behind, the next run works)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from sandloop import SandboxLimits, run_code
from sandloop.root import default_root
from sandloop.runtime.docker import DockerBackend
from sandloop.runtime.oci import OCIBackend
from sandloop.settings import runtime_image
from tests.helpers import ONLY_LOOPBACK_GUARD, our_containers


@pytest.fixture
def lim(runtime):
    return SandboxLimits(runtime=runtime)


@pytest.fixture(autouse=True)
def _host_stays_clean(runtime):
    yield
    assert our_containers() == []
    r = run_code("print('next run works')", limits=SandboxLimits(runtime=runtime))
    assert r.stdout == "next run works\n"


def _run(code, lim, language="python", timeout=30, **kw):
    r = run_code(code, language, timeout, limits=lim, **kw)
    assert r.duration_seconds < timeout + 20
    return r


# -- resources -------------------------------------------------------------------------------
def test_python_fork_bomb(lim):
    code = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    r = _run(code, lim, timeout=5)
    assert r.timed_out or r.exit_code != 0


def test_shell_fork_bomb(lim):
    # the classic usually returns at once and leaves the bomb running in the background: the run
    # ends, and the bomb dies with its container. But the top-level shell forks twice (one per
    # side of the pipe); when the first side's descendants fill the process ceiling before the
    # second fork, bash retries that fork with back-off and the run is killed at its timeout
    # (seen once in a full local run), or bash gives up retrying first and exits 2 (seen in CI
    # under gVisor on a busy machine). Either way it ends within its bound (_run checks that), and
    # the process ceiling is what stopped it.
    # Under gVisor the whole sandbox may end instead, status 2, before the launcher's end line and
    # sometimes before bash's "fork: retry" reaches stderr (CI, 2026-12-03; and reproduced without
    # sandloop: `docker run --runtime runsc --pids-limit 64 IMAGE bash -c 'bomb() { bomb | bomb & };
    # bomb; sleep 2; echo still here'` prints nothing after the bomb and exits 2 in ~0.5 s, where
    # runc prints "still here" and exits 0).
    def ended_by_gvisor(r) -> bool:
        return lim.runtime == "runsc" and r.exit_code == 2 and not r.timed_out

    r = _run(":(){ :|:& };:", lim, "bash", timeout=5)
    assert (r.exit_code == 0 and not r.timed_out) or "fork: retry" in r.stderr or ended_by_gvisor(r), r
    r = _run("bomb() { bomb | bomb & }; bomb; sleep 2; echo still here", lim, "bash", timeout=10)
    assert r.timed_out or "fork" in r.stderr or r.stdout == "still here\n" or ended_by_gvisor(r), r


def test_thread_bomb(lim):
    code = (
        "import threading, time\nn = 0\ntry:\n    while True:\n"
        "        threading.Thread(target=time.sleep, args=(30,), daemon=True).start(); n += 1\n"
        "except RuntimeError as e:\n    print(n, e)\n"
    )
    r = _run(code, lim)
    count = int(r.stdout.split()[0])
    assert count < 64 and "can't start new thread" in r.stdout


@pytest.mark.parametrize(
    "language, code",
    [
        ("python", "x = []\nwhile True:\n    x.append(bytearray(8 << 20))"),
        ("python", "import time\nx = []\nwhile True:\n    x.append(bytearray(4 << 20)); time.sleep(0.01)"),
        ("node", "const a = []; while (true) { a.push(Buffer.alloc(8 << 20, 1)); }"),
    ],
)
def test_memory_hogs_are_killed_at_the_ceiling(lim, language, code):
    r = _run(code, lim, language, timeout=60)
    assert not r.timed_out and r.exit_code in (137, 134, 1) and not r.ok
    if language == "python":
        assert r.exit_code == 137 and r.oom_killed


def test_a_memory_hog_is_oom_killed_even_when_the_host_page_cache_was_cold(lim):
    # A sandbox that is the first to read its interpreter is charged for those pages: at its
    # ceiling the kernel evicts the interpreter's own code and the process thrashes until the
    # timeout (seen in CI: 60 s, then timed out). The backend reads the image's programs from the
    # host first, so those pages are the host's; dropping the cache and prefetching again must
    # bring back a prompt OOM kill.
    Path("/proc/sys/vm/drop_caches").write_text("3\n")
    backend = default_root().backend
    assert isinstance(backend, DockerBackend | OCIBackend)
    backend.prefetch_image(runtime_image(), wait=True, force=True)
    r = _run("const a = []; while (true) { a.push(Buffer.alloc(8 << 20, 1)); }", lim, "node", timeout=60)
    assert not r.timed_out and r.exit_code == 137 and r.duration_seconds < 20, r


def test_inode_exhaustion_in_tmp_is_contained(lim):
    # Bounded by the cap, not by the machine's speed: a small cap ends the loop at ENOSPC within a
    # few hundred files on any machine (under gVisor too: /tmp is a host tmpfs, runtime/tmpfs.py).
    # The default cap itself is read where it is exact: the filesystem's own inode count.
    cap = 500
    code = (
        "import os, errno\nn = 0\ntry:\n    while n < 100_000:\n        open(f'/tmp/f{n}', 'w').close(); n += 1\n"
        "except OSError as e:\n    print(n, errno.errorcode[e.errno])\nelse:\n    print(n, 'none')"
    )
    r = _run(code, SandboxLimits(runtime=lim.runtime, tmpfs_inodes=cap), timeout=120)
    n, err = r.stdout.split()
    # the mount's root directory is an inode too, so at most cap - 1 files fit
    assert err == "ENOSPC" and cap - 10 <= int(n) < cap, (r.stdout, r.stderr[-300:], r.exit_code)
    r = _run("import os\ns = os.statvfs('/tmp')\nprint(s.f_files, s.f_blocks * s.f_frsize)", lim)
    assert r.stdout.split() == [str(lim.tmpfs_inodes), str(lim.tmpfs_bytes)], r


@pytest.mark.parametrize("stream", ["stdout", "stderr", "both"])
def test_output_floods_are_capped(lim, stream):
    targets = {"stdout": "sys.stdout", "stderr": "sys.stderr", "both": "sys.stdout, sys.stderr"}[stream]
    code = (
        f"import sys\nchunk = 'z' * 65536\nfor _ in range(800):\n    for s in ({targets},):\n        s.write(chunk)\n"
    )
    r = _run(code, lim, timeout=120)
    assert r.ok
    if stream in ("stdout", "both"):
        assert len(r.stdout) == 65536 and r.stdout_dropped_bytes == 800 * 65536 - 65536
    if stream in ("stderr", "both"):
        assert len(r.stderr) == 65536 and r.stderr_dropped_bytes == 800 * 65536 - 65536


def test_double_forked_daemon_does_not_outlive_the_run(lim):
    code = r"""
import os, sys, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        sys.stdout.close(); sys.stderr.close()
        os.close(1); os.close(2)
        time.sleep(600)
    os._exit(0)
os.wait()
print("parent done")
"""
    r = _run(code, lim, timeout=30)
    assert r.stdout == "parent done\n" and r.ok and r.duration_seconds < 15


def test_background_children_do_not_hold_the_run(lim):
    r = _run("sleep 300 &\nsleep 300 &\necho started", lim, "bash", timeout=30)
    assert r.stdout == "started\n" and r.ok and r.duration_seconds < 15


def test_nul_bytes_in_code_are_a_result(lim):
    # Debian's Python 3.11.2 stops reading a source file at a NUL (newer ones refuse the file);
    # either way it is a result, not a crash
    r = _run("print(1)\x00print(2)", lim)
    assert (r.exit_code == 0 and r.stdout == "1\n") or (r.exit_code == 1 and "null bytes" in r.stderr)


# -- escape and privilege ------------------------------------------------------------------------
ATTACKS = r"""
import ctypes, errno, json, os, socket
libc = ctypes.CDLL(None, use_errno=True)
out = {}
def attempt(name, fn):
    # each attempt in its own child, so one that succeeded (say, a new user namespace) cannot
    # lend its privileges to the next
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(r)
        try:
            rc = fn()
            verdict = errno.errorcode.get(ctypes.get_errno(), "E?") if isinstance(rc, int) and rc < 0 else "ALLOWED"
        except OSError as e:
            verdict = errno.errorcode.get(e.errno, str(e.errno))
        os.write(w, verdict.encode())
        os._exit(0)
    os.close(w)
    out[name] = os.read(r, 100).decode() or "CRASHED"
    os.close(r)
    os.waitpid(pid, 0)
os.makedirs("/tmp/m", exist_ok=True)
attempt("mount", lambda: libc.mount(b"none", b"/tmp/m", b"tmpfs", 0, None))
attempt("chroot", lambda: os.chroot("/tmp"))
attempt("setuid0", lambda: os.setuid(0))
attempt("setgid0", lambda: os.setgid(0))
attempt("sethostname", lambda: libc.sethostname(b"pwned", 5))
attempt("unshare_user", lambda: libc.unshare(0x10000000))
attempt("unshare_mount", lambda: libc.unshare(0x00020000))
attempt("unshare_net", lambda: libc.unshare(0x40000000))
attempt("ptrace_pid1", lambda: libc.ptrace(16, 1, 0, 0))
attempt("keyctl", lambda: libc.syscall(248, b"user", b"k", b"v", 1, -3))
attempt("bpf", lambda: libc.syscall(321, 0, 0, 0))
attempt("raw_socket", lambda: socket.socket(socket.AF_INET, socket.SOCK_RAW, socket.IPPROTO_ICMP))
attempt("packet_socket", lambda: socket.socket(socket.AF_PACKET, socket.SOCK_RAW, 0))
attempt("sysrq", lambda: open("/proc/sysrq-trigger", "w").write("h"))
def mknod_mem():
    os.mknod("/tmp/mem", 0o600 | 0o020000, os.makedev(1, 1))  # /dev/mem
    with open("/tmp/mem", "rb") as f:
        return 0 if f.read(1) is not None else -1
attempt("mknod_dev_mem_read", mknod_mem)
attempt("chown_root", lambda: os.chown("/tmp/m", 0, 0))
try:
    with open("/proc/kcore", "rb") as f:
        out["kcore_read"] = "ALLOWED" if f.read(16) else "EMPTY"
except OSError as e:
    out["kcore_read"] = errno.errorcode.get(e.errno, "E?")
out["firmware"] = os.listdir("/sys/firmware") if os.path.isdir("/sys/firmware") else "ABSENT"
socks = ("/var/run/docker.sock", "/run/docker.sock", "/run/containerd/containerd.sock")
out["docker_sock"] = [p for p in socks if os.path.exists(p)]
print(json.dumps(out))
"""


#: What gVisor 20221219 allows because it happens inside its own kernel, never the host's: a user
#: namespace, and a mount namespace (it does not check CAP_SYS_ADMIN for CLONE_NEWNS) are Sentry
#: objects. The test below checks that they reach nothing outside.
RUNSC_INTERNAL = {"unshare_user", "unshare_mount"}


def test_privileged_operations_are_refused(lim, runtime):
    r = _run(ATTACKS, lim)
    out = json.loads(r.stdout)
    firmware, sock = out.pop("firmware"), out.pop("docker_sock")
    allowed = {k for k, v in out.items() if v == "ALLOWED"}
    expected = RUNSC_INTERNAL & allowed if runtime == "runsc" else set()
    assert allowed == expected, out
    assert firmware in ([], "ABSENT") and sock == []


def test_gvisor_user_namespace_gains_nothing_outside(lim, runtime):
    """Under runsc a new user namespace is allowed; from it, the host stays out of reach."""
    code = r"""
import ctypes, errno, os, socket
libc = ctypes.CDLL(None, use_errno=True)
if libc.unshare(0x10000000 | 0x00020000) != 0:   # CLONE_NEWUSER | CLONE_NEWNS
    print("refused", errno.errorcode[ctypes.get_errno()]); raise SystemExit
print("uid in ns", os.getuid())
os.makedirs("/tmp/m", exist_ok=True)
print("mount tmpfs", libc.mount(b"none", b"/tmp/m", b"tmpfs", 0, None))
for path in ("/etc/shadow", "/proc/1/root/etc/hostname"):
    try:
        open(path, "rb").read(); print("read", path)
    except OSError as e:
        print("denied", path)
s = socket.socket(); s.settimeout(2)
try:
    s.connect(("192.0.2.1", 80)); print("CONNECTED")
except OSError as e:
    print("connect", errno.errorcode.get(e.errno))
"""
    out = _run(code, lim).stdout
    if out.startswith("refused"):
        assert runtime == "runc", out
        return
    assert "read /etc/shadow" not in out and "CONNECTED" not in out, out


def test_kernel_interfaces_are_masked(lim):
    code = (
        "import os\nfor p in ('/proc/kcore', '/proc/keys', '/proc/timer_list', '/proc/sched_debug'):\n"
        "    try:\n        data = open(p, 'rb').read(64)\n        print(p, len(data))\n"
        "    except OSError as e:\n        print(p, 'refused', e.errno)\n"
    )
    for line in _run(code, lim).stdout.splitlines():
        path, verdict = line.split(" ", 1)
        assert verdict == "0" or verdict.startswith("refused"), line


# -- egress --------------------------------------------------------------------------------------
def test_icmp_and_node_http_cannot_leave(lim):
    r = _run(ONLY_LOOPBACK_GUARD + "print('only lo')", lim)
    assert r.stdout == "only lo\n", r.stdout
    node = (
        "const http = require('http');"
        "const req = http.get('http://192.0.2.1/', () => console.log('CONNECTED'));"
        "req.setTimeout(3000, () => { console.log('TIMEOUT'); req.destroy(); });"
        "req.on('error', e => console.log(e.code));"
    )
    r = _run(node, lim, "node")
    assert r.stdout.strip() in ("ENETUNREACH", "EHOSTUNREACH", "EADDRNOTAVAIL"), r.stdout
    r = _run("require('dns').lookup('example.com', (e) => console.log(e ? e.code : 'RESOLVED'))", lim, "node")
    assert r.stdout.strip() in ("ENOTFOUND", "EAI_AGAIN"), r.stdout


# -- input ---------------------------------------------------------------------------------------
def test_binary_garbage_output(lim):
    r = _run("import os, sys\nos.write(1, bytes(range(256)) * 4)\nos.write(2, b'\\xc3\\x28\\x00')", lim)
    assert r.ok and len(r.stdout) > 0 and "\ufffd" in r.stderr


def test_endless_flood_times_out_promptly(lim):
    """Found by hand: with the stream left unread, the engine's kill waited on its stream copier
    and the run ended in a 30 s engine timeout instead of a timed-out result."""
    for _ in range(3):
        # 5 s, not 2: on a saturated CI host gVisor's Python once printed nothing within 2 s (the
        # timeout counts its start), so there was no flood to drain; the bug's mark is the 30 s wait
        r = run_code('while True:\n    print("x" * 1000)', limits=lim, timeout_seconds=5)
        assert r.timed_out and r.exit_code == -1 and r.stdout_truncated, r
        assert r.duration_seconds < 15, r.duration_seconds

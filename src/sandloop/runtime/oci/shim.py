"""The holder of one direct session interpreter: ``python -S -E shim.py FD PIDFILE RUNTIME ARGS...``,
where FD is a listening Unix socket it serves the interpreter on and PIDFILE where it writes its pid.

A session's interpreter outlives the process that started it (the CLI's ``session create`` exits,
the next ``session exec`` attaches), so its stdio cannot be that process's pipes. Like Docker's
containerd-shim, this process holds them: it detaches (forks; the caller's child exits at once),
makes itself the child subreaper (runsc leaves its sandbox and gofer processes to whoever adopts
orphans, see ``subreaper.py``), starts the runtime (``runsc run`` or ``runsc restore``) on three
pipes, and relays them to whoever connects to the socket, in Docker's attach framing (8-byte
header: stream 1 or 2, three zero bytes, big-endian length), so ``SocketChannel`` reads it as it
reads Docker's. Bytes a client sends go to the interpreter's stdin; output goes to every client
connected (none: dropped, as Docker drops an unattached container's output). The interpreter's
stdin stays open while this process lives, so the launcher never sees EOF: the interpreter ends
when the runtime's sandbox does (killed, deleted, or checkpointed); then this process closes every
connection, reaps what is left, and exits.
"""

import ctypes
import json
import os
import select
import socket
import struct
import sys
import time

PR_SET_CHILD_SUBREAPER = 36
#: Bytes of clients' input held for the interpreter's stdin before clients are read no further.
MAX_PENDING_INPUT = 64 * 1024 * 1024
#: In a restored interpreter's bundle: the CPU quota (and period) its restore ran without. Its first
#: answer applies it (``kernels.DirectKernels.throttle``); if the process restoring it died before,
#: this holder applies it after ``SANDLOOP_RESTORE_QUOTA_SECONDS`` (30).
QUOTA_AFTER = "cpu-quota-after-restore"
#: What ``apply_pending_quota`` says while the restore has not made the sandbox's cpu cgroup yet
#: (the quota stays pending: the first answer, or this holder later, applies it).
NOT_YET = "the restored sandbox has no cpu cgroup yet"


def apply_pending_quota(bundle: str) -> str | None:
    """The quota a restore ran without, into the sandbox's cpu cgroup, read back. None when done
    (or none was pending), else why not; never raises."""
    pending = os.path.join(bundle, QUOTA_AFTER)
    try:
        with open(pending) as f:
            quota, period = f.read().split()
        with open(os.path.join(bundle, "config.json")) as f:
            cgroup = "/sys/fs/cgroup/cpu" + json.load(f)["linux"]["cgroupsPath"]
        if not os.path.isdir(cgroup):
            return NOT_YET
        for name, value in (("cpu.cfs_period_us", period), ("cpu.cfs_quota_us", quota)):
            with open(os.path.join(cgroup, name), "w") as f:
                f.write(value)
        with open(os.path.join(cgroup, "cpu.cfs_quota_us")) as f:
            if f.read().strip() != quota:
                return "the quota did not take"
        os.unlink(pending)
    except FileNotFoundError as exc:
        return None if exc.filename == pending else str(exc)
    except (OSError, ValueError, KeyError) as exc:
        return str(exc)
    return None


def _frame(stream: int, data: bytes) -> bytes:
    return struct.pack(">BxxxL", stream, len(data)) + data


def main() -> int:
    if os.fork():  # the caller waits for this one: it exits at once, the holder lives on
        os._exit(0)
    os.setsid()
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        return 125
    listener_fd = int(sys.argv[1])
    with open(sys.argv[2], "w") as f:
        f.write(str(os.getpid()))
    argv = sys.argv[3:]
    listener = socket.socket(fileno=listener_fd)
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    actions = [
        (os.POSIX_SPAWN_DUP2, in_r, 0),
        (os.POSIX_SPAWN_DUP2, out_w, 1),
        (os.POSIX_SPAWN_DUP2, err_w, 2),
        (os.POSIX_SPAWN_CLOSE, listener_fd),
    ]
    child = os.posix_spawn(argv[0], argv, dict(os.environ), file_actions=actions)
    for fd in (in_r, out_w, err_w):
        os.close(fd)
    os.set_blocking(in_w, False)
    outputs = {out_r: 1, err_r: 2}
    clients: list[socket.socket] = []
    pending = bytearray()
    code = 125
    child_running = True
    quota_at = time.monotonic() + float(os.environ.get("SANDLOOP_RESTORE_QUOTA_SECONDS") or 30)
    while outputs or child_running:
        if quota_at and time.monotonic() > quota_at:
            why = apply_pending_quota(os.path.dirname(sys.argv[2]))
            if why and why != NOT_YET:
                sys.stderr.write(f"shim: could not apply the restored sandbox's CPU quota: {why}\n")
            quota_at = time.monotonic() + 1 if why == NOT_YET else 0.0
        if child_running:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                pid, status = 0, 0
                child_running = False
            if pid == child:
                code = os.waitstatus_to_exitcode(status)
                code = 128 - code if code < 0 else code
                child_running = False
        readers: list[socket.socket | int] = [listener, *outputs]
        if len(pending) < MAX_PENDING_INPUT:
            readers += clients
        writers = [in_w] if pending and in_w >= 0 else []
        try:
            readable, writable, _ = select.select(readers, writers, [], 0.5)
        except InterruptedError:
            continue
        if writable:
            try:
                del pending[: os.write(in_w, pending)]
            except BlockingIOError:
                pass
            except OSError:  # the interpreter closed its stdin: what clients send goes nowhere
                os.close(in_w)
                in_w = -1
                pending.clear()
        for r in readable:
            if r is listener:
                try:
                    conn, _ = listener.accept()
                except OSError:
                    continue
                conn.settimeout(30)  # a client that stops reading is dropped, not waited for
                clients.append(conn)
            elif isinstance(r, int):
                try:
                    data = os.read(r, 256 * 1024)
                except OSError:
                    data = b""
                if not data:
                    del outputs[r]
                    os.close(r)
                    continue
                frame = _frame(outputs[r], data)
                for conn in list(clients):
                    try:
                        conn.sendall(frame)
                    except OSError:
                        clients.remove(conn)
                        conn.close()
            else:
                try:
                    data = r.recv(256 * 1024)
                except OSError:
                    data = b""
                if not data:
                    clients.remove(r)
                    r.close()
                elif in_w >= 0:
                    pending += data
    for conn in clients:
        conn.close()
    listener.close()
    while True:  # the sandbox's and gofer's processes runsc left to us
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return code
        except InterruptedError:
            continue


if __name__ == "__main__":
    sys.exit(main())

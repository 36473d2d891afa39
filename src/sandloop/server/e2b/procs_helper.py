"""Processes of an E2B-style sandbox, kept by its session's interpreter (inside the sandbox).

Not imported by sandloop: its source is sent as a cell (``exec`` in a namespace of its own, so
the user's globals never see it) with ``ARGS`` set. The table of processes lives in
``sys.modules["_sandloop_procs"]`` and so outlives the cell: a process started by one cell is
polled, fed and signalled by later ones. Each process gets its own session (``setsid``) so the
interpreter's interrupts never reach it; two threads per process drain its stdout and stderr into
bounded buffers that a poll takes.

The reply is one line on stdout: ``MARK`` + JSON.
"""

import base64
import json
import os
import subprocess
import sys
import threading
import time
import types

MARK = "\x1esandloop-procs:"
#: Unread output kept per stream of a process nobody is polling; the rest is counted and dropped.
BUFFER_CAP = 4 * 1024 * 1024
#: The most one poll returns in all (the cell's output has a cap of its own: 1 MiB by default;
#: base64 and JSON add a third).
POLL_CAP = 512 * 1024


def _state():
    state = sys.modules.get("_sandloop_procs")
    if state is None:
        state = types.ModuleType("_sandloop_procs")
        state.procs = {}
        state.cond = threading.Condition()
        sys.modules["_sandloop_procs"] = state
    return state


class Proc:
    def __init__(self, popen, config, tag):
        self.popen = popen
        self.config = config
        self.tag = tag
        self.out = {"stdout": bytearray(), "stderr": bytearray()}
        self.dropped = 0
        self.open_streams = 2
        self.exit_code = None
        self.ended = None


#: A read within CHATTY seconds of the one before waits PACE seconds first: under gVisor's ptrace
#: platform every write that wakes a waiting reader costs ~0.5 ms (issue 60: 10,000 writes into a
#: pipe took 4.5 s with a reader waiting), so in a burst the reader lets writes gather in the
#: pipe; the first line of a burst still comes at once.
CHATTY = 0.01
PACE = 0.004


def _drain(state, proc, name, stream):
    last = 0.0
    while True:
        now = time.monotonic()
        if now - last < CHATTY:
            time.sleep(PACE)
        last = now
        try:
            chunk = os.read(stream.fileno(), 65536)
        except OSError:
            chunk = b""
        if not chunk:
            with state.cond:
                proc.open_streams -= 1
                last = proc.open_streams == 0
            if last:
                code = proc.popen.wait()  # both streams closed: it has ended, or soon will
                with state.cond:
                    proc.exit_code = code
                    proc.ended = time.monotonic()
                    state.cond.notify_all()
            return
        with state.cond:
            buf = proc.out[name]
            room = BUFFER_CAP - len(buf)
            buf += chunk[: max(0, room)]
            proc.dropped += max(0, len(chunk) - max(0, room))
            state.cond.notify_all()


#: An ended process whose end nobody collected is forgotten this long after it ended.
KEEP_ENDED = 600.0


def _prune(state):
    now = time.monotonic()
    for pid, proc in list(state.procs.items()):
        if proc.exit_code is not None and now - proc.ended > KEEP_ENDED:
            del state.procs[pid]


def op_start(state, args):
    config = args["config"]
    env = dict(os.environ)
    env.update(config.get("envs") or {})
    env["PWD"] = config.get("cwd") or "/workspace"  # so a shell's pwd says /home/user, not where it leads
    try:
        popen = subprocess.Popen(
            [config["cmd"], *config.get("args", [])],
            cwd=config.get("cwd") or "/workspace",
            env=env,
            stdin=subprocess.PIPE if args.get("stdin") else subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            start_new_session=True,
        )
    except OSError as exc:
        return {"error": "cannot start %s: %s" % (config["cmd"], exc.strerror), "kind": "invalid_argument"}
    proc = Proc(popen, config, args.get("tag"))
    with state.cond:
        _prune(state)
        state.procs[popen.pid] = proc
    for name, stream in (("stdout", popen.stdout), ("stderr", popen.stderr)):
        threading.Thread(target=_drain, args=(state, proc, name, stream), daemon=True).start()
    return {"pid": popen.pid}


def _find(state, args):
    pid, tag = args.get("pid"), args.get("tag")
    if pid is not None:
        return state.procs.get(int(pid))
    for proc in state.procs.values():
        if tag is not None and proc.tag == tag:
            return proc
    return None


def _ready(proc):
    return proc.out["stdout"] or proc.out["stderr"] or proc.exit_code is not None


def op_poll(state, args):
    """What one process (``pid`` or ``tag``) or several (``pids``: one reply each, under
    ``replies``) printed since the last poll, and the exit code once it ended and all was taken.
    Waits up to ``wait`` seconds for any of them to have something."""
    deadline = time.monotonic() + min(float(args.get("wait", 0)), 1.0)
    with state.cond:
        if "pids" in args:
            procs = [(pid, state.procs.get(int(pid))) for pid in args["pids"]]
            while not any(p is None or _ready(p) for _, p in procs):
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                state.cond.wait(left)
            replies = {}
            for pid, proc in procs:
                if proc is None:
                    replies[str(pid)] = {"error": "no process %s" % pid, "kind": "not_found"}
                elif _ready(proc):
                    replies[str(pid)] = _take(state, proc, args, max(4096, POLL_CAP // 2 // len(procs)))
            return {"replies": replies}
        proc = _find(state, args)
        if proc is None:
            return {"error": "no process %s" % (args.get("pid") or args.get("tag")), "kind": "not_found"}
        while not _ready(proc):
            left = deadline - time.monotonic()
            if left <= 0:
                break
            state.cond.wait(left)
        return _take(state, proc, args, POLL_CAP // 2)


def _take(state, proc, args, cap):
    """A poll's reply for one process, at most ``cap`` bytes per stream (the caller holds
    ``state.cond``)."""
    reply = {"pid": proc.popen.pid}
    for name in ("stdout", "stderr"):
        buf = proc.out[name]
        reply[name] = base64.b64encode(bytes(buf[:cap])).decode()
        del buf[:cap]
    reply["dropped"], proc.dropped = proc.dropped, 0
    done = proc.exit_code is not None and not proc.out["stdout"] and not proc.out["stderr"]
    if done:
        reply["exit_code"] = proc.exit_code
        if args.get("forget", True):
            state.procs.pop(proc.popen.pid, None)
    return reply


def op_list(state, args):
    with state.cond:
        return {
            "processes": [
                {"pid": pid, "config": p.config, "tag": p.tag}
                for pid, p in sorted(state.procs.items())
                if p.exit_code is None
            ]
        }


def op_signal(state, args):
    with state.cond:
        proc = _find(state, args)
    if proc is None or proc.exit_code is not None:
        return {"error": "no running process %s" % (args.get("pid") or args.get("tag")), "kind": "not_found"}
    try:
        os.killpg(proc.popen.pid, int(args["signal"]))
    except ProcessLookupError:
        pass
    return {}


def op_input(state, args):
    with state.cond:
        proc = _find(state, args)
    if proc is None or proc.exit_code is not None:
        return {"error": "no running process %s" % (args.get("pid") or args.get("tag")), "kind": "not_found"}
    if proc.popen.stdin is None:
        return {"error": "process %d was started without stdin (stdin=True)" % proc.popen.pid, "kind": "invalid"}
    try:
        if args.get("close"):
            proc.popen.stdin.close()
        else:
            proc.popen.stdin.write(base64.b64decode(args["data"]))
            proc.popen.stdin.flush()
    except (OSError, ValueError) as exc:
        return {"error": "cannot write to process %d: %s" % (proc.popen.pid, exc), "kind": "invalid"}
    return {}


OPS = {"start": op_start, "poll": op_poll, "list": op_list, "signal": op_signal, "input": op_input}


def main(args):
    state = _state()
    try:
        reply = OPS[args["op"]](state, args)
    except Exception as exc:  # reported to the host, never raised into the user's interpreter
        reply = {"error": "%s: %s" % (type(exc).__name__, exc), "kind": "internal"}
    sys.stdout.write(MARK + json.dumps(reply) + "\n")
    sys.stdout.flush()


main(ARGS)  # noqa: F821 - set by the cell that runs this source

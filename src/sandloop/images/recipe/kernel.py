"""A session's interpreters (``launcher.py --kernel``): a supervisor and its contexts.

The host sends frames on stdin with the launcher's framing (preamble + JSON header + N bytes of
code). Each frame is an operation; ``op`` is ``cell`` unless it says otherwise:

- ``cell``: run code in a context (``context`` by id, else the default context of ``language``,
  python unless said), with ``env`` set for that cell only (restored after it) and ``ca`` trusted.
- ``create`` (``language``, ``cwd``), ``restart`` / ``remove`` (``context``), ``list``.

Every frame ends with the launcher's end line on stdout and stderr; the stdout line carries a
base64 JSON payload: for a cell ``{"execution_count", "error", "value", "value_omitted",
"restarted", "context", "language", "outputs"}``, for the others ``{"contexts": [...]}`` or an
``error``. A Python context streams each output as it is displayed, a line of its own on stdout
(``\0\x1esandloop-output:<nonce>:<base64 JSON>``, see kernel_python.py); the other languages'
outputs ride on the end line. ``default_cwd`` in any frame says where default contexts that have
not started yet will start (the E2B API: /home/user).

This process runs no user code. It imports IPython (and ``SANDLOOP_PRELOAD``'s modules) once,
before any cell, and every Python context is a ``fork`` of it: the pages are shared and a new
context starts in milliseconds. A JavaScript or TypeScript context is a node process
(``kernel.js``), a bash context a persistent ``bash`` (``kernel_bash.py``). A context writes its
output straight to this process's stdout and stderr and reports the end of each cell on a pipe;
SIGINT from the host (a timeout) goes on to the running context. One that does not come back
within ``INTERRUPT_GRACE`` seconds, or dies (the memory limit's OOM kill takes the biggest
process, the context), is replaced and the cell says so (``restarted``); its siblings live on.
"""

import base64
import itertools
import json
import os
import select
import signal
import subprocess
import sys
import time
import traceback

from host_wire import PREAMBLE, PREAMBLE_LEN, fail, read_exact
from kernel_wire import write_all

HERE = os.path.dirname(os.path.abspath(__file__))
#: Seconds a context has to answer an interrupt before it is killed and replaced (the host
#: waits 3 s more before it gives up on the whole sandbox).
INTERRUPT_GRACE = 2.0
LANGUAGES = {
    "python": "python",
    "python3": "python",
    "py": "python",
    "javascript": "javascript",
    "js": "javascript",
    "node": "javascript",
    "nodejs": "javascript",
    "typescript": "typescript",
    "ts": "typescript",
    "bash": "bash",
    "sh": "bash",
    "shell": "bash",
}
#: Default contexts, one per language, listed from the start and started on first use.
DEFAULTS = {"python": "default", "javascript": "default-javascript"}
MAX_CONTEXTS = 16


class Refused(Exception):
    def __init__(self, name, message):
        super().__init__(message)
        self.name = name


def language_of(name):
    key = str(name or "python").strip().lower()
    if key not in LANGUAGES:
        raise Refused(
            "UnknownLanguage",
            "unknown language %r: the code interpreter runs python, javascript, typescript and bash" % (name,),
        )
    return LANGUAGES[key]


class Context:
    def __init__(self, cid, language, cwd):
        self.id, self.language, self.cwd = cid, language, cwd
        self.pid = None
        self.cmd = self.reply = None
        self.buffer = b""
        #: Started, and no cell run yet: it can still move to another cwd (``adopt_default_cwd``).
        self.fresh = False
        self.moved = False

    def describe(self):
        return {"id": self.id, "language": self.language, "cwd": self.cwd}

    @property
    def alive(self):
        return self.pid is not None

    def start(self, preloaded, others=()):
        """``others``: the pipes to the other contexts, which a forked context must not hold."""
        cmd_r, cmd_w = os.pipe()
        reply_r, reply_w = os.pipe()
        if self.language in ("javascript", "typescript"):
            env = dict(
                os.environ, SANDLOOP_CELL_FD=str(cmd_r), SANDLOOP_REPLY_FD=str(reply_w), SANDLOOP_LANGUAGE=self.language
            )
            proc = subprocess.Popen(
                ["node", os.path.join(HERE, "kernel.js")],
                stdin=subprocess.DEVNULL,
                pass_fds=(cmd_r, reply_w),
                cwd=self.cwd,
                env=env,
                start_new_session=True,  # its own group: the host's SIGINT reaches it only through us
            )
            self.pid = proc.pid
            proc.returncode = 0  # we reap it ourselves (waitpid); keep Popen from doing so later
        else:
            pid = os.fork()
            if pid == 0:  # the context: never returns
                code = 1
                try:
                    os.setsid()
                    signal.set_wakeup_fd(-1)  # the supervisor's, inherited: not ours
                    for fd in (cmd_w, reply_r, *others):
                        os.close(fd)
                    devnull = os.open(os.devnull, os.O_RDONLY)
                    os.dup2(devnull, 0)  # fd 0 carries the host's frames: never the context's
                    os.close(devnull)
                    os.chdir(self.cwd)
                    signal.signal(signal.SIGINT, signal.default_int_handler)
                    if self.language == "python":
                        import kernel_python

                        kernel_python.serve(cmd_r, reply_w, preloaded)
                    else:
                        import kernel_bash

                        kernel_bash.serve(cmd_r, reply_w)
                    code = 0
                except BaseException:
                    traceback.print_exc()
                finally:
                    os._exit(code)
            self.pid = pid
        os.close(cmd_r)
        os.close(reply_w)
        self.cmd, self.reply, self.buffer = cmd_w, reply_r, b""
        self.fresh, self.moved = True, False

    def stop(self):
        if self.pid is not None:
            try:
                os.killpg(self.pid, signal.SIGKILL)
            except OSError:
                try:
                    os.kill(self.pid, signal.SIGKILL)
                except OSError:
                    pass
            status = _reap(self.pid)
            self._forget()
            return status
        return None

    def _forget(self):
        for fd in (self.cmd, self.reply):
            if fd is not None:
                try:
                    os.close(fd)
                except OSError:
                    pass
        self.pid = self.cmd = self.reply = None
        self.buffer = b""


def _reap(pid):
    """The exit status of a context that has ended (or is ending): 128+N for signal N."""
    try:
        _, status = os.waitpid(pid, 0)
    except ChildProcessError:
        return None
    if os.WIFSIGNALED(status):
        return 128 + os.WTERMSIG(status)
    return os.WEXITSTATUS(status)


class Supervisor:
    def __init__(self, preloaded):
        self.preloaded = preloaded
        self.cwd = os.getcwd()
        self.contexts = {}
        self.running = None  # the context running a cell: SIGINT goes to it
        self.interrupted_at = None
        self.ids = itertools.count(1)
        for language, cid in DEFAULTS.items():
            self.contexts[cid] = Context(cid, language, self.cwd)

    # -- signals -------------------------------------------------------------------------------
    def on_sigint(self, signum, frame):
        ctx = self.running
        if ctx is not None and ctx.pid is not None:
            self.interrupted_at = self.interrupted_at or time.monotonic()
            try:
                os.kill(ctx.pid, signal.SIGINT)
            except OSError:
                pass

    def pipes(self, ctx):
        """What a forked context must not hold: the other contexts' pipes, the signal pipe."""
        fds = [fd for c in self.contexts.values() if c is not ctx for fd in (c.cmd, c.reply) if fd is not None]
        return fds + [fd for fd in getattr(self, "wakeup_fds", ()) if fd is not None]

    def adopt_default_cwd(self, header):
        """``default_cwd`` (the E2B API sends /home/user): where default contexts that have not
        started yet will start."""
        cwd = header.get("default_cwd")
        if isinstance(cwd, str) and os.path.isabs(cwd) and os.path.isdir(cwd):
            self.cwd = cwd
            for cid, ctx in self.contexts.items():
                if cid.startswith("default") and ctx.cwd != cwd and (not ctx.alive or ctx.fresh):
                    ctx.cwd = cwd
                    ctx.moved = ctx.alive  # a warm one: its first cell moves there

    # -- operations ----------------------------------------------------------------------------
    def context_for(self, header):
        cid = header.get("context")
        if cid:
            ctx = self.contexts.get(str(cid))
            if ctx is None:
                raise Refused("ContextNotFound", "no context %r in this sandbox" % (cid,))
            if header.get("language") and language_of(header["language"]) != ctx.language:
                raise Refused(
                    "InvalidArgument",
                    "context %s runs %s, not %s: pass the context or the language, not both"
                    % (ctx.id, ctx.language, header["language"]),
                )
            return ctx
        language = language_of(header.get("language"))
        cid = DEFAULTS.get(language, "default-" + language)
        if cid not in self.contexts:
            self.contexts[cid] = Context(cid, language, self.cwd)
        return self.contexts[cid]

    def create(self, header):
        language = language_of(header.get("language"))
        cwd = header.get("cwd") or self.cwd
        if not isinstance(cwd, str) or not os.path.isabs(cwd):
            raise Refused("InvalidArgument", "cwd must be an absolute path, got %r" % (cwd,))
        if not os.path.isdir(cwd):
            try:
                os.makedirs(cwd, exist_ok=True)
            except OSError as exc:
                raise Refused("InvalidArgument", "cwd %s cannot be made: %s" % (cwd, exc.strerror)) from None
        if not os.access(cwd, os.X_OK):
            raise Refused("InvalidArgument", "cwd %s is not accessible to the sandbox's user" % cwd)
        if len(self.contexts) >= MAX_CONTEXTS:
            raise Refused("TooManyContexts", "a sandbox holds at most %d contexts: remove one first" % MAX_CONTEXTS)
        ctx = Context("ctx-%d" % next(self.ids), language, cwd)
        self.contexts[ctx.id] = ctx
        ctx.start(self.preloaded, self.pipes(ctx))
        return {"context": ctx.describe()}

    def restart(self, header):
        ctx = self.contexts.get(str(header.get("context")))
        if ctx is None:
            raise Refused("ContextNotFound", "no context %r in this sandbox" % (header.get("context"),))
        ctx.stop()
        ctx.start(self.preloaded, self.pipes(ctx))
        return {"context": ctx.describe()}

    def remove(self, header):
        ctx = self.contexts.pop(str(header.get("context")), None)
        if ctx is None:
            raise Refused("ContextNotFound", "no context %r in this sandbox" % (header.get("context"),))
        ctx.stop()
        if ctx.id in DEFAULTS.values():  # a default context comes back, fresh, when next used
            self.contexts[ctx.id] = Context(ctx.id, ctx.language, ctx.cwd)
        return {"removed": ctx.id}

    def list(self, header):
        return {"contexts": [c.describe() for c in self.contexts.values()]}

    def warm(self, header):
        """Start the default Python context and let it pay its first cell's one-time costs (a
        warm session, before anyone has it: ``sessions/reserve.py``). Then list the contexts."""
        ctx = self.contexts[DEFAULTS["python"]]
        reply = self.ask(ctx, {"code": 0, "warmup": True})
        if reply.get("error"):
            raise Refused(reply["error"]["name"], reply["error"]["value"])
        return self.list(header)

    def cell(self, header, code):
        ctx = self.context_for(header)
        message = {"code": len(code)}
        for key in ("env", "ca", "nonce"):
            if header.get(key):
                message[key] = header[key]
        if ctx.moved:
            message["chdir"] = ctx.cwd
        reply = self.ask(ctx, message, code)
        ctx.fresh = ctx.moved = False
        reply["context"], reply["language"] = ctx.id, ctx.language
        return reply

    def ask(self, ctx, message, code=b""):
        """Send one message to a context (started first if need be) and wait for its reply."""
        if not ctx.alive:
            ctx.start(self.preloaded, self.pipes(ctx))
        try:
            write_all(ctx.cmd, json.dumps(message).encode() + b"\n" + code)
        except OSError:
            pass  # it died: the wait below sees the end of its reply pipe
        self.running, self.interrupted_at = ctx, None
        try:
            return self.wait(ctx)
        finally:
            self.running, self.interrupted_at = None, None

    def wait(self, ctx):
        """The context's reply to its cell; if it dies, or ignores an interrupt, it is replaced."""
        while True:
            line, _, rest = ctx.buffer.partition(b"\n")
            if _:
                ctx.buffer = rest
                return json.loads(line)
            timeout = None
            if self.interrupted_at is not None:
                timeout = max(0.0, self.interrupted_at + INTERRUPT_GRACE - time.monotonic())
            ready, _w, _x = select.select([ctx.reply, self.wakeup], [], [], timeout)
            if self.wakeup in ready:  # a signal arrived (its handler has run): new deadline
                _drain(self.wakeup)
                continue
            if not ready:  # it ignored the interrupt
                status = ctx.stop()
                return _restarted(ctx, status, "did not stop within %g s of its interrupt" % INTERRUPT_GRACE)
            chunk = os.read(ctx.reply, 1 << 20)
            if not chunk:
                status = _reap(ctx.pid)
                ctx._forget()
                return _restarted(ctx, status, "ended")
            ctx.buffer += chunk

    # -- the loop -------------------------------------------------------------------------------
    def serve(self):
        self.wakeup, wakeup_w = os.pipe()
        os.set_blocking(self.wakeup, False)
        os.set_blocking(wakeup_w, False)
        self.wakeup_fds = (self.wakeup, wakeup_w)
        signal.set_wakeup_fd(wakeup_w)  # a select() in wait() returns when a signal comes
        signal.signal(signal.SIGINT, self.on_sigint)
        signal.signal(signal.SIGCHLD, signal.SIG_DFL)
        while True:
            frame = _read_frame()
            if frame is None:
                break  # the host closed stdin: the session's interpreters end
            header, code = frame
            nonce = str(header.get("nonce") or "")
            op = header.get("op") or "cell"
            status, reply = 0, {}
            try:
                self.adopt_default_cwd(header)
                if op == "cell":
                    reply = self.cell(header, code)
                    status = int(reply.pop("status", 0))
                elif op in ("create", "restart", "remove", "list", "warm"):
                    reply = getattr(self, op)(header)
                else:
                    raise Refused("InvalidArgument", "unknown operation %r" % (op,))
            except Refused as exc:
                status, reply = 2, {"error": {"name": exc.name, "value": str(exc), "traceback": ""}, "refused": True}
            except Exception as exc:  # never take the sandbox's contexts down with us
                status = 1
                reply = {"error": {"name": type(exc).__name__, "value": str(exc), "traceback": traceback.format_exc()}}
            _end(nonce, status, reply)
        for ctx in self.contexts.values():
            ctx.stop()


def _restarted(ctx, status, how):
    if how != "ended":
        why = how
    elif status == 128 + signal.SIGKILL:
        why = "was killed (SIGKILL: most likely the sandbox's memory limit)"
    elif status is not None and status > 128:
        why = "was killed by signal %d" % (status - 128)
    else:
        why = "exited (status %s)" % status
    value = "the %s context %s %s; it was restarted and its state is gone" % (ctx.language, ctx.id, why)
    return {
        "status": status if status is not None and status > 128 else 1,
        "restarted": True,
        "killed_by_signal": (status - 128) if status is not None and status > 128 else None,
        "error": {"name": "ContextRestarted", "value": value, "traceback": ""},
    }


def _drain(fd):
    try:
        while os.read(fd, 512):
            pass
    except OSError:
        pass


def _read_frame():
    while True:
        try:
            pre = os.read(0, PREAMBLE_LEN)
            break
        except KeyboardInterrupt:
            continue  # an interrupt that arrived between cells
    if not pre:
        return None
    while len(pre) < PREAMBLE_LEN:
        more = os.read(0, PREAMBLE_LEN - len(pre))
        if not more:
            return None
        pre += more
    if not pre.startswith(PREAMBLE):
        fail("bad cell header")
    header = json.loads(read_exact(int(pre[len(PREAMBLE) : -1]), "cell header").decode())
    code = read_exact(int(header.get("code") or 0), "cell")
    return header, code


def _end(nonce, status, reply):
    payload = base64.b64encode(json.dumps(reply).encode())
    line = b"\0\x1esandloop-exit:%s:%d" % (nonce.encode(), status)
    for fd, data in ((1, line + b":" + payload + b"\n"), (2, line + b"\n")):
        try:
            write_all(fd, data)
        except OSError:
            pass


def serve(args=()):
    """``args``: ``--preload=a,b`` imports those modules too before any context starts (a warm
    session's interpreter: ``sessions/reserve.py``)."""
    # A process started with SIGINT ignored (a background job's child, as the test double's
    # interpreters can be) would never see the host's interrupt: take it back.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    sys.argv = [""]
    sys.stdin = open(os.devnull)  # noqa: SIM115 - fd 0 carries the cells
    import kernel_python

    extra = [a.split("=", 1)[1] for a in args if a.startswith("--preload=")]
    preloaded = kernel_python.preload(tuple(m for v in extra for m in v.split(",") if m))
    Supervisor(preloaded).serve()


if __name__ == "__main__":
    try:
        serve()
    except Exception:
        traceback.print_exc()
        sys.exit(125)

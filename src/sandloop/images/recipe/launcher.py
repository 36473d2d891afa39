"""Runs inside the sandbox, under tini, as the unprivileged user. Started before any code exists
(a warm pool starts it ahead of time), it waits on stdin for one program, runs it once, and exits.

Protocol on stdin: ``SANDLOOP1 <n>\\n`` (a 19-byte preamble, n zero-padded to 8 digits), an
n-byte JSON header ``{"argv": [...], "file": PATH, "code": N, "cwd": DIR, "inproc": bool}``, exactly
N bytes of code, then the user's stdin until EOF. Exact-size reads with os.read on fd 0 (no Python
buffering), so not one byte of the user's stdin is consumed.

The program is written to PATH. With "inproc" (Python) it runs in this already-started interpreter
as ``__main__``, exactly as ``python3 PATH`` would run it (same argv, sys.path, tracebacks, exit
codes); that is what makes a warm sandbox fast. Otherwise argv + [PATH] runs in a child process that
inherits the rest of stdin, and the launcher waits for it. Failures to stage the program exit 125
with a message on stderr.

When the program is done, the launcher writes ``\0\x1esandloop-exit:<nonce>:<status>\n`` to
stdout and to stderr, so the host has the exit status without waiting for the container to be torn down (~50 ms).
The program could forge that line, but it can only claim what it could do anyway: exit early with
a status of its choice. Kills by signal (OOM) write nothing; the host then asks the engine.
"""

import os
import sys

from host_wire import PREAMBLE, PREAMBLE_LEN, exit_status, fail, read_exact, trust  # noqa: F401

LAUNCHER_PID = os.getpid()


class _Decoding:
    """What CPython's C JSON scanner reads from its decoder (``json.decoder.JSONDecoder``)."""

    strict = True
    object_hook = object_pairs_hook = None
    parse_float, parse_int = float, int

    @staticmethod
    def parse_constant(name):
        fail("bad run header")


def parse_json(text):
    """``json.loads`` without importing ``json``: its decoder imports ``re`` (with ``enum``,
    ``functools`` ...), ~5 ms of every cold run's start. The parser is the same: the C scanner
    ``json`` itself uses."""
    try:
        import _json
    except ImportError:  # an interpreter built without it
        import json

        return json.loads(text)
    try:
        value, end = _json.make_scanner(_Decoding)(text, 0)
    except (StopIteration, ValueError):  # nothing to scan; a malformed value (JSONDecodeError)
        fail("bad run header")
    if end != len(text):
        fail("bad run header")
    return value


def read_header():
    pre = read_exact(PREAMBLE_LEN, "run header")
    if not pre.startswith(PREAMBLE) or not pre.endswith(b"\n"):
        fail("bad run header")
    return parse_json(read_exact(int(pre[len(PREAMBLE) : -1]), "run header").decode())


def report_exit(nonce, status):
    """End both streams with the end-of-run line (the engine forwards them independently)."""
    if nonce and os.getpid() == LAUNCHER_PID:  # not from a forked child finishing the script
        line = b"\0\x1esandloop-exit:%s:%d\n" % (nonce.encode(), status)
        for fd in (1, 2):
            try:
                os.write(fd, line)
            except OSError:
                pass  # the program closed it: the host falls back to waiting for the exit


def finish(nonce, status):
    """Finalize like the interpreter would (threads, atexit, flush), report, then exit."""
    import atexit

    threading = sys.modules.get("threading")  # imported by the program, or no thread to join
    if threading is not None:
        try:
            threading._shutdown()
        except Exception:
            pass
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    report_exit(nonce, status)
    os._exit(status)


def run_child(argv, nonce):
    pid = os.fork()
    if pid == 0:
        try:
            os.execvp(argv[0], argv)
        except OSError as exc:
            os.write(2, ("sandloop: cannot start %s: %s\n" % (argv[0], exc.strerror)).encode())
        os._exit(125)
    os.close(0)  # the child owns stdin now
    _, wstatus = os.waitpid(pid, 0)
    status = os.waitstatus_to_exitcode(wstatus)
    status = 128 - status if status < 0 else status  # killed by signal N: 128+N, like a shell
    report_exit(nonce, status)
    os._exit(status)


def run_inproc(path, code, nonce):
    """Be ``python3 PATH``: fresh __main__, argv, sys.path[0], standard tracebacks and exit codes."""
    import types

    sys.argv = [path]
    sys.path[0] = os.path.dirname(path)
    main = types.ModuleType("__main__")
    main.__dict__.update({"__file__": path, "__builtins__": __builtins__, "__cached__": None})
    sys.modules["__main__"] = main
    try:
        compiled = compile(code, path, "exec", dont_inherit=True)
    except SyntaxError as exc:
        sys.excepthook(type(exc), exc.with_traceback(None), None)
        finish(nonce, 1)
    try:
        exec(compiled, main.__dict__)
    except SystemExit as exc:
        finish(nonce, exit_status(exc.code))
    except BaseException as exc:
        tb = exc.__traceback__.tb_next if exc.__traceback__ else None  # drop this frame
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        finish(nonce, 130 if isinstance(exc, KeyboardInterrupt) else 1)
    finish(nonce, 0)


def main():
    header = read_header()
    code = read_exact(int(header["code"]), "program")
    path = header["file"]
    try:
        os.makedirs(os.path.dirname(path), mode=0o700, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(code)
    except OSError as exc:
        fail("could not write the program to %s: %s (is /tmp full? raise tmpfs_size)" % (path, exc.strerror))
    os.environ.update(header.get("env") or {})  # e.g. secrets' placeholders (never their values)
    if header.get("ca"):
        trust(header["ca"])
    cwd = header.get("cwd") or "/tmp"
    try:
        os.chdir(cwd)
    except OSError as exc:
        fail("cannot enter %s: %s" % (cwd, exc.strerror))
    nonce = str(header.get("nonce") or "")
    # NUL bytes: let the real interpreter produce its own error message for the file
    if header.get("inproc") and b"\0" not in code:
        return run_inproc, (path, code, nonce)
    return run_child, (list(header["argv"]) + [path], nonce)


#: Longest a template's ready command is waited for before code runs anyway (the build checked it).
READY_SECONDS = 60


def start_template_command():
    """A template's start command (``SANDLOOP_START_CMD``, set by its image) runs in the
    background, its output in /tmp/.sandloop-start.log; then its ready command
    (``SANDLOOP_READY_CMD``) is run every 0.1 s until it succeeds (at most ``READY_SECONDS``),
    before any program or cell."""
    start = os.environ.pop("SANDLOOP_START_CMD", "")
    ready = os.environ.pop("SANDLOOP_READY_CMD", "")
    if not start:
        return
    import subprocess  # only here: ~3 ms of every cold run's start otherwise
    import time

    log = os.open("/tmp/.sandloop-start.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    devnull = os.open(os.devnull, os.O_RDONLY)
    try:
        subprocess.Popen(["/bin/sh", "-c", start], stdin=devnull, stdout=log, stderr=log, start_new_session=True)
    except OSError as exc:
        os.write(log, ("sandloop: cannot start the template's start command: %s\n" % exc).encode())
    finally:
        os.close(devnull)
    deadline = time.monotonic() + READY_SECONDS
    while ready and time.monotonic() < deadline:
        try:
            done = subprocess.run(["/bin/sh", "-c", ready], stdin=subprocess.DEVNULL, stdout=log, stderr=log)
        except OSError:
            break
        if done.returncode == 0:
            break
        time.sleep(0.1)
    else:
        if ready:
            os.write(log, b"sandloop: the template's ready command did not succeed in time; going on\n")
    os.close(log)


def prepare():
    """What comes before a program or a session's interpreter: an allowlist's egress relay, then a
    template's start command (and its ready check)."""
    if os.environ.get("SANDLOOP_EGRESS_SOCKET"):  # an allowlist: its relay, before any code runs
        import egress_relay

        egress_relay.start()
    start_template_command()


def run_one():
    """Read one program from stdin and run it (this process becomes it, or waits for it)."""
    try:
        job = main()
    except SystemExit:
        raise
    except BaseException as exc:  # never a launcher traceback in the user's stderr
        fail("launcher error: %r" % (exc,))
    job[0](*job[1])  # outside the try: the program's own exceptions are its own


if __name__ == "__main__":  # run as a script (tests): one program; ``start.py`` is the image's entry
    sys.modules["launcher"] = sys.modules[__name__]  # one module, whichever way it was started
    prepare()
    run_one()

"""Runs inside the sandbox, under tini, as the unprivileged user. Started before any code exists
(a warm pool starts it ahead of time), it waits on stdin for one program, runs it once, and exits.

Protocol on stdin: ``SANDLOOP1 <n>\\n`` (a 19-byte preamble, n zero-padded to 8 digits), an
n-byte JSON header ``{"argv": [...], "file": PATH, "code": N, "cwd": DIR, "inproc": bool}``, exactly
N bytes of code, then the user's stdin until EOF. Exact-size reads with os.read on fd 0 (no Python
buffering), so not one byte of the user's stdin is consumed.

The program is written to PATH. With "inproc" (Python) it runs in this already-started interpreter
as ``__main__``, exactly as ``python3 PATH`` would run it (same argv, sys.path, tracebacks, exit
codes); that is what makes a warm sandbox fast. Otherwise argv + [PATH] is exec'd and inherits the
rest of stdin. Failures to stage the program exit 125 with a message on stderr.
"""

import json
import os
import sys

PREAMBLE = b"SANDLOOP1 "
PREAMBLE_LEN = len(PREAMBLE) + 9  # 8 digits and a newline


def fail(message):
    os.write(2, ("sandloop: " + message + "\n").encode())
    os._exit(125)


def read_exact(n, what):
    chunks = []
    while n > 0:
        chunk = os.read(0, min(n, 1 << 20))
        if not chunk:
            fail("stdin closed before the whole %s arrived" % what)
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def read_header():
    pre = read_exact(PREAMBLE_LEN, "run header")
    if not pre.startswith(PREAMBLE) or not pre.endswith(b"\n"):
        fail("bad run header")
    return json.loads(read_exact(int(pre[len(PREAMBLE) : -1]), "run header").decode())


def run_inproc(path, code):
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
        sys.exit(1)
    try:
        exec(compiled, main.__dict__)
    except SystemExit:
        raise
    except BaseException as exc:
        tb = exc.__traceback__.tb_next if exc.__traceback__ else None  # drop this frame
        sys.excepthook(type(exc), exc.with_traceback(tb), tb)
        sys.exit(130 if isinstance(exc, KeyboardInterrupt) else 1)


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
    cwd = header.get("cwd") or "/tmp"
    try:
        os.chdir(cwd)
    except OSError as exc:
        fail("cannot enter %s: %s" % (cwd, exc.strerror))
    # NUL bytes: let the real interpreter produce its own error message for the file
    if header.get("inproc") and b"\0" not in code:
        return run_inproc, (path, code)
    argv = list(header["argv"]) + [path]
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        fail("cannot start %s: %s" % (argv[0], exc.strerror))


if __name__ == "__main__":
    try:
        job = main()
    except SystemExit:
        raise
    except BaseException as exc:  # never a launcher traceback in the user's stderr
        fail("launcher error: %r" % (exc,))
    job[0](*job[1])  # outside the try: the program's own exceptions are its own

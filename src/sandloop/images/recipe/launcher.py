"""Runs inside the sandbox, under tini, as the unprivileged user.

Protocol on stdin: one JSON header line ``{"argv": [...], "file": PATH, "code": N, "cwd": DIR}``,
then exactly N bytes of code, then the user's stdin until EOF. The launcher writes the code to
PATH and execs argv + [PATH], so the user's process inherits the rest of stdin untouched.

It reads with os.read on fd 0 (no Python buffering) so that not one byte of the user's stdin is
consumed before the exec. Failures to stage the code exit 125 with a message on stderr.
"""

import json
import os
import sys

MAX_HEADER = 64 * 1024


def fail(message):
    os.write(2, ("sandloop: " + message + "\n").encode())
    os._exit(125)


def read_exact(n):
    chunks = []
    while n > 0:
        chunk = os.read(0, min(n, 1 << 20))
        if not chunk:
            fail("stdin closed before the whole program arrived")
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def read_header():
    buf = bytearray()
    while len(buf) < MAX_HEADER:
        b = os.read(0, 1)
        if not b:
            fail("stdin closed before the run header arrived")
        if b == b"\n":
            return json.loads(buf.decode())
        buf += b
    fail("run header too long")


def main():
    header = read_header()
    code = read_exact(int(header["code"]))
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
    argv = list(header["argv"]) + [path]
    try:
        os.execvp(argv[0], argv)
    except OSError as exc:
        fail("cannot start %s: %s" % (argv[0], exc.strerror))


if __name__ == "__main__":
    try:
        main()
    except SystemExit:
        raise
    except BaseException as exc:  # never a launcher traceback in the user's stderr
        fail("launcher error: %r" % (exc,))
    sys.exit(125)

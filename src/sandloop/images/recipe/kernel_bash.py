"""A bash context of a session (see ``kernel.py``): one persistent ``bash``, so the working
directory, variables, functions and aliases of one cell are there in the next.

Each cell is written to a file and ``source``d (with its stdin from /dev/null, so it cannot read
the cells that follow); its exit status comes back on a pipe of its own. ``env`` is set for that
cell only (assignments before ``source`` are temporary in bash). SIGINT ends the running cell
with status 130 (a trap that returns from the sourced file) and keeps the shell.
"""

import json
import os
import shlex
import signal
import subprocess

from kernel_wire import read_message, write_all


def serve(cmd_fd, reply_fd):
    status_r, status_w = os.pipe()
    cell_file = "/tmp/.sandloop-bash-%d.sh" % os.getpid()
    bash = subprocess.Popen(
        ["bash", "--norc", "--noprofile"],
        stdin=subprocess.PIPE,
        pass_fds=(status_w,),
        start_new_session=True,  # we pass the host's SIGINT on to its whole group
    )
    os.close(status_w)
    assert bash.stdin is not None
    bash.stdin.write(b"trap 'return 130 2>/dev/null' INT\nunset HISTFILE\n")
    bash.stdin.flush()
    buffered, pending = b"", b""
    try:
        while True:
            try:
                message, buffered = read_message(cmd_fd, buffered)
            except KeyboardInterrupt:
                continue
            if message is None:
                return
            header, code = message
            with open(cell_file, "w") as f:
                f.write(code if code.endswith("\n") else code + "\n")
            env = header.get("env") or {}
            assign = " ".join("%s=%s" % (k, shlex.quote(str(v))) for k, v in env.items() if _name(k))
            command = "%s source %s </dev/null; echo $? >&%d\n" % (assign, shlex.quote(cell_file), status_w)
            try:
                bash.stdin.write(command.encode())
                bash.stdin.flush()
            except OSError:
                pass  # bash is gone: the status pipe's end says so
            status = None
            while status is None:
                try:
                    chunk = os.read(status_r, 64)
                except KeyboardInterrupt:
                    try:
                        os.killpg(bash.pid, signal.SIGINT)
                    except OSError:
                        pass
                    continue
                if not chunk:
                    return  # bash exited (`exit` in a cell): the supervisor restarts the context
                pending += chunk
                if b"\n" in pending:
                    line, _, pending = pending.partition(b"\n")
                    status = int(line.strip() or b"1")
            reply = {"status": status, "outputs": [], "execution_count": None, "error": None}
            if status == 130:
                reply["error"] = {"name": "KeyboardInterrupt", "value": "", "traceback": ""}
            write_all(reply_fd, json.dumps(reply).encode() + b"\n")
    finally:
        try:
            os.unlink(cell_file)
        except OSError:
            pass
        try:
            os.killpg(bash.pid, signal.SIGKILL)
        except OSError:
            pass


def _name(key):
    return isinstance(key, str) and key.replace("_", "a").isalnum() and not key[:1].isdigit()

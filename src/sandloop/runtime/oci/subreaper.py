"""A parent for one runsc sandbox: ``python -S -E subreaper.py RUNSC ARGS...``.

``runsc run`` leaves its sandbox and gofer processes to be reaped by whoever adopts orphans; left
to the host's init they linger as zombies (and runsc's waits stall on them). This process makes
itself the child subreaper, starts runsc with its own stdio (the sandbox's pipes), reaps every
process it adopts, and exits with runsc's status once none is left. It must be its own process:
``waitpid(-1)`` in sandloop's would steal the statuses of the caller's own subprocesses.
"""

import ctypes
import os
import sys

PR_SET_CHILD_SUBREAPER = 36


def main() -> int:
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print("sandloop subreaper: prctl(PR_SET_CHILD_SUBREAPER) failed", file=sys.stderr)
        return 125
    child = os.posix_spawn(sys.argv[1], sys.argv[1:], dict(os.environ))
    code = 125
    while True:
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:
            return code
        except InterruptedError:
            continue
        if pid == child:
            code = os.waitstatus_to_exitcode(status)
            code = 128 - code if code < 0 else code


if __name__ == "__main__":
    sys.exit(main())

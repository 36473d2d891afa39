"""Unbuffered stdout/stderr for sandboxed Python that never drops data on a short write.

Loaded at start-up by sandloop_stdio.pth. Why: output must reach the host as it is printed (a run
killed for time keeps what it printed), so PYTHONUNBUFFERED=1 is set. In that mode CPython puts
its text layer straight on a raw FileIO and ignores short writes. Under gVisor (runsc 20221219) a
write of more than 64 KiB to stdout returns short, so the rest of a large print vanished. Here each
write goes through a BufferedWriter (which retries short writes) and is flushed at once.
"""

import io
import sys

_originals = []  # keep the replaced wrappers alive: collecting one would close its FileIO


class _FlushingTextIO(io.TextIOWrapper):
    def write(self, s):
        n = super().write(s)
        self.flush()
        return n


def _install():
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name, None)
        if stream is None or not isinstance(getattr(stream, "buffer", None), io.FileIO):
            continue  # buffered mode already retries short writes
        raw = io.FileIO(stream.fileno(), "wb", closefd=False)
        wrapper = _FlushingTextIO(
            io.BufferedWriter(raw), encoding=stream.encoding, errors=stream.errors, write_through=True
        )
        _originals.append(stream)
        setattr(sys, name, wrapper)
        setattr(sys, "__%s__" % name, wrapper)


try:
    _install()
except Exception:  # never break the interpreter's start-up over this
    pass

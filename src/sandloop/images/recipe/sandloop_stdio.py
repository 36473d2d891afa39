"""stdout and stderr for sandboxed Python: whole writes, at once when the program prints now and
then, gathered when it prints in a burst.

Loaded at start-up by sandloop_stdio.pth. Why whole writes: output must reach the host as it is
printed (a run killed for time keeps what it printed), so PYTHONUNBUFFERED=1 is set. In that mode
CPython puts its text layer straight on a raw FileIO and ignores short writes. Under gVisor
(runsc 20221219) a write of more than 64 KiB to stdout returns short, so the rest of a large print
vanished (and anywhere, a write of more than 4 KiB to a full pipe returns short when a signal
handler runs). So the raw writer writes the whole of what it is given.

Why gathered (issue 60): under gVisor's ptrace platform every write that reaches a reader costs
~0.6 ms (10,000 printed lines took 6.6 s where runc took 0.15 s; the same bytes as one write took
55 ms). Once ``BURST`` writes in a row came each within ``CHATTY`` seconds of the one before, a
write that comes as quickly is kept, and what is kept
goes out as one write at most ``FLUSH`` seconds later (a flusher thread, started on the first
burst), when ``MAX_KEPT`` bytes are kept, when the program writes to the other stream (gathering
reorders nothing between them), and before anything else may write to the same files or end the process:
``flush()`` and exit (the launcher and the interpreter flush), a fork, a subprocess,
``os.system``, an ``exec``, ``os.kill`` (Python's audit events). A line printed on its own still
leaves at once, so streaming stays streaming and a program that prints and then hangs, is timed
out or is OOM-killed has lost nothing. What a kill the program does not make itself (SIGKILL from
outside, ``os._exit``) can cost: at most the last ``FLUSH`` seconds of a burst.
"""

import _thread
import io
import os
import sys
import time

CHATTY = 0.002
#: Writes in a row within CHATTY of each other before any is kept.
BURST = 64
FLUSH = 0.005
MAX_KEPT = 64 * 1024

_originals = []  # keep the replaced wrappers alive: collecting one would close its FileIO
_streams = []
_lock = _thread.RLock()
_wake = _thread.allocate_lock()
_wake.acquire()
_flusher = [False]  # started (in this process)
_now = time.monotonic


def _write_all(fd, data, _write=os.write):
    view = memoryview(data).cast("B")
    while view:
        view = view[_write(fd, view) :]


class _WholeWrites(io.FileIO):
    """A FileIO whose ``write`` returns only once all of ``data`` is written or kept."""

    _kept = None
    _last = 0.0
    _run = 0  # writes in a row, each within CHATTY of the one before

    def write(self, data, _write=os.write):
        size = len(data) if isinstance(data, (bytes, bytearray)) else memoryview(data).nbytes
        now = _now()
        with _lock:
            for other in _streams:  # the other stream's kept output goes first: the order holds
                if other is not self and other._kept:
                    other._drain()
            kept = self._kept
            self._run = self._run + 1 if now - self._last < CHATTY else 0
            self._last = now
            if (kept or self._run >= BURST) and _flusher_running():
                if kept is None:
                    kept = self._kept = bytearray()
                was_empty = not kept
                kept += data
                if len(kept) >= MAX_KEPT:
                    self._drain()
                elif was_empty:
                    _wake_flusher()
            else:
                _write_all(self.fileno(), data, _write)
        return size

    def _drain(self):
        kept = self._kept
        if kept:
            self._kept = bytearray()
            _write_all(self.fileno(), kept)

    def flush(self):
        with _lock:
            self._drain()


def flush_all():
    with _lock:
        for stream in _streams:
            try:
                stream._drain()
            except OSError:
                if stream._kept is not None:
                    stream._kept.clear()


def _flusher_running():
    """The flusher, started on the first long burst: a program that never has one (most) has no
    thread of ours. (Under gVisor a thread busy at an OOM kill can take the sandbox's kernel down
    with it: exit 2 instead of 137, measured with one started at the first kept write.)"""
    if not _flusher[0]:
        try:
            _thread.start_new_thread(_flush_loop, ())
        except RuntimeError:  # no thread to be had (the pids limit): every write goes out at once
            return False
        _flusher[0] = True
    return True


def _wake_flusher():
    if _wake.locked():
        try:
            _wake.release()
        except RuntimeError:
            pass


def _flush_loop():
    while True:
        _wake.acquire()
        time.sleep(FLUSH)
        try:
            flush_all()
        except Exception:
            pass


def _after_fork_in_child():
    """A new flusher when one is needed, and new locks: the parent's flusher may have held one
    at the fork, and it does not exist here."""
    global _wake, _lock
    _flusher[0] = False
    _lock = _thread.RLock()
    _wake = _thread.allocate_lock()
    _wake.acquire()


_FLUSH_BEFORE = frozenset(
    ("os.fork", "os.forkpty", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.kill", "os.killpg")
)


def _audit(event, args):
    if (event in _FLUSH_BEFORE or event == "subprocess.Popen") and any(stream._kept for stream in _streams):
        flush_all()


def _install():
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name, None)
        if stream is None or not isinstance(getattr(stream, "buffer", None), io.FileIO):
            continue  # buffered mode already retries short writes
        raw = _WholeWrites(stream.fileno(), "wb", closefd=False)
        wrapper = io.TextIOWrapper(raw, encoding=stream.encoding, errors=stream.errors, write_through=True)
        _originals.append(stream)
        _streams.append(raw)
        setattr(sys, name, wrapper)
        setattr(sys, "__%s__" % name, wrapper)
    if _streams:
        os.register_at_fork(before=flush_all, after_in_child=_after_fork_in_child)
        sys.addaudithook(_audit)


try:
    _install()
except Exception:  # never break the interpreter's start-up over this
    pass

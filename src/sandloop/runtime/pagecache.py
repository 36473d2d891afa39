"""Keep a runtime image's programs and libraries in the host's page cache, charged to the host.

Why: a page of a file belongs (in the memory cgroup's accounts) to the cgroup that first read it
in. If a sandbox is the first to map ``libnode.so`` (47 MB) and then allocates up to its memory
ceiling, the kernel keeps reclaiming the interpreter's own code pages from that sandbox's cgroup
instead of calling the OOM killer: the process thrashes, re-reading its code from disk, until the
run's timeout (measured: a Node ``Buffer`` hog under a 256 MiB ceiling took 60 s and timed out
after ``drop_caches``, and was OOM-killed in 0.8 s when the host had read the files first).
Reading the image's executables and shared objects once from the host charges those pages to the
host's cgroup, where no sandbox's limit can evict them.

This is the backend-neutral part: a backend gives the directories that hold the image's files
(Docker's overlay2 layer directories; a direct backend's exported root file system).
"""

from __future__ import annotations

import logging
import os
import stat
import threading
import time
from collections.abc import Callable, Iterable
from pathlib import Path

log = logging.getLogger(__name__)

#: At most this much is read per image (the runtime image's programs and libraries: ~290 MB).
DEFAULT_BUDGET = 768 * 1024 * 1024
#: Read again after this long: a page the host evicted under memory pressure is read back (when
#: the pages are still cached, a pass costs ~0.1 s of CPU).
REFRESH_SECONDS = 600.0
_CHUNK = 1024 * 1024

_done: dict[str, float] = {}
_running: dict[str, threading.Thread] = {}
_lock = threading.Lock()


def _is_code(name: str, mode: int) -> bool:
    return bool(mode & stat.S_IXUSR) or name.endswith(".so") or ".so." in name


def prefetch(roots: Iterable[Path], budget: int = DEFAULT_BUDGET) -> int:
    """Read every executable and shared object under ``roots`` (no symlinks followed), up to
    ``budget`` bytes. Returns the bytes read. Unreadable files are skipped."""
    total = 0
    buf = bytearray(_CHUNK)
    for root in roots:
        for dirpath, _dirs, files in os.walk(root):
            for name in files:
                path = os.path.join(dirpath, name)
                try:
                    st = os.lstat(path)
                except OSError:
                    continue
                if not stat.S_ISREG(st.st_mode) or not _is_code(name, st.st_mode):
                    continue
                if total + st.st_size > budget:
                    return total
                try:
                    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NOATIME)
                except OSError:
                    try:
                        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW)
                    except OSError:
                        continue
                try:
                    with os.fdopen(fd, "rb", buffering=0) as f:
                        while n := f.readinto(buf):
                            total += n
                except OSError:
                    continue
    return total


def prefetch_once(
    key: str, roots: Callable[[], list[Path]], *, wait: bool = False, force: bool = False
) -> threading.Thread | None:
    """Prefetch ``roots()`` for ``key`` (an image) in a daemon thread, unless this process did
    so in the last ``REFRESH_SECONDS`` (or ``force``). With ``wait``, return when it is done.
    Never raises: this is an optimisation."""

    def work() -> None:
        try:
            dirs = roots()
            n = prefetch(dirs)
            log.debug("page cache: read %.0f MB of programs for %s", n / 1e6, key[:19])
        except Exception as exc:  # noqa: BLE001 - best effort
            log.debug("page cache: could not prefetch %s: %s", key[:19], exc)
        finally:
            with _lock:
                _done[key] = time.monotonic()
                _running.pop(key, None)

    with _lock:
        thread = _running.get(key)
        fresh = key in _done and time.monotonic() - _done[key] < REFRESH_SECONDS
        if thread is None and (force or not fresh):
            thread = threading.Thread(target=work, name="sandloop-prefetch", daemon=True)
            _running[key] = thread
            thread.start()
    if wait and thread is not None:
        thread.join()
    return thread

"""Client side of a session's stateful Python interpreter (``launcher.py --kernel`` in the image).

One long-lived sandbox per session, which another process can find again (``find_kernel``). The
policy lives here, the mechanics in the backend (``Backend.run_cell``): a cell past its timeout is
interrupted (SIGINT: the state survives); if the interpreter does not come back within a grace
period, or it died (OOM), it is destroyed and the next cell starts a fresh one, which the result
says (``interpreter_restarted``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import threading
import weakref
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from sandloop.contract import CellResult, SandboxLimits, SessionNotFound
from sandloop.contract.egress import Secret
from sandloop.runtime.base import Backend, Sandbox, SandboxSpec
from sandloop.runtime.labels import LABEL_PREFIX, SESSION_LABEL
from sandloop.sessions.store import HOME_DIR, WORKSPACE, SessionRecord

#: Seconds an interrupted cell has to return before its interpreter is replaced.
INTERRUPT_GRACE_SECONDS = 3.0

#: This process's kernels, by session (several ``Session`` objects may hold one session): a pause
#: through one lets the others' streams go (``others_let_go``).
_KERNELS: dict[str, weakref.WeakSet[Kernel]] = {}
_KERNELS_LOCK = threading.Lock()


def kernel_command(preload: tuple[str, ...] = ()) -> tuple[str, ...]:
    """The launcher's arguments that start a session's interpreter (``kernel.py``)."""
    return ("--kernel", "--preload=" + ",".join(preload)) if preload else ("--kernel",)


def interpreter_spec(record: SessionRecord, *, kernel: bool = True, preload: tuple[str, ...] = ()) -> SandboxSpec:
    """A session's sandbox: its interpreter (``kernel``, lives as long as the session, whichever
    process started it) or a single-use run, both with the workspace at /workspace and /home/user.
    ``preload``: modules the interpreter imports before its first cell (a warm session's)."""
    labels: list[tuple[str, str]] = [(SESSION_LABEL, record.id)]
    command: tuple[str, ...] = ()
    if kernel:
        labels += [(f"{LABEL_PREFIX}owner", f"session:{record.id}"), (f"{LABEL_PREFIX}expires", "inf")]
        command = kernel_command(preload)
    return SandboxSpec(
        record.image,
        SandboxLimits(**record.limits).for_container(),
        cwd=WORKSPACE,
        labels=tuple(labels),
        volumes=((record.volume, WORKSPACE), (record.volume, HOME_DIR)),
        command=command,
    )


class Kernel:
    def __init__(
        self, backend: Backend[Any], spec: SandboxSpec, session_id: str, lock_path: Path, lifetime: float
    ) -> None:
        self.backend = backend
        self.spec = spec
        self.session_id = session_id
        self.lock_path = lock_path
        self.lifetime = lifetime
        self._sandbox: Sandbox | None = None
        self._held = threading.local()
        with _KERNELS_LOCK:
            _KERNELS.setdefault(session_id, weakref.WeakSet()).add(self)
        weakref.finalize(self, _unregister, session_id)

    @contextlib.contextmanager
    def locked(self) -> Iterator[None]:
        """One cell (or pause, snapshot, resume) at a time per session, across processes; a thread
        already holding it enters again (a pause runs its own cells)."""
        if getattr(self._held, "depth", 0):
            self._held.depth += 1
            try:
                yield
            finally:
                self._held.depth -= 1
            return
        try:
            f = open(self.lock_path, "a+")  # noqa: SIM115 - closed below, after the lock is let go
        except FileNotFoundError:  # its folder went with the session (deleted, or by another process)
            raise SessionNotFound(f"no session {self.session_id}: it was deleted or expired") from None
        with f:
            fcntl.flock(f, fcntl.LOCK_EX)
            self._held.depth = 1
            try:
                yield
            finally:
                self._held.depth = 0
                fcntl.flock(f, fcntl.LOCK_UN)

    @contextlib.contextmanager
    def try_locked(self) -> Iterator[bool]:
        """``locked`` if nobody holds it now (True), else at once False: for upkeep that must
        never wait behind a cell (an idle pause)."""
        if getattr(self._held, "depth", 0):
            with self.locked():
                yield True
            return
        with open(self.lock_path, "a+") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            self._held.depth = 1
            try:
                yield True
            finally:
                self._held.depth = 0
                fcntl.flock(f, fcntl.LOCK_UN)

    def running(self) -> Sandbox | None:
        """The session's interpreter if one runs (connected), without starting one."""
        if self._sandbox is not None and self.backend.is_alive(self._sandbox):
            return self._sandbox
        self._drop(remove=False)
        self._sandbox = self.backend.find_kernel(self.session_id, self.spec)
        return self._sandbox

    def others_let_go(self) -> None:
        """The interpreter ended (paused through this kernel): every other handle on it in this
        process lets go of its stream, which would hold a dead connection (a file descriptor
        each: ~700 idle-paused sessions held by one process went past select's 1024) until its
        next use. Called under the session's lock, so none of them is in a cell."""
        with _KERNELS_LOCK:
            kernels = _KERNELS.get(self.session_id)
            others = [k for k in kernels if k is not self] if kernels is not None else []
        for kernel in others:
            kernel._drop(remove=False)

    def forget(self) -> None:
        """The interpreter is gone (checkpointed): let go of its handle without removing anything."""
        self._sandbox = None

    def adopt(self, sandbox: Sandbox) -> None:
        """Use this running interpreter (a warm session's) for the next cell."""
        self._sandbox = sandbox

    def handle(self, limits: SandboxLimits) -> Sandbox:
        """The running interpreter's sandbox (started if none runs), for a program started beside
        the interpreter (``Reachable.exec_stream``). Holds no stream of it afterwards that this
        process did not hold before (another process's cells must not pile up on an idle one)."""
        with self.locked():
            held = self._sandbox is not None
            if not held:  # one that answers (a runtime's exec finds no sandbox still being made)
                self.run("", 30, limits, None, None, None, True, {"op": "list"})
            sandbox = self._connect()
            if not held:
                self._drop(remove=False)
            return sandbox

    def _connect(self) -> Sandbox:
        if self._sandbox is not None and self.backend.is_alive(self._sandbox):
            return self._sandbox
        self._drop(remove=False)
        self._sandbox = self.backend.find_kernel(self.session_id, self.spec) or self.backend.launch(
            self.spec, purpose="kernel", lifetime_seconds=self.lifetime
        )
        return self._sandbox

    def _drop(self, remove: bool) -> None:
        if self._sandbox is not None:
            if remove:
                self.backend.destroy(self._sandbox)
            else:
                self.backend.detach(self._sandbox)
        self._sandbox = None

    def run(
        self,
        code: str,
        timeout_seconds: float,
        limits: SandboxLimits,
        secrets: Mapping[str, Secret] | None = None,
        on_output: Callable[[str, bytes], None] | None = None,
        cancel: threading.Event | None = None,
        detach: bool = False,
        options: Mapping[str, Any] | None = None,
        guard: Callable[[], None] | None = None,
    ) -> CellResult:
        """``detach``: let go of the interpreter's stream after the cell (under the same lock), so
        no idle connection of this process receives another process's cells meanwhile. ``guard``
        runs once the lock is taken (not when this thread held it already: a pause's or resume's
        own cells) and may refuse: a session paused while this call waited for the lock must
        not get a fresh interpreter from it (seen: a command's poll, queued behind a pause)."""
        fresh = not getattr(self._held, "depth", 0)
        with self.locked():
            if guard is not None and fresh:
                guard()
            sandbox = self._connect()
            result = self.backend.run_cell(
                sandbox,
                code,
                limits=limits,
                interrupt_after=timeout_seconds,
                grace=INTERRUPT_GRACE_SECONDS,
                secrets=secrets,
                on_output=on_output,
                cancel=cancel,
                options=options,
            )
            if result.sandbox_replaced:  # one context's restart is the supervisor's business
                self._drop(remove=True)
            elif detach:
                self._drop(remove=False)
            return result

    def close(self) -> None:
        """Detach; the interpreter keeps running for other processes (until the session ends)."""
        self._drop(remove=False)

    def shutdown(self) -> None:
        self._drop(remove=True)


def _unregister(session_id: str) -> None:
    """A kernel of ``session_id`` was collected: its entry goes once none of them is left."""
    with _KERNELS_LOCK:
        kernels = _KERNELS.get(session_id)
        if kernels is not None and not list(kernels):
            del _KERNELS[session_id]


def lock_file(directory: Path) -> Path:
    path = directory / "kernel.lock"
    if not path.exists():
        with contextlib.suppress(OSError):
            path.touch(mode=0o600)
            os.chmod(path, 0o600)
    return path


__all__ = ["Kernel", "interpreter_spec", "kernel_command", "lock_file"]

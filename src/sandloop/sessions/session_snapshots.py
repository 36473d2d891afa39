"""Pause, resume, snapshots and forks of a session (``SessionSnapshots``, a part of
``Session``): the session's verbs over the snapshot store and the backends' memory checkpoints
(``sessions/snapshots.py``)."""

from __future__ import annotations

import builtins
import contextlib
import json
import logging
import os
import shutil
import time
from dataclasses import asdict
from pathlib import Path

from sandloop.contract import (
    InvalidArgument,
    SandboxError,
    SessionNotFound,
    SessionNotPaused,
)
from sandloop.sessions.host import SessionHost, default_host
from sandloop.sessions.session_parts import SessionParts
from sandloop.sessions.session_reach import close_reach
from sandloop.sessions.snapshots import (
    IDLE_MARK,
    LOAD_STATE,
    PAUSED,
    SAVE_STATE,
    STATE_FILE,
    SnapshotRecord,
    SnapshotStore,
    copy_files,
    memory_backend,
    new_snapshot_id,
    place_file,
    take_file,
)
from sandloop.sessions.store import SESSION_LABEL, WORKSPACE

log = logging.getLogger(__name__)


class SessionSnapshots(SessionParts):
    """Pause, resume, snapshot and fork, for ``Session``."""

    # -- pause, resume, snapshots, forks (snapshots.py) ---------------------------------------------
    @property
    def _home(self) -> Path:
        return self._store.root / self.id

    @property
    def paused(self) -> str | None:
        """How the session is paused ("memory", "state" or "files"), or None while it runs."""
        return self._store.paused(self.id)

    def pause(self, *, keep_memory: bool = True) -> str:
        """Stop the session's interpreter and keep what it had: its memory where the backend can
        (gVisor on the direct backend), else its picklable Python state; the workspace stays.
        ``keep_memory=False`` keeps the files only (E2B's filesystem-only pause: a cold start).
        Nothing runs and no memory is held until ``resume`` (or ``Session.attach``). A cell in
        flight finishes (or times out) first. Returns the kind kept ("memory", "state", "files").

        Raises:
            SessionNotPaused: it is paused already.
        """
        self._check_open()
        if self._store.remote is not None:  # where it lives (a Ray node), by the code below run there
            with self._kernel.locked():
                self._kernel.forget()  # that host lets go of the interpreter it checkpoints or stops
                kind = self._store.remote.pause_session(asdict(self._record), keep_memory)
        else:
            kind = self.pause_here(keep_memory=keep_memory)
        # A pause is a use: its idle TTL counts from now, paused or not (``SessionStore.expired``).
        self._record.last_used = time.time()
        with contextlib.suppress(OSError, SandboxError):  # as ``touch``: the pause is made
            self._store.save(self._record)
        return kind

    def pause_here(self, *, keep_memory: bool = True, idle: bool = False) -> str:
        """``pause`` on the host that holds the session's workspace and interpreter; ``idle``:
        paused for want of use (``sessions/idle.py``), so its next call resumes it."""
        with self._kernel.locked():
            self._recover()
            if self.paused and self.paused_for_idleness and not idle:
                # Paused for want of use: a caller's pause makes it theirs (it stays paused now
                # until they resume it), with what the idle pause kept.
                (self._home / PAUSED / IDLE_MARK).unlink(missing_ok=True)
                return str(self.paused)
            if self.paused:
                raise SessionNotPaused(f"session {self.id} is already paused; resume it first")
            staged = self._home / f".{PAUSED}"
            shutil.rmtree(staged, ignore_errors=True)
            staged.mkdir(mode=0o700)
            try:
                kind, dropped = self._keep(staged, keep_running=False, files_only=not keep_memory)
                (staged / "dropped.json").write_text(json.dumps(dropped))
                (staged / "kind").write_text(kind)
                if idle:
                    (staged / IDLE_MARK).write_text(str(time.time()))
                os.rename(staged, self._home / PAUSED)
            except BaseException:
                shutil.rmtree(staged, ignore_errors=True)
                raise
            self._kernel.others_let_go()  # this process's other handles on it hold a dead stream
            self._dispatcher.drop_pools(lambda spec: (SESSION_LABEL, self.id) in spec.labels)
            return kind

    def pause_if_idle(self, idle_seconds: float) -> str | None:
        """Pause the session for want of use (``sessions/idle.py``) if nothing has used it for
        ``idle_seconds``, its interpreter runs and no cell, pause or resume holds it now (never
        waits for one); the kind kept, or None: left as it was."""
        with self._kernel.try_locked() as held:
            if not held or self._store.remote is not None or self._store.stopped_here(self.id):
                return None
            try:  # as it is now: a call may have used it since the caller listed it
                record = self._store.load(self.id)
            except SessionNotFound:
                return None
            if time.time() - record.last_used < idle_seconds or self._kernel.running() is None:
                return None  # used since, or nothing in memory to free (a pause would keep files only)
            return self.pause_here(keep_memory=True, idle=True)

    @property
    def paused_for_idleness(self) -> bool:
        """Paused by the idle pause (not by a caller): the next call resumes it."""
        return self._store.idle_paused(self.id)

    def resume(self) -> str:
        """Start the paused session again as it was (same id); the kind it was kept as.

        Raises:
            SessionNotPaused: it is running.
            SnapshotIncompatible: its memory was kept by another runsc, image or CPU.
        """
        self._check_open()
        with self._kernel.locked():
            if self._store.remote is not None:
                kind = self._store.remote.resume_session(asdict(self._record))
            else:
                kind = self.resume_here()
            self._store.touch(self._record)
            return kind

    def settle_here(self) -> str | None:
        """How the session is paused, on the host that holds it, once what a pause or resume cut
        short (a killed process) left is settled (see ``_recover``)."""
        if self.paused or (self._home / f".{PAUSED}").exists():
            with self._kernel.locked():
                self._recover()
        return self.paused

    def interpreter_id(self) -> str | None:
        """The id of the session's running interpreter on this host (None: none runs); starts none."""
        kernel = self._kernel.running()
        return None if kernel is None else str(kernel.id)

    def resume_here(self) -> str:
        """``resume`` on the host that holds the session's workspace and interpreter."""
        with self._kernel.locked():
            self._recover()
            kind = self.paused
            if kind is None:
                raise SessionNotPaused(f"session {self.id} is running: there is nothing to resume")
            self._bring_back(self._home / PAUSED, kind)
            shutil.rmtree(self._home / PAUSED)
            return kind

    def snapshot(self, name: str = "", *, owner: str = "") -> SnapshotRecord:
        """Keep the session as it is now (see ``pause`` for what each kind keeps, with a copy of
        the workspace's files); it goes on running. ``Session.from_snapshot`` starts new sessions
        from it. ``owner``: who it counts against (the HTTP API's token)."""
        with self._kernel.locked():
            return self._snapshot(name, owner=owner, bring_back=True)

    def _snapshot(self, name: str, *, owner: str = "", bring_back: bool) -> SnapshotRecord:
        """``snapshot`` under the kernel's lock; ``bring_back=False`` leaves a memory-kind
        session's interpreter down (``fork`` restores it beside its children)."""
        if not isinstance(name, str) or len(name) > 128:
            raise InvalidArgument("a snapshot's name is a string of at most 128 characters")
        if self._store.remote is not None:  # kept where the session lives (a Ray node), made there
            self._check_open()
            self._kernel.forget()  # a memory-kind interpreter comes back there as a new sandbox
            made = self._store.remote.snapshot_session(asdict(self._record), name, owner, bring_back)
            return SnapshotRecord(**made)
        return self.snapshot_here(name, owner=owner, bring_back=bring_back)

    def snapshot_here(self, name: str, *, owner: str = "", bring_back: bool = True) -> SnapshotRecord:
        """``snapshot`` on the host that holds the session's workspace and interpreter."""
        with self._kernel.locked():
            self._live()
            snapshots = self._local_snapshots()
            snapshot_id = new_snapshot_id()
            staged = snapshots.staging(snapshot_id)
            staged.mkdir(mode=0o700)
            return self._commit_snapshot(snapshots, staged, snapshot_id, name, owner, bring_back)

    def _commit_snapshot(
        self, snapshots: SnapshotStore, staged: Path, snapshot_id: str, name: str, owner: str, bring_back: bool
    ) -> SnapshotRecord:
        try:
            kind, dropped = self._keep(staged, keep_running=True, bring_back=bring_back)
            record = self._record
            return snapshots.commit(
                SnapshotRecord(
                    snapshot_id,
                    self.id,
                    name,
                    kind,
                    time.time(),
                    0,
                    record.image,
                    record.limits,
                    record.quota_bytes,
                    self._record_owner(),
                    record.ttl_seconds,
                    dropped,
                    owner,
                )
            )
        except BaseException:
            self._unstage(staged)
            raise

    def _unstage(self, staged: Path) -> None:
        """Remove a snapshot that failed; an interpreter it had checkpointed (and nothing brought
        back) is restored from it first: the session never loses its memory to a failed snapshot."""
        memory = memory_backend(self._root.backend)
        checkpointed = staged / "memory"
        whole = memory is not None and checkpointed.is_dir() and memory.checkpoint_whole(checkpointed)
        if whole and self._kernel.running() is None:
            try:
                self._bring_back(staged, "memory")
            except Exception as exc:  # noqa: BLE001 - the snapshot's own error is the one raised
                log.warning("session %s: its interpreter did not come back after a failed snapshot: %s", self.id, exc)
        shutil.rmtree(staged, ignore_errors=True)

    @classmethod
    def snapshots(
        cls, session_id: str | None = None, *, root: SessionHost | None = None
    ) -> builtins.list[SnapshotRecord]:
        """The snapshots on this host (of one session when ``session_id`` is given)."""
        return (root or default_host()).snapshots.list(session_id)

    @classmethod
    def delete_snapshot(cls, snapshot_id: str, *, root: SessionHost | None = None) -> None:
        store = (root or default_host()).snapshots
        store.get(snapshot_id)  # SnapshotNotFound
        store.delete(snapshot_id)

    def _local_snapshots(self) -> SnapshotStore:
        snapshots = self._root.snapshots
        if not isinstance(snapshots, SnapshotStore):
            raise SandboxError("this backend keeps snapshots on other hosts")
        return snapshots

    def _restore_from(self, snap: SnapshotRecord) -> BaseException | None:
        """Bring this session's interpreter back from its fork's memory snapshot (nothing to do for
        another kind); what went wrong is returned, to be raised once the children are settled."""
        if snap.kind != "memory":
            return None
        try:
            if self._store.remote is not None:
                self._store.remote.restore_from_snapshot(asdict(self._record), snap.id)
            else:
                self.restore_here(snap.id)
        except Exception as exc:  # noqa: BLE001 - returned
            return SandboxError(
                f"the session's interpreter did not come back after the fork's snapshot ({exc}); "
                f"what it held is kept in snapshot {snap.id}: start it again with Session.from_snapshot({snap.id!r})"
            )
        except BaseException as exc:  # noqa: BLE001 - an interrupt: raised as it is, the snapshot kept
            return exc
        return None

    def start_here(self, snapshot_id: str, *, paused: bool = False) -> None:
        """A new session's workspace and interpreter from a snapshot on the host holding both;
        ``paused``: the interpreter not started but kept as an idle pause (``paused_here``)."""
        snapshots = self._local_snapshots()
        snap = snapshots.get(snapshot_id)
        on_host = self._root.backend.workspace_on_host(self.id, self._record.workspace)
        if on_host is None:
            raise SandboxError("this backend keeps workspaces on other hosts: start it where it lives")
        directory = snapshots.dir(snap.id)
        copy_files(directory / "files", on_host)
        with self._kernel.locked():
            if paused:
                self._paused_from(directory, snap)
            else:
                self._bring_back(directory, snap.kind)

    def _paused_from(self, directory: Path, snap: SnapshotRecord) -> None:
        """This new session paused for want of use with its own copy of what the snapshot keeps
        (its memory image or picklable state), as if it had run and the idle pause had come: no
        interpreter starts and no memory is held until its first call, which resumes it. A fork
        of many costs a copy each (no restore, no checkpoint). Under the kernel's lock."""
        staged = self._home / f".{PAUSED}"
        shutil.rmtree(staged, ignore_errors=True)
        staged.mkdir(mode=0o700)
        try:
            for name in ("memory", "state.pkl"):  # what ``_keep`` writes for each kind
                source = directory / name
                if source.is_dir():
                    shutil.copytree(source, staged / name, symlinks=True)
                elif source.is_file():
                    shutil.copy2(source, staged / name)
            (staged / "dropped.json").write_text(json.dumps(snap.dropped))
            (staged / "kind").write_text(snap.kind)
            (staged / IDLE_MARK).write_text(str(time.time()))
            os.rename(staged, self._home / PAUSED)
        except BaseException:
            shutil.rmtree(staged, ignore_errors=True)
            raise

    def restore_here(self, snapshot_id: str) -> None:
        """This session's interpreter back from its own memory snapshot (a fork's parent), on the
        host holding it."""
        with self._kernel.locked():
            self._bring_back(self._local_snapshots().dir(snapshot_id), "memory")

    def _keep(
        self, directory: Path, *, keep_running: bool, files_only: bool = False, bring_back: bool = True
    ) -> tuple[str, builtins.list[str]]:
        """Write what the session has into ``directory``: its memory or state, and (for a
        snapshot, ``keep_running``) a copy of its workspace's files; a checkpointed interpreter
        is restored unless ``bring_back`` is False. Under the kernel's lock."""
        on_host = self._root.backend.workspace_on_host(self.id, self._record.workspace)
        if on_host is None:
            raise SandboxError("this backend keeps workspaces on other hosts: pause it where it lives")
        # This process's terminals and connections end first: a program started beside the
        # interpreter holds the host's pipes, which no memory image can take along (gVisor's
        # restore failed on them).
        close_reach(self.id)
        kernel = self._kernel.running()
        dropped: builtins.list[str] = []
        memory = memory_backend(self._root.backend)
        if kernel is None or files_only:
            kind = "files"
            if kernel is not None and not keep_running:
                self._kernel.shutdown()
        elif memory is not None and memory.checkpoint_problem(kernel) is None:
            memory.checkpoint(kernel, directory / "memory")
            self._kernel.forget()
            kind = "memory"
        else:
            dropped = self._save_state(directory / "state.pkl", on_host)
            kind = "state"
            if not keep_running:
                self._kernel.shutdown()
        if keep_running:
            copy_files(on_host, directory / "files")
            if kind == "memory" and bring_back:
                self._bring_back(directory, "memory")
        return kind, dropped

    def _save_state(self, dest: Path, on_host: Path) -> builtins.list[str]:
        result = self._kernel.run(SAVE_STATE % f"{WORKSPACE}/{STATE_FILE}", 120, self.limits)
        if result.error is not None:
            with contextlib.suppress(OSError):
                (on_host / STATE_FILE).unlink()
            raise SandboxError(f"could not save the session's Python state: {result.error}")
        take_file(on_host / STATE_FILE, dest)  # the sandbox's file: never a link followed on the host
        try:
            dropped = json.loads(result.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            dropped = None
        if not isinstance(dropped, builtins.list) or not all(isinstance(n, str) for n in dropped):
            raise SandboxError("the interpreter did not say which names it could not keep (was print replaced?)")
        return dropped

    def _bring_back(self, directory: Path, kind: str) -> None:
        """Start this session's interpreter from what ``_keep`` wrote (under the kernel's lock)."""
        if kind == "memory":
            memory = memory_backend(self._root.backend)
            if memory is None:
                raise SandboxError("this backend cannot restore a memory snapshot")
            self._kernel.adopt(
                memory.restore(self._spec(kernel=True), directory / "memory", lifetime_seconds=self._record.ttl_seconds)
            )
        elif kind == "state":
            on_host = self._root.backend.workspace_on_host(self.id, self._record.workspace)
            if on_host is None:
                raise SandboxError("this backend keeps workspaces on other hosts")
            uid, gid = (int(x) for x in self._record_owner().split(":"))
            place_file(directory / "state.pkl", on_host / STATE_FILE, uid, gid)
        else:
            return
        cell = LOAD_STATE % f"{WORKSPACE}/{STATE_FILE}" if kind == "state" else "None"
        result = self._kernel.run(cell, 120, self.limits)  # the first cell: the interpreter is back
        if result.error is not None or result.interpreter_restarted:
            raise SandboxError(f"the session's interpreter did not come back: {result.error or result.stderr[-500:]}")

    def _record_owner(self) -> str:
        user = str(self.limits.user)
        return user if ":" in user else f"{user}:{user}"

    def _recover(self) -> None:
        """A pause cut short by a killed process: promote a whole memory checkpoint whose
        interpreter is gone (else the session would lose it), drop anything else half-made."""
        if self._store.remote is not None:
            return  # where it lives, as part of each call there
        staged = self._home / f".{PAUSED}"
        if staged.exists():
            memory = memory_backend(self._root.backend)
            whole = memory is not None and (staged / "memory").is_dir() and memory.checkpoint_whole(staged / "memory")
            if whole and self._kernel.running() is None:
                (staged / "kind").write_text("memory")
                os.rename(staged, self._home / PAUSED)
            else:
                shutil.rmtree(staged, ignore_errors=True)
        # A resume cut short after its interpreter started: a restored one (its holder restores on)
        # is the session, running; a fresh one whose state was not loaded yet goes, to be resumed again.
        kind = self.paused
        if kind and self._kernel.running() is not None:
            if kind == "memory":
                shutil.rmtree(self._home / PAUSED, ignore_errors=True)
            else:
                self._kernel.shutdown()

"""``Session``: one sandbox identity whose ``/workspace`` persists across runs, with a stateful
Python interpreter and a file API.

    with Session(ttl=3600) as s:
        s.write_file("data.csv", "x,y\\n1,2\\n")
        s.run_cell("import pandas as pd; df = pd.read_csv('data.csv')")
        print(s.run_cell("df.y.sum()").value)

Each ``run`` is a fresh single-use sandbox (warm-pooled) with the workspace mounted; ``run_cell``
goes to the session's long-lived interpreter. File operations run inside a sandbox too, so a
symlink made by code in the workspace can never reach a host file. ``with`` deletes the session
at the end; ``Session.create()`` + ``Session.attach(id)`` keep it across processes until
``delete()`` or until it has been idle for ``ttl`` seconds.
"""

from __future__ import annotations

import builtins
import concurrent.futures
import json
import logging
import math
import threading
from collections.abc import Callable, Mapping
from dataclasses import asdict, replace
from typing import Any

from sandloop.contract import (
    CellResult,
    CodeContext,
    ContextNotFound,
    ExecutionResult,
    InvalidArgument,
    Output,
    SandboxError,
    SandboxLimits,
    SessionPaused,
    parse_size,
)
from sandloop.contract.egress import Secret
from sandloop.requests import build_request, check_secrets, check_timeout
from sandloop.runtime.base import Sandbox, SandboxSpec
from sandloop.sessions.host import SessionHost, default_host
from sandloop.sessions.kernel import Kernel, interpreter_spec, lock_file
from sandloop.sessions.session_files import SessionFiles
from sandloop.sessions.session_reach import SessionReach, close_reach
from sandloop.sessions.session_snapshots import SessionSnapshots
from sandloop.sessions.snapshots import PAUSED, ClusterSnapshots, SnapshotRecord, validate_count
from sandloop.sessions.store import SESSION_LABEL, WORKSPACE, SessionRecord
from sandloop.sessions.watch import Watcher

MAX_TTL_SECONDS = 30 * 86400
#: What ``language=`` of a cell or a context may say, and the interpreter it names.
CONTEXT_LANGUAGES = {
    "python": "python",
    "python3": "python",
    "py": "python",
    "javascript": "javascript",
    "js": "javascript",
    "node": "javascript",
    "typescript": "typescript",
    "ts": "typescript",
    "bash": "bash",
    "sh": "bash",
    "shell": "bash",
}
MIN_QUOTA_BYTES, MAX_QUOTA_BYTES = 8 * 1024**2, 64 * 1024**3
DEFAULT_QUOTA = "256m"

log = logging.getLogger(__name__)


class Session(SessionFiles, SessionSnapshots, SessionReach):
    """A persistent workspace plus a stateful interpreter. See the module docstring."""

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        ttl: float = 3600,
        quota: str | int = DEFAULT_QUOTA,
        *,
        root: SessionHost | None = None,
        template: str | None = None,
        _record: SessionRecord | None = None,
    ) -> None:
        created_here = _record is None
        warm: Sandbox | None = None
        self._root = root or default_host()
        self._dispatcher = self._root.dispatcher
        self._store = self._root.sessions
        if _record is None:
            limits = limits or SandboxLimits()
            if not isinstance(limits, SandboxLimits):
                raise InvalidArgument("limits must be a SandboxLimits")
            if (
                isinstance(ttl, bool)
                or not isinstance(ttl, int | float)
                or not math.isfinite(ttl)
                or not 1 <= ttl <= MAX_TTL_SECONDS
            ):
                raise InvalidArgument(f"ttl must be between 1 second and 30 days, got {ttl!r}")
            try:
                quota_bytes = parse_size(quota)
            except ValueError as exc:
                raise InvalidArgument(str(exc)) from None
            if not MIN_QUOTA_BYTES <= quota_bytes <= MAX_QUOTA_BYTES:
                raise InvalidArgument(f"quota must be between 8m and 64g, got {quota!r}")
            self._store.reap_expired()
            owner = limits.user if ":" in limits.user else f"{limits.user}:{limits.user}"
            image = self._root.image_for(template)  # TemplateNotFound before anything is made
            # Warm sessions run the runtime image: one from a template starts cold.
            reserve = self._root.reserves.take(limits, quota_bytes, owner) if template is None else None
            if reserve is not None:  # a warm one: its interpreter is started, pandas imported
                _record = self._store.claim(reserve.record, float(ttl))
                warm = reserve.sandbox
            else:
                _record = self._store.create(
                    ttl_seconds=float(ttl),
                    quota_bytes=quota_bytes,
                    image=image,
                    limits=limits.model_dump(),
                    owner_uid_gid=owner,
                )
        self._record = _record
        self.limits = SandboxLimits(**_record.limits)
        self._closed = False
        self._watchers: builtins.list[Watcher] = []
        self._watch_lock = threading.Lock()
        #: ``with`` releases what this call acquired: a session made here is deleted at the end
        #: of a ``with``; one attached to is only closed (it lives on for others).
        self._created_here = created_here
        #: Where the default contexts start when this handle starts them (None: the workspace);
        #: the E2B API sets /home/user, E2B's own default.
        self.default_cwd: str | None = None
        self._kernel = Kernel(
            self._root.backend,
            self._spec(kernel=True),
            self.id,
            lock_file(self._store.root / self.id),
            lifetime=_record.ttl_seconds,
        )
        if warm is not None:
            self._kernel.adopt(warm)
        if template is not None and created_here and self._root.templates.seeds_home(_record.image):
            try:
                self._seed_home()
            except BaseException:
                self.delete()
                raise

    # -- identity -------------------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        limits: SandboxLimits | None = None,
        ttl: float = 3600,
        quota: str | int = DEFAULT_QUOTA,
        *,
        root: SessionHost | None = None,
        template: str | None = None,
    ) -> Session:
        """A new session; ``template`` ("name[:tag]") starts its sandboxes from a template."""
        return cls(limits, ttl, quota, root=root, template=template)

    @classmethod
    def attach(cls, session_id: str, *, root: SessionHost | None = None, resume: bool = True) -> Session:
        """Reattach to a live session by id (from any process on this host). A paused session
        resumes (unless ``resume=False``: then its calls raise ``SessionPaused`` until ``resume()``)."""
        root = root or default_host()
        record = root.sessions.load(session_id)
        root.sessions.ensure_workspace(record)
        root.sessions.touch(record)
        session = cls(root=root, _record=record)
        # Only a session paused (or one whose pause was cut short) needs the kernel's lock here:
        # taking it on every attach would wait for whatever cell another caller is running.
        if session.paused or (session._home / f".{PAUSED}").exists():
            with session._kernel.locked():
                session._recover()
                if resume and session.paused:  # attaching is using it: a paused session resumes
                    session.resume()
        return session

    @classmethod
    def list(cls, *, root: SessionHost | None = None) -> list[SessionRecord]:
        return (root or default_host()).sessions.list()

    @property
    def id(self) -> str:
        return self._record.id

    @property
    def record(self) -> SessionRecord:
        return self._record

    def _spec(self, kernel: bool = False) -> SandboxSpec:
        return interpreter_spec(self._record, kernel=kernel)

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError(
                f"session {self.id} is closed in this process; Session.attach({self.id!r}) to use it again"
            )

    def _live(self) -> None:
        self._check_open()
        self._not_paused()
        self._store.touch(self._record)

    def _not_paused(self) -> None:
        # A session on another host (Ray): its node refuses a paused session's sandboxes, with no
        # call here for every cell to ask.
        if self._store.remote is None and self.paused:
            if self.paused_for_idleness:  # paused for want of use, not by a caller: its use resumes it
                with self._kernel.locked():
                    if self.paused:
                        self.resume_here()
                return
            raise SessionPaused(f"session {self.id} is paused: resume it (resume(), or Session.attach) to use it")

    # -- running --------------------------------------------------------------------------------
    def run(
        self,
        code: str | bytes,
        language: str = "python",
        timeout_seconds: float = 30,
        *,
        stdin: str | bytes | None = None,
        limits: SandboxLimits | None = None,
        secrets: Mapping[str, Secret] | None = None,
        on_output: Callable[[str, bytes], None] | None = None,
    ) -> ExecutionResult:
        """Run code in a fresh process with the workspace as its working directory
        (``on_output("stdout" | "stderr", data)`` sees output as it arrives)."""
        self._live()
        request = build_request(
            code,
            language,
            timeout_seconds,
            limits=limits or self.limits,
            stdin=stdin,
            image=self._record.image,
            secrets=secrets,
            on_output=on_output,
        )
        spec = self._spec()
        request = replace(request, image=spec.image, cwd=WORKSPACE, volumes=spec.volumes, labels=spec.labels)
        return self._dispatcher.run(request, pool_size=1)

    def run_cell(
        self,
        code: str,
        timeout_seconds: float = 30,
        *,
        secrets: Mapping[str, Secret] | None = None,
        on_output: Callable[[str, bytes], None] | None = None,
        cancel: threading.Event | None = None,
        output_limit: int | None = None,
        detach: bool = False,
        context: str | CodeContext | None = None,
        language: str | None = None,
        env: Mapping[str, str] | None = None,
        on_display: Callable[[Output], None] | None = None,
    ) -> CellResult:
        """Run a cell in one of the session's interpreters, with IPython's semantics for Python
        (``!cmd``, ``%magic``, ``display()``, rich outputs in ``result.outputs``): state persists
        between cells of a context. ``context`` (an id or a ``CodeContext``) picks one made by
        ``create_context``; else ``language`` (python, javascript, typescript, bash) picks that
        language's default context. ``env`` is set for this cell only. ``on_display(output)``
        sees each output as the cell displays it (``result.outputs`` has them all at the end).
        ``secrets`` as for ``run_code``: their placeholders are set for this cell only.
        ``on_output("stdout" | "stderr", data)`` sees output as it arrives; setting ``cancel``
        interrupts the cell (as its timeout would); ``output_limit`` replaces the session's
        (bytes of stdout and of stderr kept); ``detach`` lets go of the interpreter's stream after
        the cell (a long-lived holder of this Session, like a server, should: an idle stream would
        also receive other processes' cells)."""
        self._live()
        if not isinstance(code, str):
            raise InvalidArgument("a cell must be a string of code")
        options = self._cell_options(context, language, env)
        checked = check_secrets(secrets or {}, self.limits)
        relay = _relay(on_output, on_display)
        limits = self.limits
        if output_limit is not None:
            try:
                limits = SandboxLimits(**{**limits.model_dump(), "output_limit": output_limit})
            except SandboxError as exc:
                raise InvalidArgument(str(exc)) from None
        result = self._kernel.run(
            code, check_timeout(timeout_seconds), limits, checked, relay, cancel, detach, options, self._not_paused
        )
        if result.error is not None and result.reply.get("refused"):
            self._op_reply(result, "a cell")
        return result

    def _cell_options(
        self, context: str | CodeContext | None, language: str | None, env: Mapping[str, str] | None
    ) -> dict[str, Any]:
        options: dict[str, Any] = {"default_cwd": self.default_cwd} if self.default_cwd else {}
        if context is not None:
            cid = context.id if isinstance(context, CodeContext) else context
            if not isinstance(cid, str) or not cid or len(cid) > 64:
                raise InvalidArgument(f"context must be a context id, got {context!r}")
            options["context"] = cid
        if language is not None:
            if not isinstance(language, str) or language.strip().lower() not in CONTEXT_LANGUAGES:
                known = ", ".join(sorted(set(CONTEXT_LANGUAGES.values())))
                raise InvalidArgument(f"language {language!r} has no interpreter; use one of: {known}")
            options["language"] = CONTEXT_LANGUAGES[language.strip().lower()]
        if env:
            if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
                raise InvalidArgument("env must map names to strings")
            options["env"] = dict(env)
        return options

    # -- contexts -------------------------------------------------------------------------------
    def create_context(self, language: str = "python", cwd: str | None = None) -> CodeContext:
        """A new independent interpreter in this session's sandbox (``cwd`` defaults to the
        workspace). Its state is its own; files are shared."""
        if cwd is not None and (not isinstance(cwd, str) or not cwd.startswith("/")):
            raise InvalidArgument(f"cwd must be an absolute path inside the sandbox, got {cwd!r}")
        reply = self._context_op("create", "creating a context", language=language, cwd=cwd)
        return CodeContext(**reply["context"])

    def list_contexts(self) -> builtins.list[CodeContext]:
        """The session's contexts: the default Python and JavaScript ones, then those created."""
        return [CodeContext(**c) for c in self._context_op("list", "listing contexts")["contexts"]]

    def restart_context(self, context: str | CodeContext) -> CodeContext:
        """Replace a context's interpreter by a fresh one (its variables are gone)."""
        return CodeContext(**self._context_op("restart", "restarting a context", context=context)["context"])

    def remove_context(self, context: str | CodeContext) -> None:
        """End a context. A default one comes back, fresh, when next used."""
        self._context_op("remove", "removing a context", context=context)

    def _context_op(
        self,
        op: str,
        what: str,
        *,
        context: str | CodeContext | None = None,
        language: str | None = None,
        cwd: str | None = None,
    ) -> dict[str, Any]:
        """One operation on the interpreter's contexts (kernel.py's ``op`` frames): its reply."""
        self._live()
        options = {"op": op, "cwd": cwd, **self._cell_options(context, language, None)}
        reply = self._kernel.run("", 30, self.limits, None, None, None, False, options, self._not_paused)
        return self._op_reply(reply, what)

    def _op_reply(self, result: CellResult, op: str) -> dict[str, Any]:
        if result.error is not None:
            if result.error.name == "ContextNotFound":
                raise ContextNotFound(f"{result.error.value}; list them with Session.list_contexts()")
            if result.error.name in ("InvalidArgument", "UnknownLanguage", "TooManyContexts"):
                raise InvalidArgument(result.error.value)
            raise SandboxError(f"{op} failed: {result.error.value}")
        if result.timed_out or result.sandbox_replaced:
            raise SandboxError(f"{op} failed: the session's interpreter did not answer")
        return result.reply

    def _seed_home(self) -> None:
        """The template's /home/user files into the new workspace, which is mounted over
        /home/user in every sandbox of the session: copied inside a sandbox that has the workspace
        at /workspace only (the template's own /home/user visible), as the session's user."""
        spec = self._spec()
        limits = self.limits.model_copy(update={"egress": (), "output_limit": 64 * 1024})
        copy = (  # each entry (not the folder itself: the workspace's root is not the sandbox user's to chmod)
            "find /home/user -mindepth 1 -maxdepth 1 -exec cp -R --preserve=mode,timestamps,links -t /workspace/ {} +"
        )
        request = build_request(copy, "bash", 300, limits=limits, image=self._record.image)
        volumes = tuple(v for v in spec.volumes if v[1] == WORKSPACE)
        request = replace(request, image=spec.image, cwd="/tmp", volumes=volumes, labels=spec.labels)
        result = self._dispatcher.run(request, pool_size=0)
        if result.exit_code != 0:
            raise SandboxError(
                f"could not copy the template's /home/user into the new session's workspace "
                f"(exit {result.exit_code}): {(result.stderr or result.stdout)[-500:]}; make its files readable "
                "by the sandbox's user (uid 65534), or fit them within the session's quota"
            )

    # -- new sessions from this one, or from a snapshot (session_snapshots.py) ------------------
    def fork(self, count: int = 1, *, paused: bool = False) -> builtins.list[Session]:
        """``count`` new sessions, each starting as this one is now, with its own copy of the
        workspace (and of the memory, where it is kept): what one changes, no other sees. Where
        the memory is kept, this session's own restore runs beside its children's (each is
        mostly waiting on runsc: one after the other took 4.9 s for a fork of one).
        ``paused``: the children are made paused for want of use (each its own copy of the
        memory image or state, nothing started: no memory held, no restore now); each resumes
        at its first call, as after an idle pause. Branching a state many ways for rollouts that
        run later costs a copy each instead of a restore each."""
        validate_count(count)
        if not isinstance(paused, bool):
            raise InvalidArgument(f"paused must be true or false, got {paused!r}")
        with self._kernel.locked():
            snap = self._snapshot(f"fork of {self.id}", bring_back=False)
            parent: BaseException | None = None
            try:
                with concurrent.futures.ThreadPoolExecutor(max_workers=min(count, 4)) as pool:
                    futures = [
                        pool.submit(Session.from_snapshot, snap.id, root=self._root, paused=paused)
                        for _ in range(count)
                    ]
                    parent = self._restore_from(snap)
                    concurrent.futures.wait(futures)
                made = [f.result() for f in futures if f.exception() is None]
                failed = [f.exception() for f in futures if f.exception() is not None]
                if parent is not None or failed:  # all or none: the ones that started go again
                    for child in made:
                        child.delete()
                    raise parent or failed[0]  # type: ignore[misc]
                return made
            finally:
                if parent is None:  # else the snapshot holds this session's memory: never removed with it
                    self._root.snapshots.delete(snap.id)

    @classmethod
    def from_snapshot(
        cls,
        snapshot: str | SnapshotRecord,
        *,
        ttl: float | None = None,
        root: SessionHost | None = None,
        paused: bool = False,
    ) -> Session:
        """A new session started from a snapshot (its workspace a copy of the snapshot's);
        ``paused``: made paused for want of use, resumed at its first call (see ``fork``)."""
        root = root or default_host()
        if paused and root.sessions.remote is not None:
            raise InvalidArgument("paused=True makes sessions on this host only, not on a cluster's nodes")
        snapshots = root.snapshots
        snapshot_id = snapshot.id if isinstance(snapshot, SnapshotRecord) else snapshot
        # on a cluster, where the snapshot is kept (its memory image and files), found with its record
        place, snap = (
            snapshots.locate(snapshot_id)
            if isinstance(snapshots, ClusterSnapshots)
            else (None, snapshots.get(snapshot_id))
        )
        record = root.sessions.create(
            ttl_seconds=float(ttl if ttl is not None else snap.ttl_seconds),
            quota_bytes=snap.quota_bytes,
            image=snap.image,
            limits=snap.limits,
            owner_uid_gid=snap.owner_uid_gid,
            place=place,
        )
        session = cls(root=root, _record=record)
        session._created_here = True
        try:
            if root.sessions.remote is not None:
                root.sessions.remote.start_from_snapshot(asdict(record), snap.id)
            else:
                session.start_here(snap.id, paused=paused)
        except BaseException:
            session.delete()
            raise
        return session

    # -- end ---------------------------------------------------------------------------------------
    def close(self) -> None:
        """Release this process's hold; the session lives on for ``attach``."""
        if not self._closed:
            with self._watch_lock:
                watchers, self._watchers = self._watchers, []
            for watcher in watchers:  # each holds the workspace open: before any unmount
                watcher.close()
            self._kernel.close()
            self._dispatcher.drop_pools(lambda spec: (SESSION_LABEL, self.id) in spec.labels)
            self._closed = True

    def let_go(self) -> None:
        """Release only this handle's hold on the interpreter (a node's handle for one call from
        a driver): the session's pooled sandboxes stay for its next runs."""
        self._kernel.close()
        self._closed = True

    def delete(self) -> None:
        """Remove the session: its interpreter, containers, workspace and record."""
        close_reach(self.id)  # this process's terminals and connections into it (else they end with it)
        self.close()
        self._kernel.shutdown()
        self._store.delete(self.id)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._created_here:
            self.delete()
        else:
            self.close()

    def __repr__(self) -> str:
        return f"Session({self.id!r})"


def _relay(
    on_output: Callable[[str, bytes], None] | None, on_display: Callable[[Output], None] | None
) -> Callable[[str, bytes], None] | None:
    """The interpreter's stream of ``stdout``, ``stderr`` and ``display`` pieces (an output's
    JSON, runtime/protocol.py), split between the two callbacks."""
    if on_output is None and on_display is None:
        return None

    def relay(kind: str, data: bytes) -> None:
        if kind == "display":
            if on_display is not None:
                on_display(Output(**json.loads(data)))
        elif on_output is not None:
            on_output(kind, data)

    return relay

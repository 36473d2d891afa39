"""``Sandloop``: the one object that owns a backend, its dispatcher (warm pool, admission), the
session store and the settings. Everything else is handed one; nothing else reads the environment
or builds a backend.

    from sandloop import Sandloop, Settings

    with Sandloop() as sl:                                  # settings from SANDLOOP_* variables
        print(sl.run_code("print(6 * 7)").stdout)
        with sl.create_session(quota="64m") as s:           # deleted at the end of the `with`
            s.run_cell("x = 1")

    Sandloop(Settings(pool_size=0, backend="fake"))         # no warm pool; the test double

``sandloop.run_code`` is a convenience over a default instance built on first use (as
``httpx.get`` is over a ``Client``); ``with`` closes what the instance holds (warm sandboxes).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from sandloop.backends import build_backend
from sandloop.contract import ExecutionResult, SandboxLimits
from sandloop.contract.egress import Secret
from sandloop.images.templates import Templates
from sandloop.pool.dispatcher import Dispatcher
from sandloop.pool.reaper import Reaped, reap
from sandloop.requests import build_request
from sandloop.runtime.base import BackendInfo, FullBackend, RemoteSessions
from sandloop.sessions.host import provide_default
from sandloop.sessions.idle import IdlePauser
from sandloop.sessions.reserve import Reserves
from sandloop.sessions.snapshots import ClusterSnapshots, SnapshotStore
from sandloop.sessions.store import SessionRecord, SessionStore
from sandloop.settings import Settings

if TYPE_CHECKING:
    from sandloop.sessions.session import Session


@dataclass(frozen=True)
class ReapReport:
    """What ``Sandloop.reap`` removed (or would remove, with ``dry_run``)."""

    items: list[Reaped] = field(default_factory=list)
    expired_sessions: list[str] = field(default_factory=list)

    @property
    def removed(self) -> list[Reaped]:
        return [i for i in self.items if not i.error]

    @property
    def unremovable(self) -> list[Reaped]:
        """What the backend refused to remove (see ``pool.reaper.STUCK_ADVICE``)."""
        return [i for i in self.items if i.error]


class Sandloop:
    def __init__(
        self, settings: Settings | None = None, *, backend: FullBackend | None = None, records_elsewhere: bool = False
    ) -> None:
        """``records_elsewhere``: a cluster node's (``node_root``): its sessions' records are the
        cluster's, kept and expired by the drivers (``SessionStore``)."""
        self.settings = settings or Settings()
        self.backend: FullBackend = backend or build_backend(self.settings, node_root)
        self.dispatcher = Dispatcher(self.backend, self.settings)
        self.sessions = SessionStore(
            self.backend,
            self.settings.home,
            paused_retention=self.settings.paused_retention_seconds,
            records_elsewhere=records_elsewhere,
        )
        #: Sessions' snapshots (``sessions/snapshots.py``): this host's, or the nodes' of a cluster.
        self.snapshots: SnapshotStore | ClusterSnapshots = (
            ClusterSnapshots(self.backend)
            if isinstance(self.backend, RemoteSessions)
            else SnapshotStore(self.settings.home)
        )
        #: The runtime image sandboxes start from.
        self.image = self.settings.runtime_image()
        #: Warm sessions (``Settings.session_pool_size``), in the dispatcher's pools.
        self.reserves = Reserves(
            self.backend, self.dispatcher, self.sessions, self.image, self.settings.session_pool_size
        )
        #: Templates: images built on the runtime image (``images/templates/``).
        self.templates = Templates(
            self.backend.image_builder, self.image, self._sessions_using, lambda: self.dispatcher.quiesce(30)
        )
        #: Idle sessions paused to disk (``Settings.session_idle_pause_seconds``; 0: never).
        self.idle = IdlePauser(self, self.settings.session_idle_pause_seconds)
        self.idle.start()
        self._closed = False

    # -- runs -----------------------------------------------------------------------------------
    def run_code(
        self,
        code: str | bytes,
        language: str = "python",
        timeout_seconds: float = 30,
        *,
        limits: SandboxLimits | None = None,
        stdin: str | bytes | None = None,
        on_output: Callable[[str, bytes], None] | None = None,
        secrets: Mapping[str, Secret] | None = None,
        template: str | None = None,
    ) -> ExecutionResult:
        """Run ``code`` once in a fresh, hardened, throwaway sandbox (see ``sandloop.run_code``);
        ``template`` ("name[:tag]") starts it from a template instead of the runtime image."""
        request = build_request(
            code,
            language,
            timeout_seconds,
            limits=limits,
            stdin=stdin,
            on_output=on_output,
            image=self.image_for(template),
            secrets=secrets,
        )
        return self.dispatcher.run(request)

    def image_for(self, template: str | None) -> str:
        """The image a sandbox of ``template`` starts from (the runtime image for None)."""
        return self.image if template is None else self.templates.image_for(template)

    def _sessions_using(self, image_id: str) -> list[str]:
        return [r.id for r in self.sessions.list() if r.image == image_id]

    # -- sessions -------------------------------------------------------------------------------
    def create_session(
        self,
        limits: SandboxLimits | None = None,
        ttl: float = 3600,
        quota: str | int = "256m",
        *,
        template: str | None = None,
    ) -> Session:
        """A new session (from ``template``, else the runtime image); ``with`` deletes it at the end."""
        from sandloop.sessions.session import Session

        return Session.create(limits, ttl, quota, root=self, template=template)

    def attach_session(self, session_id: str, *, resume: bool = True) -> Session:
        """A live session by id; ``with`` only detaches at the end (see ``Session.attach``)."""
        from sandloop.sessions.session import Session

        return Session.attach(session_id, root=self, resume=resume)

    def delete_session(self, session_id: str) -> None:
        """Remove a session: its interpreter, sandboxes, workspace and record; also one whose
        record is damaged (``SessionDamaged`` on attach)."""
        from sandloop.contract import SessionDamaged

        try:
            session = self.attach_session(session_id, resume=False)
        except SessionDamaged:
            self.sessions.delete(session_id)
            return
        session.delete()

    def list_sessions(self) -> list[SessionRecord]:
        return self.sessions.list()

    def session_here(self, record: dict[str, Any]) -> Session:
        """A handle on a session this host holds whose record another keeps (a cluster node's
        session, its record sent by the driver): for the calls that run where the session is."""
        from sandloop.sessions.session import Session

        self.sessions.here(record["id"])  # its directory here (the interpreter's lock, a pause's state)
        return Session(root=self, _record=SessionRecord(**record))

    # -- upkeep ---------------------------------------------------------------------------------
    def reap(self, *, dry_run: bool = False) -> ReapReport:
        """Remove stale sandboxes and workspaces (expired, or their owner process died) and
        sessions idle past their TTL."""
        expired = [] if dry_run else self.sessions.reap_expired()
        if not dry_run:  # snapshots past their retention, and what a killed snapshot left half-made
            self.snapshots.expire(self.settings.snapshot_retention_seconds)
            self.snapshots.sweep()
        return ReapReport(reap(self.backend, dry_run=dry_run), expired)

    def info(self) -> BackendInfo:
        return self.backend.info()

    def close(self) -> None:
        """Remove warm sandboxes and pending removals; close the engine connection. Idempotent."""
        if not self._closed:
            self._closed = True
            self.idle.close()
            self.dispatcher.close()
            self.backend.close()

    def __enter__(self) -> Sandloop:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def node_root(overrides: dict[str, Any]) -> Sandloop:
    """What a cluster node runs its sandboxes with (the Ray backend's actor on each node): a local
    ``Sandloop`` from the node's own ``SANDLOOP_*`` environment and the driver's ``overrides``."""
    return Sandloop(Settings(**overrides), records_elsewhere=True)


# -- the process-wide default, built on first use (``sandloop.run_code``, ``Session()``) ----------
_lock = threading.Lock()
_root: Sandloop | None = None


def default_root() -> Sandloop:
    """The process-wide ``Sandloop``, built on first use from ``SANDLOOP_*`` settings
    (``SANDLOOP_POOL_SIZE=0`` disables the warm pool)."""
    global _root
    with _lock:
        if _root is None:
            _root = Sandloop()
        return _root


provide_default(default_root)  # what a Session made without root= lives in (sessions/host.py)


def default_dispatcher() -> Dispatcher:
    return default_root().dispatcher


def use_root(root: Sandloop | None) -> Sandloop | None:
    """Make ``root`` the process-wide one without closing the previous, which is returned."""
    global _root
    with _lock:
        old, _root = _root, root
    return old


def shutdown() -> None:
    """Close the process-wide root, if any: its warm sandboxes are removed now rather than left
    for the reaper. A long-running front end calls this when it stops."""
    old = use_root(None)
    if old is not None:
        old.close()


def configure(settings: Settings | None = None, backend: FullBackend | None = None) -> Sandloop:
    """Replace the process-wide root (closing the old one): other settings or another backend."""
    new = Sandloop(settings, backend=backend)
    old = use_root(new)
    if old is not None:
        old.close()
    return new

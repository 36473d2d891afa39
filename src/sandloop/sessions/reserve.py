"""Warm sessions: a session's first cell at the speed of a later one (issue 22).

A cold session pays for its interpreter's start (the container, Python, IPython) and then for
its first ``import pandas``: about a second together. A *reserve* is a whole session made ahead
of time, off the caller's path: its record, its workspace, and its interpreter started with
numpy, pandas and matplotlib's pyplot imported (``--kernel --preload=...``; every context forks
from a supervisor that holds them). ``Session.create`` takes one whose limits, quota and image
are the ones asked for, and claims it: the record becomes an ordinary session's, with the
caller's TTL, and the interpreter is the session's from its first cell. Single-use, like the run
pool: a reserve serves exactly one session, and nothing of it existed before its session did
but the imports.

The pools are the dispatcher's (``pool/warm.py``: refills under the admission control's creation
bound, idle expiry, closing at shutdown); this module is what makes and removes their members
(``ReserveMaker``: the ``PoolBackend`` of one key). A reserve's record says ``reserved_by`` (the
owner id of the process keeping it): nobody lists it or attaches to it, and the session reaper
removes it once that process is gone (``SessionStore.reap_expired``). Sessions with an egress
allowlist are never reserved (their proxy is set up with their secrets), nor are sessions whose
memory cannot hold the imports (below ``MIN_MEMORY``; ``MIN_MEMORY_RUNSC`` under gVisor), nor
sessions on a backend whose nodes run their own sandboxes (Ray).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sandloop.contract import SandboxError, SandboxLimits
from sandloop.pool.warm import WarmPool
from sandloop.runtime.base import FullBackend, Sandbox, SandboxSpec
from sandloop.runtime.labels import LABEL_PREFIX, owner_id
from sandloop.sessions.kernel import interpreter_spec, kernel_command
from sandloop.sessions.store import SessionRecord

if TYPE_CHECKING:
    from sandloop.pool.dispatcher import Dispatcher
    from sandloop.sessions.store import SessionStore

log = logging.getLogger(__name__)

#: What a reserve's interpreter imports while it waits.
PRELOAD = ("numpy", "pandas", "matplotlib.pyplot")
#: Below this memory limit a session is not reserved: a warm runc interpreter holds ~100 MiB
#: (docs/benchmarks.md), and its contexts need room besides.
MIN_MEMORY = 256 * 1024 * 1024
#: gVisor counts the libraries' file pages as the sandbox's own memory: a warm runsc session holds
#: ~200 MiB before its first cell, and each further context ~30 MiB (measured here).
MIN_MEMORY_RUNSC = 512 * 1024 * 1024
#: A reserve's record outlives the pool's idle time by this (the pool replaces it before).
RECORD_MARGIN_SECONDS = 120
#: After this many failed starts in a row, a key gets no reserves (e.g. an image without pandas).
MAX_FAILURES = 3


@dataclass(eq=False)
class Reserve:
    """A warm session: its record and its started interpreter."""

    record: SessionRecord
    sandbox: Sandbox

    @property
    def id(self) -> str:  # the interpreter's: what the pool lists (a leak check's pooled ids)
        return self.sandbox.id

    @property
    def started_at(self) -> float:
        return self.sandbox.started_at


@dataclass(frozen=True)
class ReserveKey:
    image: str
    limits: SandboxLimits
    quota_bytes: int
    owner_uid_gid: str

    @property
    def spec(self) -> SandboxSpec:
        """The pool's key: the interpreter's spec, less what is a session's own."""
        return SandboxSpec(
            self.image,
            self.limits,
            labels=(
                (f"{LABEL_PREFIX}purpose", "reserve"),
                (f"{LABEL_PREFIX}quota", str(self.quota_bytes)),
                (f"{LABEL_PREFIX}workspace-owner", self.owner_uid_gid),
            ),
            command=kernel_command(PRELOAD),
        )


class ReserveMaker:
    """The ``PoolBackend`` of one key's reserves."""

    def __init__(self, key: ReserveKey, reserves: Reserves) -> None:
        self.key = key
        self.reserves = reserves

    def launch(self, spec: SandboxSpec, *, purpose: str, lifetime_seconds: float) -> Reserve:
        store, backend = self.reserves.store, self.reserves.backend
        record = store.create(
            ttl_seconds=lifetime_seconds + RECORD_MARGIN_SECONDS,
            quota_bytes=self.key.quota_bytes,
            image=self.key.image,
            limits=self.key.limits.model_dump(),
            owner_uid_gid=self.key.owner_uid_gid,
            reserved_by=owner_id(),
        )
        sandbox: Sandbox | None = None
        try:
            sandbox = backend.launch(
                interpreter_spec(record, preload=PRELOAD), purpose="kernel", lifetime_seconds=record.ttl_seconds
            )
            # The supervisor answers once its imports are done and its default context has paid
            # its first cell's one-time costs: then the reserve is warm.
            reply = backend.run_cell(
                sandbox, "", limits=self.key.limits, interrupt_after=120, grace=3, options={"op": "warm"}
            )
            if reply.error is not None or reply.timed_out or reply.sandbox_replaced or "contexts" not in reply.reply:
                raise SandboxError(f"a warm session's interpreter did not start: {reply.stderr.strip()[-300:]}")
        except BaseException:
            if sandbox is not None:
                backend.destroy(sandbox)
            store.delete(record.id)
            self.reserves.failed(self.key)
            raise
        self.reserves.started(self.key)
        return Reserve(record, sandbox)

    def is_alive(self, reserve: Sandbox) -> bool:
        assert isinstance(reserve, Reserve)
        return self.reserves.backend.is_alive(reserve.sandbox)

    def destroy(self, reserve: Sandbox) -> None:
        assert isinstance(reserve, Reserve)
        self.reserves.backend.destroy(reserve.sandbox)
        self.reserves.store.delete(reserve.record.id)


class Reserves:
    """A root's warm sessions, by key, ``pool_size`` of each (``Settings.session_pool_size``), in
    its dispatcher's pools; each a session record in ``store`` with its interpreter on ``backend``,
    started from ``image``."""

    def __init__(
        self, backend: FullBackend, dispatcher: Dispatcher, store: SessionStore, image: str, pool_size: int
    ) -> None:
        self.backend = backend
        self.dispatcher = dispatcher
        self.store = store
        self.image = image
        self.pool_size = pool_size
        self._lock = threading.Lock()
        self._failures: dict[ReserveKey, int] = {}
        self.claimed = 0

    def eligible(self, limits: SandboxLimits) -> bool:
        least = MIN_MEMORY_RUNSC if limits.runtime == "runsc" else MIN_MEMORY
        return (
            self.pool_size > 0
            and not getattr(self.backend, "dispatches_runs", False)  # a cluster's nodes: not here
            and not limits.egress
            and limits.memory_bytes >= least
            and limits.memory_swap_bytes >= least
        )

    def take(self, limits: SandboxLimits, quota_bytes: int, owner_uid_gid: str) -> Reserve | None:
        """A warm session of exactly these limits and quota, or None (then the caller makes a
        cold one). The first call for a key starts its pool and returns None: a reserve takes
        longer to start than a cold session."""
        pool = self._pool(limits, quota_bytes, owner_uid_gid)
        if pool is None:
            return None
        reserve = pool.take(wait_seconds=0)
        if reserve is None:
            return None
        assert isinstance(reserve, Reserve)
        with self._lock:
            self.claimed += 1
        return reserve

    def prewarm(self, limits: SandboxLimits, quota_bytes: int, owner_uid_gid: str, timeout: float = 120) -> bool:
        """Start the key's pool and wait until it is full (benchmarks, tests)."""
        pool = self._pool(limits, quota_bytes, owner_uid_gid)
        return pool is not None and pool.wait_ready(timeout)

    def _pool(self, limits: SandboxLimits, quota_bytes: int, owner_uid_gid: str) -> WarmPool | None:
        """The dispatcher's pool of this kind (started on first use); None for a kind that gets
        no warm sessions."""
        if not self.eligible(limits):
            return None
        key = ReserveKey(self.image, limits, quota_bytes, owner_uid_gid)
        with self._lock:
            if self._failures.get(key, 0) >= MAX_FAILURES:
                return None
        maker = ReserveMaker(key, self)
        return self.dispatcher.pool_for(key.spec, size=self.pool_size, maker=maker)

    def failed(self, key: ReserveKey) -> None:
        with self._lock:
            self._failures[key] = n = self._failures.get(key, 0) + 1
        if n >= MAX_FAILURES:
            log.warning("no more warm sessions for %s: %d starts failed in a row", key.limits.runtime, n)
            # from a refill thread of that pool: its close waits for its refills, so not here
            drop = self.dispatcher.drop_pools
            threading.Thread(target=drop, args=(lambda spec: spec == key.spec,), daemon=True).start()

    def started(self, key: ReserveKey) -> None:
        with self._lock:
            self._failures.pop(key, None)

"""What runs on each sandbox node of a Ray cluster: ``NodeService``, one long-lived actor per node
started with the ``sandloop`` resource, owning that node's local backend (Docker, or the direct
OCI one) and a dispatcher with its warm pool, admission, labels, deadlines and reaper. Untrusted
code never runs in a Ray worker: only in this node's sandboxes, with the full isolation set.

``Registry``: one detached actor per cluster (on any node, no resources) that maps a session to
the node holding its workspace and interpreter, so any driver can find it.

Both are plain classes here; ``backend.py`` makes them actors (``ray.remote``) with no retries.
"""

from __future__ import annotations

import contextlib
import io
import os
import queue
import tarfile
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, replace
from typing import Any, Protocol, TypeVar

from sandloop.contract import (
    CellResult,
    ExecutionResult,
    InvalidArgument,
    SandboxError,
    SandboxLimits,
    SessionPaused,
    SnapshotNotFound,
)
from sandloop.contract.egress import Secret
from sandloop.runtime.base import FullBackend, ImageBuilder, ImageTransfer, Owned, RunRequest, SandboxSpec, WorkspaceRef
from sandloop.runtime.labels import SESSION_LABEL

T = TypeVar("T")
#: The image builder calls a driver may make on a node (``NodeService.build``).
BUILDER_CALLS = frozenset(
    {"inspect", "images", "tag", "remove_image", "containers_using", "read_file", "has_entries", "add_files", "change"}
)
#: What a streamed call yields: ("output", [(stream, bytes), ...]) as it comes, then ("result", R).
Piece = tuple[str, Any]


class _Dispatch(Protocol):
    def run(self, request: RunRequest) -> ExecutionResult: ...

    def stats(self) -> dict[str, Any]: ...


class LocalRoot(Protocol):
    """What a node runs its sandboxes with (``sandloop.Sandloop``, built by ``node_root``)."""

    settings: Any
    backend: FullBackend
    dispatcher: _Dispatch
    image: str
    #: Its sessions' local side (``SessionStore``: their directories, whether one is paused).
    sessions: Any
    #: Snapshots of its sessions, kept here (``SnapshotStore``).
    snapshots: Any

    def session_here(self, record: dict[str, Any]) -> Any:
        """A ``Session`` handle on one of this node's sessions (its record from the driver)."""
        ...

    def reap(self) -> Any: ...

    def close(self) -> None: ...


class NodeService:
    """One node's sandboxes. Handles of launched sandboxes stay here, keyed by their id; drivers
    hold only ids."""

    def __init__(
        self, node_id: str, overrides: dict[str, Any], namespace: str, node_root: Callable[[dict[str, Any]], LocalRoot]
    ) -> None:
        self.node_id = node_id
        self.namespace = namespace
        #: A local ``Sandloop`` (built by the composition root's ``node_root``): backend, dispatcher.
        self.root: LocalRoot = node_root(overrides)
        self.settings = self.root.settings
        self._handles: dict[str, Any] = {}
        self._kernel_locks: dict[str, threading.Lock] = {}
        #: The cancel switches of streamed cells in flight, by the driver's call id.
        self._cancels: dict[str, threading.Event] = {}
        self._lock = threading.Lock()
        self._running = 0
        self.started = time.time()
        self.runs = 0
        self._stop = threading.Event()
        # This node's reaper: now (what a previous actor here left: a lost node's sandboxes end at
        # their deadlines, and are removed when it returns) and every reap interval.
        threading.Thread(target=self._reap_loop, name="sandloop-node-reaper", daemon=True).start()

    def _reap_loop(self) -> None:
        while True:
            with contextlib.suppress(Exception):  # an engine hiccup must not end the sweeps
                self.root.reap()
            with contextlib.suppress(Exception):
                self._remove_dropped_workspaces()
            if self._stop.wait(self.settings.reap_interval_seconds):
                return

    # -- state --------------------------------------------------------------------------------
    def status(self) -> dict[str, Any]:
        image = self.root.image
        try:
            has_image, problem = self.root.backend.has_image(image), ""
            info = self.root.backend.info()
            runtimes, quotas = list(info.runtimes), info.quotas_enforced
        except Exception as exc:  # noqa: BLE001 - reported, the node takes no runs
            has_image, problem = False, f"{type(exc).__name__}: {exc}"
            runtimes, quotas = [], False
        return {
            "node_id": self.node_id,
            "host": os.uname().nodename,
            "pid": os.getpid(),
            "backend": self.root.backend.name,
            "image": image,
            "has_image": has_image,
            "runtimes": runtimes,
            "quotas_enforced": quotas,
            "problem": problem or ("" if has_image else f"image {image} is missing: run `sandloop images build` here"),
            "max_running": self.settings.max_running,
            "running": self._running,
            "runs": self.runs,
            "pool": self.root.dispatcher.stats(),
            "held": len(self._handles),
            "started": self.started,
        }

    def _remove_dropped_workspaces(self) -> None:
        """What this host has of sessions deleted while its node was gone: their workspaces and
        directories (a pause's state), wherever either is still found."""
        import ray

        dropped: set[str] = set(
            ray.get(ray.get_actor("sandloop-registry", namespace=self.namespace).dropped.remote(), timeout=30)
        )
        if not dropped:
            return
        here = {item.labels.get(SESSION_LABEL) for item in self.root.backend.owned() if item.kind == "workspace"}
        # A directory without its workspace too: an engine shared with another node (one host,
        # two nodes) may have had the volume removed by that node.
        here |= {d.name for d in self.root.sessions.root.glob("s-*")}
        for session in sorted(dropped & {s for s in here if s}):
            # Its interpreter still holds the workspace: it goes first (found by hand: a
            # session with a kernel kept its volume and its interpreter after the node returned).
            self.root.sessions.delete(session)

    # -- coarse runs (the node's own warm pool) -------------------------------------------------
    def run(self, request: RunRequest) -> ExecutionResult:
        self._refuse_paused(request.labels)
        with self._lock:
            self._running += 1
        try:
            result = self.root.dispatcher.run(request)
        finally:
            with self._lock:
                self._running -= 1
                self.runs += 1
        return result.model_copy(update={"host": self.node_id})

    def run_stream(self, call_id: str, request: RunRequest) -> Iterator[Piece]:
        """``run``, its output sent on as it comes (a generator function: Ray streams what it yields)."""
        yield from self._streamed(lambda emit, _cancel: self.run(replace(request, on_output=emit)), call_id)

    # -- streaming: output as it comes, and a caller that gives up ----------------------------------
    def _streamed(
        self, work: Callable[[Callable[[str, bytes], None], threading.Event], Any], call_id: str
    ) -> Iterator[Piece]:
        """``streamed(work)``, which ``cancel(call_id)`` from the driver interrupts."""
        switch = threading.Event()
        with self._lock:
            self._cancels[call_id] = switch
        try:
            yield from streamed(work, switch)
        finally:
            with self._lock:
                self._cancels.pop(call_id, None)

    def cancel(self, call_id: str) -> None:
        """The driver's caller gave up on a streamed cell: interrupt it (its state survives)."""
        with self._lock:
            switch = self._cancels.get(call_id)
        if switch is not None:
            switch.set()

    # -- the backend seam, one call each ------------------------------------------------------
    def launch(self, spec: SandboxSpec, purpose: str, lifetime_seconds: float) -> str:
        self._refuse_paused(spec.labels)
        sandbox = self.root.backend.launch(spec, purpose=purpose, lifetime_seconds=lifetime_seconds)
        with self._lock:
            self._handles[sandbox.id] = sandbox
        return str(sandbox.id)

    def _handle(self, sandbox_id: str) -> Any:
        with self._lock:
            handle = self._handles.get(sandbox_id)
        if handle is None:
            raise InvalidArgument(f"sandbox {sandbox_id} is not held by node {self.node_id[:12]}")
        return handle

    def execute(self, sandbox_id: str, request: RunRequest) -> ExecutionResult:
        result = self.root.backend.execute(self._handle(sandbox_id), request)
        return result.model_copy(update={"host": self.node_id})

    def execute_stream(self, call_id: str, sandbox_id: str, request: RunRequest) -> Iterator[Piece]:
        yield from self._streamed(
            lambda emit, _cancel: self.execute(sandbox_id, replace(request, on_output=emit)), call_id
        )

    def run_cell(
        self,
        sandbox_id: str,
        code: str,
        limits: SandboxLimits,
        interrupt_after: float,
        grace: float,
        secrets_: dict[str, Secret] | None,
        options: dict[str, Any] | None = None,
        *,
        on_output: Callable[[str, bytes], None] | None = None,
        cancel: threading.Event | None = None,
    ) -> CellResult:
        with self._lock:
            lock = self._kernel_locks.setdefault(sandbox_id, threading.Lock())
        with lock:  # one cell at a time per interpreter, whichever driver sent it
            result = self.root.backend.run_cell(
                self._handle(sandbox_id),
                code,
                limits=limits,
                interrupt_after=interrupt_after,
                grace=grace,
                secrets=secrets_,
                on_output=on_output,
                cancel=cancel,
                options=options,
            )
        return result.model_copy(update={"host": self.node_id})

    def run_cell_stream(self, call_id: str, sandbox_id: str, *args: Any) -> Iterator[Piece]:
        """``run_cell(sandbox_id, *args)`` with its output sent on as it comes; ``cancel(call_id)``
        interrupts it."""
        yield from self._streamed(
            lambda emit, cancel: self.run_cell(sandbox_id, *args, on_output=emit, cancel=cancel), call_id
        )

    def find_kernel(self, session_id: str, spec: SandboxSpec) -> str | None:
        self._refuse_paused(spec.labels)
        sandbox = self.root.backend.find_kernel(session_id, spec)
        if sandbox is None:
            return None
        with self._lock:
            self._handles[sandbox.id] = sandbox
        return str(sandbox.id)

    def is_alive(self, sandbox_id: str) -> bool:
        with self._lock:
            handle = self._handles.get(sandbox_id)
        return handle is not None and bool(self.root.backend.is_alive(handle))

    def _release(self, sandbox_id: str) -> Any:
        """Forget a held sandbox; its handle, if it was held."""
        with self._lock:
            self._kernel_locks.pop(sandbox_id, None)
            return self._handles.pop(sandbox_id, None)

    def detach(self, sandbox_id: str) -> None:
        if (handle := self._release(sandbox_id)) is not None:
            self.root.backend.detach(handle)

    def destroy(self, sandbox_id: str) -> None:
        if (handle := self._release(sandbox_id)) is not None:
            self.root.backend.destroy(handle)

    def has_image(self, image: str) -> bool:
        return bool(self.root.backend.has_image(image))

    # -- sessions paused and resumed here, where their memory and workspace are --------------------
    def _refuse_paused(self, labels: tuple[tuple[str, str], ...]) -> None:
        """A paused session's sandboxes are not started (nor its interpreter found): the driver
        asks nothing before each cell, the node that holds the session answers."""
        session_id = dict(labels).get(SESSION_LABEL)
        if not session_id:
            return
        if self.root.sessions.stopped_here(session_id):
            raise SessionPaused(f"session {session_id} is paused: resume it (resume(), or Session.attach) to use it")

    @contextlib.contextmanager
    def _session(self, record: dict[str, Any], *, between_cells: bool = False) -> Iterator[Any]:
        """A handle here on one of this node's sessions, for one call from a driver, let go after.
        ``between_cells``: hold its interpreter's cell lock meanwhile (a cell sent here takes it:
        this waits for one in flight), then let go of the node's handle on that interpreter too
        (checkpointed, stopped or restored as a new sandbox: the driver's next cell finds it)."""
        session = self.root.session_here(record)
        try:
            kernel_id = session.interpreter_id() if between_cells else None
            cells: contextlib.AbstractContextManager[Any] = contextlib.nullcontext()
            if kernel_id is not None:
                with self._lock:
                    cells = self._kernel_locks.setdefault(kernel_id, threading.Lock())
            with cells:
                yield session
            if kernel_id is not None and (held := self._release(kernel_id)) is not None:
                with contextlib.suppress(Exception):  # only the handle goes
                    self.root.backend.detach(held)
        finally:
            session.let_go()

    def pause_session(self, record: dict[str, Any], keep_memory: bool) -> str:
        """Pause one of this node's sessions (``Session.pause`` on the driver), between cells."""
        with self._session(record, between_cells=True) as session:
            return str(session.pause_here(keep_memory=keep_memory))

    def resume_session(self, record: dict[str, Any]) -> str:
        """Start one of this node's paused sessions again; the next cell finds its interpreter."""
        with self._session(record) as session:
            return str(session.resume_here())

    def session_paused(self, record: dict[str, Any]) -> str | None:
        """How one of this node's sessions is paused (None: it runs), a cut-short pause settled."""
        with self._session(record) as session:
            kind = session.settle_here()
            return None if kind is None else str(kind)

    # Snapshots: kept here, where the session was, in this node's own store (its reaper expires them).
    def snapshot_session(self, record: dict[str, Any], name: str, owner: str, bring_back: bool) -> dict[str, Any]:
        with self._session(record, between_cells=True) as session:
            return asdict(session.snapshot_here(name, owner=owner, bring_back=bring_back))

    def start_from_snapshot(self, record: dict[str, Any], snapshot_id: str) -> None:
        with self._session(record) as session:
            session.start_here(snapshot_id)

    def restore_from_snapshot(self, record: dict[str, Any], snapshot_id: str) -> None:
        with self._session(record) as session:
            session.restore_here(snapshot_id)

    def snapshot_record(self, snapshot_id: str) -> dict[str, Any] | None:
        try:
            return asdict(self.root.snapshots.get(snapshot_id))
        except SnapshotNotFound:
            return None

    def snapshot_records(self, session_id: str | None) -> list[dict[str, Any]]:
        return [asdict(r) for r in self.root.snapshots.list(session_id)]

    def delete_snapshot(self, snapshot_id: str) -> None:
        self.root.snapshots.delete(snapshot_id)

    # -- workspaces -----------------------------------------------------------------------------
    def create_workspace(self, session_id: str, quota_bytes: int, owner_uid_gid: str) -> WorkspaceRef:
        return self.root.backend.create_workspace(session_id, quota_bytes, owner_uid_gid)

    def ensure_workspace(self, session_id: str, ref: WorkspaceRef) -> None:
        self.root.backend.ensure_workspace(session_id, ref)

    def delete_workspace(self, session_id: str) -> None:
        """The session's workspace and everything this node kept of it (a paused one's memory)."""
        self.root.sessions.delete(session_id)

    # -- templates: built on one node, received by the others (runtime/ray/images.py) -------------
    def _builder(self) -> ImageBuilder:
        builder = self.root.backend.image_builder()
        if builder is None:
            raise SandboxError(f"node {self.node_id[:12]}'s backend cannot build templates (it needs a Docker engine)")
        return builder

    def build(self, method: str, *args: Any, **kwargs: Any) -> Any:
        """One call of this node's image builder (only the calls ``BUILDER_CALLS`` names)."""
        if method not in BUILDER_CALLS:
            raise InvalidArgument(f"{method} is not an image builder call")
        return getattr(self._builder(), method)(*args, **kwargs)

    def build_step_stream(
        self, call_id: str, parent: str, command: str, options: dict[str, Any], packages: bytes | None
    ) -> Iterator[Piece]:
        """A template's RUN step here, its log lines streamed as they come; ``packages``: a helper
        step's packages (fetched on the driver), as a tar unpacked here for the step."""
        yield from self._streamed(lambda emit, _cancel: self._step(parent, command, options, packages, emit), call_id)

    def _step(
        self,
        parent: str,
        command: str,
        options: dict[str, Any],
        packages: bytes | None,
        emit: Callable[[str, bytes], None],
    ) -> str:
        with tempfile.TemporaryDirectory(prefix="sandloop-packages-") as tmp:
            if packages is not None:
                with tarfile.open(fileobj=io.BytesIO(packages)) as tar:
                    tar.extractall(tmp, filter="data")  # nothing outside it, no devices, no links out
            return str(
                self._builder().run_step(
                    parent,
                    command,
                    packages_dir=tmp if packages is not None else None,
                    on_line=lambda line: emit("log", line.encode()),
                    **options,
                )
            )

    def _transfer(self) -> ImageTransfer:
        builder = self._builder()
        if not isinstance(builder, ImageTransfer):
            raise SandboxError(f"node {self.node_id[:12]}'s engine cannot send or receive images")
        return builder

    def save_image(self, ref: str) -> Iterator[bytes]:
        """The image whole, in chunks (a generator: Ray streams it to the node receiving it)."""
        yield from self._transfer().save(ref)

    def receive_image(self, source_node: str, ref: str) -> None:
        """``ref`` from another node's engine into this one's (node to node: not through the driver)."""
        import ray

        source = ray.get_actor(f"sandloop-node-{source_node}", namespace=self.namespace)
        stream: Any = source.save_image.remote(ref)
        self._transfer().load(ray.get(chunk) for chunk in stream)

    # -- housekeeping ---------------------------------------------------------------------------
    def owned(self) -> list[Owned]:
        return list(self.root.backend.owned())

    def remove(self, item: Owned) -> str | None:
        return self.root.backend.remove(item)

    def remove_labelled(self, label: str, value: str) -> int:
        return int(self.root.backend.remove_labelled(label, value))

    def retry_removals(self) -> int:
        return int(self.root.backend.retry_removals())

    def sweep_orphans(self, min_age: float | None = None) -> int:
        return int(self.root.backend.sweep_orphans(min_age))

    def reap(self) -> dict[str, Any]:
        report = self.root.reap()
        return {"removed": len(report.removed), "unremovable": len(report.unremovable)}

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            handles, self._handles = list(self._handles.values()), {}
        for handle in handles:
            with contextlib.suppress(Exception):  # best effort at shutdown
                self.root.backend.detach(handle)
        self.root.close()


class Registry:
    """Which node holds which session and the session's record (cluster-wide, so a driver on any
    host attaches to it); and the sessions deleted while their node was gone, whose workspaces
    that node removes when it returns."""

    def __init__(self) -> None:
        self._where: dict[str, str] = {}
        self._dropped: set[str] = set()
        self._records: dict[str, dict[str, Any]] = {}

    def get_record(self, session_id: str) -> dict[str, Any] | None:
        return self._records.get(session_id)

    def put_record(self, session_id: str, record: dict[str, Any]) -> None:
        self._records[session_id] = record

    def remove_record(self, session_id: str) -> None:
        self._records.pop(session_id, None)

    def all_records(self) -> dict[str, dict[str, Any]]:
        return dict(self._records)

    def put(self, session_id: str, node_id: str) -> None:
        self._where[session_id] = node_id

    def get(self, session_id: str) -> str | None:
        return self._where.get(session_id)

    def remove(self, session_id: str) -> None:
        self._where.pop(session_id, None)

    def drop(self, session_id: str) -> None:
        self._where.pop(session_id, None)
        self._dropped.add(session_id)

    def dropped(self) -> list[str]:
        return sorted(self._dropped)


def streamed(
    work: Callable[[Callable[[str, bytes], None], threading.Event], T], cancel: threading.Event
) -> Iterator[Piece]:
    """Run ``work(emit, cancel)`` on a thread and yield what it emits, in batches (whatever arrived
    since the last one: a flood becomes a few large pieces, not one Ray object per write), then its
    result; its exception is raised here. ``cancel`` is also set when the consumer stops listening
    (the driver's generator dropped or cancelled by Ray), so the work is interrupted."""
    pieces: queue.Queue[tuple[str, bytes] | None] = queue.Queue()
    outcome: dict[str, Any] = {}

    def target() -> None:
        try:
            outcome["result"] = work(lambda name, data: pieces.put((name, data)), cancel)
        except BaseException as exc:  # noqa: BLE001 - raised in the consumer below
            outcome["error"] = exc
        finally:
            pieces.put(None)

    threading.Thread(target=target, name="sandloop-node-stream", daemon=True).start()
    try:
        finished = False
        while not finished:
            batch = [pieces.get()]
            with contextlib.suppress(queue.Empty):
                while True:
                    batch.append(pieces.get_nowait())
            finished = batch[-1] is None
            out = [p for p in batch if p is not None]
            if out:
                yield ("output", out)
        if "error" in outcome:
            raise outcome["error"]
        yield ("result", outcome["result"])
    finally:
        cancel.set()


def strip_for_the_wire(request: RunRequest) -> RunRequest:
    """A request a node can receive: no callback (it cannot cross processes)."""
    return replace(request, on_output=None) if request.on_output is not None else request

"""``RayBackend``: sandboxes across the nodes of a Ray cluster, behind the same seam.

    SANDLOOP_BACKEND=ray RAY_ADDRESS=head:6379 sandloop serve

A node offers sandboxes when it was started with the ``sandloop`` resource
(``ray start --address=HEAD:6379 --resources='{"sandloop": 1}'``). Each such node gets one
``NodeService`` actor (node.py), pinned to it, detached (it outlives drivers), named
``sandloop-node-<node id>`` so every driver finds the same one. The driver sends it one coarse
call per operation: a whole run (through the node's warm pool), or one step of the seam.

Failure semantics, by design: untrusted code never runs twice. Actors have no restarts and calls
no retries; every wait has a deadline from the operation's own timeout; a node lost during a call
raises ``NodeLost`` within seconds (the run may or may not have started: never retried); new runs
go to live nodes; a node's leftovers end at their own deadline and its reaper removes them when it
returns. A run nobody can take fails with ``SandboxBusy`` after the queue wait.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import os
import threading
import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandloop.contract import (
    CellResult,
    EngineUnavailable,
    ExecutionResult,
    NodeLost,
    SandboxBusy,
    SandboxError,
    SandboxLimits,
    SessionLost,
)
from sandloop.contract.egress import Secret
from sandloop.runtime.base import BackendInfo, Owned, RunRequest, SandboxSpec, WorkspaceRef
from sandloop.runtime.labels import LABEL_PREFIX, SESSION_LABEL
from sandloop.runtime.ray.images import ClusterBuilder
from sandloop.runtime.ray.node import NodeService, Registry, strip_for_the_wire
from sandloop.runtime.ray.sessions import QUICK, ClusterSessions

log = logging.getLogger(__name__)

RESOURCE = "sandloop"
#: The label ``owned()`` adds: which node an item is on.
NODE_LABEL = f"{LABEL_PREFIX}node"
NAMESPACE = "sandloop"
#: Seconds the list of usable nodes is trusted before it is looked up again.
REFRESH = 2.0
#: Margin over a run's own timeout for starting its sandbox and returning the result.
MARGIN = 60.0


@dataclass(frozen=True)
class RaySandbox:
    """A sandbox on one node: the node's id and the sandbox's id there."""

    node_id: str
    sandbox_id: str
    started_at: float

    @property
    def id(self) -> str:
        return f"{self.node_id}/{self.sandbox_id}"


def _ray() -> Any:
    try:
        import ray
    except ImportError:
        raise SandboxError("the Ray backend needs Ray: pip install 'sandloop[ray]'") from None
    return ray


class RayBackend(ClusterSessions):
    """The seam (``FullBackend``) over a Ray cluster; see the module docstring."""

    name = "ray"
    #: The dispatcher hands whole runs to ``run``: each node pools and admits its own sandboxes.
    dispatches_runs = True

    def __init__(
        self,
        address: str | None = None,
        *,
        namespace: str = NAMESPACE,
        node_settings: dict[str, Any],
        node_root: Callable[[dict[str, Any]], Any],
        queue_wait_seconds: float = 30.0,
    ) -> None:
        """``node_settings`` configure each node's actor (``image`` among them); ``node_root``
        builds, on the node, what runs its sandboxes from them (the composition root passes
        ``sandloop.root.node_root``: a local ``Sandloop``)."""
        ray = _ray()
        self.ray = ray
        if not ray.is_initialized():
            _reachable(address or os.environ.get("RAY_ADDRESS", ""))
            try:
                ray.init(
                    address=address or "auto", namespace=namespace, log_to_driver=False, logging_level=logging.WARNING
                )
            except (ConnectionError, RuntimeError, ValueError) as exc:
                where = address or os.environ.get("RAY_ADDRESS") or "auto (none running here)"
                raise EngineUnavailable(
                    f"no Ray cluster at {where}: start one (`ray start --head`, and `ray start --address=HEAD:6379 "
                    f"--resources='{{\"sandloop\": 1}}'` on each sandbox node) or set RAY_ADDRESS ({exc})"
                ) from None
        self.namespace = namespace
        self.node_settings = dict(node_settings)
        self.node_root = node_root
        self.queue_wait_seconds = queue_wait_seconds
        self._actors: dict[str, Any] = {}
        self._inflight: collections.Counter[str] = collections.Counter()
        self._lock = threading.Lock()
        self._usable_nodes: list[str] = []
        self._builder: ClusterBuilder | None = None
        self._turn = 0
        self._usable_at = 0.0
        self._registry = (
            ray.remote(Registry)
            .options(
                name="sandloop-registry",
                namespace=namespace,
                lifetime="detached",
                get_if_exists=True,
                max_restarts=0,
                max_task_retries=0,
                num_cpus=0,
                resources={"node:__internal_head__": 0.001},  # on the head: it outlives sandbox nodes
            )
            .remote()
        )

    # -- nodes ------------------------------------------------------------------------------------
    def node_ids(self) -> list[str]:
        """Live nodes that offer sandboxes (the ``sandloop`` resource)."""
        if not self.ray.is_initialized():
            return []  # this process left the cluster (ray.shutdown)
        return sorted(
            n["NodeID"] for n in self.ray.nodes() if n.get("Alive") and n.get("Resources", {}).get(RESOURCE, 0) > 0
        )

    def _actor(self, node_id: str) -> Any:
        with self._lock:
            actor = self._actors.get(node_id)
        if actor is not None:
            return actor
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        actor = (
            self.ray.remote(NodeService)
            .options(
                name=f"sandloop-node-{node_id}",
                namespace=self.namespace,
                lifetime="detached",
                get_if_exists=True,
                max_restarts=0,  # a lost node's actor is not started again elsewhere
                max_task_retries=0,  # and no call is ever retried: untrusted code runs once
                max_concurrency=256,
                num_cpus=0,
                resources={RESOURCE: 0.001},
                scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
            )
            .remote(node_id, self.node_settings, self.namespace, self.node_root)
        )
        with self._lock:
            actor = self._actors.setdefault(node_id, actor)
        return actor

    def _call(self, node_id: str, method: str, *args: Any, timeout: float = QUICK, **kwargs: Any) -> Any:
        """``method`` of the node's actor, within ``timeout`` seconds; a lost node is ``NodeLost``."""
        ref = getattr(self._actor(node_id), method).remote(*args, **kwargs)
        with self._failures(node_id, method, timeout, ref):
            return self.ray.get(ref, timeout=timeout)

    def _streamed(
        self,
        node_id: str,
        method: str,
        *args: Any,
        timeout: float,
        on_output: Callable[[str, bytes], None] | None,
        cancel: threading.Event | None = None,
    ) -> Any:
        """``method`` of the node's actor, a generator (``NodeService._streamed``): its output goes
        to ``on_output`` as it comes; once ``cancel`` is set the node is told to interrupt; the
        result, within ``timeout`` seconds; a lost node is ``NodeLost``."""
        ray = self.ray
        call_id = uuid.uuid4().hex
        stream = getattr(self._actor(node_id), method).remote(call_id, *args)
        deadline = time.monotonic() + timeout
        told = False

        def tell() -> None:
            nonlocal told
            if not told:
                told = True
                with contextlib.suppress(Exception):  # fire and forget: a lost node is seen below
                    self._actor(node_id).cancel.remote(call_id)

        try:
            with self._failures(node_id, method, timeout, stream):
                while True:
                    if cancel is not None and cancel.is_set():
                        tell()
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise ray.exceptions.GetTimeoutError(f"{method} took over {timeout:g} s")
                    ready, _ = ray.wait([stream], timeout=min(left, 0.25) if cancel is not None and not told else left)
                    if not ready:
                        continue
                    kind, payload = ray.get(next(stream), timeout=QUICK)
                    if kind == "result":
                        told = True  # done: nothing to interrupt
                        return payload
                    if on_output is not None:
                        for name, data in payload:
                            on_output(name, data)
        finally:
            tell()  # this side gave up (an error, a callback that raised): the node stops the work

    @contextlib.contextmanager
    def _failures(self, node_id: str, method: str, timeout: float, ref: Any) -> Iterator[None]:
        """Ray's failures of a call to a node, as sandloop's: the node's own ``SandboxError`` as
        itself; no answer in time, or the node gone, as ``NodeLost`` (nothing is retried)."""
        ray = self.ray
        try:
            yield
        except ray.exceptions.RayTaskError as exc:
            cause = exc.cause if isinstance(getattr(exc, "cause", None), BaseException) else None
            if isinstance(cause, SandboxError):
                raise cause from None
            raise SandboxError(f"node {node_id[:12]} failed: {cause or exc}") from None
        except ray.exceptions.GetTimeoutError:
            ray.cancel(ref, force=False)
            self._forget(node_id)
            raise NodeLost(
                f"node {node_id[:12]} did not answer {method} within {timeout:g} s; it is treated as lost "
                "(nothing is retried)"
            ) from None
        except (ray.exceptions.RayActorError, ray.exceptions.NodeDiedError, ray.exceptions.ObjectLostError) as exc:
            self._forget(node_id)
            raise NodeLost(
                f"node {node_id[:12]} was lost during {method} ({type(exc).__name__}); what it was running "
                "ends at its own deadline there, and is not run again elsewhere"
            ) from None

    def _forget(self, node_id: str) -> None:
        with self._lock:
            self._actors.pop(node_id, None)
            self._usable_at = 0.0  # look again before the next run

    def status(self) -> list[dict[str, Any]]:
        """Each live sandbox node's state (``sandloop cluster status``)."""
        out = []
        for node_id in self.node_ids():
            try:
                out.append(self._call(node_id, "status"))
            except SandboxError as exc:
                out.append({"node_id": node_id, "problem": str(exc), "has_image": False})
        return out

    def _usable(self) -> list[str]:
        """Live nodes with the image, least busy first (as this driver sees them). Which nodes are
        usable is looked up at most every ``REFRESH`` seconds (and at once after a node is lost)."""
        with self._lock:
            fresh = time.monotonic() - self._usable_at < REFRESH
            nodes = list(self._usable_nodes)
        if not fresh:
            nodes = []
            image = self.node_settings["image"]
            for node_id in self.node_ids():
                try:
                    if self._call(node_id, "has_image", image, timeout=QUICK):
                        nodes.append(node_id)
                except SandboxError:
                    continue
            with self._lock:
                self._usable_nodes, self._usable_at = nodes, time.monotonic()
        with self._lock:
            self._turn += 1
            turn = self._turn
            order = {n: (i - turn) % max(1, len(nodes)) for i, n in enumerate(nodes)}
            # least busy first; among equals, a different one first each time (spread the load)
            return sorted(nodes, key=lambda n: (self._inflight[n], order[n]))

    # -- runs: whole, through a node's own pool ---------------------------------------------------
    def run(self, request: RunRequest) -> ExecutionResult:
        session = dict(request.labels).get(SESSION_LABEL)
        wire = strip_for_the_wire(request)
        deadline = time.monotonic() + self.queue_wait_seconds
        while True:
            nodes = [self._session_node(session, pin=True)] if session else self._usable()
            if not nodes:
                raise SandboxBusy(
                    "no node of the cluster offers sandboxes (none has the sandloop resource and the image)"
                )
            for node_id in nodes:
                with self._lock:
                    self._inflight[node_id] += 1
                timeout = request.timeout_seconds + MARGIN + self.queue_wait_seconds
                try:
                    result: ExecutionResult = (
                        self._streamed(node_id, "run_stream", wire, timeout=timeout, on_output=request.on_output)
                        if request.on_output is not None
                        else self._call(node_id, "run", wire, timeout=timeout)
                    )
                except SandboxBusy:
                    continue  # that node is full: the next one
                finally:
                    with self._lock:
                        self._inflight[node_id] -= 1
                return result
            if time.monotonic() >= deadline:
                raise SandboxBusy(f"every node of the cluster is full (waited {self.queue_wait_seconds:g} s)")
            time.sleep(0.2)

    # -- the seam, step by step -------------------------------------------------------------------
    def launch(self, spec: SandboxSpec, *, purpose: str, lifetime_seconds: float) -> RaySandbox:
        session = dict(spec.labels).get(SESSION_LABEL)
        nodes = [self._session_node(session, pin=True)] if session else self._usable()
        if not nodes:
            raise SandboxBusy("no node of the cluster offers sandboxes")
        node_id = nodes[0]
        sandbox_id = self._call(node_id, "launch", spec, purpose, lifetime_seconds, timeout=QUICK + MARGIN)
        return RaySandbox(node_id, sandbox_id, time.monotonic())

    def execute(self, sandbox: RaySandbox, request: RunRequest, *, started: float | None = None) -> ExecutionResult:
        wire, timeout = strip_for_the_wire(request), request.timeout_seconds + MARGIN
        if request.on_output is None:
            result: ExecutionResult = self._call(sandbox.node_id, "execute", sandbox.sandbox_id, wire, timeout=timeout)
        else:
            result = self._streamed(
                sandbox.node_id,
                "execute_stream",
                sandbox.sandbox_id,
                wire,
                timeout=timeout,
                on_output=request.on_output,
            )
        return result

    def run_cell(
        self,
        kernel: RaySandbox,
        code: str,
        *,
        limits: SandboxLimits,
        interrupt_after: float,
        grace: float,
        secrets: Mapping[str, Secret] | None = None,
        on_output: Callable[[str, bytes], None] | None = None,
        cancel: threading.Event | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> CellResult:
        args = (
            kernel.sandbox_id,
            code,
            limits,
            interrupt_after,
            grace,
            dict(secrets) if secrets else None,
            dict(options) if options else None,
        )
        timeout = interrupt_after + grace + MARGIN
        if on_output is None and cancel is None:  # one plain call: the quickest way across
            result: CellResult = self._call(kernel.node_id, "run_cell", *args, timeout=timeout)
        else:
            result = self._streamed(
                kernel.node_id, "run_cell_stream", *args, timeout=timeout, on_output=on_output, cancel=cancel
            )
        return result

    def find_kernel(self, session_id: str, spec: SandboxSpec) -> RaySandbox | None:
        node_id = self._session_node(session_id)
        sandbox_id = self._call(node_id, "find_kernel", session_id, spec)
        return None if sandbox_id is None else RaySandbox(node_id, sandbox_id, time.monotonic())

    def is_alive(self, sandbox: RaySandbox) -> bool:
        try:
            return bool(self._call(sandbox.node_id, "is_alive", sandbox.sandbox_id))
        except NodeLost:
            return False

    def has_image(self, image: str) -> bool:
        return any(self._call(n, "has_image", image) for n in self.node_ids())

    def detach(self, sandbox: RaySandbox) -> None:
        self._quietly(sandbox.node_id, "detach", sandbox.sandbox_id)

    def destroy(self, sandbox: RaySandbox) -> None:
        self._quietly(sandbox.node_id, "destroy", sandbox.sandbox_id)

    def _quietly(self, node_id: str, method: str, *args: Any) -> None:
        with contextlib.suppress(NodeLost):  # its sandboxes end at their deadlines; its reaper removes them
            self._call(node_id, method, *args)

    def info(self) -> BackendInfo:
        states = self.status()
        usable = [s for s in states if s.get("has_image")]
        # What a run can ask for wherever it lands: the runtimes every usable node's engine has.
        runtimes = set.intersection(*(set(s.get("runtimes", ())) for s in usable)) if usable else set()
        return BackendInfo(
            name="ray",
            version=str(self.ray.__version__),
            runtimes=tuple(sorted(runtimes)),
            quotas_enforced=bool(usable) and all(s.get("quotas_enforced") for s in usable),
            details={
                "nodes": str(len(states)),
                "usable": str(len(usable)),
                "address": str(self.ray.get_runtime_context().gcs_address),
            },
        )

    def image_builder(self) -> ClusterBuilder:
        """Templates: built on one node, sent to every other (``images.py``)."""
        with self._lock:
            if self._builder is None:
                self._builder = ClusterBuilder(self)
            return self._builder

    # -- what other rooms of this backend call (images.py) ---------------------------------------
    def usable_nodes(self) -> list[str]:
        return self._usable()

    def node_call(self, node_id: str, method: str, *args: Any, timeout: float = QUICK, **kwargs: Any) -> Any:
        return self._call(node_id, method, *args, timeout=timeout, **kwargs)

    def node_stream(
        self, node_id: str, method: str, *args: Any, timeout: float, on_output: Callable[[str, bytes], None] | None
    ) -> Any:
        return self._streamed(node_id, method, *args, timeout=timeout, on_output=on_output)

    def close(self) -> None:
        """Leaves the node actors running (they are the cluster's, and other drivers use them)."""
        with self._lock:
            self._actors.clear()

    def shutdown_nodes(self) -> int:
        """Stop every node's actor the clean way (its warm pool and held sandboxes removed), as
        before the cluster is taken down; the next driver starts them again. Returns how many."""
        stopped = 0
        for node_id in self.node_ids():
            with contextlib.suppress(SandboxError):
                self._call(node_id, "close", timeout=QUICK + MARGIN)
                stopped += 1
            actor = self._actor(node_id)
            with contextlib.suppress(Exception):
                self.ray.kill(actor, no_restart=True)
            self._forget(node_id)
        return stopped

    def create_workspace(self, session_id: str, quota_bytes: int, owner_uid_gid: str) -> WorkspaceRef:
        node_id = self._session_node(session_id, pin=True)
        ref: WorkspaceRef = self._call(node_id, "create_workspace", session_id, quota_bytes, owner_uid_gid)
        return ref

    def ensure_workspace(self, session_id: str, ref: WorkspaceRef) -> None:
        self._call(self._session_node(session_id), "ensure_workspace", session_id, ref)

    def workspace_on_host(self, session_id: str, ref: WorkspaceRef) -> Path | None:
        return None  # on its node

    def delete_workspace(self, session_id: str) -> None:
        try:
            self._call(self._session_node(session_id), "delete_workspace", session_id)
        except SessionLost:  # its node is gone: that host removes the workspace when it returns
            self._registry_call("drop", session_id)
            return
        self._registry_call("remove", session_id)

    # -- housekeeping: every node's --------------------------------------------------------------
    def owned(self) -> list[Owned]:
        """Every node's; a sandbox's id names its node (as ``RaySandbox.id`` does), a workspace's is
        its name; the node is also in the label ``NODE_LABEL``."""
        items = []
        for node_id in self.node_ids():
            try:
                found = self._call(node_id, "owned")
            except NodeLost as exc:
                log.warning("owned skipped: %s", exc)
                continue
            for item in found:
                labels = {**item.labels, NODE_LABEL: node_id}
                ident = f"{node_id}/{item.id}" if item.kind == "sandbox" else item.id
                items.append(Owned(item.kind, ident, labels, item.stuck))
        return items

    def remove(self, item: Owned) -> str | None:
        node_id = item.labels.get(NODE_LABEL, "")
        local = item.id.split("/", 1)[1] if item.kind == "sandbox" and "/" in item.id else item.id
        inner = Owned(item.kind, local, {k: v for k, v in item.labels.items() if k != NODE_LABEL}, item.stuck)
        result: str | None = self._call(node_id, "remove", inner)
        return result

    def _each(self, method: str, *args: Any) -> list[Any]:
        """``method`` on every live node; a node lost meanwhile is skipped (its own reaper
        cleans up when it returns)."""
        answers = []
        for node_id in self.node_ids():
            try:
                answers.append(self._call(node_id, method, *args))
            except NodeLost as exc:
                log.warning("%s skipped: %s", method, exc)
        return answers

    def remove_labelled(self, label: str, value: str) -> int:
        return sum(int(n) for n in self._each("remove_labelled", label, value))

    def retry_removals(self) -> int:
        return sum(int(n) for n in self._each("retry_removals"))

    def sweep_orphans(self, min_age: float | None = None) -> int:
        return sum(int(n) for n in self._each("sweep_orphans", min_age))


def _reachable(address: str) -> None:
    """Refuse at once (not after Ray's minutes of retries) a cluster address nothing listens on."""
    import socket

    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or "://" in address:
        return  # "auto", a ray:// client address: Ray's own lookup answers quickly
    try:
        socket.create_connection((host or "127.0.0.1", int(port)), timeout=5).close()
    except OSError as exc:
        raise EngineUnavailable(
            f"no Ray cluster at {address} ({exc.strerror or exc}): start its head (`ray start --head --port={port}`) "
            "or fix RAY_ADDRESS"
        ) from None

"""Where a Ray cluster keeps its sessions: each pinned to the node that holds its workspace (the
head's registry actor says which), its record in that registry (a driver on any host attaches),
pause, resume and snapshots done on that node, where its memory and workspace are. A session whose
node is gone is lost (``SessionLost``). ``RayBackend`` (backend.py) is made of this and its calls.
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Any

from sandloop.contract import EngineUnavailable, NodeLost, SandboxBusy, SessionLost

#: Seconds a quick call (status, a handle's state, a workspace) may take before its node counts as lost.
QUICK = 30.0
#: Seconds a pause or resume may take on its node: a cell in flight finishes first (its own
#: timeout), then a checkpoint or a state save (at most 120 s, ``Session._save_state``).
PAUSE = 300.0


class ClusterSessions:
    """The sessions part of ``RayBackend`` (``RemoteSessions`` on the seam)."""

    if TYPE_CHECKING:  # given by RayBackend
        ray: Any
        _registry: Any

        def node_ids(self) -> list[str]: ...
        def _usable(self) -> list[str]: ...
        def _call(self, node_id: str, method: str, *args: Any, timeout: float = QUICK, **kwargs: Any) -> Any: ...
        def _each(self, method: str, *args: Any) -> list[Any]: ...

    def _session_node(self, session_id: str, pin: bool = False) -> str:
        """The node that holds the session; with ``pin``, a session the cluster does not know yet
        is pinned to the least busy usable node (its first sandbox decides where it lives)."""
        node_id = self._registry_call("get", session_id)
        if node_id is None:
            if not pin:
                raise SessionLost(f"session {session_id} is not known to the cluster (was it made on another backend?)")
            nodes = self._usable()
            if not nodes:
                raise SandboxBusy("no node of the cluster offers sandboxes")
            self._registry_call("put", session_id, nodes[0])
            return nodes[0]
        if node_id not in self.node_ids():
            raise SessionLost(
                f"session {session_id} lived on node {node_id[:12]}, which is gone: its workspace and interpreter "
                "are lost with it (delete the session)"
            )
        return str(node_id)

    def _registry_call(self, method: str, *args: Any) -> Any:
        """``method`` of the registry actor on the head, within ``QUICK`` seconds."""
        try:
            return self.ray.get(getattr(self._registry, method).remote(*args), timeout=QUICK)
        except (self.ray.exceptions.RayError, TimeoutError) as exc:
            raise EngineUnavailable(
                f"the cluster's session registry (on the head) did not answer {method}: {type(exc).__name__}"
            ) from None

    # Session records live in the registry (``SharedRecords``): a driver on any host attaches.
    def get_record(self, session_id: str) -> dict[str, Any] | None:
        record: dict[str, Any] | None = self._registry_call("get_record", session_id)
        return record

    def put_record(self, session_id: str, record: dict[str, Any]) -> None:
        self._registry_call("put_record", session_id, record)

    def remove_record(self, session_id: str) -> None:
        self._registry_call("remove_record", session_id)

    def all_records(self) -> dict[str, dict[str, Any]]:
        return dict(self._registry_call("all_records"))

    # Pause and resume (``RemoteSessions``): on the node that holds the session, where its memory
    # and workspace are; a paused session stays there. Its node gone, it is lost (``SessionLost``).
    def pause_session(self, record: dict[str, Any], keep_memory: bool) -> str:
        node_id = self._session_node(record["id"])
        return str(self._call(node_id, "pause_session", record, keep_memory, timeout=PAUSE))

    def resume_session(self, record: dict[str, Any]) -> str:
        node_id = self._session_node(record["id"])
        return str(self._call(node_id, "resume_session", record, timeout=PAUSE))

    def session_paused(self, session_id: str) -> str | None:
        record = self.get_record(session_id)
        if record is None:
            return None
        kind = self._call(self._session_node(session_id), "session_paused", record, timeout=PAUSE)
        return None if kind is None else str(kind)

    def place_session(self, session_id: str, place: str) -> None:
        if place not in self.node_ids():
            raise SessionLost(f"node {place[:12]} is gone: a session cannot be started there")
        self._registry_call("put", session_id, place)

    # Snapshots: kept by the node that made them; a session started from one lives there too.
    def snapshot_session(self, record: dict[str, Any], name: str, owner: str, bring_back: bool) -> dict[str, Any]:
        node_id = self._session_node(record["id"])
        made: dict[str, Any] = self._call(node_id, "snapshot_session", record, name, owner, bring_back, timeout=PAUSE)
        return made

    def start_from_snapshot(self, record: dict[str, Any], snapshot_id: str) -> None:
        self._call(self._session_node(record["id"]), "start_from_snapshot", record, snapshot_id, timeout=PAUSE)

    def restore_from_snapshot(self, record: dict[str, Any], snapshot_id: str) -> None:
        self._call(self._session_node(record["id"]), "restore_from_snapshot", record, snapshot_id, timeout=PAUSE)

    def snapshot_record(self, snapshot_id: str) -> tuple[str, dict[str, Any]] | None:
        for node_id in self.node_ids():
            with contextlib.suppress(NodeLost):
                found = self._call(node_id, "snapshot_record", snapshot_id)
                if found is not None:
                    return node_id, found
        return None

    def snapshot_records(self, session_id: str | None) -> list[dict[str, Any]]:
        return [r for records in self._each("snapshot_records", session_id) for r in records]

    def delete_snapshot(self, snapshot_id: str) -> None:
        self._each("delete_snapshot", snapshot_id)

"""The driver's side of sessions that live on other hosts (the Ray backend's nodes), with a stub
in place of the cluster: snapshots asked of every node (``ClusterSnapshots``), and the store's
expiry, which asks a session's node whether it is paused only when that can matter."""

from __future__ import annotations

import time
from dataclasses import asdict

import pytest

from sandloop.contract import SessionLost, SnapshotNotFound
from sandloop.sessions.snapshots import ClusterSnapshots, SnapshotRecord
from sandloop.sessions.store import SessionRecord, SessionStore
from sandloop.testing.fake import FakeBackend


def _snap(snapshot_id: str, created: float, size: int, owner: str) -> dict:
    return asdict(
        SnapshotRecord(snapshot_id, "s-0123456789ab", "", "memory", created, size, "img", {}, 1, "65534:65534", 60)
    ) | {"owner": owner}


class Nodes:
    """Two nodes' snapshots; which calls were made."""

    def __init__(self) -> None:
        self.kept = {
            "node-a": {"snap-aaaa": _snap("snap-aaaa", 2.0, 10, "alice")},
            "node-b": {"snap-bbbb": _snap("snap-bbbb", 1.0, 32, "bob")},
        }
        self.asked_paused: list[str] = []
        self.paused: dict[str, str | BaseException] = {}

    def snapshot_record(self, snapshot_id: str):
        return next(((n, s[snapshot_id]) for n, s in self.kept.items() if snapshot_id in s), None)

    def snapshot_records(self, session_id):
        return [r for s in self.kept.values() for r in s.values() if session_id in (None, r["session_id"])]

    def delete_snapshot(self, snapshot_id: str) -> None:
        for s in self.kept.values():
            s.pop(snapshot_id, None)

    def session_paused(self, session_id: str):
        self.asked_paused.append(session_id)
        answer = self.paused.get(session_id)
        if isinstance(answer, BaseException):
            raise answer
        return answer


class RemoteFake(FakeBackend, Nodes):
    def __init__(self, home) -> None:
        FakeBackend.__init__(self, home=home)
        Nodes.__init__(self)

    def pause_session(self, record, keep_memory):  # the rest of RemoteSessions: not called here
        raise AssertionError

    resume_session = place_session = snapshot_session = start_from_snapshot = restore_from_snapshot = pause_session


def test_snapshots_are_found_listed_sized_and_deleted_on_whichever_node_keeps_them(tmp_path):
    nodes = RemoteFake(tmp_path)
    snapshots = ClusterSnapshots(nodes)
    assert snapshots.get("snap-bbbb").size_bytes == 32 and snapshots.locate("snap-bbbb")[0] == "node-b"
    assert [r.id for r in snapshots.list()] == ["snap-bbbb", "snap-aaaa"]  # oldest first, across nodes
    assert snapshots.total_bytes("alice") == 10 and snapshots.total_bytes() == 42
    with pytest.raises(SnapshotNotFound, match="its node is gone"):
        snapshots.get("snap-cccc")
    with pytest.raises(SnapshotNotFound, match="not a snapshot id"):
        snapshots.get("../../etc")  # refused before any node is asked
    snapshots.delete("snap-aaaa")
    assert [r.id for r in snapshots.list()] == ["snap-bbbb"]
    assert snapshots.expire(0) == [] and snapshots.sweep(0) == []  # each node's reaper does these


def test_expiry_asks_a_sessions_node_only_past_a_bound_and_a_lost_node_does_not_keep_it(tmp_path):
    nodes = RemoteFake(tmp_path)
    store = SessionStore(nodes, tmp_path, paused_retention=1000)
    now = time.time()
    fresh = SessionRecord("s-00000000000a", now, now, 60, 1, False, "v", "img", {})
    assert not store.expired(fresh) and nodes.asked_paused == []  # within both bounds: no call
    idle = SessionRecord("s-00000000000b", now - 100, now - 100, 60, 1, False, "v", "img", {})
    nodes.paused[idle.id] = "memory"
    assert store.expired(idle)  # past its TTL, paused or not (issue 52 finding 9): no call
    assert nodes.asked_paused == []
    long = SessionRecord("s-00000000000c", now - 2000, now - 2000, 10**6, 1, False, "v", "img", {})
    nodes.paused[long.id] = "memory"
    assert store.expired(long)  # within its TTL, paused past its retention
    assert nodes.asked_paused == [long.id]
    nodes.paused[long.id] = SessionLost("node gone")
    assert not store.expired(long)  # its node is gone: kept to its TTL, as a running one
    nodes.paused[long.id] = None
    assert not store.expired(long)

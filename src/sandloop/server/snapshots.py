"""Routes: pause, resume, fork and snapshots of the calling token's sessions (issue 25).

A paused session keeps its id; its calls answer 409 ``session_paused`` until ``resume``. A
snapshot belongs to the token whose session it was made from; its disk counts, with the token's
sessions' quotas, against ``--max-workspace``.
"""

from typing import Any

from fastapi import APIRouter, Response

from sandloop.contract import SnapshotNotFound
from sandloop.server.context import Api, Auth
from sandloop.server.models import ForkIn, FromSnapshotIn, SnapshotIn
from sandloop.server.quota import check_session_room, check_snapshot_room
from sandloop.server.sessions import session_json
from sandloop.sessions.snapshots import SnapshotRecord, describe


def snapshot_routes(api: Api) -> APIRouter:
    router = APIRouter()
    root, tokens, rates, session_lock = api.root, api.tokens, api.rates, api.session_lock
    owned, held = api.owned, api.held

    def mine(token: Any, snapshot_id: str) -> SnapshotRecord:
        snap = root.snapshots.get(snapshot_id)
        if snap.owner != token.id:  # someone else's and nonexistent look the same
            raise SnapshotNotFound(f"no snapshot {snapshot_id}")
        return snap

    def room_for_snapshot(token: Any) -> None:
        check_snapshot_room(token, held(token), root.snapshots.total_bytes(token.id))

    @router.post("/v1/sessions/{session_id}/pause")
    def pause(session_id: str, token: Auth) -> dict[str, Any]:
        """Stop the session's interpreter, keeping its memory (gVisor) or picklable state (runc);
        refused once the token's sessions, pauses and snapshots reach its --max-workspace (what
        the pause keeps counts against it from then on: ``quota.footprints``)."""
        with rates.use(token), owned(token, session_id) as s:
            room_for_snapshot(token)
            kind = s.pause()
            return {**session_json(s.record), "paused": kind}

    @router.post("/v1/sessions/{session_id}/resume")
    def resume(session_id: str, token: Auth) -> dict[str, Any]:
        with rates.use(token), owned(token, session_id) as s:
            kind = s.resume()
            return {**session_json(s.record), "paused": None, "resumed": kind}

    @router.post("/v1/sessions/{session_id}/fork", status_code=201)
    def fork(session_id: str, body: ForkIn, token: Auth) -> list[dict[str, Any]]:
        """``count`` new sessions, each as this one is now, with their own workspace and memory;
        ``paused``: made paused, each resumed at its first call."""
        with rates.use(token), session_lock, owned(token, session_id) as s:
            live = held(token)
            for i in range(body.count):  # each child is a session of the token's
                check_session_room(token, live + [s.record.quota_bytes] * i, s.record.quota_bytes)
            room_for_snapshot(token)
            children = s.fork(body.count, paused=body.paused)
            for child in children:
                tokens.own(child.id, token.id)
                child.close()
            return [session_json(c.record) for c in children]

    @router.get("/v1/sessions/{session_id}/snapshots")
    def session_snapshots(session_id: str, token: Auth) -> list[dict[str, Any]]:
        with owned(token, session_id) as s:
            return [describe(r) for r in root.snapshots.list(s.id) if r.owner == token.id]

    @router.post("/v1/sessions/{session_id}/snapshots", status_code=201)
    def snapshot(session_id: str, body: SnapshotIn, token: Auth) -> dict[str, Any]:
        with rates.use(token), owned(token, session_id) as s:
            room_for_snapshot(token)
            return describe(s.snapshot(body.name, owner=token.id))

    @router.get("/v1/snapshots")
    def list_snapshots(token: Auth) -> list[dict[str, Any]]:
        return [describe(r) for r in root.snapshots.list() if r.owner == token.id]

    @router.get("/v1/snapshots/{snapshot_id}")
    def get_snapshot(snapshot_id: str, token: Auth) -> dict[str, Any]:
        return describe(mine(token, snapshot_id))

    @router.delete("/v1/snapshots/{snapshot_id}", status_code=204)
    def delete_snapshot(snapshot_id: str, token: Auth) -> Response:
        root.snapshots.delete(mine(token, snapshot_id).id)
        return Response(status_code=204)

    @router.post("/v1/snapshots/{snapshot_id}/sessions", status_code=201)
    def session_from_snapshot(snapshot_id: str, body: FromSnapshotIn, token: Auth) -> dict[str, Any]:
        """A new session of the token's, started from the snapshot."""
        from sandloop.sessions.session import Session

        snap = mine(token, snapshot_id)
        with rates.use(token), session_lock:
            check_session_room(token, held(token), snap.quota_bytes)
            s = Session.from_snapshot(snap.id, ttl=body.ttl_seconds, root=root)
            tokens.own(s.id, token.id)
            s.close()
        return session_json(s.record)

    return router

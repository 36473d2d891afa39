"""Terminals over HTTP give back what they hold (issue 52, findings 5 and 11): a terminal that
ends or is deleted frees its sandbox's channel whether anyone followed it or not (before: each
kept its channel and up to 4 MiB, and after 64 the session's terminals and previews were 503);
a session deleted or paused releases its terminals and ends their streams; a revoked token's
terminal streams end. The table's own rules, without sandboxes: tests/unit/test_terminal_table.py."""

from __future__ import annotations

import base64
import json
import threading
import time

import httpx
import pytest

from sandloop.root import default_root
from sandloop.server.app import create_app
from sandloop.server.tokens import TokenStore
from sandloop.sessions.session_reach import live_reach
from tests.servers import serve_in_thread

pytestmark = [pytest.mark.timeout(600)]

#: A plain HTTP server on port 8000 of the session's sandbox, for a preview.
WEB = """
import subprocess
web = subprocess.Popen(["python3", "-m", "http.server", "8000"], cwd="/workspace",
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
"""


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    path = tmp_path_factory.mktemp("terminals") / "tokens.sqlite"
    tokens = TokenStore(path)
    mine, _ = tokens.create("mine", runs_per_minute=1000, max_concurrent=8)
    app = create_app(tokens)
    with serve_in_thread(app) as url:
        yield url, mine, tokens, app.state.terminals


def _events(lines) -> list[tuple[str, str]]:
    """(event, data) pairs of a server-sent event stream, until it ends."""
    seen, kind = [], ""
    for line in lines:
        if line.startswith("event: "):
            kind = line[7:]
        elif line.startswith("data: "):
            seen.append((kind, line[6:]))
    return seen


def _until_served(get, seconds: float = 60.0) -> httpx.Response:
    """The first answer that is not a 502 (the server inside is still starting), bounded."""
    deadline = time.monotonic() + seconds
    while (r := get()).status_code == 502 and time.monotonic() < deadline:
        time.sleep(0.2)
    return r


def test_terminals_that_end_or_are_hung_up_free_their_channels(server):
    """70 that end unfollowed and 70 hung up, one session: more than its sandbox's 64 channels."""
    url, mine, _, table = server
    auth = {"Authorization": f"Bearer {mine}"}
    with httpx.Client(base_url=url, timeout=60) as client:
        sid = client.post("/v1/sessions", json={}, headers=auth).json()["id"]
        try:
            started = time.monotonic()
            for _ in range(70):
                made = client.post(f"/v1/sessions/{sid}/terminals", json={"cmd": ["/bin/true"]}, headers=auth)
                assert made.status_code == 201, made.text
                assert table.wait_gone(sid, made.json()["pid"], 30), "its end was not handled within 30 s"
            for _ in range(70):
                made = client.post(f"/v1/sessions/{sid}/terminals", json={"cmd": ["sleep", "600"]}, headers=auth)
                assert made.status_code == 201, made.text
                gone = client.delete(f"/v1/sessions/{sid}/terminals/{made.json()['pid']}", headers=auth)
                assert gone.status_code == 204, gone.text
            print(f"140 terminals made and ended in {time.monotonic() - started:.1f} s")
            reach = live_reach(sid)
            assert reach is not None and reach.open_count() == 0
            assert client.get(f"/v1/sessions/{sid}/terminals", headers=auth).json() == []

            # a terminal still starts, takes input and ends
            made = client.post(
                f"/v1/sessions/{sid}/terminals",
                json={"cmd": ["sh", "-c", "echo ready; read x; echo got-$x"]},
                headers=auth,
            )
            assert made.status_code == 201, made.text
            pid = made.json()["pid"]
            shown, code = b"", None
            with client.stream("GET", f"/v1/sessions/{sid}/terminals/{pid}/output", headers=auth) as events:
                kind = ""
                for line in events.iter_lines():
                    if line.startswith("event: "):
                        kind = line[7:]
                    elif line.startswith("data: ") and kind == "data":
                        shown += base64.b64decode(json.loads(line[6:]))
                        if b"ready" in shown and b"typed" not in shown:
                            typed = client.post(
                                f"/v1/sessions/{sid}/terminals/{pid}/input", json={"data": "hi\r"}, headers=auth
                            )
                            assert typed.status_code == 204, typed.text
                            shown += b"typed"
                    elif line.startswith("data: ") and kind == "exit":
                        code = json.loads(line[6:])["exit_code"]
                        break
            assert code == 0 and b"got-hi" in shown, shown[-400:]
            assert table.wait_gone(sid, pid, 30) and reach.open_count() == 0

            # and a preview reaches a server inside (before: 503, no channel left)
            cell = client.post(f"/v1/sessions/{sid}/cells", json={"code": WEB}, headers=auth)
            assert cell.status_code == 200 and cell.json()["exit_code"] == 0, cell.text
            client.put(f"/v1/sessions/{sid}/files/hello.txt", content=b"still here\n", headers=auth)
            host = f"8000-{sid}.localhost:{url.rsplit(':', 1)[1]}"  # the preview host, sent to the server itself
            r = _until_served(lambda: client.get("/hello.txt", headers={"Host": host, **auth}))
            assert (r.status_code, r.text) == (200, "still here\n")
        finally:
            client.delete(f"/v1/sessions/{sid}", headers=auth)


@pytest.mark.parametrize("end", ["pause", "delete"])
def test_a_session_that_goes_releases_its_terminals_and_ends_their_streams(server, end):
    url, mine, _, table = server
    auth = {"Authorization": f"Bearer {mine}"}
    with httpx.Client(base_url=url, timeout=60) as client:
        sid = client.post("/v1/sessions", json={}, headers=auth).json()["id"]
        try:
            pids = []
            for _ in range(3):
                made = client.post(f"/v1/sessions/{sid}/terminals", json={"cmd": ["sleep", "600"]}, headers=auth)
                assert made.status_code == 201, made.text
                pids.append(made.json()["pid"])
            held = [table.held(sid, pid) for pid in pids]
            reach = live_reach(sid)
            assert reach is not None and reach.open_count() == 3

            ended: list[list[tuple[str, str]]] = []
            with client.stream("GET", f"/v1/sessions/{sid}/terminals/{pids[0]}/output", headers=auth) as events:
                assert events.status_code == 200
                follower = threading.Thread(target=lambda: ended.append(_events(events.iter_lines())), daemon=True)
                follower.start()
                started = time.monotonic()
                if end == "pause":
                    r = client.post(f"/v1/sessions/{sid}/pause", headers=auth)
                    assert r.status_code == 200, r.text
                else:
                    assert client.delete(f"/v1/sessions/{sid}", headers=auth).status_code == 204
                follower.join(20)  # before: 30 s of waiting for an exit code that never came
                assert ended, f"the stream did not end within 20 s of the {end}"
            print(f"the stream ended {time.monotonic() - started:.2f} s after the {end} began")
            assert ended[0][-1][0] == "error" and json.loads(ended[0][-1][1])["code"] == "terminal_gone", ended
            assert all(h is not None and h.released for h in held)
            assert table.listed(sid) == [] and all(table.held(sid, pid) is None for pid in pids)
            assert reach.open_count() == 0 and live_reach(sid) is None
        finally:
            client.delete(f"/v1/sessions/{sid}", headers=auth)


def test_revoking_a_token_ends_its_terminal_streams(server, tmp_path):
    """Revoked as ``sandloop tokens revoke`` does it: from another connection to the database,
    heard by the store's poller (``REVOKE_POLL``)."""
    url, _, tokens, table = server
    secret, token = tokens.create("revoked-soon", runs_per_minute=1000)
    auth = {"Authorization": f"Bearer {secret}"}
    with httpx.Client(base_url=url, timeout=60) as client:
        sid = client.post("/v1/sessions", json={}, headers=auth).json()["id"]
        try:
            made = client.post(
                f"/v1/sessions/{sid}/terminals", json={"cmd": ["sh", "-c", "echo ready; sleep 600"]}, headers=auth
            )
            assert made.status_code == 201, made.text
            pid = made.json()["pid"]
            seen, started = [], 0.0
            with client.stream("GET", f"/v1/sessions/{sid}/terminals/{pid}/output", headers=auth) as events:
                assert events.status_code == 200
                kind = ""
                for line in events.iter_lines():  # before: on until the client left
                    if line.startswith("event: "):
                        kind = line[7:]
                    elif line.startswith("data: "):
                        seen.append((kind, line[6:]))
                        if kind == "data" and not started:  # the stream follows (and listens): revoke
                            started = time.monotonic()
                            assert TokenStore(tokens.path).revoke(token.id) is not None
                took = time.monotonic() - started
            print(f"the stream ended {took:.2f} s after the revocation")
            assert seen[-1][0] == "error" and json.loads(seen[-1][1])["code"] == "unauthorized", seen
            assert took < 20
            assert client.get(f"/v1/sessions/{sid}/terminals", headers=auth).status_code == 401
        finally:
            default_root().delete_session(sid)
            tokens.disown(sid)

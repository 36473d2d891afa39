"""The HTTP API through a real HTTP client against a real uvicorn on loopback."""

from __future__ import annotations

import base64
import io
import json
import os
import socket
import statistics
import tarfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import uvicorn

from sandloop.server.app import create_app
from sandloop.server.providers import ProviderEndpoints
from sandloop.server.tokens import TokenStore
from tests.helpers import our_containers
from tests.servers import serve_in_thread, sse_events


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tokens = TokenStore(tmp_path_factory.mktemp("api") / "tokens.sqlite")
    port = _free_port()
    config = uvicorn.Config(create_app(tokens), host="127.0.0.1", port=port, log_level="warning")
    srv = uvicorn.Server(config)
    thread = threading.Thread(target=srv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not srv.started and time.monotonic() < deadline:
        time.sleep(0.05)
    assert srv.started
    yield f"http://127.0.0.1:{port}", tokens
    srv.should_exit = True
    thread.join(10)


@pytest.fixture(scope="module")
def alice(server):
    url, tokens = server
    secret, _ = tokens.create("alice", max_concurrent=8, runs_per_minute=1000, max_memory="512m", max_timeout=60)
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {secret}"}, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def bob(server):
    url, tokens = server
    secret, _ = tokens.create("bob")
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {secret}"}, timeout=120) as c:
        yield c


def test_health_metrics_and_openapi(server, alice):
    url, _ = server
    assert httpx.get(f"{url}/healthz").json() == {"status": "ok"}
    spec = httpx.get(f"{url}/openapi.json").json()
    assert "/v1/runs" in spec["paths"] and "/v1/sessions/{session_id}/cells" in spec["paths"]
    assert "sandloop_runs_total" in alice.get("/metrics").text
    ran = alice.post("/v1/runs", json={"code": "print(1)"}).json()
    assert ran["backend"] in ("oci", "docker")  # which backend started the sandbox, also counted:
    assert f'sandloop_runs_by_backend_total{{backend="{ran["backend"]}"}}' in alice.get("/metrics").text


def test_auth_is_required_and_checked(server):
    url, tokens = server
    r = httpx.post(f"{url}/v1/runs", json={"code": "print(1)"})
    assert r.status_code == 401 and r.json()["code"] == "unauthorized" and r.headers["www-authenticate"] == "Bearer"
    r = httpx.post(f"{url}/v1/runs", json={"code": "print(1)"}, headers={"Authorization": "Bearer sl_wrong"})
    assert r.status_code == 401
    secret, token = tokens.create("short-lived")
    assert tokens.revoke(token.id)
    r = httpx.post(f"{url}/v1/runs", json={"code": "print(1)"}, headers={"Authorization": f"Bearer {secret}"})
    assert r.status_code == 401 and "revoked" in r.json()["message"]


def test_run_results_and_notes(alice):
    r = alice.post("/v1/runs", json={"code": "print(6*7)"})
    assert r.status_code == 200 and r.json()["stdout"] == "42\n" and r.json()["ok"] is True
    r = alice.post("/v1/runs", json={"code": "x = bytearray(600 << 20)", "limits": {"memory": "128m"}})
    body = r.json()
    assert r.status_code == 200 and body["exit_code"] == 137 and body["oom_killed"]
    assert any("128m memory limit" in n for n in body["notes"])
    r = alice.post("/v1/runs", json={"code": "console.log(process.version)", "language": "node"})
    assert r.json()["stdout"].startswith("v")


@pytest.mark.parametrize(
    "body, status, code",
    [
        ({"code": "x", "language": "cobol"}, 400, "unknown_language"),
        ({"language": "python"}, 400, "invalid_request"),
        ({"code": "x", "timeout_seconds": -1}, 400, "invalid_request"),
        ({"code": "x" * 1_000_001}, 413, "too_large"),
        ({"code": "x", "limits": {"memory": "2g"}}, 403, "over_token_limit"),
        ({"code": "x", "timeout_seconds": 120}, 403, "over_token_limit"),
    ],
)
def test_error_statuses(alice, body, status, code):
    r = alice.post("/v1/runs", json=body)
    assert (r.status_code, r.json()["code"]) == (status, code), r.text
    assert r.json()["message"]


def test_rate_limit_is_a_429_with_retry_after(server):
    url, tokens = server
    secret, _ = tokens.create("slow", runs_per_minute=2)
    h = {"Authorization": f"Bearer {secret}"}
    codes = [
        httpx.post(f"{url}/v1/runs", json={"code": "print(1)"}, headers=h, timeout=60).status_code for _ in range(3)
    ]
    assert codes == [200, 200, 429]
    r = httpx.post(f"{url}/v1/runs", json={"code": "print(1)"}, headers=h)
    assert int(r.headers["retry-after"]) >= 1 and r.json()["code"] == "rate_limited"


def test_engine_trouble_is_a_503(server, alice, tmp_path):
    from sandloop import Sandloop, Settings

    url, tokens = server
    with (
        Sandloop(Settings(image="sandloop-runtime:not-built", home=tmp_path)) as broken,
        serve_in_thread(create_app(tokens, sandloop=broken)) as broken_url,
    ):
        r = httpx.post(f"{broken_url}/v1/runs", json={"code": "print(1)"}, headers=alice.headers)
    assert (
        r.status_code == 503
        and r.json()["code"] == "engine_unavailable"
        and "sandloop images build" in r.json()["message"]
    )


def test_sessions_files_cells_and_token_isolation(alice, bob):
    r = alice.post("/v1/sessions", json={"ttl_seconds": 300, "quota": "32m"})
    assert r.status_code == 201
    sid = r.json()["id"]
    try:
        assert alice.put(f"/v1/sessions/{sid}/files/in/data.csv", content=b"v\n1\n2\n").json()["size"] == 6
        assert [e["name"] for e in alice.get(f"/v1/sessions/{sid}/files", params={"path": "in"}).json()] == ["data.csv"]
        assert alice.get(f"/v1/sessions/{sid}/files/in/data.csv").content == b"v\n1\n2\n"
        r = alice.post(f"/v1/sessions/{sid}/runs", json={"code": "cat in/data.csv | wc -l", "language": "bash"})
        assert r.json()["stdout"].strip() == "3"
        alice.post(f"/v1/sessions/{sid}/cells", json={"code": "import pandas as pd\ndf = pd.read_csv('in/data.csv')"})
        r = alice.post(
            f"/v1/sessions/{sid}/cells",
            json={"code": "import matplotlib.pyplot as plt\nplt.plot(df.v)\nint(df.v.sum())"},
        )
        body = r.json()
        assert body["value"] == "3" and base64.b64decode(body["artifacts"][0]["data_base64"]).startswith(b"\x89PNG")
        assert sid in [s["id"] for s in alice.get("/v1/sessions").json()]
        # bob sees nothing of it, and cannot tell it exists
        assert sid not in [s["id"] for s in bob.get("/v1/sessions").json()]
        for method, path, kw in [
            ("GET", f"/v1/sessions/{sid}", {}),
            ("POST", f"/v1/sessions/{sid}/runs", {"json": {"code": "print(1)"}}),
            ("POST", f"/v1/sessions/{sid}/cells", {"json": {"code": "1"}}),
            ("GET", f"/v1/sessions/{sid}/files/in/data.csv", {}),
            ("PUT", f"/v1/sessions/{sid}/files/x", {"content": b"x"}),
            ("DELETE", f"/v1/sessions/{sid}", {}),
        ]:
            r = bob.request(method, path, **kw)
            assert r.status_code == 404 and r.json()["code"] == "not_found", (method, path, r.text)
        r = alice.get(f"/v1/sessions/{sid}/files/../../etc/passwd")
        assert r.status_code in (400, 404)
        r = alice.get(f"/v1/sessions/{sid}/files/nope.txt")
        assert r.status_code == 404
        assert alice.delete(f"/v1/sessions/{sid}/files/in/data.csv").status_code == 204
    finally:
        assert alice.delete(f"/v1/sessions/{sid}").status_code == 204
    assert alice.get(f"/v1/sessions/{sid}").status_code == 404


def test_load_200_concurrent_clients(server):
    """Every request answered (a result or a 429), bounded in time, the server responsive, no leaks."""
    url, tokens = server
    secret, _ = tokens.create("load", max_concurrent=8, runs_per_minute=10_000)
    h = {"Authorization": f"Bearer {secret}"}
    latencies: list[float] = []
    health: list[int] = []
    stop = threading.Event()

    def probe() -> None:
        while not stop.is_set():
            health.append(httpx.get(f"{url}/healthz", timeout=10).status_code)
            time.sleep(0.2)

    def one(i: int) -> int:
        t = time.monotonic()
        r = httpx.post(f"{url}/v1/runs", json={"code": f"print({i})"}, headers=h, timeout=120)
        latencies.append(time.monotonic() - t)
        if r.status_code == 200:
            assert r.json()["stdout"] == f"{i}\n"
        else:
            assert r.status_code == 429 and "retry-after" in r.headers
        return r.status_code

    prober = threading.Thread(target=probe)
    prober.start()
    started = time.monotonic()
    with ThreadPoolExecutor(200) as pool:
        codes = list(pool.map(one, range(200)))
    elapsed = time.monotonic() - started
    stop.set()
    prober.join()
    assert len(codes) == 200 and set(codes) <= {200, 429} and codes.count(200) >= 8
    assert elapsed < 120 and health and set(health) == {200}
    latencies.sort()
    print(
        f"\nload: 200 requests in {elapsed:.1f}s, ok {codes.count(200)}, 429 {codes.count(429)}, "
        f"p50 {statistics.median(latencies) * 1000:.0f} ms, p99 {latencies[197] * 1000:.0f} ms"
    )
    assert our_containers() == []


def test_agent_run_streams_its_transcript_as_sse(server, alice):
    import json as _json

    from sandloop.testing.wire import FakeProviderServer, openai_completion

    first = openai_completion(tool_calls=[("call_1", "execute_code", _json.dumps({"code": "print(2 ** 10)"}))])

    def conclude(req):
        return openai_completion("2**10 is " + req.body["messages"][-1]["content"].split("stdout:\n")[1].split()[0])

    with FakeProviderServer([first, conclude]) as provider:
        endpoints = ProviderEndpoints([f"openai={provider.url}/v1"])
        body = {"task": "compute 2**10", "provider": "openai", "model": "m", "base_url": provider.url + "/v1"}
        events = []
        with (
            serve_in_thread(create_app(server[1], providers=endpoints)) as url,
            httpx.Client(base_url=url, headers=alice.headers, timeout=120) as client,
            client.stream("POST", "/v1/agent/runs", json=body) as r,
        ):
            assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
            events += sse_events(r)
    kinds = [k for k, _ in events]
    assert kinds == ["assistant", "tool_call", "tool_result", "assistant", "done"], kinds
    assert events[2][1]["call_id"] == "call_1" and "1024" in events[2][1]["content"]
    assert events[-1][1]["answer"] == "2**10 is 1024" and events[-1][1]["stop_reason"] == "answered"


def test_every_sandbox_operation_counts_against_the_token(server):
    """Before: only runs and cells counted; a 3-a-minute token did 20 file operations in 7 s."""
    url, tokens = server
    secret, _ = tokens.create("metered", runs_per_minute=4, max_sessions=5)
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {secret}"}, timeout=120) as c:
        r = c.post("/v1/sessions", json={"ttl_seconds": 300, "quota": "16m"})  # 1
        assert r.status_code == 201
        sid = r.json()["id"]
        try:
            codes = [c.put(f"/v1/sessions/{sid}/files/a.txt", content=b"a").status_code]  # 2
            codes.append(c.get(f"/v1/sessions/{sid}/files").status_code)  # 3
            codes.append(c.get(f"/v1/sessions/{sid}/files/a.txt").status_code)  # 4
            limited = c.delete(f"/v1/sessions/{sid}/files/a.txt")
            assert codes == [200, 200, 200] and limited.status_code == 429, (codes, limited.text)
            assert limited.json()["code"] == "rate_limited" and int(limited.headers["retry-after"]) >= 1
            assert c.post("/v1/sessions", json={"quota": "16m"}).status_code == 429
        finally:
            tokens_store_owner = tokens.owner_of(sid)
            assert tokens_store_owner is not None
    # the window is per token: a fresh token cleans up
    cleaner, _ = tokens.create("cleaner")
    tokens.own(sid, tokens.verify(cleaner).id)
    assert httpx.delete(f"{url}/v1/sessions/{sid}", headers={"Authorization": f"Bearer {cleaner}"}).status_code == 204


def test_session_count_and_workspace_ceilings(server):
    """Before: a token created 5 sessions of quota 64g each."""
    url, tokens = server
    secret, _ = tokens.create("ceilings", max_sessions=2, max_workspace="48m")
    made = []
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {secret}"}, timeout=120) as c:
        try:
            r = c.post("/v1/sessions", json={"quota": "64g"})
            assert r.status_code == 403 and r.json()["code"] == "over_token_limit" and "48m" in r.json()["message"]
            for quota in ("16m", "16m"):
                r = c.post("/v1/sessions", json={"quota": quota})
                assert r.status_code == 201, r.text
                made.append(r.json()["id"])
            r = c.post("/v1/sessions", json={"quota": "8m"})
            assert r.status_code == 403 and "2 sessions" in r.json()["message"]
            assert c.delete(f"/v1/sessions/{made.pop()}").status_code == 204
            r = c.post("/v1/sessions", json={"quota": "24m"})  # 16m + 24m > 48m? no: 40m fits
            assert r.status_code == 201
            made.append(r.json()["id"])
            r = c.post("/v1/sessions", json={"quota": "8m"})
            assert r.status_code == 403
        finally:
            for sid in made:
                c.delete(f"/v1/sessions/{sid}")


def test_a_paused_sessions_state_counts_against_the_workspace_ceiling(server):
    """Issue 52 finding 9: a pause's bytes on disk (its state here, under runc; its memory image
    under gVisor) were counted nowhere (a 512m token put 1.5 GiB on disk). Counted once made:
    the next pause, or a session more, is refused until the pause is resumed."""
    url, tokens = server
    secret, _ = tokens.create("pauses", max_workspace="240m")
    made = []
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {secret}"}, timeout=120) as c:
        try:
            for _ in range(2):  # 96m + 96m of quotas: room for 48m more
                r = c.post("/v1/sessions", json={"quota": "96m", "limits": {"memory": "512m"}})
                assert r.status_code == 201, r.text
                made.append(r.json()["id"])
            first, second = made
            for sid in made:  # an interpreter runs in each (else a pause keeps files only)
                assert c.post(f"/v1/sessions/{sid}/cells", json={"code": "import os; x = 1"}).status_code == 200
            r = c.post(f"/v1/sessions/{first}/cells", json={"code": "blob = os.urandom(64 * 2**20)"})
            assert r.status_code == 200 and r.json()["ok"], r.text
            assert c.post(f"/v1/sessions/{first}/pause").json()["paused"] == "state"  # 64 MiB kept, pickled
            refused = c.post(f"/v1/sessions/{second}/pause")  # 192m + 64 MiB >= 240m
            assert refused.status_code == 403 and refused.json()["code"] == "over_token_limit", refused.text
            assert "resume a paused session" in refused.json()["message"]
            more = c.post("/v1/sessions", json={"quota": "16m"})  # fitted before: 208m of 240m
            assert more.status_code == 403 and "paused sessions' images" in more.json()["message"], more.text
            assert c.post(f"/v1/sessions/{first}/resume").status_code == 200  # its state is loaded and removed
            assert c.post(f"/v1/sessions/{second}/pause").status_code == 200
        finally:
            for sid in made:
                c.delete(f"/v1/sessions/{sid}")


def test_defaults_are_clamped_to_a_small_tokens_ceilings(server):
    """Before: a 5 s / 128m token was refused the defaults (30 s, 256m), so the playground failed."""
    url, tokens = server
    secret, _ = tokens.create("small", max_timeout=5, max_memory="128m")
    r = httpx.post(
        f"{url}/v1/runs", json={"code": "print(1)"}, headers={"Authorization": f"Bearer {secret}"}, timeout=60
    )
    assert r.status_code == 200 and r.json()["timeout_seconds"] == 5 and r.json()["limits"]["memory"] == "128m"


def test_errors_get_their_status_from_the_code_not_the_message(alice):
    r = alice.post("/v1/sessions", json={"ttl_seconds": 300, "quota": "8m"})
    sid = r.json()["id"]
    try:
        # a symlink named "escaped": before, "cap" in the message made it a 413
        code = "import os; os.symlink('/etc', 'escaped-cap'); os.makedirs('d/e')"
        assert alice.post(f"/v1/sessions/{sid}/runs", json={"code": code}).json()["ok"]
        r = alice.get(f"/v1/sessions/{sid}/files/escaped-cap/passwd")
        assert (r.status_code, r.json()["code"]) == (400, "path_refused"), r.text
        r = alice.get(f"/v1/sessions/{sid}/files/d")  # a directory: before, 500
        assert (r.status_code, r.json()["code"]) == (400, "path_refused") and "list" in r.json()["message"], r.text
        big = b"x" * (7 * 1024 * 1024)
        codes = [alice.put(f"/v1/sessions/{sid}/files/big{i}", content=big).status_code for i in range(2)]
        assert codes[0] == 200 and codes[1] == 507, codes  # the 8m workspace is full: before, 500
        r = alice.get(f"/v1/sessions/{sid}/files")
        assert "big1" not in [e["name"] for e in r.json()]  # nothing half-written is left
        assert not [e for e in r.json() if "sandloop-tmp" in e["name"]]
    finally:
        alice.delete(f"/v1/sessions/{sid}")


def test_a_run_streams_its_output_as_it_comes(alice):

    code = (
        "import sys, time\nfor i in range(3):\n    print(i, flush=True); time.sleep(0.3)\nprint('é', file=sys.stderr)"
    )
    events = []
    with alice.stream("POST", "/v1/runs", json={"code": code, "stream": True}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        for event in sse_events(r):
            events.append(event)
    kinds = [k for k, _ in events]
    assert kinds[-1] == "result" and kinds.count("stdout") >= 2, kinds  # not one block at the end
    streamed = "".join(d["text"] for k, d in events if k == "stdout")
    result = events[-1][1]
    assert streamed == result["stdout"] == "0\n1\n2\n" and result["stderr"] == "é\n" and result["ok"]
    r = alice.post("/v1/runs", json={"code": "x", "language": "cobol", "stream": True})
    assert r.status_code == 200 and "event: error" in r.text and "unknown_language" in r.text


def test_session_cells_and_runs_stream_as_they_print(alice, bob):
    """A cell prints, then waits for a file the test writes only after it has read that line
    from the stream: the line cannot have come at the end (before, "stream": true was refused)."""
    sid = alice.post("/v1/sessions", json={"quota": "16m"}).json()["id"]
    try:
        wait_for_go = (
            "import os, time\nprint('first', flush=True)\n"
            "for _ in range(600):\n    if os.path.exists('go'): break\n    time.sleep(0.1)\n"
            "os.remove('go')\nprint('second')"
        )
        for route, body in (("cells", {"code": wait_for_go}), ("runs", {"code": wait_for_go})):
            events, printed = [], ""
            with alice.stream("POST", f"/v1/sessions/{sid}/{route}", json={**body, "stream": True}) as r:
                assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
                for kind, data in sse_events(r):
                    events.append((kind, data))
                    printed += data["text"] if kind == "stdout" else ""
                    if printed == "first\n":  # seen while the cell waits: now let it go on
                        assert alice.put(f"/v1/sessions/{sid}/files/go", content=b"1").status_code in (200, 201)
            kinds = [k for k, _ in events]
            assert kinds[0] == "stdout" and kinds[-1] == "result", (route, events)
            result = events[-1][1]
            assert result["stdout"] == "first\nsecond\n" and result["ok"], (route, result)
        r = alice.post(f"/v1/sessions/{sid}/cells", json={"code": "x = 41", "stream": True})
        assert r.text.count("event: ") == 1 and "event: result" in r.text
        assert json.loads(r.text.split("data: ", 1)[1])["notes"] == []  # a silent cell needs no note
        r = bob.post(f"/v1/sessions/{sid}/cells", json={"code": "1", "stream": True})
        assert r.status_code == 404  # another token's session: a status, before any stream
    finally:
        alice.delete(f"/v1/sessions/{sid}")


def test_session_contexts_languages_and_displayed_outputs_over_http(alice, bob):
    """Issue 22: contexts and languages of a session's cells, and each displayed output as a
    ``display`` event as it comes (a cell that waits for a file the test writes only once it has
    seen the first display)."""
    sid = alice.post("/v1/sessions", json={"quota": "16m"}).json()["id"]
    try:
        made = alice.post(f"/v1/sessions/{sid}/contexts", json={"language": "bash"})
        assert made.status_code == 201 and made.json()["language"] == "bash"
        cid = made.json()["id"]
        r = alice.post(f"/v1/sessions/{sid}/cells", json={"code": "X=5; echo $X", "context": cid})
        assert r.json()["stdout"] == "5\n" and r.json()["context"] == cid
        again = alice.post(f"/v1/sessions/{sid}/cells", json={"code": "echo $X", "context": cid})
        assert again.json()["stdout"] == "5\n"
        js = alice.post(f"/v1/sessions/{sid}/cells", json={"code": "[1, 2].map(x => x * 2)", "language": "js"})
        assert js.json()["value"] == "[ 2, 4 ]" and js.json()["outputs"][0]["data"]["application/json"] == [2, 4]
        ids = [c["id"] for c in alice.get(f"/v1/sessions/{sid}/contexts").json()]
        assert ids[:2] == ["default", "default-javascript"] and cid in ids
        assert alice.post(f"/v1/sessions/{sid}/contexts/{cid}/restart").status_code == 200
        assert (
            alice.post(f"/v1/sessions/{sid}/cells", json={"code": "echo ${X:-gone}", "context": cid}).json()["stdout"]
            == "gone\n"
        )
        assert alice.delete(f"/v1/sessions/{sid}/contexts/{cid}").status_code == 204
        missing = alice.post(f"/v1/sessions/{sid}/cells", json={"code": "1", "context": cid})
        assert missing.status_code == 404 and missing.json()["code"] == "not_found", missing.text
        bad = alice.post(f"/v1/sessions/{sid}/cells", json={"code": "1", "language": "cobol"})
        assert bad.status_code == 400 and "no interpreter" in bad.json()["message"]
        assert bob.get(f"/v1/sessions/{sid}/contexts").status_code == 404
        code = (
            "import os, time\nfrom IPython.display import display, HTML\ndisplay(HTML('<i>one</i>'))\n"
            "for _ in range(600):\n    if os.path.exists('go'): break\n    time.sleep(0.1)\n"
            "os.remove('go')\ndisplay(HTML('<i>two</i>'))\n3"
        )
        events = []
        with alice.stream("POST", f"/v1/sessions/{sid}/cells", json={"code": code, "stream": True}) as r:
            for kind, data in sse_events(r):
                events.append((kind, data))
                if kind == "display" and data["data"].get("text/html") == "<i>one</i>":
                    assert alice.put(f"/v1/sessions/{sid}/files/go", content=b"1").status_code in (200, 201)
        displays = [d for k, d in events if k == "display"]
        assert [d["data"].get("text/html") for d in displays] == ["<i>one</i>", "<i>two</i>", None]
        assert displays[-1]["type"] == "execute_result" and events[-1][0] == "result"
        assert [o["type"] for o in events[-1][1]["outputs"]] == ["display_data", "display_data", "execute_result"]
    finally:
        alice.delete(f"/v1/sessions/{sid}")


def test_a_streamed_run_whose_client_leaves_at_once_gives_its_slot_back(server):
    """Before: the token's concurrency slot was taken before the stream's generator first ran and
    given back only inside it, so a client that left before the body started kept it for good."""
    url, tokens = server
    secret, _ = tokens.create("leaver", max_concurrent=1, runs_per_minute=1000)
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"code": "import time; time.sleep(1); print(1)", "stream": True}).encode()
    request = (
        b"POST /v1/runs HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        + f"Authorization: Bearer {secret}\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        + body
    )
    with httpx.Client(base_url=url, headers={"Authorization": f"Bearer {secret}"}, timeout=120) as client:
        for i in range(4):
            with socket.create_connection((host, int(port))) as conn:
                conn.sendall(request)
                if i % 2:  # half wait to be admitted, half leave before any answer
                    assert conn.recv(12).startswith(b"HTTP/1.1 200")
            # the one slot comes back once the abandoned run ends (its own timeout bounds it)
            deadline = time.monotonic() + 120
            while (r := client.post("/v1/runs", json={"code": "print(2)"})).status_code == 429:
                assert time.monotonic() < deadline, "the slot never came back"
                time.sleep(0.2)
            assert r.status_code == 200 and r.json()["stdout"] == "2\n"


def test_archives_in_and_out_land_whole_or_not_at_all(alice):
    def tar_of(files: dict[str, bytes]) -> bytes:
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w:gz") as tar:
            for name, data in files.items():
                info = tarfile.TarInfo(name)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
        return buf.getvalue()

    sid = alice.post("/v1/sessions", json={"ttl_seconds": 300, "quota": "8m"}).json()["id"]
    try:
        r = alice.post(f"/v1/sessions/{sid}/archive", params={"dest": "in"}, content=tar_of({"a/b.txt": b"hello"}))
        assert r.status_code == 200 and r.json() == {"files": 1, "bytes": 5}, r.text
        r = alice.get(f"/v1/sessions/{sid}/archive", params={"path": "in"})
        assert r.status_code == 200 and r.headers["content-type"] == "application/gzip"
        with tarfile.open(fileobj=io.BytesIO(r.content)) as tar:
            assert tar.extractfile("in/a/b.txt").read() == b"hello"
        bomb = tar_of({"big": b"\0" * (9 * 1024 * 1024)})
        r = alice.post(f"/v1/sessions/{sid}/archive", content=bomb)
        assert (r.status_code, r.json()["code"]) == (413, "too_large"), r.text
        # fits the declared-size check, but not the disk: 3 x 2.5 MB into what is left of 8m
        parts = {f"part{i}": os.urandom(2_600_000) for i in range(3)}
        r = alice.post(f"/v1/sessions/{sid}/archive", params={"dest": "many"}, content=tar_of(parts))
        assert r.status_code == 507 and r.json()["code"] == "workspace_full", r.text
        names = [e["name"] for e in alice.get(f"/v1/sessions/{sid}/files").json()]
        assert "many" not in names and names == ["in"], names  # nothing half-written
        r = alice.post(f"/v1/sessions/{sid}/archive", content=b"not an archive")
        assert (r.status_code, r.json()["code"]) == (400, "invalid_argument")
    finally:
        alice.delete(f"/v1/sessions/{sid}")

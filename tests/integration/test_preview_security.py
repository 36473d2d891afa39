"""The way in, hardened (issue 52): preview URLs never serve a sandbox's page on the API's origin,
no credential of the owner reaches the sandbox, a relayed connection serves one preview, one
upload never blocks the server, a half-buffered request head is never taken for a preview's,
and a revoked token's relays end. Each test failed on the relay before this issue's fix."""

from __future__ import annotations

import json
import socket
import threading
import time

import httpx
import pytest

from sandloop.server.app import create_app
from sandloop.server.tokens import TokenStore
from tests.servers import serve_in_thread

#: Servers inside the sandbox: 8000 answers every request (HTTP/1.1, kept alive) with what it
#: was sent as JSON and counts them; 8002 accepts and never reads.
SERVERS = r"""
import json, socket, threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
seen = []
class Echo(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    def do_GET(self):
        seen.append(self.path)
        body = json.dumps({"path": self.path, "headers": dict(self.headers.items()), "count": len(seen)}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)
    def log_message(self, *args):
        pass
threading.Thread(target=ThreadingHTTPServer(("127.0.0.1", 8000), Echo).serve_forever, daemon=True).start()
sink = socket.socket(); sink.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
sink.bind(("127.0.0.1", 8002)); sink.listen(8)
held = []
def _hold():
    while True:
        held.append(sink.accept())
threading.Thread(target=_hold, daemon=True).start()
"""


def _get(sock: socket.socket, head: str) -> bytes:
    """One answer with a Content-Length, read whole from ``sock`` after sending ``head``."""
    sock.sendall(head.encode())
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = sock.recv(65536)
        assert chunk, got
        got += chunk
    top, _, body = got.partition(b"\r\n\r\n")
    length = next(int(line.split(b":")[1]) for line in top.split(b"\r\n") if line.lower().startswith(b"content-length"))
    while len(body) < length:
        chunk = sock.recv(65536)
        assert chunk, got
        body += chunk
    return top + b"\r\n\r\n" + body


@pytest.fixture(scope="module")
def box(tmp_path_factory):
    tokens = TokenStore(tmp_path_factory.mktemp("preview") / "tokens.sqlite")
    mine, _ = tokens.create("mine")
    with serve_in_thread(create_app(tokens)) as url:
        port = int(url.rsplit(":", 1)[1])
        auth = {"Authorization": f"Bearer {mine}"}
        with httpx.Client(base_url=url, timeout=60) as client:
            made = client.post("/v1/sessions", json={}, headers=auth)
            assert made.status_code == 201, made.text
            sid = made.json()["id"]
            try:
                cell = client.post(f"/v1/sessions/{sid}/cells", json={"code": SERVERS}, headers=auth)
                assert cell.status_code == 200 and cell.json()["exit_code"] == 0, cell.text
                yield {"url": url, "port": port, "sid": sid, "mine": mine, "tokens": tokens, "auth": auth}
            finally:
                client.delete(f"/v1/sessions/{sid}", headers=auth)


def _host(box: dict, port: int = 8000) -> str:
    return f"{port}-{box['sid']}.localhost:{box['port']}"


def test_no_credential_of_the_owner_reaches_the_sandbox(box):
    """Finding 2: the key in Authorization or X-API-Key, the preview cookie, E2B's traffic
    token and ``?sandloop_token=`` are taken out of every request (the first and the later ones
    on a kept-alive connection); the app's own cookies and credentials pass."""
    host, mine = _host(box), box["mine"]
    with httpx.Client(base_url=box["url"], timeout=60) as client:
        first = client.get(f"/x?sandloop_token={mine}", headers={"Host": host})
        assert first.status_code == 307, first.text
        keyed = httpx.URL(first.headers["location"])
        assert keyed.path == "/x" and mine not in str(keyed)
    with socket.create_connection(("127.0.0.1", box["port"]), timeout=60) as sock:
        answers = []
        for path in ("/a", f"/b?keep=1&sandloop_token={mine}"):
            head = (
                f"GET {path} HTTP/1.1\r\nHost: {keyed.host}:{box['port']}\r\nCookie: theirs=1; sandloop_preview=x\r\n"
                f"X-API-Key: {mine}\r\ne2b-traffic-access-token: secret-traffic\r\nX-Own: kept\r\n\r\n"
            )
            answers.append(_get(sock, head))
    seen = [json.loads(a.partition(b"\r\n\r\n")[2]) for a in answers]
    assert [s["path"] for s in seen] == ["/a", "/b?keep=1"]
    for s in seen:
        text = json.dumps(s)
        assert mine not in text and "sandloop_preview" not in text and "secret-traffic" not in text, text
        headers = {k.lower(): v for k, v in s["headers"].items()}
        assert headers["cookie"] == "theirs=1" and headers["x-own"] == "kept", headers
        assert "x-api-key" not in headers and "authorization" not in headers
    with httpx.Client(base_url=box["url"], timeout=60) as client:
        # an app's own bearer credential is the app's: it passes; a sandloop key never does
        r = client.get("/c", headers={"Host": host, "Authorization": f"Bearer {mine}"})
        assert "authorization" not in {k.lower() for k in r.json()["headers"]}, r.text
    with httpx.Client(base_url=box["url"], timeout=60) as client:  # (a new connection: another origin)
        r = client.get("/d", headers={"Host": f"{keyed.host}:{box['port']}", "Authorization": "Bearer app"})
        assert r.json()["headers"].get("authorization") == "Bearer app", r.text


def test_the_path_form_only_redirects_to_the_previews_own_origin(box):
    """Finding 1: nothing of a sandbox is served on the API's origin."""
    sid, mine = box["sid"], box["mine"]
    with socket.create_connection(("127.0.0.1", box["port"]), timeout=60) as sock:
        got = _get(
            sock,
            f"GET /sandboxes/{sid}/ports/8000/p?q=1 HTTP/1.1\r\nHost: 127.0.0.1:{box['port']}\r\n"
            f"Authorization: Bearer {mine}\r\n\r\n",
        )
        assert got.startswith(b"HTTP/1.1 307"), got
        assert f"Location: http://{_host(box)}/p?q=1".encode() in got, got
        assert b'"path"' not in got  # the sandbox's server was not asked
        assert sock.recv(100) == b""  # and the connection ends there


def test_a_relayed_connection_serves_one_preview(box):
    """Finding 1: a kept-alive connection's later request for the API (or another preview) is
    refused with 421, never relayed to the sandbox with its token."""
    host, mine = _host(box), box["mine"]
    with socket.create_connection(("127.0.0.1", box["port"]), timeout=60) as sock:
        one = _get(sock, f"GET /one HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {mine}\r\n\r\n")
        assert one.startswith(b"HTTP/1.1 200"), one
        count = json.loads(one.partition(b"\r\n\r\n")[2])["count"]
        two = _get(
            sock, f"GET /v1/sessions HTTP/1.1\r\nHost: 127.0.0.1:{box['port']}\r\nAuthorization: Bearer {mine}\r\n\r\n"
        )
        assert two.startswith(b"HTTP/1.1 421"), two
    with httpx.Client(base_url=box["url"], timeout=60) as client:
        after = client.get("/three", headers={"Host": host, "Authorization": f"Bearer {mine}"}).json()
    assert after["count"] == count + 1  # /v1/sessions never reached the sandbox


def test_an_upload_nobody_reads_blocks_neither_the_server_nor_the_sandbox(box):
    """Finding 3: 17 MiB posted to a server inside that reads nothing fills its channel's window
    and then waits; the API answers meanwhile, and so does another port of the same sandbox."""
    host, mine = _host(box, 8002), box["mine"]
    size = 17 * 1024 * 1024
    sock = socket.create_connection(("127.0.0.1", box["port"]), timeout=120)
    sent = [0]

    def upload() -> None:
        try:
            head = (
                f"POST /up HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {mine}\r\nContent-Length: {size}\r\n\r\n"
            )
            sock.sendall(head.encode())
            chunk = b"u" * 65536
            while sent[0] < size:
                sock.sendall(chunk)
                sent[0] += len(chunk)
        except OSError:
            pass

    uploader = threading.Thread(target=upload, daemon=True)
    uploader.start()
    try:
        deadline = time.monotonic() + 120
        last, still = -1, 0
        while still < 5 and time.monotonic() < deadline:  # the upload stalls (the window is full)
            time.sleep(0.2)
            still = still + 1 if sent[0] == last else 0
            last = sent[0]
        assert sent[0] < size and uploader.is_alive(), sent
        with httpx.Client(base_url=box["url"], timeout=60) as client:
            assert client.get("/healthz").status_code == 200
            r = client.get("/other", headers={"Host": _host(box), "Authorization": f"Bearer {mine}"})
            assert r.status_code == 200 and r.json()["path"] == "/other"
        assert uploader.is_alive()  # all the while, the upload was still stalled
    finally:
        sock.close()
        uploader.join(30)


def test_a_half_buffered_head_is_never_taken_for_a_previews(box):
    """Finding 10: a pipelined request's first bytes held by h11, then a packet that looks like a
    preview's head: the bytes are one request for the API, as HTTP reads them."""
    mine = box["mine"]
    with socket.create_connection(("127.0.0.1", box["port"]), timeout=60) as sock:
        first = _get(sock, "GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\nGET /healthz HTTP/1.1\r\nX-A: ")
        assert first.startswith(b"HTTP/1.1 200")
        second = _get(sock, f"GET /x HTTP/1.1\r\nHost: {_host(box)}\r\nAuthorization: Bearer {mine}\r\n\r\n")
    assert second.startswith(b"HTTP/1.1 200") and b'"path"' not in second, second  # the API's /healthz


def test_revoking_a_token_ends_its_open_previews(box):
    """Finding 11: a kept-alive preview connection of a token ends once the token is revoked (in
    this process or another: the relay rereads the token store)."""
    secret, token = box["tokens"].create("revoked-soon")
    auth = {"Authorization": f"Bearer {secret}"}
    with httpx.Client(base_url=box["url"], timeout=60) as client:
        sid = client.post("/v1/sessions", json={}, headers=auth).json()["id"]
        try:
            cell = client.post(f"/v1/sessions/{sid}/cells", json={"code": SERVERS}, headers=auth)
            assert cell.status_code == 200 and cell.json()["exit_code"] == 0, cell.text
            with socket.create_connection(("127.0.0.1", box["port"]), timeout=60) as sock:
                host = f"8000-{sid}.localhost:{box['port']}"
                one = _get(sock, f"GET /r HTTP/1.1\r\nHost: {host}\r\nAuthorization: Bearer {secret}\r\n\r\n")
                assert one.startswith(b"HTTP/1.1 200"), one
                box["tokens"].revoke(token.id)
                assert sock.recv(100) == b""  # closed by the relay's next check, well before the timeout
        finally:
            client.delete(f"/v1/sessions/{sid}", headers=auth)  # (refused once revoked: the reaper's then)

"""Reaching into running sandboxes (issue 38): a server the code starts in a session is reached
through ``Session.expose`` and through preview URLs of ``sandloop serve`` (host and path forms,
HTTP and WebSocket); terminals run, resize and end; and what reaches in cannot be turned around:
the way in reaches only the sandbox's own loopback, never the host's or another sandbox's, and
the agent that carries it is one of the sandbox's own processes (its user, no capabilities, its
seccomp filter, no new privileges), on runc and gVisor."""

from __future__ import annotations

import base64
import json
import os
import socket
import time

import httpx
import pytest

from sandloop import InvalidArgument, SandboxLimits, Session
from sandloop.runtime.reach.mux import PortClosed, ReachError
from sandloop.server.app import create_app
from sandloop.server.tokens import TokenStore
from tests.helpers import read_until
from tests.servers import serve_in_thread

#: A server on a port inside the sandbox, started by a cell: plain HTTP (python's http.server
#: serving /workspace) and a WebSocket echo written with the standard library (the image has no
#: WebSocket package, and the relay must carry the upgrade's bytes as they are).
SERVERS = r"""
import base64, hashlib, socket, subprocess, threading
web = subprocess.Popen(["python3", "-m", "http.server", "8000"], cwd="/workspace",
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

def _ws(conn):
    head = b""
    while b"\r\n\r\n" not in head:
        head += conn.recv(4096)
    key = [l.split(b":", 1)[1].strip() for l in head.split(b"\r\n") if l.lower().startswith(b"sec-websocket-key")][0]
    accept = base64.b64encode(hashlib.sha1(key + b"258EAFA5-E914-47DA-95CA-C5AB0DC85B11").digest())
    conn.sendall(b"HTTP/1.1 101 Switching Protocols\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                 b"Sec-WebSocket-Accept: " + accept + b"\r\n\r\n")
    f = conn.makefile("rb")
    while True:
        b1, b2 = f.read(2)
        n = b2 & 127
        if n == 126:
            n = int.from_bytes(f.read(2), "big")
        mask = f.read(4)
        data = bytes(c ^ mask[i % 4] for i, c in enumerate(f.read(n)))
        if b1 & 15 == 8:
            return
        reply = b"echo:" + data
        conn.sendall(bytes([0x81, len(reply)]) + reply)

def _serve_ws():
    s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    s.bind(("127.0.0.1", 8001)); s.listen(8)
    while True:
        c, _ = s.accept()
        threading.Thread(target=_ws, args=(c,), daemon=True).start()

threading.Thread(target=_serve_ws, daemon=True).start()
"""


def _until_served(get, seconds: float = 60.0):
    """The first answer that is not a 502 (the server inside is still starting), bounded."""
    deadline = time.monotonic() + seconds
    while True:
        r = get()
        if r.status_code != 502 or time.monotonic() > deadline:
            return r
        time.sleep(0.2)


def _ws_roundtrip(sock: socket.socket, head: bytes, message: bytes) -> tuple[bytes, bytes]:
    """(the answer's head, the first frame's payload) of a WebSocket opened by ``head``."""
    sock.sendall(head)
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = sock.recv(4096)
        assert chunk, got
        got += chunk
    answer, _, rest = got.partition(b"\r\n\r\n")
    mask = os.urandom(4)
    sock.sendall(bytes([0x81, 0x80 | len(message)]) + mask + bytes(c ^ mask[i % 4] for i, c in enumerate(message)))
    while len(rest) < 2 or len(rest) < 2 + rest[1]:
        chunk = sock.recv(4096)
        assert chunk, rest
        rest += chunk
    return answer, rest[2 : 2 + rest[1]]


def _ws_head(path: str, host: str, extra: str = "") -> bytes:
    key = base64.b64encode(os.urandom(16)).decode()
    return (
        f"GET {path} HTTP/1.1\r\nHost: {host}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n{extra}\r\n"
    ).encode()


def test_expose_and_a_terminal_in_a_session(runtime):
    with Session(limits=SandboxLimits(runtime=runtime)) as s:
        s.write_file("hello.txt", "from the sandbox\n")
        s.run_cell(SERVERS)
        with s.expose(8000) as url, httpx.Client(timeout=30) as client:
            r = _until_served(lambda: client.get(f"{url}/hello.txt"))
            assert (r.status_code, r.text) == (200, "from the sandbox\n")
        with pytest.raises(PortClosed, match="nothing listens on port 8999"):
            s.connect(8999)
        with pytest.raises(ReachError, match="port must be 1-65535, got 70000"):
            s.expose(70000)  # said now, not by each connection later
        # one request, read whole (what an agent checks its server with): capped, bounded, refused
        answer = s.request(8000, "/hello.txt")
        assert (answer.status, answer.text, answer.truncated) == (200, "from the sandbox\n", False)
        assert answer.headers["content-length"] == "17"
        assert s.request(8000, "/hello.txt", max_bytes=4).body == b"from" and s.request(8000, "/x").status == 404
        with pytest.raises(PortClosed, match="nothing listens on port 8999"):
            s.request(8999)
        with pytest.raises(InvalidArgument, match="path must start with /"):
            s.request(8000, "hello.txt")
        with pytest.raises(InvalidArgument, match="a value has no line breaks"):
            s.request(8000, headers={"X-A": "1\r\nX-Smuggled: 2"})

        term = s.terminal(cols=80, rows=24, envs={"ABC": "123"})
        term.send(b"echo $ABC-$(tput cols)-$(id -u)\n")
        assert b"123-80-65534" in read_until(term, b"123-80-65534")  # its env, its size, the sandbox's user
        term.resize(132, 40)
        # A resize can land while readline reads the size to set it back at a prompt (wide under
        # gVisor: ci12, ci15); the agent puts the host's size back (agent.SETTLE): asked until it
        # is seen, bounded, so a resize that stays undone still fails.
        term.send(b"for i in $(seq 50); do [ $(tput cols) = 132 ] && break; sleep 0.1; done; echo now=$(tput cols)\n")
        assert b"now=132" in read_until(term, b"now=132")
        term.send(b"exit 4\n")
        assert term.wait(30) == 4

        # a program on a terminal is told of its new size (gVisor sends no SIGWINCH itself)
        script = "trap 'echo winch-$(stty size)' WINCH; echo up-$((6*7)); while :; do sleep 0.05; done"
        told = s.terminal(cmd=["/bin/sh", "-c", script])
        read_until(told, b"up-42")
        told.resize(100, 30)
        assert b"winch-30 100" in read_until(told, b"winch-30 100")
        told.close()


def test_the_agent_is_one_of_the_sandboxes_own_processes(runtime):
    """What carries ports and terminals has what the interpreter's own processes have (the
    sandbox's user, no capabilities, the seccomp filter, no new privileges): seen from inside, in
    /proc of the agent itself beside /proc of a cell's process."""
    wanted = "^(Uid|Gid|CapEff|CapPrm|CapBnd|NoNewPrivs|Seccomp):"
    with Session(limits=SandboxLimits(runtime=runtime)) as s:
        term = s.terminal(cmd=["/bin/sh", "-c", f"grep -E '{wanted}' /proc/$PPID/status"])
        out = b""
        while not term.ended:
            out += term.recv(30)
        assert term.wait(30) == 0
        grep = f"subprocess.run(['grep', '-E', {wanted!r}, '/proc/self/status'], capture_output=True, text=True)"
        cell = s.run_cell(f"import subprocess; print({grep}.stdout)")

    def fields(text: str) -> dict[str, list[str]]:
        return {k.strip(): v.split() for k, v in (line.split(":", 1) for line in text.splitlines() if ":" in line)}

    agent, own = fields(out.decode().replace("\r", "")), fields(cell.stdout)
    assert agent == own and agent, (agent, own)
    assert agent["Uid"][:2] == ["65534", "65534"], agent
    assert agent["CapEff"] == agent["CapPrm"] == ["0000000000000000"], agent
    if runtime == "runc":  # gVisor's /proc reports neither (its sentry filters the whole sandbox)
        assert agent["NoNewPrivs"] == ["1"] and agent["Seccomp"] == ["2"], agent


def test_a_port_reaches_only_the_sandboxes_own_loopback(runtime):
    """A port the host listens on, or another sandbox does, is not reachable through a sandbox's
    way in: the connection is made inside, where nothing listens."""
    host = socket.socket()
    host.bind(("127.0.0.1", 0))
    host.listen(1)
    port = host.getsockname()[1]
    try:
        with (
            Session(limits=SandboxLimits(runtime=runtime)) as a,
            Session(limits=SandboxLimits(runtime=runtime)) as b,
        ):
            b.run_cell(SERVERS)
            with b.expose(8000) as url:  # b's server is up (reached through b)
                assert _until_served(lambda: httpx.get(url, timeout=30)).status_code == 200
            with pytest.raises(PortClosed):
                a.connect(port)  # the host's loopback port: not a's
            with pytest.raises(PortClosed):
                a.connect(8000)  # b's server: not a's
            host.settimeout(0.5)
            with pytest.raises(TimeoutError):
                host.accept()  # nothing came to the host
    finally:
        host.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tokens = TokenStore(tmp_path_factory.mktemp("reach") / "tokens.sqlite")
    mine, _ = tokens.create("mine")
    other, _ = tokens.create("other")
    with serve_in_thread(create_app(tokens)) as url:
        yield url, mine, other


def test_preview_urls_by_host_and_by_path_with_their_access(server):
    url, mine, other = server
    port = url.rsplit(":", 1)[1]
    auth = {"Authorization": f"Bearer {mine}"}
    with httpx.Client(base_url=url, timeout=60) as client:
        made = client.post("/v1/sessions", json={}, headers=auth)
        assert made.status_code == 201, made.text
        sid = made.json()["id"]
        try:
            put = client.put(f"/v1/sessions/{sid}/files/hello.txt", content=b"previewed\n", headers=auth)
            assert put.status_code == 200, put.text
            cell = client.post(f"/v1/sessions/{sid}/cells", json={"code": SERVERS}, headers=auth)
            assert cell.status_code == 200 and cell.json()["exit_code"] == 0, cell.text
            host = f"8000-{sid}.localhost:{port}"

            r = _until_served(lambda: client.get("/hello.txt", headers={"Host": host, **auth}))
            assert (r.status_code, r.text) == (200, "previewed\n")
            # the path form is never served on the API's origin: a redirect to the host form
            r = client.get(f"/sandboxes/{sid}/ports/8000/hello.txt?a=1", headers=auth)
            assert r.status_code == 307, r.text
            assert r.headers["location"] == f"http://{host}/hello.txt?a=1"
            # a token once in the query (a browser's first visit): a redirect to the same page on the
            # preview's keyed origin, whose key is not the token and opens only this port
            r = client.get(f"/hello.txt?b=2&sandloop_token={mine}", headers={"Host": host})
            assert r.status_code == 307 and r.headers["referrer-policy"] == "no-referrer", r.text
            keyed = httpx.URL(r.headers["location"])
            assert keyed.path == "/hello.txt" and keyed.query == b"b=2" and mine not in str(keyed)
            assert keyed.host.startswith(f"8000-{sid}.k") and keyed.host.endswith(".localhost")
            r = client.get("/hello.txt", headers={"Host": f"{keyed.host}:{port}"})
            assert (r.status_code, r.text) == (200, "previewed\n")
            key = keyed.host.split(".")[1]
            other_port = client.get("/", headers={"Host": f"8001-{sid}.{key}.localhost:{port}"})
            assert other_port.status_code == 401  # the key is for port 8000 only
            other_mac = key[:-1] + ("1" if key.endswith("0") else "0")  # (never the key itself)
            forged = client.get("/", headers={"Host": f"8000-{sid}.{other_mac}.localhost:{port}"})
            assert forged.status_code == 401

            refused = client.get("/hello.txt", headers={"Host": host})
            assert refused.status_code == 401 and "send a token that owns it" in refused.json()["message"]
            refused = client.get("/hello.txt", headers={"Host": host, "Authorization": f"Bearer {other}"})
            assert refused.status_code == 404  # someone else's sandbox and none look the same
            closed = client.get("/", headers={"Host": f"8999-{sid}.localhost:{port}", **auth})
            assert closed.status_code == 502
            assert "nothing listens on port 8999" in closed.json()["message"], closed.text
            gone = client.get("/", headers={"Host": f"8000-nosuchsandbox.localhost:{port}", **auth})
            assert gone.status_code == 404

            # the API is still the API on the same port (test_preview_security.py: one preview a connection)
            assert client.get(f"/v1/sessions/{sid}", headers=auth).status_code == 200
            # a WebSocket: the relay carries the upgrade, then the bytes as they are
            for path, h in (("/ws", f"8001-{sid}.localhost:{port}"),):
                with socket.create_connection(("127.0.0.1", int(port)), timeout=30) as sock:
                    answer, echoed = _ws_roundtrip(sock, _ws_head(path, h, f"Authorization: Bearer {mine}\r\n"), b"hi")
                assert answer.startswith(b"HTTP/1.1 101"), answer
                assert echoed == b"echo:hi"
        finally:
            assert client.delete(f"/v1/sessions/{sid}", headers=auth).status_code == 204


def test_a_head_past_the_cap_is_the_apis_to_refuse(server):
    """A head larger than the cap is never relayed (the API answers it, as any request it takes);
    a host that is not a preview host is the API's too."""
    url, mine, _ = server
    port = int(url.rsplit(":", 1)[1])
    with httpx.Client(base_url=url, timeout=30) as client:
        r = client.get("/v1/sessions", headers={"Host": "example.com", "Authorization": f"Bearer {mine}"})
        assert r.status_code == 200  # not a preview host: the API answers
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(b"GET / HTTP/1.1\r\nHost: 8000-x.localhost\r\nX-Fill: " + b"a" * (70 * 1024) + b"\r\n\r\n")
        answer = sock.recv(4096)
    assert b"server: uvicorn" in answer.lower() and b"no sandbox" not in answer, answer  # the API's answer


def test_a_terminal_over_http(server):
    """The playground's terminal: create, follow its output (server-sent events), type, resize,
    exit; another token sees none of it."""
    url, mine, other = server
    auth = {"Authorization": f"Bearer {mine}"}
    with httpx.Client(base_url=url, timeout=60) as client:
        sid = client.post("/v1/sessions", json={}, headers=auth).json()["id"]
        try:
            made = client.post(f"/v1/sessions/{sid}/terminals", json={"cols": 80, "rows": 24}, headers=auth)
            assert made.status_code == 201, made.text
            pid = made.json()["pid"]
            assert [t["pid"] for t in client.get(f"/v1/sessions/{sid}/terminals", headers=auth).json()] == [pid]
            foreign = {"Authorization": f"Bearer {other}"}
            assert client.get(f"/v1/sessions/{sid}/terminals", headers=foreign).status_code == 404
            assert (
                client.post(
                    f"/v1/sessions/{sid}/terminals/{pid}/input", json={"data": "x"}, headers=foreign
                ).status_code
                == 404
            )
            typed = client.post(
                f"/v1/sessions/{sid}/terminals/{pid}/input", json={"data": "echo a$((40+2))b\r"}, headers=auth
            )
            assert typed.status_code == 204, typed.text
            shown, code = b"", None
            with client.stream("GET", f"/v1/sessions/{sid}/terminals/{pid}/output", headers=auth) as events:
                kind = ""
                for line in events.iter_lines():
                    if line.startswith("event: "):
                        kind = line[7:]
                    elif line.startswith("data: ") and kind == "data":
                        shown += base64.b64decode(json.loads(line[6:]))
                        if b"a42b" in shown and b"resized" not in shown:
                            client.post(
                                f"/v1/sessions/{sid}/terminals/{pid}/resize",
                                json={"cols": 111, "rows": 30},
                                headers=auth,
                            )
                            client.post(
                                f"/v1/sessions/{sid}/terminals/{pid}/input",
                                json={"data": "echo resized-$(tput cols); exit 5\r"},
                                headers=auth,
                            )
                            shown += b"resized"  # asked once
                    elif line.startswith("data: ") and kind == "exit":
                        code = json.loads(line[6:])["exit_code"]
                        break
            assert code == 5 and b"resized-111" in shown, shown[-400:]
            gone = client.post(f"/v1/sessions/{sid}/terminals/{pid}/input", json={"data": "x"}, headers=auth)
            assert gone.status_code == 404
            bad = client.post(f"/v1/sessions/{sid}/terminals", json={"cols": 0}, headers=auth)
            assert bad.status_code == 400 and "cols" in bad.json()["message"]
        finally:
            client.delete(f"/v1/sessions/{sid}", headers=auth)


#: Run as the sandbox's code: the agent's process found by its name, then its stream reopened
#: and its memory opened through /proc, as issue 52 finding 4 did (both on runc, the first on
#: gVisor too).
FORGE = r"""
import os
def named(p):
    with open(f"/proc/{p}/cmdline", "rb") as f:
        return b"sandloop-reach-agent" in f.read()
agents = [p for p in os.listdir("/proc") if p.isdigit() and named(p)]
print("agents", len(agents))
for pid in agents:
    for what, mode in (("fd/0", os.O_RDONLY), ("fd/1", os.O_WRONLY), ("mem", os.O_RDWR)):
        try:
            os.close(os.open(f"/proc/{pid}/{what}", mode))
            print("opened", what)
        except OSError as exc:
            print("refused", what, exc.errno)
"""


def test_the_sandboxes_code_cannot_take_over_the_agents_stream(runtime):
    """The agent is non-dumpable: its /proc/<pid>/fd and mem are root's, so code in the sandbox
    (its user, no capabilities) can neither reopen the agent's stdin and stdout to forge frames
    nor write its memory."""
    with Session(limits=SandboxLimits(runtime=runtime)) as s:
        term = s.terminal(cmd=["/bin/sleep", "60"])  # the agent runs
        out = s.run_cell(FORGE).stdout
        term.close()
    assert "agents 1" in out, out
    assert "opened" not in out and out.count("refused") == 3, out

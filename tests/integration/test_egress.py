"""Egress by allowlist, proven from inside real sandboxes on runc and runsc (gVisor).

No traffic leaves loopback: the egress proxy's own name map sends the test names (allowed.test,
other.test) to HTTP and HTTPS servers started here on 127.0.0.1, with a test CA whose certificate
the programs are given. What the proxy refuses, and what the sandbox cannot do without it (a
direct connection, DNS), is asserted from inside; what reached the servers is asserted from here.
"""

from __future__ import annotations

import json
import os

import pytest

from sandloop import SandboxLimits, Sandloop, Settings
from sandloop.notes import sandbox_notes
from sandloop.runtime.egress.host import egress_state
from tests.egress_servers import WHEEL_NAME, Servers
from tests.helpers import our_containers


@pytest.fixture(scope="module")
def servers():
    made = Servers()
    yield made
    made.close()


@pytest.fixture(scope="module")
def root(servers):
    with Sandloop(Settings(pool_size=0, egress_hosts=servers.hosts())) as made:
        yield made


def _limits(runtime: str, *rules: str) -> SandboxLimits:
    return SandboxLimits(runtime=runtime, egress=rules)


def _python(ca: str, body: str) -> str:
    return f"import json, os, socket, ssl, sys, urllib.request\nCA = {ca!r}\n{body}"


def test_allowed_hosts_over_http_and_https_with_python_and_the_audit(root, servers, runtime):
    body = """
ctx = ssl.create_default_context(cadata=CA)
print(urllib.request.urlopen("http://allowed.test/plain", timeout=20).read().decode(), end="")
print(urllib.request.urlopen("https://allowed.test/tls", context=ctx, timeout=20).read().decode(), end="")
import requests
open("/tmp/ca.pem", "w").write(CA)
print(requests.get("https://allowed.test/requests", verify="/tmp/ca.pem", timeout=20).text, end="")
"""
    r = root.run_code(_python(servers.ca_pem, body), limits=_limits(runtime, "allowed.test"), timeout_seconds=60)
    assert r.ok, r.stderr
    assert r.stdout == "hello from http /plain\nhello from https /tls\nhello from https /requests\n"
    assert [(a.host, a.port, a.method, a.allowed) for a in r.egress] == [
        ("allowed.test", 80, "GET", True),
        ("allowed.test", 443, "CONNECT", True),
        ("allowed.test", 443, "CONNECT", True),
    ]
    assert all(a.bytes_out > 0 and a.bytes_in > 0 for a in r.egress)


def test_node_fetch_and_pip_go_through_the_proxy(root, servers, runtime):
    node = (
        "const ca = process.env.CA_FILE;\n"
        "fetch('http://allowed.test/node-plain').then(r => r.text()).then(t => process.stdout.write(t))\n"
        ".then(() => fetch('https://allowed.test/node-tls')).then(r => r.text()).then(t => process.stdout.write(t))\n"
        ".catch(e => { console.error('FAILED', e, e.cause); process.exit(1); });\n"
    )
    script = (
        f"cat > /tmp/ca.pem <<'EOF'\n{servers.ca_pem}EOF\n"
        f"cat > /tmp/f.js <<'EOF'\n{node}EOF\n"
        "NODE_EXTRA_CA_CERTS=/tmp/ca.pem node /tmp/f.js\n"
        "python3 -m pip download --no-deps --disable-pip-version-check -q -d /tmp/dl "
        "--index-url http://allowed.test/simple/ --trusted-host allowed.test demo && "
        "python3 -c 'import os; print(*os.listdir(\"/tmp/dl\"))'\n"  # not ls: gVisor's statx here says EINVAL
    )
    r = root.run_code(script, "bash", limits=_limits(runtime, "allowed.test"), timeout_seconds=90)
    assert r.ok, r.stderr
    assert r.stdout == f"hello from http /node-plain\nhello from https /node-tls\n{WHEEL_NAME}\n"
    assert ("http", f"/files/{WHEEL_NAME}") in [(s, p) for s, p, _ in servers.seen.requests]


def test_a_client_hello_split_in_two_records_cannot_front_another_host(root, servers, runtime):
    """Issue 27 #2 from inside the sandbox: the ClientHello for other.test split over two TLS
    records, in a tunnel to allowed.test. Before, the proxy read the first record as the whole
    hello, saw no server name and let it through to a server that reassembled it."""
    body = """
incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
tls = ssl.create_default_context().wrap_bio(incoming, outgoing, server_hostname="other.test")
try:
    tls.do_handshake()
except ssl.SSLWantReadError:
    pass
record = outgoing.read()
hello = record[5:]
half = len(hello) // 3
split = b"".join(record[:3] + len(p).to_bytes(2, "big") + p for p in (hello[:half], hello[half:]))
s = socket.create_connection(("127.0.0.1", 3128), timeout=20)
s.sendall(b"CONNECT allowed.test:443 HTTP/1.1\\r\\nHost: allowed.test:443\\r\\n\\r\\n")
head = b""
while b"\\r\\n\\r\\n" not in head:
    head += s.recv(1)
s.sendall(split)
print("answer:", s.recv(100))
"""
    r = root.run_code(_python(servers.ca_pem, body), limits=_limits(runtime, "allowed.test:443"), timeout_seconds=60)
    assert r.ok and r.stdout.strip() == "answer: b''", (r.stdout, r.stderr)
    (attempt,) = r.egress
    assert not attempt.allowed and "'other.test' does not match" in attempt.note and attempt.bytes_in == 0


def test_everything_else_is_refused_and_said(root, servers, runtime):
    body = """
def attempt(what, f):
    try:
        f()
        print(what, "REACHED")
    except urllib.error.HTTPError as e:
        print(what, e.code, e.read().decode().strip())
    except Exception as e:
        print(what, type(e).__name__)

import urllib.error
attempt("unlisted", lambda: urllib.request.urlopen("http://other.test/", timeout=20))
attempt("inward", lambda: urllib.request.urlopen("http://localhost/", timeout=20))
attempt("direct-ip", lambda: socket.create_connection(("192.0.2.1", 80), timeout=5))
attempt("host-bridge", lambda: socket.create_connection(("172.17.0.1", 22), timeout=5))
attempt("dns", lambda: socket.getaddrinfo("allowed.test", 80))
raw = socket.create_connection(("127.0.0.1", 3128), timeout=20)  # CONNECT one host, TLS to another
raw.sendall(b"CONNECT allowed.test:443 HTTP/1.1\\r\\nHost: allowed.test:443\\r\\n\\r\\n")
head = b""
while not head.endswith(b"\\r\\n\\r\\n"):
    head += raw.recv(1)
attempt("sni", lambda: ssl.create_default_context(cadata=CA).wrap_socket(raw, server_hostname="other.test"))
"""
    r = root.run_code(
        _python(servers.ca_pem, body), limits=_limits(runtime, "allowed.test", "localhost"), timeout_seconds=60
    )
    lines = dict(line.split(" ", 1) for line in r.stdout.splitlines())
    assert lines["unlisted"].startswith("403 sandloop egress: other.test:80 is not on this sandbox's allowlist")
    assert lines["inward"].startswith("403 sandloop egress: localhost resolves to 127.0.0.1, an inward address")
    assert lines["direct-ip"] in ("OSError", "TimeoutError") and lines["host-bridge"] in ("OSError", "TimeoutError")
    assert lines["dns"] == "gaierror"
    assert lines["sni"].endswith("Error"), lines  # the tunnel was closed: SSLZeroReturnError, SSLEOFError...
    refused = [a for a in r.egress if not a.allowed]
    assert [(a.host, a.port) for a in refused] == [("other.test", 80), ("localhost", 80), ("allowed.test", 443)]
    assert "does not match" in refused[2].note
    notes = sandbox_notes(r)
    assert any(n.startswith("refused: other.test:80 is not on this sandbox's allowlist") for n in notes), notes
    assert not [h for _, _, h in servers.seen.requests if h.get("Host", "").startswith("other.test")]  # never reached


def test_without_an_allowlist_there_is_no_network_and_no_proxy(root, runtime):
    body = (
        "import os, socket\n"
        "print(sorted(k for k in os.environ if 'proxy' in k.lower() or k.startswith('SANDLOOP')))\n"
        "print(os.path.exists('/run/sandloop-egress'))\n"
        "try:\n    socket.create_connection(('127.0.0.1', 3128), timeout=3)\n    print('relay')\n"
        "except OSError as e:\n    print(type(e).__name__)\n"
    )
    r = root.run_code(body, limits=SandboxLimits(runtime=runtime))
    assert r.stdout == "[]\nFalse\nConnectionRefusedError\n" and r.egress == []


@pytest.mark.serial  # the proxy's state folder is the host's: other workers' runs open and close theirs there
def test_nothing_is_left_after_egress_runs(root, servers, runtime):
    before = set(os.listdir(egress_state())) if egress_state().is_dir() else set()
    for _ in range(3):
        r = root.run_code("print(1)", limits=_limits(runtime, "allowed.test"))
        assert r.stdout == "1\n"
    assert not our_containers(patience=30)  # waits for teardowns, which close the proxy's sockets
    after = set(os.listdir(egress_state())) if egress_state().is_dir() else set()
    assert after <= before
    # the result carries the audit as JSON too (the API and the CLI's --json show this)
    assert json.loads(r.model_dump_json())["egress"] == []


SECRET_VALUE = "ghp_RealValue0123456789abcdef"


@pytest.fixture(scope="module")
def secret_root(servers, tmp_path_factory):
    ca_file = tmp_path_factory.mktemp("upstream") / "ca.pem"
    ca_file.write_text(servers.ca_pem)  # the proxy verifies the test servers as any client would
    settings = Settings(pool_size=0, egress_hosts=servers.hosts(), egress_upstream_ca=ca_file)
    with Sandloop(settings) as made:
        yield made


def test_a_secret_is_sent_only_to_its_hosts_and_never_seen_inside(secret_root, servers, runtime):
    from sandloop.contract.egress import Secret

    body = """
token = os.environ["GITHUB_TOKEN"]
print("inside:", token)
print("environ has value:", any("RealValue" in open(f"/proc/{p}/environ", errors="replace").read()
      for p in os.listdir("/proc") if p.isdigit() and os.access(f"/proc/{p}/environ", os.R_OK)))
import requests
auth = {"Authorization": f"Bearer {token}"}
print(requests.get("https://allowed.test/api", headers=auth, timeout=20).text, end="")
print(requests.get("https://other.test/steal", headers=auth, timeout=20).text, end="")
for url, headers in (
    ("http://allowed.test/plain", auth),  # plain HTTP: the secret goes over HTTPS only
    (f"https://allowed.test/echo/{token}", {}),  # in the URL: a redirect or a 404 page would echo it
    ("https://allowed.test/x", {"X-Echo": token}),  # in a header it may not go in
):
    r = requests.get(url, headers=headers, timeout=20)
    print(r.status_code, r.text.strip()[:120])
"""
    servers.seen.requests.clear()
    r = secret_root.run_code(
        _python(servers.ca_pem, body),
        limits=_limits(runtime, "allowed.test", "other.test"),
        secrets={"GITHUB_TOKEN": Secret(SECRET_VALUE, hosts=["allowed.test"])},
        timeout_seconds=60,
    )
    assert r.ok, r.stderr
    placeholder = r.stdout.split("\n")[0].removeprefix("inside: ")
    assert placeholder.startswith("sandloop-secret-GITHUB_TOKEN-") and SECRET_VALUE not in r.stdout + r.stderr
    assert "environ has value: False" in r.stdout
    seen = {path: headers.get("Authorization") for _, path, headers in servers.seen.requests}
    assert seen["/api"] == f"Bearer {SECRET_VALUE}"  # its host got the value, over HTTPS
    assert seen["/steal"] == f"Bearer {placeholder}"  # another host got the placeholder only
    assert "/plain" not in seen and not [p for p in seen if p.startswith("/echo") or p == "/x"]  # refused
    refused = r.stdout.splitlines()[-3:]
    assert all(line.startswith("403 ") for line in refused), refused
    assert "HTTPS only" in refused[0] and "request line" in refused[1] and "X-Echo" in refused[2]
    audit = r.model_dump_json()
    assert SECRET_VALUE not in audit
    notes = {a.host + a.method: a.note for a in r.egress if a.allowed}
    assert "secret GITHUB_TOKEN sent" in notes["allowed.testCONNECT"]
    assert "carried the placeholder of secret GITHUB_TOKEN to other.test" in notes["other.testCONNECT"]


def test_secrets_are_checked_before_anything_runs(secret_root, runtime):
    from sandloop import InvalidArgument
    from sandloop.contract.egress import Secret

    with pytest.raises(InvalidArgument, match="does not reach"):
        secret_root.run_code(
            "print(1)", limits=_limits(runtime, "allowed.test"), secrets={"T": Secret("v", hosts=["other.test"])}
        )
    with pytest.raises(InvalidArgument, match="environment variable name"):
        secret_root.run_code("print(1)", limits=_limits(runtime, "allowed.test"), secrets={"1 bad": Secret("v", "x.y")})
    with pytest.raises(InvalidArgument, match="hosts"):
        Secret("v")


def test_front_ends_cli_api_and_agent_carry_egress_and_secrets(secret_root, servers, tmp_path, monkeypatch):
    """`sandloop run --allow --secret`, POST /v1/runs with limits.egress and secrets within the
    token's policy, and run_agent(egress=, secrets=): the same audit, never the value."""
    import subprocess
    import sys

    import httpx

    from sandloop.agent import run_agent
    from sandloop.contract.egress import Secret
    from sandloop.server.app import create_app
    from sandloop.server.tokens import TokenStore
    from sandloop.testing import ScriptedClient, answer, calls, code_call
    from tests.servers import serve_in_thread

    fetch = (
        "import os, urllib.request\n"
        "req = urllib.request.Request('http://allowed.test/{path}', headers={{'X-Key': os.environ['KEY']}})\n"
        "print(urllib.request.urlopen(req, timeout=20).read().decode(), end='')\n"
        "try:\n    urllib.request.urlopen('http://other.test/', timeout=20)\nexcept Exception as e:\n    print(e)\n"
    )
    env = {
        **os.environ,
        "SANDLOOP_EGRESS_HOSTS": json.dumps(servers.hosts()),
        "MY_KEY": SECRET_VALUE,
    }
    # the CLI
    cli = subprocess.run(
        [sys.executable, "-m", "sandloop", "run", "--allow", "allowed.test",
         "--secret", "KEY=MY_KEY@allowed.test;header=X-Key;plain-http", "-c", fetch.format(path="cli")],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert cli.returncode == 0, cli.stderr
    assert cli.stdout.startswith("hello from http /cli\nHTTP Error 403") and SECRET_VALUE not in cli.stdout + cli.stderr
    assert "sandloop egress: allowed GET allowed.test:80" in cli.stderr and "refused GET other.test:80" in cli.stderr
    bad = subprocess.run(
        [sys.executable, "-m", "sandloop", "run", "--allow", "allowed.test", "--secret", "KEY=UNSET_VAR@allowed.test",
         "-c", "print(1)"],
        capture_output=True, text=True, env=env, timeout=60,
    )  # fmt: skip
    assert bad.returncode == 2 and "UNSET_VAR is not set" in bad.stderr
    # the HTTP API
    tokens = TokenStore(tmp_path / "tokens.sqlite")
    secret, _ = tokens.create("agent", egress=("allowed.test", "other.test"))
    with serve_in_thread(create_app(tokens, sandloop=secret_root)) as url:
        body = {
            "code": fetch.format(path="api"),
            "limits": {"egress": ["allowed.test", "other.test"]},
            "secrets": {
                "KEY": {"value": SECRET_VALUE, "hosts": ["allowed.test"], "headers": ["X-Key"], "plain_http": True}
            },
        }
        r = httpx.post(f"{url}/v1/runs", json=body, headers={"Authorization": f"Bearer {secret}"}, timeout=120)
        # issue 27 #1 through the API: the placeholder in a URL to the secret's host, where a 404
        # page or a redirect would echo it back with the value in its place
        echo = {
            **body,
            "code": "import os, urllib.request\ntry:\n"
            "    urllib.request.urlopen('http://allowed.test/echo/' + os.environ['KEY'], timeout=20)\n"
            "except Exception as e:\n    print(e.code, e.read().decode())",
        }
        reflected = httpx.post(f"{url}/v1/runs", json=echo, headers={"Authorization": f"Bearer {secret}"}, timeout=120)
    assert reflected.status_code == 200 and SECRET_VALUE not in reflected.text, reflected.text
    assert reflected.json()["stdout"].startswith("403 sandloop egress: the placeholder of secret KEY is in the request")
    assert r.status_code == 200 and SECRET_VALUE not in r.text, r.text
    result = r.json()
    assert result["stdout"] == "hello from http /api\n"  # other.test is listed here: no error printed
    assert [(a["host"], a["allowed"]) for a in result["egress"]] == [("allowed.test", True), ("other.test", True)]
    # the agent loop: the model's code uses the placeholder, a refusal comes back as a note
    client = ScriptedClient([calls(code_call(fetch.format(path="agent"))), answer("done")])
    from sandloop.runner import use_root

    previous = use_root(secret_root)  # the process-wide root, on which the agent's default tool runs
    try:
        run_agent(
            "fetch it",
            client,
            egress=["allowed.test"],
            secrets={"KEY": Secret(SECRET_VALUE, hosts=["allowed.test"], headers=["X-Key"], plain_http=True)},
        )
    finally:
        use_root(previous)
    tool_text = str(client.transcripts[1][-1])
    assert "hello from http /agent" in tool_text and "refused: other.test:80 is not on" in tool_text
    assert "egress (allowed): GET allowed.test:80" in tool_text and SECRET_VALUE not in tool_text
    description = client.tools_seen[0][0].description
    assert "allowed.test only" in description and "KEY hold credentials" in description
    seen = {path: headers.get("X-Key") for _, path, headers in servers.seen.requests}
    assert seen["/cli"] == seen["/api"] == seen["/agent"] == SECRET_VALUE


def test_the_reaper_removes_what_a_killed_process_left_and_the_proxy_bounds_connections(root, servers):
    import socket as socketlib

    from sandloop.runtime.egress.proxy import MAX_CONNECTIONS

    stale = egress_state() / "e-stale-test"
    stale.mkdir(parents=True, exist_ok=True)
    (stale / "owner.json").write_text(json.dumps({"owner": f"{socketlib.gethostname()}:999999:1"}))
    report = root.reap()
    assert ("egress", "e-stale-test") in [(i.kind, i.id) for i in report.items] and not stale.exists()
    # one sandbox may hold at most MAX_CONNECTIONS open through the proxy; the rest are refused and said
    code = (
        "import socket, time\n"
        f"held = [socket.create_connection(('127.0.0.1', 3128)) for _ in range({MAX_CONNECTIONS + 5})]\n"
        "time.sleep(0.5)\n"
        "def closed(s):\n"
        "    try:\n        return s.recv(1, socket.MSG_DONTWAIT | socket.MSG_PEEK) == b''\n"
        "    except BlockingIOError:\n        return False\n"
        "print(sum(map(closed, held)))\n"
    )
    r = root.run_code(code, limits=_limits("runc", "allowed.test"))
    assert r.stdout.strip() == "5", (r.stdout, r.stderr)  # exactly the extra ones were closed
    assert sum("connections at once" in a.note for a in r.egress) == 5


def test_a_session_reaches_its_allowlist_from_any_process_with_its_secrets(secret_root, servers, runtime):
    """A session's interpreter outlives the process that started it: a CLI process attaching it
    (a new process per command) serves its egress again, and the cell's audit is its own."""
    import subprocess
    import sys

    from sandloop.contract.egress import Secret
    from sandloop.runtime.egress.host import kernel_egress_key

    s = secret_root.create_session(limits=_limits(runtime, "allowed.test"), quota="16m")
    sid = s.id
    try:
        get = "urllib.request.urlopen('http://allowed.test/{}', timeout=20).read().decode()"
        c = s.run_cell("import os, urllib.request\n" + get.format("cell1"))
        assert c.ok and "hello from http /cell1" in (c.value or ""), (c.stdout, c.stderr)
        assert [(a.host, a.allowed) for a in c.egress] == [("allowed.test", True)]
        c = s.run_cell(
            "try:\n    urllib.request.urlopen('http://other.test/', timeout=20)\nexcept Exception as e:\n    print(e)"
        )
        assert "403" in c.stdout and [a.allowed for a in c.egress] == [False]  # only this cell's attempts
        secret_cell = (
            "req = urllib.request.Request('https://allowed.test/cell-secret', headers={'X-Key': os.environ['KEY']})\n"
            "urllib.request.urlopen(req, timeout=20).read().decode()"
        )
        c = s.run_cell(
            "kept = os.environ['KEY']\n" + secret_cell,
            secrets={"KEY": Secret(SECRET_VALUE, hosts=["allowed.test"], headers=["X-Key"])},
        )
        assert "hello from https /cell-secret" in (c.value or ""), (c.stdout, c.stderr)
        assert SECRET_VALUE not in c.model_dump_json()
        # a secret lives for its cell: the next cell has no variable, and the placeholder it kept
        # is a plain string to the proxy now (before: later cells could still use it)
        later = (  # no secret, so no interception: the test server's own certificate (a test CA)
            "import ssl\nprint('KEY' in os.environ)\n"
            "req = urllib.request.Request('https://allowed.test/after-cell', headers={'X-Key': kept})\n"
            "urllib.request.urlopen(req, timeout=20, context=ssl._create_unverified_context()).read().decode()"
        )
        c = s.run_cell(later)
        assert c.stdout == "False\n" and "hello from https /after-cell" in (c.value or ""), (c.stdout, c.stderr)
        s.close()  # this process lets go; the interpreter lives on

        env = {**os.environ, "SANDLOOP_EGRESS_HOSTS": json.dumps(servers.hosts())}
        cli = subprocess.run(
            [sys.executable, "-m", "sandloop", "session", "cell", sid, "-c", get.format("cli-cell")],
            capture_output=True, text=True, env=env, timeout=120,
        )  # fmt: skip
        assert cli.returncode == 0 and "hello from http /cli-cell" in cli.stdout, (cli.stdout, cli.stderr)

        again = secret_root.attach_session(sid)
        c = again.run_cell(get.format("again"))
        assert "hello from http /again" in (c.value or "") and c.egress[0].allowed, (c.stdout, c.stderr)
        again.close()
        seen = {path: headers.get("X-Key") for _, path, headers in servers.seen.requests}
        assert seen["/cell-secret"] == SECRET_VALUE and "/cli-cell" in seen
        assert seen["/after-cell"].startswith("sandloop-secret-KEY-")  # the placeholder, not the value
    finally:
        secret_root.attach_session(sid).delete()
    assert not (egress_state() / kernel_egress_key(sid)).exists()


def test_api_sessions_take_an_allowlist_and_cells_take_secrets(secret_root, servers, tmp_path):
    import httpx

    from sandloop.server.app import create_app
    from sandloop.server.tokens import TokenStore
    from tests.servers import serve_in_thread

    tokens = TokenStore(tmp_path / "tokens.sqlite")
    secret, _ = tokens.create("api-session", egress=("allowed.test",))
    plain, _ = tokens.create("no-egress")
    cell = (
        "import os, urllib.request\n"
        "req = urllib.request.Request('http://allowed.test/api-cell', headers={'X-Key': os.environ['KEY']})\n"
        "urllib.request.urlopen(req, timeout=20).read().decode()"
    )
    with serve_in_thread(create_app(tokens, sandloop=secret_root)) as url:
        c = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {secret}"}, timeout=120)
        refused = httpx.post(
            f"{url}/v1/sessions",
            json={"quota": "16m", "limits": {"egress": ["allowed.test"]}},
            headers={"Authorization": f"Bearer {plain}"},
        )
        assert (refused.status_code, refused.json()["code"]) == (403, "egress_refused")
        sid = c.post("/v1/sessions", json={"quota": "16m", "limits": {"egress": ["allowed.test"]}}).json()["id"]
        try:
            key = {"value": SECRET_VALUE, "hosts": ["allowed.test"], "headers": ["X-Key"], "plain_http": True}
            body = {"code": cell, "secrets": {"KEY": key}}
            r = c.post(f"/v1/sessions/{sid}/cells", json=body)
            assert r.status_code == 200 and "hello from http /api-cell" in r.json()["value"], r.text
            assert SECRET_VALUE not in r.text and r.json()["egress"][0]["allowed"]
            bad = c.post(
                f"/v1/sessions/{sid}/cells", json={"code": "1", "secrets": {"K": {"value": "v", "hosts": ["x.y"]}}}
            )
            assert (bad.status_code, bad.json()["code"]) == (400, "invalid_argument") and "does not reach" in bad.text
        finally:
            c.delete(f"/v1/sessions/{sid}")
            c.close()
    assert [h.get("X-Key") for _, p, h in servers.seen.requests if p == "/api-cell"] == [SECRET_VALUE]

"""The egress proxy on its own, over its Unix socket (no engine): what it allows, refuses and records."""

from __future__ import annotations

import json
import socket
import ssl

import httpx
import pytest

from sandloop import InvalidLimits, SandboxLimits, Sandloop, Settings
from sandloop.contract.egress import allows
from sandloop.runtime.egress import EgressProxy
from tests.egress_servers import Servers


@pytest.fixture(scope="module")
def servers():
    made = Servers()
    yield made
    made.close()


@pytest.fixture
def proxy(tmp_path, servers):
    def resolve(host: str, port: int) -> list[str]:  # what a hostile DNS answer would say
        return {"inward.test": ["127.0.0.1"], "meta.test": ["169.254.169.254"], "lan.test": ["10.1.2.3"]}.get(
            host, ["203.0.113.9"]
        )

    made = EgressProxy(tmp_path / "egress", hosts=servers.hosts("allowed.test", "other.test"), resolve=resolve)
    yield made
    made.shutdown()


def _connect(directory) -> socket.socket:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.settimeout(10)
    s.connect(str(directory / "proxy.sock"))
    return s


def _read_all(s) -> bytes:
    out = b""
    while chunk := s.recv(65536):
        out += chunk
    return out


def _get(directory, url: str) -> bytes:
    s = _connect(directory)
    host = url.split("/")[2] if "://" in url else "x"
    s.sendall(f"GET {url} HTTP/1.1\r\nHost: {host}\r\nProxy-Authorization: Basic eDp5\r\n\r\n".encode())
    try:
        return _read_all(s)
    finally:
        s.close()


def _open_tunnel(directory, target: str) -> socket.socket:
    """A CONNECT tunnel through the proxy, past its "200 Connection established"."""
    s = _connect(directory)
    s.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += s.recv(1)
    assert b" 200 " in head.split(b"\r\n")[0], head
    return s


def _tunnel(directory, target: str, server_name: str, ca_pem: str) -> bytes:
    s = _connect(directory)
    s.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
    head = b""
    while b"\r\n\r\n" not in head:
        head += s.recv(1)
    if b" 200 " not in head.split(b"\r\n")[0]:
        return head + _read_all(s)
    context = ssl.create_default_context(cadata=ca_pem)
    with context.wrap_socket(s, server_hostname=server_name) as tls:
        tls.sendall(f"GET /x HTTP/1.1\r\nHost: {server_name}\r\nConnection: close\r\n\r\n".encode())
        return _read_all(tls)


def test_rules_are_validated_and_matched():
    rules = SandboxLimits(egress=["PyPI.org.", "*.example.com:8443", "10.0.0.1:8080"]).egress
    assert rules == ("pypi.org", "*.example.com:8443", "10.0.0.1:8080")
    assert allows(rules, "pypi.org", 443) and allows(rules, "pypi.org", 80) and not allows(rules, "pypi.org", 22)
    assert allows(rules, "a.b.example.com", 8443) and not allows(rules, "example.com", 8443)
    assert not allows(rules, "evilexample.com", 8443) and allows(rules, "10.0.0.1", 8080)
    for bad in ("*", "a b", "host:0", "*.com", "ex*ample.com", ""):
        with pytest.raises(InvalidLimits):
            SandboxLimits(egress=[bad])
    with pytest.raises(InvalidLimits, match="choose one"):
        SandboxLimits(egress=["pypi.org"], network=True)


def test_an_allowed_host_is_reached_and_recorded_with_its_bytes(proxy, servers):
    d = proxy.open("e-test1", ("allowed.test",))
    reply = _get(d, "http://allowed.test/hello?q=1")
    assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"hello from http /hello?q=1\n")
    path, headers = servers.seen.requests[-1][1:]
    assert path == "/hello?q=1" and "Proxy-Authorization" not in headers  # hop-by-hop headers dropped
    (attempt,) = proxy.attempts("e-test1")
    assert (attempt.host, attempt.port, attempt.method, attempt.allowed) == ("allowed.test", 80, "GET", True)
    assert attempt.bytes_out > 30 and attempt.bytes_in == len(reply)


def test_https_through_a_tunnel_and_the_sni_must_match(proxy, servers):
    d = proxy.open("e-test2", ("allowed.test:443",))
    assert _tunnel(d, "allowed.test:443", "allowed.test", servers.ca_pem).endswith(b"hello from https /x\n")
    with pytest.raises((ssl.SSLError, ConnectionError, OSError)):
        _tunnel(d, "allowed.test:443", "other.test", servers.ca_pem)  # CONNECT one host, TLS to another
    first, second = proxy.attempts("e-test2")
    assert first.allowed and first.bytes_in > 100
    assert not second.allowed and "does not match" in second.note and "other.test" in second.note


def test_unlisted_hosts_ports_and_inward_answers_are_refused_with_the_reason(proxy, servers):
    d = proxy.open("e-test3", ("allowed.test:443", "inward.test", "meta.test", "lan.test", "127.0.0.1:9"))
    cases = {
        "http://other.test/": "is not on this sandbox's allowlist",
        "http://allowed.test/": "allowed.test:80 is not on",  # the rule names port 443 only
        "http://inward.test/": "resolves to 127.0.0.1, an inward address",
        "http://meta.test/latest/meta-data/": "resolves to 169.254.169.254",
        "http://lan.test/": "resolves to 10.1.2.3",
        "http://127.0.0.2:9/": "is not on",
    }
    for url, why in cases.items():
        reply = _get(d, url)
        assert reply.startswith(b"HTTP/1.1 403 Forbidden"), (url, reply)
        assert why in reply.decode(), (url, reply)
    assert b"403" in _tunnel(d, "other.test:443", "other.test", servers.ca_pem)
    attempts = proxy.attempts("e-test3")
    assert len(attempts) == len(cases) + 1 and not any(a.allowed for a in attempts)
    assert not [r for r in servers.seen.requests if r[1] == "/latest/meta-data/"]


def test_a_listed_address_is_reached_even_inward(proxy, servers):
    port = servers.http.server_address[1]
    d = proxy.open("e-test4", (f"127.0.0.1:{port}",))
    assert _get(d, f"http://127.0.0.1:{port}/direct").startswith(b"HTTP/1.1 200")


def test_bad_requests_get_a_400(proxy):
    d = proxy.open("e-test5", ("allowed.test",))
    assert _get(d, "/relative").startswith(b"HTTP/1.1 400")
    s = _connect(d)
    s.sendall(b"garbage\r\n\r\n")
    assert _read_all(s).startswith(b"HTTP/1.1 400")


def test_closing_removes_the_socket_and_garbage_of_dead_owners_is_collected(proxy, tmp_path):
    d = proxy.open("e-test6", ("allowed.test",))
    proxy.close("e-test6")
    assert not d.exists()
    stale = tmp_path / "egress" / "e-stale"
    stale.mkdir(parents=True)
    (stale / "owner.json").write_text(json.dumps({"owner": f"{socket.gethostname()}:999999:1"}))
    kept = tmp_path / "egress" / "kernel-s-123"
    kept.mkdir()
    (kept / "owner.json").write_text(json.dumps({"owner": "session:s-123"}))
    live = proxy.open("e-live", ("allowed.test",))
    assert proxy.collect_garbage() == ["e-stale"] and live.exists() and kept.exists()


def test_a_tokens_egress_policy_bounds_what_its_runs_may_ask_for(tmp_path):
    from sandloop.contract.egress import covers
    from sandloop.server.app import create_app
    from sandloop.server.tokens import TokenError, TokenStore
    from tests.servers import serve_in_thread

    policy = ("pypi.org", "*.example.com", "api.x.io:443")
    assert covers(policy, "pypi.org:443") and covers(policy, "*.a.example.com") and covers(("any",), "z.org")
    assert not covers(policy, "pypi.org:22") and not covers(policy, "example.com") and not covers(policy, "api.x.io")
    tokens = TokenStore(tmp_path / "tokens.sqlite")
    with pytest.raises(TokenError, match="not a hostname"):
        tokens.create("bad", egress=("not a host",))
    plain, _ = tokens.create("plain")
    scoped, token = tokens.create("scoped", egress=("*.Example.com",))
    assert token.egress == ("*.example.com",)
    root = Sandloop(Settings(backend="fake", home=tmp_path, pool_size=0))
    with root, serve_in_thread(create_app(tokens, sandloop=root)) as url:

        def run(secret: str, egress: list[str]) -> httpx.Response:
            body = {"code": "print(1)", "limits": {"egress": egress}}
            return httpx.post(f"{url}/v1/runs", json=body, headers={"Authorization": f"Bearer {secret}"})

        r = run(plain, ["pypi.org"])
        assert (r.status_code, r.json()["code"]) == (403, "egress_refused") and "no egress at all" in r.text
        r = run(scoped, ["pypi.org"])
        assert (r.status_code, r.json()["code"]) == (403, "egress_refused") and "*.example.com" in r.text
        r = run(scoped, ["bad host"])
        assert (r.status_code, r.json()["code"]) == (400, "invalid_limits")
        r = run(scoped, ["a.example.com"])  # within the policy: on to the backend (the fake has no proxy)
        assert r.status_code == 400 and "no egress proxy" in r.json()["message"]
        assert run(plain, []).json()["stdout"] == "1\n"
        # an agent run's secrets are checked before any model is called
        agent = {
            "task": "t",
            "limits": {"egress": ["a.example.com"]},
            "secrets": {"KEY": {"value": "v", "hosts": ["b.example.com"]}},
        }
        r = httpx.post(f"{url}/v1/agent/runs", json=agent, headers={"Authorization": f"Bearer {scoped}"})
        assert (r.status_code, r.json()["code"]) == (400, "invalid_argument") and "does not reach" in r.text


# -- secrets: the value goes only in a named header's value, over TLS, to its hosts -----------------
SECRET = "ghp_RealValue0123456789abcdef"


@pytest.fixture
def secret_proxy(tmp_path, servers):
    ca_file = tmp_path / "upstream-ca.pem"
    ca_file.write_text(servers.ca_pem)
    made = EgressProxy(
        tmp_path / "egress",
        hosts=servers.hosts("allowed.test", "other.test"),
        resolve=lambda host, port: ["203.0.113.9"],
        upstream_ca=str(ca_file),
    )
    yield made
    made.shutdown()


def _armed(proxy, key: str, **options):
    from sandloop.contract.egress import Secret

    d = proxy.open(key, ("allowed.test", "other.test"))
    (placeholder,) = proxy.arm(key, {"TOKEN": Secret(SECRET, hosts=["allowed.test"], **options)}).values()
    return d, placeholder


def _tls_request(proxy, d, host: str, request: str) -> bytes:
    """One request through an intercepted tunnel (the sandbox trusts this install's CA)."""
    s = _open_tunnel(d, f"{host}:443")
    context = ssl.create_default_context(cadata=proxy.authority.cert_pem)
    with context.wrap_socket(s, server_hostname=host) as tls:
        tls.sendall(request.encode())
        return _read_all(tls)


def test_a_secret_goes_in_its_header_over_tls_to_its_hosts(secret_proxy, servers):
    d, placeholder = _armed(secret_proxy, "e-s1")
    servers.seen.requests.clear()
    reply = _tls_request(
        secret_proxy,
        d,
        "allowed.test",
        f"GET /api HTTP/1.1\r\nHost: allowed.test\r\nAuthorization: Bearer {placeholder}\r\n\r\n",
    )
    assert reply.startswith(b"HTTP/1.1 200") and SECRET.encode() not in reply
    assert servers.seen.requests[-1][2]["Authorization"] == f"Bearer {SECRET}"
    (attempt,) = secret_proxy.attempts("e-s1")
    assert attempt.allowed and "secret TOKEN sent" in attempt.note and SECRET not in attempt.note


@pytest.mark.parametrize(
    "request_text, why",
    [
        # the finding: a server echoes the URL back (a redirect's Location, a 404 page, a query)
        ("GET /echo/{p}?q={p} HTTP/1.1\r\nHost: allowed.test\r\n\r\n", "request line"),
        ("GET / HTTP/1.1\r\nHost: allowed.test\r\nX-Echo: {p}\r\n\r\n", "X-Echo"),
        ("GET / HTTP/1.1\r\nHost: allowed.test\r\nAuthorization: x\r\n{p}: y\r\n\r\n", "is in"),
    ],
    ids=["url", "other-header", "header-name"],
)
def test_a_placeholder_anywhere_but_its_header_is_refused_never_replaced(secret_proxy, servers, request_text, why):
    d, placeholder = _armed(secret_proxy, "e-s2")
    servers.seen.requests.clear()
    reply = _tls_request(secret_proxy, d, "allowed.test", request_text.format(p=placeholder))
    assert reply.startswith(b"HTTP/1.1 403") and why.encode() in reply, reply
    assert SECRET.encode() not in reply and servers.seen.requests == []  # nothing reached the server
    (attempt,) = secret_proxy.attempts("e-s2")
    assert not attempt.allowed and "placeholder of secret TOKEN" in attempt.note


def test_a_secret_is_not_sent_over_plain_http_unless_it_says_so(secret_proxy, servers):
    d, placeholder = _armed(secret_proxy, "e-s3")
    servers.seen.requests.clear()
    s = _connect(d)
    s.sendall(
        f"GET http://allowed.test/p HTTP/1.1\r\nHost: allowed.test\r\nAuthorization: {placeholder}\r\n\r\n".encode()
    )
    reply = _read_all(s)
    s.close()
    assert reply.startswith(b"HTTP/1.1 403") and b"HTTPS only" in reply and servers.seen.requests == []
    d, placeholder = _armed(secret_proxy, "e-s4", plain_http=True, headers=["X-Api-Key"])
    s = _connect(d)
    s.sendall(f"GET http://allowed.test/p HTTP/1.1\r\nHost: allowed.test\r\nX-Api-Key: {placeholder}\r\n\r\n".encode())
    assert _read_all(s).startswith(b"HTTP/1.1 200")
    s.close()
    assert servers.seen.requests[-1][2]["X-Api-Key"] == SECRET


def test_a_placeholder_to_another_host_is_sent_unreplaced_and_flagged(secret_proxy, servers):
    d, placeholder = _armed(secret_proxy, "e-s5")
    servers.seen.requests.clear()
    reply = _tls_request(secret_proxy, d, "other.test", f"GET /{placeholder} HTTP/1.1\r\nHost: other.test\r\n\r\n")
    assert reply.startswith(b"HTTP/1.1 200") and SECRET.encode() not in reply  # the placeholder is no secret
    (attempt,) = secret_proxy.attempts("e-s5")
    assert "not one of its hosts" in attempt.note


def test_a_secret_names_only_headers_it_may_go_in():
    from sandloop.contract import InvalidArgument
    from sandloop.contract.egress import Secret

    assert Secret("v", hosts=["a.test"]).headers == ("authorization",)
    assert Secret("v", hosts=["a.test"], headers=["X-Api-Key", "x-api-key"]).headers == ("x-api-key",)
    for bad in (["Host"], ["Proxy-Authorization"], ["bad header"], []):
        with pytest.raises(InvalidArgument):
            Secret("v", hosts=["a.test"], headers=bad)


@pytest.mark.parametrize("intercepted", [False, True], ids=["plain-http", "intercepted-tls"])
def test_host_is_bound_to_the_host_the_request_was_allowed_for(secret_proxy, servers, intercepted):
    """Before: ``GET http://allowed.test/`` with ``Host: other.test`` reached the allowed address as
    other.test (a shared virtual host or CDN serves whoever Host names), a secret with it."""
    d, placeholder = _armed(secret_proxy, f"e-h{int(intercepted)}", plain_http=True)
    servers.seen.requests.clear()
    if intercepted:
        request = f"GET /h HTTP/1.1\r\nHost: other.test\r\nHost: {placeholder}\r\nAuthorization: {placeholder}\r\n\r\n"
        reply = _tls_request(secret_proxy, d, "allowed.test", request)
    else:
        s = _connect(d)
        s.sendall(
            f"GET http://allowed.test/h HTTP/1.1\r\nHost: other.test\r\nAuthorization: {placeholder}\r\n\r\n".encode()
        )
        reply = _read_all(s)
        s.close()
    assert reply.startswith(b"HTTP/1.1 200"), reply
    (seen,) = servers.seen.requests
    assert seen[2]["Host"] == "allowed.test" and list(seen[2]).count("Host") == 1, seen
    assert seen[2]["Authorization"] == SECRET and placeholder not in str(seen)


def test_an_absolute_url_to_another_host_inside_a_tunnel_is_refused(secret_proxy, servers):
    d, _ = _armed(secret_proxy, "e-h2")
    reply = _tls_request(
        secret_proxy, d, "allowed.test", "GET https://other.test/x HTTP/1.1\r\nHost: allowed.test\r\n\r\n"
    )
    assert reply.startswith(b"HTTP/1.1 403") and b"inside a tunnel to 'allowed.test'" in reply


def test_a_bare_lf_in_a_head_is_a_400(proxy, servers):
    d = proxy.open("e-lf", ("allowed.test",))
    s = _connect(d)
    s.sendall(b"GET http://allowed.test/ HTTP/1.1\r\nX-A: 1\nHost: other.test\r\n\r\n")
    reply = _read_all(s)
    s.close()
    assert reply.startswith(b"HTTP/1.1 400") and b"bare LF" in reply
    assert not proxy.attempts("e-lf")[0].allowed


def _client_hello(server_name: str) -> bytes:
    """A real ClientHello (Python's own), as one TLS record."""
    incoming, outgoing = ssl.MemoryBIO(), ssl.MemoryBIO()
    tls = ssl.create_default_context().wrap_bio(incoming, outgoing, server_hostname=server_name)
    with pytest.raises(ssl.SSLWantReadError):
        tls.do_handshake()
    return outgoing.read()


def test_a_client_hello_split_over_two_records_is_read_whole(proxy, servers):
    """Before: the proxy read the first record as the whole hello, found no server name there and
    let the tunnel through, while the far server reassembled it and saw other.test."""
    d = proxy.open("e-split", ("allowed.test:443",))
    record = _client_hello("other.test")
    body = record[5:]
    half = len(body) // 3
    split = b"".join(record[:3] + len(part).to_bytes(2, "big") + part for part in (body[:half], body[half:]))
    s = _open_tunnel(d, "allowed.test:443")
    s.sendall(split)
    assert _read_all(s) == b""  # closed, nothing relayed
    s.close()
    (attempt,) = proxy.attempts("e-split")
    assert not attempt.allowed and "'other.test' does not match" in attempt.note and attempt.bytes_in == 0


@pytest.mark.parametrize("first", [b"SSH-2.0-x\r\n", b"\x00\x01\x02\x03\x04\x05"], ids=["ssh", "binary"])
def test_a_tunnel_that_does_not_start_with_tls_is_refused(proxy, servers, first):
    d = proxy.open("e-notls", ("allowed.test:443",))
    s = _open_tunnel(d, "allowed.test:443")
    s.sendall(first + b"\0" * 16)
    assert _read_all(s) == b""
    s.close()
    (attempt,) = proxy.attempts("e-notls")
    assert not attempt.allowed and "did not start with a TLS ClientHello" in attempt.note


def test_wildcards_never_name_addresses_and_bad_hosts_get_an_answer(proxy, servers):
    """Before: '*.0.1:PORT' matched 127.0.0.1 (an IP literal skips the inward check), and
    CONNECT a..allowed.test escaped as an unhandled error with an "allowed" entry and no reply."""
    with pytest.raises(InvalidLimits, match="wildcard covers host names only"):
        SandboxLimits(egress=["*.0.1:9"])
    assert allows(("*.example.com",), "10.example.com", 443)  # a name with digits is fine
    assert not allows(("*.1.1",), "1.1.1.1", 443)
    d = proxy.open("e-bad", ("*.allowed.test",))
    for target in ("a..allowed.test:443", "-x.allowed.test:443", "ok.allowed.test:0"):
        s = _connect(d)
        s.sendall(f"CONNECT {target} HTTP/1.1\r\nHost: {target}\r\n\r\n".encode())
        assert _read_all(s).startswith(b"HTTP/1.1 400"), target
        s.close()
    assert [a.allowed for a in proxy.attempts("e-bad")] == [False, False, False]


def test_a_head_over_the_limit_gets_an_answer_and_an_entry(proxy):
    from sandloop.runtime.egress.proxy import HEAD_LIMIT

    d = proxy.open("e-big", ("allowed.test",))
    s = _connect(d)
    s.sendall(b"GET http://allowed.test/ HTTP/1.1\r\nX: " + b"a" * (HEAD_LIMIT + 10))
    reply = _read_all(s)
    s.close()
    assert reply.startswith(b"HTTP/1.1 431"), reply[:100]
    (attempt,) = proxy.attempts("e-big")
    assert not attempt.allowed and "over" in attempt.note


def test_plain_http_inside_a_tunnel_is_bound_to_the_tunnels_host(proxy, servers):
    """Node's fetch tunnels http:// URLs too: the request inside is read and bound like any."""
    d = proxy.open("e-plain-tunnel", ("allowed.test",))
    servers.seen.requests.clear()
    s = _open_tunnel(d, "allowed.test:80")
    s.sendall(b"GET /inside HTTP/1.1\r\nHost: other.test\r\n\r\n")
    reply = _read_all(s)
    s.close()
    assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"hello from http /inside\n")
    assert servers.seen.requests[-1][2]["Host"] == "allowed.test"


def test_a_relay_quiet_both_ways_is_closed_and_the_servers_can_hold_their_relays(tmp_path, monkeypatch):
    """Before: a held connection cost the process two descriptors for as long as the sandbox
    lived, and 8 sandboxes holding their 64 each made a 1024-descriptor server fail every run."""
    import resource

    from sandloop.runtime.egress import proxy as proxy_module
    from sandloop.runtime.egress import wire
    from sandloop.runtime.egress.host import raise_open_files

    monkeypatch.setattr(wire, "RELAY_IDLE_SECONDS", 1.0)  # read where relays are piped
    silent = socket.socket()
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    made = EgressProxy(tmp_path / "egress", hosts={"silent.test:443": f"127.0.0.1:{silent.getsockname()[1]}"})
    try:
        d = made.open("e-idle", ("silent.test:443",))
        s = _open_tunnel(d, "silent.test:443")
        s.sendall(_client_hello("silent.test"))
        upstream, _ = silent.accept()  # the relay is up; now nobody says anything
        s.settimeout(60)
        assert s.recv(1) == b""  # closed by the proxy, not by us (the bound is the test's timeout)
        upstream.close()
        s.close()
        (attempt,) = made.attempts("e-idle")
        assert attempt.allowed and "without a byte either way" in attempt.note
    finally:
        made.shutdown()
        silent.close()
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(1024, hard), hard))
        assert raise_open_files() == resource.getrlimit(resource.RLIMIT_NOFILE)[0] == hard
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    assert proxy_module.MAX_CONNECTIONS_TOTAL * 2 < 1024  # even an unraised limit holds the budget


def test_the_proxy_holds_a_bounded_number_of_connections_for_all_sandboxes(proxy, monkeypatch):
    import time

    from sandloop.runtime.egress import proxy as proxy_module

    monkeypatch.setattr(proxy_module, "MAX_CONNECTIONS_TOTAL", 2)
    a, b = proxy.open("e-ta", ("allowed.test",)), proxy.open("e-tb", ("allowed.test",))
    held = [_connect(a), _connect(b)]  # each waits in its head: two held, by two sandboxes
    for s in held:
        s.sendall(b"GET http://allowed.test/ HTTP/1.1\r\n")
    deadline = time.monotonic() + 30
    refused = False
    while not refused:  # until the proxy has taken both held ones, a third may still get in
        assert time.monotonic() < deadline, "a third connection was never refused"
        third = _connect(b)
        third.settimeout(10)
        refused = third.recv(1) == b""
        third.close()
    notes = [x.note for x in proxy.attempts("e-tb", settle=0)]
    assert any("for all sandboxes: refused" in n for n in notes), notes
    for s in held:
        s.close()


def test_one_request_per_connection_and_nothing_after_it_goes_up(proxy, servers):
    """Before: requests after the first on a plain-HTTP connection were relayed raw, unchecked and
    unaudited (a second request could name any Host or carry anything)."""
    d = proxy.open("e-pipe", ("allowed.test",))
    servers.seen.requests.clear()
    s = _connect(d)
    body = b"x=1"
    s.sendall(
        b"GET http://allowed.test/first HTTP/1.1\r\nHost: allowed.test\r\nContent-Length: 3\r\n\r\n"
        + body
        + b"GET /second HTTP/1.1\r\nHost: other.test\r\n\r\n"  # pipelined on the same connection
    )
    reply = _read_all(s)
    s.close()
    assert reply.startswith(b"HTTP/1.1 ") and b"/second" not in reply
    assert [path for _, path, _ in servers.seen.requests] == ["/first"]
    (attempt,) = proxy.attempts("e-pipe")
    assert "bytes after the request were not sent" in attempt.note
    s = _connect(d)
    s.sendall(b"POST http://allowed.test/c HTTP/1.1\r\nHost: allowed.test\r\nTransfer-Encoding: chunked\r\n\r\n")
    reply = _read_all(s)
    s.close()
    assert reply.startswith(b"HTTP/1.1 403") and b"Content-Length" in reply


def test_a_placeholder_in_a_body_is_said_and_never_replaced(secret_proxy, servers):
    """Before: a placeholder in a request body (to any host) went by unmentioned in the audit."""
    d, placeholder = _armed(secret_proxy, "e-body", plain_http=True)
    body = ("a" * 70_000 + placeholder).encode()  # past the first read, across chunk boundaries
    s = _connect(d)
    s.sendall(
        f"GET http://other.test/b HTTP/1.1\r\nHost: other.test\r\nContent-Length: {len(body)}\r\n\r\n".encode() + body
    )
    assert _read_all(s).startswith(b"HTTP/1.1 200")
    s.close()
    (attempt,) = secret_proxy.attempts("e-body")
    assert "placeholder of secret TOKEN was in a request body" in attempt.note and SECRET not in attempt.note

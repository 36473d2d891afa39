"""E2B's SDKs, unchanged, reaching into sandboxes (issue 38): ``sandbox.pty`` (create with a size
and environment, input, resize, kill, disconnect and connect again, list), ``get_host`` (a
server started by a command, reached by its preview host on the server's own port), a sandbox
that takes no public traffic, and a paused sandbox with auto-resume woken by an HTTP request (on
gVisor, where a pause keeps the server's memory). What E2B's own ``pty/*``, ``test_host.py`` and
``test_auto_resume_wakes_on_http_request`` found against ``sandloop serve``."""

from __future__ import annotations

import asyncio
import json
import os
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
from e2b import AsyncSandbox, CommandExitException, Sandbox
from e2b.sandbox.commands.command_handle import PtySize

from sandloop import Sandloop, Settings
from sandloop.server.app import create_app
from sandloop.server.tokens import TokenStore
from tests.conftest import _missing
from tests.servers import e2b_environment, serve_in_thread

pytestmark = [pytest.mark.timeout(600)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tokens = TokenStore(tmp_path_factory.mktemp("e2b-reach") / "tokens.sqlite")
    key, _ = tokens.create("reach", max_concurrent=8, runs_per_minute=1000, max_timeout=600)
    root = Sandloop(Settings(pool_size=0, session_pool_size=0, e2b_runtime="runsc"))
    with root, serve_in_thread(create_app(tokens, sandloop=root)) as url, e2b_environment(url, key):
        yield url


@pytest.fixture
def box(server):
    made = Sandbox.create(timeout=300)
    yield made
    made.kill()


def _via_host(server: str, host: str, path: str = "/", **kw) -> httpx.Response:
    """A request to a preview host (``<port>-<id>.localhost:<port>``), sent to the server itself:
    what a browser does for ``*.localhost``; this machine's resolver knows no such names."""
    return httpx.get(f"{server}{path}", headers={"Host": host, **kw.pop("headers", {})}, timeout=30, **kw)


def _served(get, seconds: float = 60.0) -> httpx.Response:
    deadline = time.monotonic() + seconds
    while (r := get()).status_code == 502 and time.monotonic() < deadline:
        time.sleep(0.3)
    return r


def test_a_terminal_takes_input_resizes_and_exits(box):
    output: list[bytes] = []
    term = box.pty.create(PtySize(cols=80, rows=24), envs={"ABC": "123"}, cwd="/")
    box.pty.send_stdin(term.pid, b"echo $ABC-$(tput cols) in-$(pwd)-dir\n")
    box.pty.resize(term.pid, PtySize(cols=100, rows=30))  # the line above may run before or after
    wait = b"for i in $(seq 50); do [ $(tput cols) = 100 ] && break; sleep 0.1; done; "  # gVisor: late once in 15
    box.pty.send_stdin(term.pid, wait + b"echo now-$(tput cols)x$(tput lines)\nexit 3\n")
    with pytest.raises(CommandExitException) as ended:
        term.wait(on_pty=output.append)
    assert ended.value.exit_code == 3
    shown = b"".join(output)
    # (a resize redraws the line being typed: each answer is looked for on its own)
    assert re.search(rb"123-(80|100)", shown) and b"in-/-dir" in shown and b"now-100x30" in shown, shown[-500:]


def test_the_async_sdk_drives_a_terminal_and_a_host(server):
    async def main() -> tuple[int, bytes, str]:
        box = await AsyncSandbox.create(timeout=300)
        try:
            output: list[bytes] = []
            term = await box.pty.create(PtySize(cols=90, rows=24), on_data=output.append)
            await box.pty.resize(term.pid, PtySize(cols=91, rows=24))
            await box.pty.send_stdin(term.pid, b"echo async-$(tput cols); exit\n")
            result = await term.wait()
            return result.exit_code, b"".join(output), box.get_host(8000)
        finally:
            await box.kill()

    code, shown, host = asyncio.run(main())
    assert code == 0 and re.search(rb"async-9[01]", shown), shown[-300:]
    assert host.startswith("8000-") and host.endswith(f".localhost:{server.rsplit(':', 1)[1]}")


def test_a_terminal_is_listed_killed_and_followed_again(box):
    term = box.pty.create(PtySize(80, 24), envs={"FOO": "bar"})
    assert term.pid in [p.pid for p in box.commands.list()]
    box.pty.send_stdin(term.pid, b"echo one-$FOO\n")
    term.disconnect()
    again = box.pty.connect(term.pid)
    box.pty.send_stdin(term.pid, b"echo two-$FOO\nexit\n")
    output: list[bytes] = []
    assert again.wait(on_pty=output.append).exit_code == 0
    assert b"two-bar" in b"".join(output)

    other = box.pty.create(PtySize(80, 24))
    assert box.pty.kill(other.pid)
    with pytest.raises(CommandExitException):
        box.commands.run(f"kill -0 {other.pid}")  # a process of the sandbox, and gone
    assert not box.pty.kill(999_999)  # none such: False, as E2B's
    assert other.pid not in [p.pid for p in box.commands.list()]


def test_get_host_reaches_a_server_a_command_started(server, box):
    box.files.write("/home/user/index.html", "hello from a command's server")
    cmd = box.commands.run("python3 -m http.server 8001", background=True, cwd="/home/user")
    try:
        host = box.get_host(8001)
        assert host == f"8001-{box.sandbox_id}.localhost:{server.rsplit(':', 1)[1]}"
        r = _served(lambda: _via_host(server, host))
        assert (r.status_code, r.text) == (200, "hello from a command's server")
        closed = _via_host(server, box.get_host(8002))
        assert closed.status_code == 502 and "nothing listens on port 8002" in closed.json()["message"]
    finally:
        cmd.kill()


def test_a_sandbox_without_public_traffic_needs_its_traffic_token(server):
    box = Sandbox.create(timeout=300, network={"allow_public_traffic": False})
    try:
        cmd = box.commands.run("python3 -m http.server 8001", background=True, cwd="/home/user")
        host = box.get_host(8001)
        refused = _via_host(server, host)
        assert refused.status_code == 403 and "traffic access token" in refused.json()["message"]
        token = box.traffic_access_token
        assert token
        r = _served(lambda: _via_host(server, host, headers={"e2b-traffic-access-token": token}))
        assert r.status_code == 200
        wrong = _via_host(server, host, headers={"e2b-traffic-access-token": "0" * 64})
        assert wrong.status_code == 403
        cmd.kill()
    finally:
        box.kill()


def _takes_only_its_own_token(server: str, box: Sandbox, other_token: str) -> None:
    """``box`` refuses its preview traffic without its traffic token, or with another sandbox's,
    and serves it with its own."""
    box.files.write("/home/user/index.html", f"served by {box.sandbox_id}")
    box.commands.run("python3 -m http.server 8001", background=True, cwd="/home/user")
    host = box.get_host(8001)
    refused = _via_host(server, host)
    assert refused.status_code == 403 and "traffic access token" in refused.json()["message"], refused.text
    assert box.traffic_access_token and box.traffic_access_token != other_token
    assert _via_host(server, host, headers={"e2b-traffic-access-token": other_token}).status_code == 403
    r = _served(lambda: _via_host(server, host, headers={"e2b-traffic-access-token": box.traffic_access_token}))
    assert (r.status_code, r.text) == (200, f"served by {box.sandbox_id}")


def test_a_fork_of_a_sandbox_without_public_traffic_takes_none_either(server):
    """Issue 52 finding 7: a fork came out public."""
    box = Sandbox.create(timeout=300, network={"allow_public_traffic": False})
    try:
        forks = box.fork(count=1, timeout=300)
        assert all(isinstance(f, Sandbox) for f in forks), forks
        try:
            _takes_only_its_own_token(server, forks[0], box.traffic_access_token)
        finally:
            forks[0].kill()
    finally:
        box.kill()


def test_a_sandbox_from_a_snapshot_of_one_without_public_traffic_takes_none_either(server):
    """Issue 52 finding 7: one made from its snapshot came out public, also once the source is
    gone; a create that says ``allow_public_traffic`` still decides."""
    box = Sandbox.create(timeout=300, network={"allow_public_traffic": False})
    try:
        snap = box.create_snapshot()
    finally:
        box.kill()
    try:
        other = Sandbox.create(snap.snapshot_id, timeout=300)
        try:
            _takes_only_its_own_token(server, other, box.traffic_access_token)
        finally:
            other.kill()
        public = Sandbox.create(snap.snapshot_id, timeout=300, network={"allow_public_traffic": True})
        try:
            assert _via_host(server, public.get_host(8001)).status_code == 502  # let in; nothing listens
        finally:
            public.kill()
    finally:
        Sandbox.delete_snapshot(snap.snapshot_id)


LISTENING = (
    "for i in $(seq 300); do python3 -c 'import socket; socket.create_connection((\"127.0.0.1\", 8000))' "
    "2>/dev/null && exit 0; sleep 0.1; done; exit 1"
)


@pytest.mark.runsc
def test_a_paused_sandbox_with_auto_resume_wakes_on_an_http_request(server):
    box = Sandbox.create(timeout=120, lifecycle={"on_timeout": "pause", "auto_resume": True})
    try:
        cmd = box.commands.run("python3 -m http.server 8000", background=True, cwd="/home/user")
        box.commands.run(LISTENING)  # its server listens (asked inside: a preview request would wake it later)
        box.set_timeout(2)
        deadline = time.monotonic() + 120
        while box.get_info().state != "paused":  # at its timeout the reaper pauses it
            assert time.monotonic() < deadline, "the sandbox was not paused at its timeout"
            time.sleep(0.5)
        r = _via_host(server, box.get_host(8000))
        assert r.status_code == 200, r.text  # woken, its server's memory kept (gVisor)
        assert box.get_info().state == "running" and box.is_running()
        cmd.kill()
    finally:
        box.kill()


JS = Path(__file__).parents[1] / "js"


def test_the_javascript_sdk_drives_a_terminal_and_a_host(server):
    """E2B's JS SDK (e2b 2.51.0, installed into tests/js by ``scripts/setup.sh --dev``), unchanged,
    in node with every connection outside loopback refused (tests/js/loopback-only.cjs)."""
    node = shutil.which("node")
    if node is None or not (JS / "node_modules" / "e2b").is_dir():
        _missing("node and tests/js/node_modules (scripts/setup.sh --dev installs them)")
    guard = ["--require", str(JS / "loopback-only.cjs")]
    probe = "fetch('https://api.e2b.app/').then(() => console.log('left'), (e) => console.log(e.cause.message))"
    refused = subprocess.run([node, *guard, "-e", probe], capture_output=True, text=True, timeout=60)
    assert refused.stdout.startswith("loopback-only: refused"), refused  # the guard holds
    done = subprocess.run(
        [node, *guard, str(JS / "reach.mjs")],
        cwd=JS, env=dict(os.environ), capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    seen = json.loads(done.stdout.strip().splitlines()[-1])
    port = server.rsplit(":", 1)[1]
    assert seen["command"] == "js-42\n"
    assert seen["listed"] and seen["reconnected"]
    assert seen["exit"] == 5 and "from-js-80" in seen["terminal"] and "now-120x40" in seen["terminal"]
    assert (seen["killed"], seen["killedAgain"]) == (True, False)  # E2B's: false once it is gone
    assert seen["host"].startswith("8000-") and seen["host"].endswith(f".localhost:{port}")
    assert seen["preview"] == {"status": 200, "body": "served-by-js\n"}
    assert seen["closedPort"] == 502 and seen["alive"] is False

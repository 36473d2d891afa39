"""The MCP server driven by the official MCP client, over stdio and over streamable HTTP."""

from __future__ import annotations

import asyncio
import base64
import sys

import httpx
from mcp import Client
from mcp.client.stdio import StdioServerParameters

from sandloop.server.tokens import TokenStore
from tests.servers import sandloop_process

STDIO = StdioServerParameters(command=sys.executable, args=["-m", "sandloop", "mcp"])


def _text(result) -> str:
    return "".join(c.text for c in result.content if getattr(c, "type", "") == "text")


async def _exercise(client: Client) -> None:
    tools = {t.name: t for t in (await client.list_tools()).tools}
    assert {"run_code", "session_create", "session_cell", "session_read_file"} <= set(tools)
    assert "no network" in (tools["run_code"].description or "").lower() or tools["run_code"].description

    ok = await client.call_tool("run_code", {"code": "print(6 * 7)"})
    assert not ok.is_error and "42" in _text(ok)

    oom = await client.call_tool("run_code", {"code": "x = bytearray(700 * 1024 * 1024)"})
    assert oom.is_error and "exceeded the 256m memory limit" in _text(oom)

    bad = await client.call_tool("run_code", {"code": "x", "language": "cobol"})
    assert bad.is_error and "unknown language" in _text(bad)


def test_mcp_over_stdio():
    async def main() -> None:
        async with Client(STDIO) as client:
            await _exercise(client)
            sid = _text(await client.call_tool("session_create", {"ttl_seconds": 300, "quota": "16m"})).strip()
            assert sid.startswith("s-")
            try:
                await client.call_tool("session_write_file", {"session_id": sid, "path": "d.txt", "content": "3,4"})
                code = (
                    "import matplotlib.pyplot as plt\nplt.plot([3, 4])\nsum(map(int, open('d.txt').read().split(',')))"
                )
                cell = await client.call_tool("session_cell", {"session_id": sid, "code": code})
                assert "value: 7" in _text(cell)
                images = [c for c in cell.content if getattr(c, "type", "") == "image"]
                assert images and base64.b64decode(images[0].data).startswith(b"\x89PNG")
                html = "from IPython.display import HTML, display\ndisplay(HTML('<table><tr><td>1</td></tr></table>'))"
                shown = await client.call_tool("session_cell", {"session_id": sid, "code": html})
                assert any("[text/html]\n<table>" in getattr(c, "text", "") for c in shown.content), shown
                js = await client.call_tool("session_cell", {"session_id": sid, "code": "6 * 7", "language": "js"})
                assert "value: 42" in _text(js)
                escape = await client.call_tool("session_read_file", {"session_id": sid, "path": "../../etc/passwd"})
                assert escape.is_error and "workspace" in _text(escape)
                serve = (
                    "import socket, subprocess, time\n"
                    "server = subprocess.Popen(['python3', '-m', 'http.server', '8000'], stderr=subprocess.DEVNULL)\n"
                    "while socket.socket().connect_ex(('127.0.0.1', 8000)):\n    time.sleep(0.05)"
                )
                await client.call_tool("session_cell", {"session_id": sid, "code": serve})
                page = await client.call_tool("session_http", {"session_id": sid, "port": 8000, "path": "/d.txt"})
                assert not page.is_error and _text(page).startswith("HTTP 200 OK") and _text(page).endswith("\n3,4")
                closed = await client.call_tool("session_http", {"session_id": sid, "port": 8999})
                assert closed.is_error and "nothing listens on port 8999" in _text(closed), _text(closed)
                await client.call_tool("session_cell", {"session_id": sid, "code": "server.kill()"})
                await client.call_tool("session_cell", {"session_id": sid, "code": "kept = 41"})
                paused = await client.call_tool("session_pause", {"session_id": sid})
                assert "kept its state" in _text(paused), _text(paused)  # runc: the picklable variables
                [child] = _text(await client.call_tool("session_fork", {"session_id": sid})).split()  # resumes it
                forked = await client.call_tool("session_fork", {"session_id": sid, "paused": True})
                [later] = _text(forked).split()  # made paused: its first call resumes it
                try:
                    await client.call_tool("session_cell", {"session_id": child, "code": "kept = 0"})
                    cell = await client.call_tool("session_cell", {"session_id": sid, "code": "kept + 1"})
                    assert "value: 42" in _text(cell)
                    first = await client.call_tool("session_cell", {"session_id": later, "code": "kept + 2"})
                    assert "value: 43" in _text(first), _text(first)
                finally:
                    await client.call_tool("session_delete", {"session_id": child})
                    await client.call_tool("session_delete", {"session_id": later})
            finally:
                await client.call_tool("session_delete", {"session_id": sid})

    asyncio.run(main())


def _client(url: str, secret: str) -> Client:
    """The SDK's own HTTP client (its timeouts: 300 s to read a tool's answer; before, httpx's
    default 5 s failed a session_pause on a busy host with ReadTimeout)."""
    from mcp.client.streamable_http import streamable_http_client
    from mcp.shared._httpx_utils import create_mcp_http_client

    return Client(
        streamable_http_client(url, http_client=create_mcp_http_client(headers={"Authorization": f"Bearer {secret}"}))
    )


def test_mcp_over_streamable_http_needs_a_token_and_scopes_sessions_to_it(tmp_path):
    """Before: any client reaching the port could run code and use any session by id."""
    tokens = TokenStore(tmp_path / "tokens.sqlite")
    alice, _ = tokens.create("alice")
    bob, _ = tokens.create("bob", runs_per_minute=4)
    with sandloop_process("mcp", "--transport", "http", home=tmp_path) as (port, _proc):
        url = f"http://127.0.0.1:{port}/mcp"
        init = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": {}}
        r = httpx.post(url, json=init, headers={"Accept": "application/json, text/event-stream"})
        assert r.status_code == 401 and r.headers["www-authenticate"] == "Bearer"
        r = httpx.post(url, json=init, headers={"Authorization": "Bearer sl_forged"})
        assert r.status_code == 401

        async def main() -> None:
            async with _client(url, alice) as client:
                await _exercise(client)
                sid = _text(await client.call_tool("session_create", {"ttl_seconds": 300, "quota": "16m"})).strip()
                assert sid.startswith("s-")
            try:
                async with _client(url, bob) as client:
                    for tool, args in [
                        ("session_list_files", {}),
                        ("session_cell", {"code": "1"}),
                        ("session_read_file", {"path": "x"}),
                        ("session_delete", {}),
                    ]:
                        denied = await client.call_tool(tool, {"session_id": sid, **args})
                        assert denied.is_error and "session_not_found" in _text(denied), (tool, _text(denied))
                    limited = await client.call_tool("run_code", {"code": "print(1)"})  # bob's 5th call this minute
                    assert limited.is_error and "rate_limited" in _text(limited)
            finally:
                async with _client(url, alice) as client:
                    assert "deleted" in _text(await client.call_tool("session_delete", {"session_id": sid}))

        asyncio.run(main())


def test_mcp_runs_reach_the_operators_allowlist_with_its_secrets(tmp_path):
    """`sandloop mcp --allow --secret`: the model's code reaches the listed host with the value it
    never sees; the tool's text carries the audit."""
    import json
    import os

    from tests.egress_servers import Servers

    servers = Servers()
    env = {**os.environ, "SANDLOOP_EGRESS_HOSTS": json.dumps(servers.hosts()), "MY_KEY": "value-for-mcp-only"}
    args = [
        "-m",
        "sandloop",
        "mcp",
        "--allow",
        "allowed.test",
        "--secret",
        "KEY=MY_KEY@allowed.test;header=X-Key;plain-http",
    ]
    fetch = (
        "import os, urllib.request\n"
        "req = urllib.request.Request('http://allowed.test/mcp', headers={'X-Key': os.environ['KEY']})\n"
        "print(urllib.request.urlopen(req, timeout=20).read().decode(), os.environ['KEY'][:20])\n"
    )

    async def main() -> None:
        async with Client(StdioServerParameters(command=sys.executable, args=args, env=env)) as client:
            tools = {t.name: t for t in (await client.list_tools()).tools}
            assert "may reach allowed.test" in (tools["run_code"].description or "")
            result = await client.call_tool("run_code", {"code": fetch})
            text = _text(result)
            assert not result.is_error and "hello from http /mcp" in text and "sandloop-secret-K" in text, text
            assert "egress (allowed): GET allowed.test:80" in text and "value-for-mcp-only" not in text
            # the finding: any caller of the tool could put the operator's placeholder in a URL
            # that the server echoes back (a redirect, a 404 page) and read the value
            echo = (
                "import os, urllib.request\ntry:\n"
                "    urllib.request.urlopen('http://allowed.test/echo/' + os.environ['KEY'], timeout=20)\n"
                "except Exception as e:\n    print(e, e.read().decode())\n"
            )
            result = await client.call_tool("run_code", {"code": echo})
            text = _text(result)
            assert "HTTP Error 403" in text and "request line" in text and "value-for-mcp-only" not in text, text

    try:
        asyncio.run(main())
        assert [h.get("X-Key") for _, p, h in servers.seen.requests if p == "/mcp"] == ["value-for-mcp-only"]
        assert not [p for _, p, _ in servers.seen.requests if p.startswith("/echo")]  # refused at the proxy
    finally:
        servers.close()

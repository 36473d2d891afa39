"""The MCP server driven by the official MCP client, over stdio and over streamable HTTP."""

from __future__ import annotations

import asyncio
import base64
import socket
import subprocess
import sys
import time

from mcp import Client
from mcp.client.stdio import StdioServerParameters

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
                escape = await client.call_tool("session_read_file", {"session_id": sid, "path": "../../etc/passwd"})
                assert escape.is_error and "workspace" in _text(escape)
            finally:
                await client.call_tool("session_delete", {"session_id": sid})

    asyncio.run(main())


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_mcp_over_streamable_http():
    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "sandloop", "mcp", "--transport", "http", "--port", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
    )
    try:
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            time.sleep(0.2)

        async def main() -> None:
            async with Client(f"http://127.0.0.1:{port}/mcp") as client:
                await _exercise(client)

        asyncio.run(main())
    finally:
        proc.terminate()
        proc.wait(20)

"""The MCP server (official ``mcp`` SDK): sandloop as tools for Claude Desktop, Claude Code, Cursor.

    sandloop mcp                                   # stdio
    sandloop mcp --transport http --port 8765      # streamable HTTP at /mcp

A front end: each tool calls the core. A failed or killed run comes back as a tool result with
``isError`` and the same notes the agent loop gives a model; nothing raises into the client.
"""

from __future__ import annotations

import base64
import functools
from collections.abc import Callable
from typing import Any

import anyio
from mcp.server.mcpserver import MCPServer
from mcp_types import CallToolResult, ImageContent, TextContent

from sandloop import languages
from sandloop.agent.tools import format_execution
from sandloop.contract import SandboxError, SandboxLimits

INSTRUCTIONS = (
    "sandloop runs code in throwaway, hardened sandboxes: no network, 256 MB of memory, half a CPU, "
    "at most 64 processes, a read-only system with a writable /tmp. Use run_code for one-off "
    "programs. For multi-step work, session_create gives a persistent /workspace and a Python "
    "interpreter whose variables survive between session_cell calls; charts come back as images."
)


def _text(text: str, is_error: bool = False) -> CallToolResult:
    return CallToolResult(content=[TextContent(type="text", text=text)], is_error=is_error)


def _guarded(fn: Callable[..., CallToolResult]) -> Callable[..., Any]:
    """Run the blocking core call off the event loop; sandbox failures become isError results."""

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> CallToolResult:
        try:
            return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))
        except SandboxError as exc:
            return _text(f"error: the sandbox could not do this: {exc}", is_error=True)

    return wrapper


def create_mcp_server(limits: SandboxLimits | None = None) -> MCPServer:
    from sandloop.runner import run_code as core_run
    from sandloop.sessions import Session

    lim = limits or SandboxLimits()
    server = MCPServer("sandloop", instructions=INSTRUCTIONS, version="0.1.0")
    langs = ", ".join(languages.names())

    @server.tool(
        description=f"Run a program once in a fresh sandbox ({langs}; Python has numpy, pandas, matplotlib). "
        "Returns exit code, stdout, stderr, and a note when the sandbox killed or limited it."
    )
    @_guarded
    def run_code(code: str, language: str = "python", timeout_seconds: float = 30) -> CallToolResult:
        result = core_run(code, language, timeout_seconds, limits=lim)
        return _text(format_execution(result), is_error=not result.ok)

    @server.tool(
        description="Create a session: a persistent /workspace (quota) and a stateful Python interpreter. "
        "Returns the session id. Sessions expire after ttl_seconds idle."
    )
    @_guarded
    def session_create(ttl_seconds: float = 3600, quota: str = "256m") -> CallToolResult:
        s = Session.create(lim, ttl=ttl_seconds, quota=quota)
        s.close()
        return _text(s.id)

    @server.tool(description="Run a program in a fresh process with the session's /workspace as working directory.")
    @_guarded
    def session_run(
        session_id: str, code: str, language: str = "python", timeout_seconds: float = 30
    ) -> CallToolResult:
        s = Session.attach(session_id)
        try:
            result = s.run(code, language, timeout_seconds)
        finally:
            s.close()
        return _text(format_execution(result), is_error=not result.ok)

    @server.tool(
        description="Run Python in the session's interpreter; variables persist between calls. The value of "
        "a last expression is returned; matplotlib figures come back as PNG images."
    )
    @_guarded
    def session_cell(session_id: str, code: str, timeout_seconds: float = 30) -> CallToolResult:
        s = Session.attach(session_id)
        try:
            result = s.run_cell(code, timeout_seconds)
        finally:
            s.close()
        text = format_execution(result)
        if result.value is not None:
            text += f"\nvalue: {result.value}"
        if result.interpreter_restarted:
            text += "\nnote: the interpreter had to be restarted; its variables are gone."
        content: list[Any] = [TextContent(type="text", text=text)]
        content += [
            ImageContent(type="image", data=base64.b64encode(a.data).decode(), mime_type=a.mime_type)
            for a in result.artifacts
        ]
        return CallToolResult(content=content, is_error=not result.ok)

    @server.tool(description="Write a text file into the session's /workspace (path relative to it).")
    @_guarded
    def session_write_file(session_id: str, path: str, content: str) -> CallToolResult:
        s = Session.attach(session_id)
        try:
            return _text(f"wrote {s.write_file(path, content)} bytes to /workspace/{path}")
        finally:
            s.close()

    @server.tool(description="Read a text file from the session's /workspace.")
    @_guarded
    def session_read_file(session_id: str, path: str) -> CallToolResult:
        s = Session.attach(session_id)
        try:
            data = s.read_file(path)
        finally:
            s.close()
        try:
            return _text(data.decode())
        except UnicodeDecodeError:
            return _text(f"{path} is binary ({len(data)} bytes)", is_error=True)

    @server.tool(description="List a directory of the session's /workspace.")
    @_guarded
    def session_list_files(session_id: str, path: str = ".") -> CallToolResult:
        s = Session.attach(session_id)
        try:
            entries = s.list_files(path)
        finally:
            s.close()
        return _text("\n".join(f"{e['type']:7} {e['size']:>10}  {e['name']}" for e in entries) or "(empty)")

    @server.tool(description="Delete a session and everything in it.")
    @_guarded
    def session_delete(session_id: str) -> CallToolResult:
        Session.attach(session_id).delete()
        return _text(f"deleted {session_id}")

    return server

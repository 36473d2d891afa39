"""The MCP server (official ``mcp`` SDK): sandloop as tools for Claude Desktop, Claude Code, Cursor.

    sandloop mcp                                   # stdio: the local user is trusted
    sandloop mcp --transport http --port 8765      # streamable HTTP at /mcp, bearer tokens required

A front end: each tool calls the core. A failed or killed run comes back as a tool result with
``isError`` and the same notes the agent loop gives a model; nothing raises into the client.

Over HTTP every request needs a token from the HTTP API's store (``sandloop tokens create``),
checked before its body is read (``RequestGuard``). A token sees only the sessions it created
(here or over the HTTP API: they are the same sessions), and its tools count against its rate,
concurrency, session and workspace ceilings exactly as over the HTTP API.
"""

from __future__ import annotations

import contextlib
import functools
import json
import threading
from collections.abc import Callable, Iterator, Mapping
from typing import TYPE_CHECKING, Any

import anyio
from mcp.server.mcpserver import Context, MCPServer
from mcp_types import CallToolResult, ImageContent, TextContent

from sandloop import languages
from sandloop.contract import SandboxError, SandboxLimits, SessionNotFound, parse_size
from sandloop.contract.egress import Secret, covers
from sandloop.present import format_execution, present_http
from sandloop.server.quota import QuotaError, RateWindow, check_session_room, check_snapshot_room, footprints
from sandloop.server.tokens import Token, TokenStore

if TYPE_CHECKING:
    from sandloop.root import Sandloop
    from sandloop.sessions import Session

INSTRUCTIONS = (
    "sandloop runs code in throwaway, hardened sandboxes: no network, 256 MB of memory, half a CPU, "
    "at most 64 processes, a read-only system with a writable /tmp. Use run_code for one-off "
    "programs. For multi-step work, session_create gives a persistent /workspace and a Python "
    "interpreter whose variables survive between session_cell calls; charts come back as images."
)


#: Characters of one HTML, markdown, SVG or JSON output a tool result carries.
OUTPUT_TEXT_CHARS = 20000


def _text(text: str, is_error: bool = False) -> CallToolResult:
    return CallToolResult(content=[TextContent(type="text", text=text)], is_error=is_error)


def _guarded(fn: Callable[..., CallToolResult]) -> Callable[..., Any]:
    """Run the blocking core call off the event loop; sandbox failures become isError results."""

    @functools.wraps(fn)
    async def wrapper(*args: Any, **kwargs: Any) -> CallToolResult:
        try:
            return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs))
        except SandboxError as exc:
            return _text(f"error ({exc.code}): the sandbox could not do this: {exc}", is_error=True)
        except QuotaError as exc:
            return _text(f"error ({exc.code}): {exc.message}", is_error=True)

    return wrapper


def _caller(ctx: Context) -> Token | None:
    """The token RequestGuard verified for this HTTP request; None over stdio."""
    request = ctx.request_context.request
    return None if request is None else request.scope.get("state", {}).get("token")


def create_mcp_server(
    limits: SandboxLimits | None = None,
    tokens: TokenStore | None = None,
    *,
    sandloop: Sandloop | None = None,
    secrets: Mapping[str, Secret] | None = None,
) -> MCPServer:
    """The tools over a ``Sandloop`` (default: the process-wide one). With ``tokens`` (the HTTP
    transport) every call must carry one of its tokens and is scoped and counted as over the HTTP
    API; without (stdio) the local user is trusted."""
    from sandloop.root import default_root

    root = sandloop or default_root()
    core_run = root.run_code

    lim = limits or SandboxLimits()
    reach = (
        f"It may reach {', '.join(lim.egress)} over HTTP(S) only, through the proxy in HTTPS_PROXY"
        + (f"; ${', $'.join(secrets)} hold credentials for those hosts, use them as is." if secrets else ".")
        if lim.egress
        else "No network."
    )
    server = MCPServer("sandloop", instructions=INSTRUCTIONS, version="0.1.0")
    langs = ", ".join(languages.names())
    rates = RateWindow()
    session_lock = threading.Lock()

    @contextlib.contextmanager
    def metered(ctx: Context) -> Iterator[Token | None]:
        """Counts the call against the caller's token (HTTP); stdio callers are not metered."""
        token = _caller(ctx)
        if tokens is None:
            yield None
            return
        if token is None:  # RequestGuard refuses these first; this is a backstop
            raise QuotaError(401, "unauthorized", "this server needs a bearer token")
        beyond = [rule for rule in lim.egress if not covers(token.egress, rule)]
        if beyond:
            raise QuotaError(403, "egress_refused", f"this token may not reach {', '.join(beyond)}")
        with rates.use(token):
            yield token

    def check_owner(token: Token | None, session_id: str) -> None:
        if tokens is not None and (token is None or tokens.owner_of(session_id) != token.id):
            raise SessionNotFound(f"no session {session_id}")  # someone else's looks like none

    def attach(token: Token | None, session_id: str) -> Session:
        check_owner(token, session_id)
        return root.attach_session(session_id)

    @server.tool(
        description=f"Run a program once in a fresh sandbox ({langs}; Python has numpy, pandas, matplotlib). "
        "Returns exit code, stdout, stderr, and a note when the sandbox killed or limited it. "
        "template: start from a template (name[:tag]) instead of the runtime image. " + reach
    )
    @_guarded
    def run_code(
        ctx: Context, code: str, language: str = "python", timeout_seconds: float = 30, template: str | None = None
    ) -> CallToolResult:
        with metered(ctx) as token:
            if token is not None and timeout_seconds > token.max_timeout:
                raise QuotaError(403, "over_token_limit", f"this token may ask for at most {token.max_timeout:g} s")
            if template is not None:  # over HTTP: the token's own templates and the operator's
                root.templates.image_for(template, owner=token.id if token is not None else None)
            result = core_run(code, language, timeout_seconds, limits=lim, secrets=secrets, template=template)
        return _text(format_execution(result), is_error=not result.ok)

    @server.tool(
        description="Create a session: a persistent /workspace (quota) and a stateful Python interpreter. "
        "Returns the session id. Sessions expire after ttl_seconds idle."
    )
    @_guarded
    def session_create(
        ctx: Context, ttl_seconds: float = 3600, quota: str = "256m", template: str | None = None
    ) -> CallToolResult:
        with metered(ctx) as token, session_lock:
            if template is not None:
                root.templates.image_for(template, owner=token.id if token is not None else None)
            if token is not None and tokens is not None:
                mine = tokens.sessions_of(token.id)
                live = footprints(root.sessions, [r for r in root.list_sessions() if r.id in mine])
                check_session_room(token, live, parse_size(quota))
            s = root.create_session(lim, ttl=ttl_seconds, quota=quota, template=template)
            if token is not None and tokens is not None:
                tokens.own(s.id, token.id)
            s.close()
        return _text(s.id)

    @server.tool(description="Run a program in a fresh process with the session's /workspace as working directory.")
    @_guarded
    def session_run(
        ctx: Context, session_id: str, code: str, language: str = "python", timeout_seconds: float = 30
    ) -> CallToolResult:
        with metered(ctx) as token, attach(token, session_id) as s:
            result = s.run(code, language, timeout_seconds)
        return _text(format_execution(result), is_error=not result.ok)

    @server.tool(
        description="Run a cell in the session's interpreter (IPython for Python: !cmd, %magic, display); "
        "variables persist between calls. language: python (default), javascript, typescript or bash. The "
        "value of a last expression is returned; figures and images come back as images, HTML and "
        "markdown outputs as text."
    )
    @_guarded
    def session_cell(
        ctx: Context, session_id: str, code: str, timeout_seconds: float = 30, language: str = "python"
    ) -> CallToolResult:
        with metered(ctx) as token, attach(token, session_id) as s:
            result = s.run_cell(code, timeout_seconds, secrets=secrets if s.limits.egress else None, language=language)
        text = format_execution(result)
        if result.value is not None:
            text += f"\nvalue: {result.value}"
        if result.interpreter_restarted:
            text += "\nnote: the interpreter had to be restarted; its variables are gone."
        content: list[Any] = [TextContent(type="text", text=text)]
        for output in result.outputs:
            for mime in ("image/png", "image/jpeg"):
                if isinstance(output.data.get(mime), str):
                    content.append(ImageContent(type="image", data=output.data[mime], mime_type=mime))
                    break
            else:
                for mime in ("text/html", "text/markdown", "image/svg+xml", "application/json"):
                    if mime in output.data and not output.is_main_result:
                        body = output.data[mime]
                        body = body if isinstance(body, str) else json.dumps(body)
                        content.append(TextContent(type="text", text=f"[{mime}]\n{body[:OUTPUT_TEXT_CHARS]}"))
                        break
        return CallToolResult(content=content, is_error=not result.ok)

    @server.tool(
        description="Send an HTTP request to a server the session's code started on port (1-65535) inside its "
        "sandbox, e.g. in session_cell: subprocess.Popen(['python3', '-m', 'http.server', '8000']). It is "
        "reached on the sandbox's own loopback: the sandbox still has no network. Returns the status line, the "
        f"headers and the body (its first {OUTPUT_TEXT_CHARS} characters). path starts with /."
    )
    @_guarded
    def session_http(
        ctx: Context,
        session_id: str,
        port: int,
        path: str = "/",
        method: str = "GET",
        body: str = "",
        timeout_seconds: float = 30,
    ) -> CallToolResult:
        with metered(ctx) as token:
            if token is not None and timeout_seconds > token.max_timeout:
                raise QuotaError(403, "over_token_limit", f"this token may ask for at most {token.max_timeout:g} s")
            with attach(token, session_id) as s:
                answer = s.request(port, path, method=method, body=body.encode(), timeout=timeout_seconds)
        return _text(present_http(answer, OUTPUT_TEXT_CHARS))

    @server.tool(description="Write a text file into the session's /workspace (path relative to it).")
    @_guarded
    def session_write_file(ctx: Context, session_id: str, path: str, content: str) -> CallToolResult:
        with metered(ctx) as token, attach(token, session_id) as s:
            return _text(f"wrote {s.write_file(path, content)} bytes to /workspace/{path}")

    @server.tool(description="Read a text file from the session's /workspace.")
    @_guarded
    def session_read_file(ctx: Context, session_id: str, path: str) -> CallToolResult:
        with metered(ctx) as token, attach(token, session_id) as s:
            data = s.read_file(path)
        try:
            return _text(data.decode())
        except UnicodeDecodeError:
            return _text(f"{path} is binary ({len(data)} bytes)", is_error=True)

    @server.tool(description="List a directory of the session's /workspace.")
    @_guarded
    def session_list_files(ctx: Context, session_id: str, path: str = ".") -> CallToolResult:
        with metered(ctx) as token, attach(token, session_id) as s:
            entries = s.list_files(path)
        return _text("\n".join(f"{e['type']:7} {e['size']:>10}  {e['name']}" for e in entries) or "(empty)")

    @server.tool(
        description="Fork a session: count (1-20) new sessions, each starting as this one is now, with its own "
        "copy of the workspace and of the interpreter's variables (its whole memory on gVisor). paused=true makes "
        "them paused (nothing runs until each is first used, which resumes it). Returns their ids."
    )
    @_guarded
    def session_fork(ctx: Context, session_id: str, count: int = 1, paused: bool = False) -> CallToolResult:
        with metered(ctx) as token, session_lock, attach(token, session_id) as s:
            if token is not None and tokens is not None:
                mine = tokens.sessions_of(token.id)
                live = footprints(root.sessions, [r for r in root.list_sessions() if r.id in mine])
                for i in range(count if isinstance(count, int) else 1):
                    check_session_room(token, live + [s.record.quota_bytes] * i, s.record.quota_bytes)
            children = s.fork(count, paused=paused)
            for child in children:
                if token is not None and tokens is not None:
                    tokens.own(child.id, token.id)
                child.close()
        return _text("\n".join(c.id for c in children))

    @server.tool(
        description="Pause a session: nothing runs and no memory is held until it is used again (any session_ tool "
        "resumes it). Returns what was kept: memory (gVisor), state (picklable variables) or files."
    )
    @_guarded
    def session_pause(ctx: Context, session_id: str) -> CallToolResult:
        with metered(ctx) as token:
            check_owner(token, session_id)
            if token is not None and tokens is not None:  # what it keeps counts once made (quota.footprints)
                mine = tokens.sessions_of(token.id)
                live = footprints(root.sessions, [r for r in root.list_sessions() if r.id in mine])
                check_snapshot_room(token, live, root.snapshots.total_bytes(token.id))
            with root.attach_session(session_id, resume=False) as s:
                return _text(f"paused {session_id}: kept its {s.pause()}")

    @server.tool(description="Delete a session and everything in it.")
    @_guarded
    def session_delete(ctx: Context, session_id: str) -> CallToolResult:
        with metered(ctx) as token:
            check_owner(token, session_id)
            root.delete_session(session_id)  # not resumed first; one with a damaged record goes too
        if tokens is not None:
            tokens.disown(session_id)
        return _text(f"deleted {session_id}")

    return server


def http_app(server: MCPServer, tokens: TokenStore, *, host: str = "127.0.0.1") -> Any:
    """The streamable HTTP transport at /mcp behind RequestGuard: a token before any body is read."""
    from sandloop.server.guard import RequestGuard

    inner = server.streamable_http_app(host=host)
    return RequestGuard(
        inner,
        tokens,
        body_cap=lambda method, path: 4 * 1024 * 1024,
        protected=lambda path: True,
    )

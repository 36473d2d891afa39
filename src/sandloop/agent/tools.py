"""The tools the loop offers the model, and their execution. ``Toolbox.execute`` never raises."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from sandloop import languages
from sandloop.agent.types import ToolCall, ToolResult, ToolSpec
from sandloop.contract import ExecutionResult, SandboxError, SandboxLimits
from sandloop.contract.egress import Secret
from sandloop.present import MODEL_STREAM_CHARS, clip_for_model, format_execution

log = logging.getLogger(__name__)
__all__ = ["MODEL_STREAM_CHARS", "Tool", "Toolbox", "clip_for_model", "execute_code_tool", "format_execution"]

#: How long a model may ask a single run to take.
MAX_TOOL_TIMEOUT = 300.0


class ToolArgumentError(ValueError):
    """The model's arguments for a tool are missing or of the wrong type."""


@dataclass(frozen=True)
class Tool:
    spec: ToolSpec
    run: Callable[[dict[str, Any]], ToolResult | tuple[str, bool]]


def _require(args: Mapping[str, Any], key: str, kind: type | tuple[type, ...], what: str, required: bool = True) -> Any:
    if key not in args or args[key] is None:
        if required:
            raise ToolArgumentError(f"missing required argument {key!r} ({what})")
        return None
    value = args[key]
    if isinstance(value, bool) and bool not in (kind if isinstance(kind, tuple) else (kind,)):
        raise ToolArgumentError(f"argument {key!r} must be {what}, got a boolean")
    if not isinstance(value, kind):
        raise ToolArgumentError(f"argument {key!r} must be {what}, got {type(value).__name__}")
    return value


def _code_parameters(default_timeout: float) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {
            "code": {"type": "string", "description": "The complete program to run."},
            "language": {"type": "string", "enum": languages.names(), "description": "Default: python."},
            "timeout_seconds": {
                "type": "number",
                "description": f"Wall-clock limit, default {default_timeout:g}, at most {MAX_TOOL_TIMEOUT:g}.",
            },
        },
        "required": ["code"],
    }


def _code_arguments(args: Mapping[str, Any], default_timeout: float) -> tuple[str, str, float]:
    """(code, language, timeout) from an execute_code call, or ToolArgumentError."""
    code = _require(args, "code", str, "a string with the program")
    language = _require(args, "language", str, "a string", required=False) or "python"
    timeout = _require(args, "timeout_seconds", (int, float), "a number", required=False) or default_timeout
    if not 0 < float(timeout) <= MAX_TOOL_TIMEOUT:
        raise ToolArgumentError(f"timeout_seconds must be > 0 and <= {MAX_TOOL_TIMEOUT:g}, got {timeout}")
    return code, language, float(timeout)


def execute_code_tool(
    *,
    limits: SandboxLimits | None = None,
    default_timeout: float = 30.0,
    runner: Callable[..., ExecutionResult] | None = None,
    secrets: Mapping[str, Secret] | None = None,
) -> Tool:
    """``execute_code``: run a snippet in a fresh sandbox with ``run_code`` (``secrets``: values
    the model's code uses through placeholders, see ``run_code``)."""
    lim = limits or SandboxLimits()
    network = (
        f"HTTP(S) to {', '.join(lim.egress)} only, through the proxy in HTTPS_PROXY (no DNS, no direct "
        "connections); every attempt is reported."
        if lim.egress
        else "No network."
    )
    if secrets:
        network += f" Environment variables {', '.join(secrets)} hold credentials for those hosts: use them as is."
    spec = ToolSpec(
        name="execute_code",
        description=(
            "Run a program in a fresh, isolated sandbox and return its exit code, stdout and stderr. "
            f"Languages: {', '.join(languages.names())}. Python has numpy, pandas and matplotlib. "
            f"{network} Memory {lim.memory}, {lim.cpus:g} CPU, at most {lim.pids} processes; only "
            f"/tmp ({lim.tmpfs_size}) is writable and nothing persists between calls. Print what you "
            "want to see: only stdout and stderr come back."
        ),
        parameters=_code_parameters(default_timeout),
    )

    def run(args: dict[str, Any]) -> tuple[str, bool]:
        from sandloop.sessions.host import default_host  # the process-wide root's run_code

        code, language, timeout = _code_arguments(args, default_timeout)
        execute: Callable[..., ExecutionResult] = runner or default_host().run_code
        extra: dict[str, Any] = {"secrets": secrets} if secrets else {}
        result = execute(code, language, timeout, limits=lim, **extra)
        return format_execution(result), not result.ok

    return Tool(spec, run)


class Toolbox:
    """Named tools; ``execute`` turns every failure into ``ToolResult(is_error=True)``."""

    def __init__(self, tools: list[Tool]) -> None:
        self._tools = {t.spec.name: t for t in tools}

    @property
    def specs(self) -> list[ToolSpec]:
        return [t.spec for t in self._tools.values()]

    def execute(self, call: ToolCall) -> ToolResult:
        tool = self._tools.get(call.name)
        if tool is None:
            return ToolResult(
                call.id,
                f"error: unknown tool {call.name!r}. Available tools: {', '.join(self._tools)}.",
                is_error=True,
                name=call.name,
            )
        if call.arguments_error:
            return ToolResult(
                call.id,
                f"error: the arguments for {call.name} were not a JSON object ({call.arguments_error}). "
                "Send the arguments as a JSON object matching the tool's schema.",
                is_error=True,
                name=call.name,
            )
        try:
            out = tool.run(dict(call.arguments))
        except ToolArgumentError as exc:
            content, is_error = f"error: {exc}. Call {call.name} again with valid arguments.", True
        except SandboxError as exc:
            content, is_error = f"error: the sandbox could not run this: {exc}", True
        except Exception as exc:  # noqa: BLE001 - nothing raises into the loop
            log.exception("tool %s failed", call.name)
            content, is_error = f"error: the tool {call.name} failed unexpectedly: {type(exc).__name__}: {exc}", True
        else:
            if isinstance(out, ToolResult):
                return out
            content, is_error = out
        return ToolResult(call.id, content, is_error=is_error, name=call.name)


def session_tools(session: Any, *, default_timeout: float = 30.0) -> list[Tool]:
    """``execute_code``, ``write_file``, ``read_file`` and ``list_files`` on a ``Session``:
    files persist between calls, so a multi-step task can build on earlier steps."""
    lim = session.limits

    exec_spec = ToolSpec(
        name="execute_code",
        description=(
            f"Run a program in this session's sandbox. The working directory /workspace persists "
            f"between calls (files written there stay; quota {session.record.quota_bytes >> 20} MB); "
            f"each call is a fresh process. Languages: {', '.join(languages.names())}; Python has "
            f"numpy, pandas and matplotlib (charts saved with plt.savefig land in /workspace). No "
            f"network, memory {lim.memory}, at most {lim.pids} processes."
        ),
        parameters=_code_parameters(default_timeout),
    )

    def run(args: dict[str, Any]) -> tuple[str, bool]:
        code, language, timeout = _code_arguments(args, default_timeout)
        result = session.run(code, language, timeout)
        return format_execution(result), not result.ok

    def write(args: dict[str, Any]) -> tuple[str, bool]:
        path = _require(args, "path", str, "a workspace-relative path")
        content = _require(args, "content", str, "the file's text")
        return f"wrote {session.write_file(path, content)} bytes to /workspace/{path}", False

    def read(args: dict[str, Any]) -> tuple[str, bool]:
        path = _require(args, "path", str, "a workspace-relative path")
        data = session.read_file(path)
        try:
            text = data.decode()
        except UnicodeDecodeError:
            return f"{path} is binary ({len(data)} bytes); inspect it with execute_code instead", False
        return clip_for_model(text, 16000), False

    def listing(args: dict[str, Any]) -> tuple[str, bool]:
        path = _require(args, "path", str, "a workspace-relative path", required=False) or "."
        entries = session.list_files(path)
        if not entries:
            return f"/workspace/{path} is empty", False
        return "\n".join(f"{e['type']:7} {e['size']:>10}  {e['name']}" for e in entries), False

    path_prop = {"path": {"type": "string", "description": "Path relative to /workspace."}}
    return [
        Tool(exec_spec, run),
        Tool(
            ToolSpec(
                "write_file",
                "Write a text file into /workspace (parent directories are created).",
                {
                    "type": "object",
                    "properties": {**path_prop, "content": {"type": "string"}},
                    "required": ["path", "content"],
                },
            ),
            write,
        ),
        Tool(
            ToolSpec(
                "read_file",
                "Read a text file from /workspace.",
                {"type": "object", "properties": path_prop, "required": ["path"]},
            ),
            read,
        ),
        Tool(
            ToolSpec(
                "list_files",
                "List a directory of /workspace (type, size, name).",
                {"type": "object", "properties": path_prop},
            ),
            listing,
        ),
    ]

"""``run_agent``: alternate model turns and tool runs until the model answers.

Two rules: it is bounded (at most ``max_iterations`` model turns), and nothing raises into it (every
tool failure becomes ``ToolResult(is_error=True)``). Only the client's own failures (auth, network)
end the run, as ``ProviderError``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from sandloop.agent.tools import Tool, Toolbox, execute_code_tool, session_tools
from sandloop.agent.types import (
    AgentResult,
    AssistantTurn,
    LLMClient,
    ToolCall,
    ToolResult,
    ToolSpec,
    Turn,
    Usage,
    UserTurn,
)
from sandloop.contract import InvalidArgument, SandboxLimits
from sandloop.contract.egress import Secret


@dataclass(frozen=True)
class AgentEvent:
    """Something the loop did, for live display: ``kind`` is "assistant", "tool_call" or "tool_result"."""

    kind: str
    turn: Turn | ToolCall
    iteration: int


def _accepts_tools(client: LLMClient) -> bool:
    try:
        params = inspect.signature(client.next_turn).parameters
    except (TypeError, ValueError):
        return False
    return "tools" in params or any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())


def run_agent(
    task: str,
    client: LLMClient,
    max_iterations: int = 10,
    *,
    limits: SandboxLimits | None = None,
    egress: Sequence[str] | None = None,
    secrets: Mapping[str, Secret] | None = None,
    timeout_seconds: float = 30.0,
    tools: Sequence[Tool] | None = None,
    session: Any = None,
    on_event: Callable[[AgentEvent], Any] | None = None,
) -> AgentResult:
    """Run ``task`` with ``client``, letting it call the sandbox through ``execute_code``.

    ``tools`` replaces the default tool set (``execute_code`` with ``limits`` and
    ``timeout_seconds``). With ``session`` (a ``sandloop.sessions.Session``) the model gets
    ``execute_code``, ``write_file``, ``read_file`` and ``list_files`` on that session's workspace.
    ``on_event`` is called after each model turn, before each tool call and after each tool result.
    ``egress`` (hosts, as ``SandboxLimits.egress``) lets the model's programs reach those hosts over
    HTTP(S) through the egress proxy; a refused attempt comes back to the model as a note.
    ``secrets`` ({"NAME": Secret(value, hosts=[...])}) are used by the model's code through
    placeholders: the model never sees a value, the proxy sends it to those hosts only.
    """
    if not isinstance(task, str) or not task.strip():
        raise InvalidArgument("task must be a non-empty string")
    if isinstance(max_iterations, bool) or not isinstance(max_iterations, int) or max_iterations < 1:
        raise InvalidArgument(f"max_iterations must be a positive integer, got {max_iterations!r}")
    if egress is not None:
        base = limits or SandboxLimits()
        limits = SandboxLimits(**{**base.model_dump(), "egress": tuple(egress)})
    if tools is None:
        tools = (
            session_tools(session, default_timeout=timeout_seconds)
            if session is not None
            else [execute_code_tool(limits=limits, default_timeout=timeout_seconds, secrets=secrets)]
        )
    toolbox = Toolbox(list(tools))
    specs: list[ToolSpec] = toolbox.specs
    pass_tools = _accepts_tools(client)
    emit = on_event or (lambda _event: None)

    transcript: list[Turn] = [UserTurn(task)]
    usage: Usage | None = None
    for iteration in range(1, max_iterations + 1):
        # Adapters that take the tool specs get them; a bare LLMClient only sees the transcript.
        turn = client.next_turn(transcript, tools=specs) if pass_tools else client.next_turn(transcript)  # type: ignore[call-arg]
        if not isinstance(turn, AssistantTurn):
            raise TypeError(f"{type(client).__name__}.next_turn returned {type(turn).__name__}, not AssistantTurn")
        transcript.append(turn)
        if turn.usage is not None:
            usage = turn.usage if usage is None else usage + turn.usage
        emit(AgentEvent("assistant", turn, iteration))
        if not turn.tool_calls:
            return AgentResult(turn.text, transcript, iteration, "answered", usage)
        last = iteration == max_iterations
        for call in turn.tool_calls:
            emit(AgentEvent("tool_call", call, iteration))
            if last:
                # Every call gets an answer (a transcript with an unanswered call cannot be resent),
                # but no code runs whose result no model turn would read.
                result = ToolResult(
                    call.id,
                    f"not run: the agent reached its limit of {max_iterations} model turns.",
                    is_error=True,
                    name=call.name,
                )
            else:
                result = toolbox.execute(call)
            transcript.append(result)
            emit(AgentEvent("tool_result", result, iteration))
    final = transcript_last_text(transcript)
    return AgentResult(final, transcript, max_iterations, "max_iterations", usage)


def transcript_last_text(transcript: Sequence[Turn]) -> str:
    for turn in reversed(transcript):
        if isinstance(turn, AssistantTurn) and turn.text:
            return turn.text
    return ""

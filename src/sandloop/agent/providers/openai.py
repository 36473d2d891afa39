"""OpenAI Chat Completions adapter (``pip install 'sandloop[openai]'``), also for OpenAI-compatible
servers (Ollama, vLLM, llama.cpp server, LM Studio) through ``base_url``.

Neutral -> wire: ``UserTurn`` is a user message; ``AssistantTurn`` an assistant message with
``tool_calls`` (arguments as a JSON string); each ``ToolResult`` a ``tool`` message with its
``tool_call_id``. The wire format has no error flag, so an error result's content starts with
"ERROR: ". Wire -> neutral: arguments are parsed; arguments that are not a JSON object become an
``arguments_error`` the loop answers. The SDK retries transient errors (``max_retries``).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from typing import Any

from sandloop.agent.providers import DEFAULT_SYSTEM
from sandloop.agent.providers.sdk_errors import provider_errors
from sandloop.agent.types import (
    AssistantTurn,
    ProviderConfigError,
    ProviderError,
    ToolCall,
    ToolResult,
    ToolSpec,
    Turn,
    Usage,
    UserTurn,
)

API_KEY_ENV = "OPENAI_API_KEY"
#: Sent to OpenAI-compatible local servers that need no key (they ignore it).
LOCAL_PLACEHOLDER_KEY = "sandloop-no-key"


def to_wire(transcript: Sequence[Turn], system: str | None = None) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = [{"role": "system", "content": system}] if system else []
    for turn in transcript:
        if isinstance(turn, UserTurn):
            messages.append({"role": "user", "content": turn.text})
        elif isinstance(turn, AssistantTurn):
            msg: dict[str, Any] = {"role": "assistant", "content": turn.text or None}
            if turn.tool_calls:
                msg["tool_calls"] = [
                    {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                    for c in turn.tool_calls
                ]
            messages.append(msg)
        elif isinstance(turn, ToolResult):
            content = f"ERROR: {turn.content}" if turn.is_error else turn.content
            messages.append({"role": "tool", "tool_call_id": turn.call_id, "content": content})
        else:
            raise TypeError(f"not a transcript turn: {turn!r}")
    return messages


def tools_to_wire(tools: Sequence[ToolSpec]) -> list[dict[str, Any]]:
    return [
        {"type": "function", "function": {"name": t.name, "description": t.description, "parameters": t.parameters}}
        for t in tools
    ]


def _parse_arguments(raw: str | None) -> tuple[dict[str, Any], str | None]:
    if raw is None or raw.strip() == "":
        return {}, None
    try:
        value = json.loads(raw)
    except json.JSONDecodeError as exc:
        return {}, f"invalid JSON: {exc}"
    if not isinstance(value, dict):
        return {}, f"expected an object, got {type(value).__name__}"
    return value, None


def from_wire(completion: Any) -> AssistantTurn:
    if not completion.choices:
        raise ProviderError("the server returned a completion with no choices")
    choice = completion.choices[0]
    message = choice.message
    calls = []
    for tc in message.tool_calls or []:
        function = getattr(tc, "function", None)
        if function is None:
            continue
        args, error = _parse_arguments(function.arguments)
        calls.append(ToolCall(tc.id, function.name, args, arguments_error=error))
    usage = getattr(completion, "usage", None)
    return AssistantTurn(
        text=message.content or "",
        tool_calls=tuple(calls),
        usage=Usage(usage.prompt_tokens or 0, usage.completion_tokens or 0) if usage else None,
        stop_reason=choice.finish_reason,
    )


class OpenAIClient:
    """``LLMClient`` for the Chat Completions API through the official ``openai`` SDK."""

    def __init__(
        self,
        model: str,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        system: str | None = DEFAULT_SYSTEM,
        max_retries: int = 2,
        timeout: float = 120.0,
        client: Any = None,
    ) -> None:
        try:
            import openai
        except ImportError as exc:  # pragma: no cover - depends on the extra
            raise ProviderConfigError("the OpenAI adapter needs its SDK: pip install 'sandloop[openai]'") from exc
        self._openai = openai
        self.model = model
        self.system = system
        if client is None:
            key = api_key or os.environ.get(API_KEY_ENV)
            if not key:
                if base_url is None:
                    raise ProviderConfigError(
                        f"{API_KEY_ENV} is not set: export it, or pass api_key= to OpenAIClient "
                        "(a local OpenAI-compatible server given with base_url needs none)"
                    )
                key = LOCAL_PLACEHOLDER_KEY
            client = openai.OpenAI(api_key=key, base_url=base_url, max_retries=max_retries, timeout=timeout)
        self._client = client

    def next_turn(self, transcript: Sequence[Turn], tools: Sequence[ToolSpec] = ()) -> AssistantTurn:
        kwargs: dict[str, Any] = {"model": self.model, "messages": to_wire(transcript, self.system)}
        if tools:
            kwargs["tools"] = tools_to_wire(tools)
        with provider_errors(self._openai, self._openai.OpenAIError, "OpenAI", "the OpenAI-compatible server"):
            completion = self._client.chat.completions.create(**kwargs)
        return from_wire(completion)

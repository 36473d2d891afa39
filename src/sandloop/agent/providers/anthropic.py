"""Anthropic Messages API adapter (``pip install 'sandloop[anthropic]'``).

Neutral -> wire: ``UserTurn`` is a user message; ``AssistantTurn`` an assistant message with text
and ``tool_use`` blocks; consecutive ``ToolResult``s one user message of ``tool_result`` blocks
(``tool_use_id`` and ``is_error`` kept). Wire -> neutral: text blocks joined, ``tool_use`` blocks
become ``ToolCall``s with their ids. Transient errors (429, 5xx, connection) are retried by the SDK
itself (``max_retries``); what is left raises ``ProviderError``.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from typing import Any

from sandloop.agent.providers import DEFAULT_SYSTEM
from sandloop.agent.providers.sdk_errors import provider_errors
from sandloop.agent.types import (
    AssistantTurn,
    ProviderConfigError,
    ToolCall,
    ToolResult,
    ToolSpec,
    Turn,
    Usage,
    UserTurn,
)

API_KEY_ENV = "ANTHROPIC_API_KEY"


def to_wire(transcript: Sequence[Turn]) -> list[dict[str, Any]]:
    messages: list[dict[str, Any]] = []
    for turn in transcript:
        if isinstance(turn, UserTurn):
            messages.append({"role": "user", "content": turn.text})
        elif isinstance(turn, AssistantTurn):
            content: list[dict[str, Any]] = []
            if turn.text:
                content.append({"type": "text", "text": turn.text})
            for call in turn.tool_calls:
                content.append({"type": "tool_use", "id": call.id, "name": call.name, "input": call.arguments})
            messages.append({"role": "assistant", "content": content or [{"type": "text", "text": ""}]})
        elif isinstance(turn, ToolResult):
            block = {
                "type": "tool_result",
                "tool_use_id": turn.call_id,
                "content": turn.content,
                "is_error": turn.is_error,
            }
            last = messages[-1] if messages else None
            if last and last["role"] == "user" and isinstance(last["content"], list):
                last["content"].append(block)
            else:
                messages.append({"role": "user", "content": [block]})
        else:
            raise TypeError(f"not a transcript turn: {turn!r}")
    return messages


def tools_to_wire(tools: Sequence[ToolSpec]) -> list[dict[str, Any]]:
    return [{"name": t.name, "description": t.description, "input_schema": t.parameters} for t in tools]


def from_wire(message: Any) -> AssistantTurn:
    texts: list[str] = []
    calls: list[ToolCall] = []
    for block in message.content:
        kind = getattr(block, "type", None)
        if kind == "text":
            texts.append(block.text)
        elif kind == "tool_use":
            args = block.input
            if isinstance(args, dict):
                calls.append(ToolCall(block.id, block.name, dict(args)))
            else:
                calls.append(ToolCall(block.id, block.name, {}, arguments_error=f"input was {type(args).__name__}"))
    usage = getattr(message, "usage", None)
    return AssistantTurn(
        text="".join(texts),
        tool_calls=tuple(calls),
        usage=Usage(usage.input_tokens or 0, usage.output_tokens or 0) if usage else None,
        stop_reason=getattr(message, "stop_reason", None),
    )


class AnthropicClient:
    """``LLMClient`` for Claude models through the official ``anthropic`` SDK."""

    def __init__(
        self,
        model: str,
        *,
        api_key: str | None = None,
        base_url: str | None = None,
        max_tokens: int = 4096,
        system: str | None = DEFAULT_SYSTEM,
        max_retries: int = 2,
        timeout: float = 120.0,
        client: Any = None,
    ) -> None:
        try:
            import anthropic
        except ImportError as exc:  # pragma: no cover - depends on the extra
            raise ProviderConfigError("the Anthropic adapter needs its SDK: pip install 'sandloop[anthropic]'") from exc
        self._anthropic = anthropic
        self.model = model
        self.max_tokens = max_tokens
        self.system = system
        if client is None:
            key = api_key or os.environ.get(API_KEY_ENV)
            if not key:
                raise ProviderConfigError(f"{API_KEY_ENV} is not set: export it, or pass api_key= to AnthropicClient")
            client = anthropic.Anthropic(api_key=key, base_url=base_url, max_retries=max_retries, timeout=timeout)
        self._client = client

    def next_turn(self, transcript: Sequence[Turn], tools: Sequence[ToolSpec] = ()) -> AssistantTurn:
        kwargs: dict[str, Any] = {"model": self.model, "max_tokens": self.max_tokens, "messages": to_wire(transcript)}
        if tools:
            kwargs["tools"] = tools_to_wire(tools)
        if self.system:
            kwargs["system"] = self.system
        with provider_errors(self._anthropic, self._anthropic.AnthropicError, "Anthropic", "the Anthropic API"):
            message = self._client.messages.create(**kwargs)
        return from_wire(message)

"""Neutral transcript types. Provider adapters translate these both ways; nothing here knows a vendor."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, TypeAlias, runtime_checkable


@dataclass(frozen=True)
class Usage:
    input_tokens: int = 0
    output_tokens: int = 0

    def __add__(self, other: Usage) -> Usage:
        return Usage(self.input_tokens + other.input_tokens, self.output_tokens + other.output_tokens)


@dataclass(frozen=True)
class ToolCall:
    """The model asked to run a tool. ``id`` is the provider's call id, kept for the reply.

    ``arguments_error`` is set when the provider sent arguments that are not a JSON object; the
    loop answers such a call with an error instead of running it.
    """

    id: str
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    arguments_error: str | None = None


@dataclass(frozen=True)
class ToolResult:
    """The answer to one ``ToolCall``, matched by ``call_id``."""

    call_id: str
    content: str
    is_error: bool = False
    #: The tool that produced it (for display and for providers that want it).
    name: str = ""


@dataclass(frozen=True)
class UserTurn:
    text: str


@dataclass(frozen=True)
class AssistantTurn:
    text: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    usage: Usage | None = None
    #: The provider's own stop reason, for display ("end_turn", "tool_use", "stop", ...).
    stop_reason: str | None = None


Turn: TypeAlias = UserTurn | AssistantTurn | ToolResult


@dataclass(frozen=True)
class ToolSpec:
    """A tool offered to the model: a name, what it does, and a JSON Schema for its arguments."""

    name: str
    description: str
    parameters: dict[str, Any]


@runtime_checkable
class LLMClient(Protocol):
    """The one thing the loop needs from a model: the next assistant turn for a transcript.

    A client whose ``next_turn`` also takes a ``tools`` keyword is given the tools on offer
    (provider adapters send them to the model); one that does not is called with the transcript.
    """

    def next_turn(self, transcript: Sequence[Turn]) -> AssistantTurn: ...


StopReason = Literal["answered", "max_iterations"]


@dataclass(frozen=True)
class AgentResult:
    answer: str
    transcript: list[Turn]
    turns: int
    stop_reason: StopReason
    usage: Usage | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "answer": self.answer,
            "turns": self.turns,
            "stop_reason": self.stop_reason,
            "usage": None if self.usage is None else vars(self.usage),
            "transcript": [turn_to_dict(t) for t in self.transcript],
        }


def turn_to_dict(turn: Turn) -> dict[str, Any]:
    """A turn as JSON-ready data, its kind under ``type`` (read back by ``transcript.turn_from_dict``)."""
    kind = {UserTurn: "user", AssistantTurn: "assistant", ToolResult: "tool_result"}[type(turn)]
    return {"type": kind, **dataclasses.asdict(turn)}


class ProviderError(Exception):
    """The model provider failed (auth, network, bad request): this ends the run."""


class ProviderConfigError(ProviderError):
    """The provider cannot be used as configured (e.g. its API key is not set)."""

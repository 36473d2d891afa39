"""Public test doubles: drive ``run_agent`` with no API key and no network (``ScriptedClient``,
``wire.FakeProviderServer``), and run pool, sessions and front ends with no engine
(``fake.FakeBackend``, via ``Settings(backend="fake")``; it isolates nothing).

>>> client = ScriptedClient([
...     AssistantTurn(tool_calls=(ToolCall("c1", "execute_code", {"code": "print(6*7)"}),)),
...     lambda transcript: AssistantTurn(text="The answer is " + transcript[-1].content.split()[-1]),
... ])
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterable, Sequence
from typing import Any

from sandloop.agent.types import AssistantTurn, ToolCall, ToolSpec, Turn

Step = AssistantTurn | Callable[[Sequence[Turn]], AssistantTurn]


class ScriptExhausted(AssertionError):
    """The loop asked a ``ScriptedClient`` for more turns than it was given."""


class ScriptedClient:
    """An ``LLMClient`` that replays scripted turns, each a turn or a function of the transcript.

    ``transcripts`` records a copy of the transcript seen at each call; ``tools_seen`` the tool
    specs the loop offered.
    """

    def __init__(self, steps: Iterable[Step]) -> None:
        self._steps = list(steps)
        self._index = 0
        self.transcripts: list[list[Turn]] = []
        self.tools_seen: list[list[ToolSpec]] = []

    def next_turn(self, transcript: Sequence[Turn], tools: Sequence[ToolSpec] = ()) -> AssistantTurn:
        self.transcripts.append(list(transcript))
        self.tools_seen.append(list(tools))
        if self._index >= len(self._steps):
            raise ScriptExhausted(f"ScriptedClient ran out of turns after {len(self._steps)}")
        step = self._steps[self._index]
        self._index += 1
        return step(transcript) if callable(step) else step

    @property
    def calls(self) -> int:
        return len(self.transcripts)


_ids = itertools.count(1)


def code_call(code: str, language: str = "python", call_id: str | None = None, **extra: Any) -> ToolCall:
    """A ``ToolCall`` of ``execute_code``."""
    return ToolCall(call_id or f"call_{next(_ids)}", "execute_code", {"code": code, "language": language, **extra})


def calls(*tool_calls: ToolCall, text: str = "") -> AssistantTurn:
    """An assistant turn that asks for these tool calls."""
    return AssistantTurn(text=text, tool_calls=tuple(tool_calls))


def answer(text: str) -> AssistantTurn:
    """An assistant turn with a final answer (no tool calls)."""
    return AssistantTurn(text=text)


class ForeverCallingClient:
    """An ``LLMClient`` that asks for a tool on every turn: the loop must stop it."""

    def __init__(self, code: str = "print(1)") -> None:
        self.code = code
        self.calls = 0

    def next_turn(self, transcript: Sequence[Turn]) -> AssistantTurn:
        self.calls += 1
        return calls(code_call(self.code, call_id=f"forever_{self.calls}"))

"""Transcript (de)serialisation: one JSON object per turn (JSON Lines with --save)."""

from __future__ import annotations

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from sandloop.agent.types import AssistantTurn, ToolCall, ToolResult, Turn, Usage, UserTurn, turn_to_dict

__all__ = ["load_jsonl", "save_jsonl", "turn_from_dict", "turn_to_dict"]


def turn_from_dict(data: dict[str, Any]) -> Turn:
    data = dict(data)
    kind = data.pop("type")
    if kind == "user":
        return UserTurn(**data)
    if kind == "tool_result":
        return ToolResult(**data)
    if kind == "assistant":
        calls = tuple(ToolCall(**c) for c in data.pop("tool_calls", ()))
        usage = data.pop("usage", None)
        return AssistantTurn(tool_calls=calls, usage=Usage(**usage) if usage else None, **data)
    raise ValueError(f"unknown turn type {kind!r}")


def save_jsonl(turns: Iterable[Turn], path: str | Path) -> None:
    with open(path, "w", encoding="utf-8") as f:
        for turn in turns:
            f.write(json.dumps(turn_to_dict(turn), ensure_ascii=False) + "\n")


def load_jsonl(path: str | Path) -> list[Turn]:
    with open(path, encoding="utf-8") as f:
        return [turn_from_dict(json.loads(line)) for line in f if line.strip()]

"""A result as each reader sees it, in one place: the text a model reads (the agent loop, MCP),
one JSON shape for the HTTP API and the CLI's ``--json`` (the result, its notes, charts as
base64), and the exact bytes for a terminal."""

from __future__ import annotations

import base64
from typing import Any

from sandloop.contract import ExecutionResult, HttpAnswer
from sandloop.notes import sandbox_notes


def result_json(result: ExecutionResult) -> dict[str, Any]:
    body = result.model_dump(mode="json", exclude={"artifacts"})
    body["notes"] = sandbox_notes(result)
    artifacts = getattr(result, "artifacts", None)
    if artifacts is not None:
        body["artifacts"] = [
            {"name": a.name, "mime_type": a.mime_type, "data_base64": base64.b64encode(a.data).decode()}
            for a in artifacts
        ]
    return body


def stream_bytes(result: ExecutionResult, stream: str) -> bytes:
    """The exact bytes a stream kept (binary output included)."""
    raw = getattr(result, f"{stream}_base64")
    return base64.b64decode(raw) if raw is not None else getattr(result, stream).encode()


#: Characters of each stream shown to the model (head and tail kept). The sandbox keeps 64 KB per
#: stream; that much of a flood in a model's context costs tokens and helps nobody.
MODEL_STREAM_CHARS = 8000


def clip_for_model(text: str, limit: int = MODEL_STREAM_CHARS) -> str:
    if len(text) <= limit:
        return text
    head, tail = text[: limit * 3 // 4], text[-(limit // 4) :]
    return f"{head}\n... [{len(text) - len(head) - len(tail)} characters omitted here] ...\n{tail}"


def format_execution(result: ExecutionResult, stream_chars: int = MODEL_STREAM_CHARS) -> str:
    """What the model reads: exit code, both streams, and a note for whatever the sandbox decided."""
    status = "timed out (killed)" if result.timed_out else str(result.exit_code)
    parts = [f"exit_code: {status}", f"duration: {result.duration_seconds:.2f}s"]
    parts.append("stdout:\n" + (clip_for_model(result.stdout, stream_chars) if result.stdout else "(empty)"))
    if result.stderr:
        parts.append("stderr:\n" + clip_for_model(result.stderr, stream_chars))
    for note in sandbox_notes(result):
        parts.append("note: " + note)
    reached = [f"{a.method} {a.host}:{a.port}" for a in result.egress if a.allowed][:10]
    if reached:
        parts.append("egress (allowed): " + ", ".join(reached))
    return "\n".join(parts)


def present_http(answer: HttpAnswer, body_chars: int = MODEL_STREAM_CHARS) -> str:
    """What the model reads of a server's answer: the status line, the headers, the body as text
    (cut at ``body_chars``, and said so)."""
    lines = [f"HTTP {answer.status} {answer.reason}".rstrip()]
    lines += [f"{name}: {value}" for name, value in answer.headers.items()]
    text = answer.text
    shown = text[:body_chars]
    lines.append("")
    lines.append(shown if shown else "(empty body)")
    if len(text) > body_chars or answer.truncated:
        lines.append(f"... [the body goes on past the first {len(shown)} characters]")
    return "\n".join(lines)

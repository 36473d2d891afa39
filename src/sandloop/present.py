"""A result as the front ends show it: one JSON shape for the HTTP API and the CLI's ``--json``
(the same fields everywhere: the result, its notes, charts as base64)."""

from __future__ import annotations

import base64
from typing import Any

from sandloop.contract import ExecutionResult
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

"""The Connect RPC protocol as envd speaks it: HTTP/1.1, the JSON codec, unary calls and server
streams (https://connectrpc.com/docs/protocol). Small enough to write here: the envd server
stubs live only inside the E2B SDK's private modules, and the JSON mapping of envd's few
messages is written out in envd.py.

Unary: ``POST /pkg.Service/Method`` with ``application/json``; the answer is the message as JSON,
or an error status with ``{"code": "not_found", "message": ...}``.
Server stream: ``application/connect+json``; request and answers are envelopes (1 flag byte, 4
bytes of big-endian length, the JSON); the last envelope has flag 2 and carries ``{}`` or
``{"error": {...}}``, always with HTTP 200.
"""

from __future__ import annotations

import json
import struct
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse, StreamingResponse

#: Connect's codes and the HTTP status a unary error carries.
STATUS = {
    "canceled": 499,
    "unknown": 500,
    "invalid_argument": 400,
    "deadline_exceeded": 504,
    "not_found": 404,
    "already_exists": 409,
    "permission_denied": 403,
    "resource_exhausted": 429,
    "failed_precondition": 400,
    "aborted": 409,
    "out_of_range": 400,
    "unimplemented": 501,
    "internal": 500,
    "unavailable": 503,
    "data_loss": 500,
    "unauthenticated": 401,
}
END_STREAM = 0b10
MAX_MESSAGE = 1024 * 1024


class ConnectError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message

    def json(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


def envelope(message: dict[str, Any], *, end: bool = False) -> bytes:
    data = json.dumps(message, separators=(",", ":")).encode()
    return struct.pack(">BI", END_STREAM if end else 0, len(data)) + data


async def read_request(request: Request) -> dict[str, Any]:
    """The request message of a unary call or of a server stream's single envelope."""
    body = await request.body()
    if len(body) > MAX_MESSAGE:
        raise ConnectError("resource_exhausted", f"request message over {MAX_MESSAGE} bytes")
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype == "application/connect+json":
        if len(body) < 5:
            raise ConnectError("invalid_argument", "a streaming request needs one envelope")
        flags, length = struct.unpack(">BI", body[:5])
        if flags & 0b1:
            raise ConnectError("unimplemented", "compressed messages are not supported; send them uncompressed")
        body = body[5 : 5 + length]
    elif ctype not in ("application/json", ""):
        raise ConnectError("unimplemented", f"content type {ctype} is not served: use the JSON codec")
    try:
        message = json.loads(body or b"{}")
    except ValueError as exc:
        raise ConnectError("invalid_argument", f"the request is not JSON: {exc}") from None
    except RecursionError:  # 100,000 nested brackets: a 400, not a 500
        raise ConnectError("invalid_argument", "the request nests too deeply") from None
    if not isinstance(message, dict):
        raise ConnectError("invalid_argument", "the request message must be a JSON object")
    return message


def unary_error(exc: ConnectError) -> JSONResponse:
    return JSONResponse(exc.json(), status_code=STATUS.get(exc.code, 500))


def stream(messages: AsyncIterator[dict[str, Any]]) -> StreamingResponse:
    """A server stream of ``messages``; a ``ConnectError`` raised while producing them ends the
    stream with that error."""

    async def body() -> AsyncIterator[bytes]:
        try:
            async for message in messages:
                yield envelope(message)
        except ConnectError as exc:
            yield envelope({"error": exc.json()}, end=True)
            return
        yield envelope({}, end=True)

    return StreamingResponse(body(), media_type="application/connect+json")

"""A local HTTP server that speaks the Anthropic Messages and OpenAI Chat Completions wire formats.

For testing adapters and agents through the *real* SDKs with no API key and no network: point the
SDK's ``base_url`` at ``server.url`` (OpenAI: ``server.url + "/v1"``). Each request is recorded
and answered by the next scripted response, so tests can assert the exact request shapes.

    with FakeProviderServer([anthropic_tool_use(("c1", "execute_code", {"code": "print(1)"})),
                             anthropic_text("done")]) as server:
        client = AnthropicClient("claude-test", api_key="test", base_url=server.url)
"""

from __future__ import annotations

import itertools
import json
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

#: A scripted reply: a JSON body (status 200), (status, body), or a function of the request.
Reply = dict[str, Any] | tuple[int, dict[str, Any]] | Callable[["RecordedRequest"], Any]

_ids = itertools.count(1)


@dataclass
class RecordedRequest:
    method: str
    path: str
    headers: dict[str, str]
    body: dict[str, Any]


class FakeProviderServer:
    """Scripted provider on 127.0.0.1 (a free port). Use as a context manager."""

    def __init__(self, replies: Iterable[Reply]) -> None:
        self._replies = list(replies)
        self._lock = threading.Lock()
        self.requests: list[RecordedRequest] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: Any) -> None:  # keep test output quiet
                pass

            def do_POST(self) -> None:  # noqa: N802 - http.server's naming
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                try:
                    body = json.loads(raw or b"{}")
                except json.JSONDecodeError:
                    body = {"_raw": raw.decode(errors="replace")}
                req = RecordedRequest("POST", self.path, {k.lower(): v for k, v in self.headers.items()}, body)
                status, payload = outer._answer(req)
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                if status == 429:
                    self.send_header("Retry-After", "0")
                self.end_headers()
                self.wfile.write(data)

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="fake-provider", daemon=True)

    def _answer(self, req: RecordedRequest) -> tuple[int, dict[str, Any]]:
        with self._lock:
            self.requests.append(req)
            if not self._replies:
                return 500, {
                    "type": "error",
                    "error": {"type": "api_error", "message": "FakeProviderServer: script exhausted"},
                }
            reply = self._replies.pop(0)
        if callable(reply):
            reply = reply(req)
        if isinstance(reply, tuple):
            return reply
        return 200, reply

    def queue(self, *replies: Reply) -> None:
        """Add replies to the script (a server started once can serve several tests)."""
        with self._lock:
            self._replies.extend(replies)

    @property
    def url(self) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}"

    def start(self) -> FakeProviderServer:
        self._thread.start()
        return self

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def __enter__(self) -> FakeProviderServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


# -- Anthropic Messages responses ------------------------------------------------------------------
def anthropic_message(
    content: list[dict[str, Any]], stop_reason: str, input_tokens: int = 11, output_tokens: int = 7
) -> dict[str, Any]:
    return {
        "id": f"msg_{next(_ids)}",
        "type": "message",
        "role": "assistant",
        "model": "claude-test",
        "content": content,
        "stop_reason": stop_reason,
        "stop_sequence": None,
        "usage": {"input_tokens": input_tokens, "output_tokens": output_tokens},
    }


def anthropic_text(text: str) -> dict[str, Any]:
    return anthropic_message([{"type": "text", "text": text}], "end_turn")


def anthropic_tool_use(*calls: tuple[str, str, dict[str, Any]], text: str = "") -> dict[str, Any]:
    """A reply asking for one or more tools: ``(id, name, input)`` each."""
    content: list[dict[str, Any]] = [{"type": "text", "text": text}] if text else []
    content += [{"type": "tool_use", "id": cid, "name": name, "input": args} for cid, name, args in calls]
    return anthropic_message(content, "tool_use")


def anthropic_error(status: int, message: str, kind: str = "api_error") -> tuple[int, dict[str, Any]]:
    return status, {"type": "error", "error": {"type": kind, "message": message}}


# -- OpenAI Chat Completions responses -------------------------------------------------------------
def openai_completion(text: str | None = None, tool_calls: list[tuple[str, str, str]] | None = None) -> dict[str, Any]:
    """``tool_calls``: ``(id, name, arguments_json_string)`` each."""
    message: dict[str, Any] = {"role": "assistant", "content": text}
    if tool_calls:
        message["tool_calls"] = [
            {"id": cid, "type": "function", "function": {"name": name, "arguments": args}}
            for cid, name, args in tool_calls
        ]
    return {
        "id": f"chatcmpl-{next(_ids)}",
        "object": "chat.completion",
        "created": 1764460800,
        "model": "test-model",
        "choices": [
            {"index": 0, "message": message, "finish_reason": "tool_calls" if tool_calls else "stop", "logprobs": None}
        ],
        "usage": {"prompt_tokens": 13, "completion_tokens": 5, "total_tokens": 18},
    }


def openai_error(status: int, message: str) -> tuple[int, dict[str, Any]]:
    return status, {"error": {"message": message, "type": "server_error", "code": None, "param": None}}

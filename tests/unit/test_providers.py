"""Adapters through the real SDKs against a local server speaking each wire format. No key, no network."""

from __future__ import annotations

import json

import pytest

from sandloop.agent import AssistantTurn, ToolCall, ToolResult, Usage, UserTurn, execute_code_tool, run_agent
from sandloop.agent.providers.anthropic import AnthropicClient
from sandloop.agent.providers.openai import OpenAIClient
from sandloop.agent.types import ProviderConfigError, ProviderError
from sandloop.contract import ExecutionResult
from sandloop.testing.wire import (
    FakeProviderServer,
    anthropic_error,
    anthropic_text,
    anthropic_tool_use,
    openai_completion,
    openai_error,
)


def fake_runner(code, language, timeout, *, limits):
    return ExecutionResult(stdout=f"{language}:{code}\n", exit_code=0, duration_seconds=0.01, limits=limits)


TOOLS = [execute_code_tool(runner=fake_runner)]


# -- Anthropic -----------------------------------------------------------------------------------
def test_anthropic_round_trip_keeps_ids_and_error_flags():
    replies = [
        anthropic_tool_use(
            ("toolu_A", "execute_code", {"code": "print(1)"}), ("toolu_B", "nope", {}), text="Let me run it."
        ),
        anthropic_text("The answer is 1."),
    ]
    with FakeProviderServer(replies) as server:
        client = AnthropicClient("claude-test", api_key="sk-test", base_url=server.url, max_tokens=321)
        result = run_agent("compute", client, tools=TOOLS)
    assert (result.answer, result.stop_reason, result.turns) == ("The answer is 1.", "answered", 2)
    assert result.usage == Usage(22, 14)

    first, second = server.requests
    assert first.path == "/v1/messages"
    # the key travels as x-api-key or, in newer SDKs, as a bearer token
    assert "sk-test" in (
        first.headers.get("x-api-key", ""),
        first.headers.get("authorization", "").removeprefix("Bearer "),
    )
    assert "anthropic-version" in first.headers
    assert first.body["model"] == "claude-test" and first.body["max_tokens"] == 321
    assert first.body["messages"] == [{"role": "user", "content": "compute"}]
    (tool,) = first.body["tools"]
    assert tool["name"] == "execute_code" and tool["input_schema"]["required"] == ["code"]
    assert "system" in first.body

    assistant, tool_results = second.body["messages"][1:]
    assert assistant["role"] == "assistant"
    assert assistant["content"][0] == {"type": "text", "text": "Let me run it."}
    assert [b["id"] for b in assistant["content"][1:]] == ["toolu_A", "toolu_B"]
    assert tool_results["role"] == "user"
    a, b = tool_results["content"]
    assert (a["type"], a["tool_use_id"], a["is_error"]) == ("tool_result", "toolu_A", False)
    assert "python:print(1)" in a["content"]
    assert (b["tool_use_id"], b["is_error"]) == ("toolu_B", True) and "unknown tool" in b["content"]


def test_anthropic_retries_transient_errors_like_its_sdk():
    replies = [
        anthropic_error(529, "Overloaded", "overloaded_error"),
        anthropic_error(500, "oops"),
        anthropic_text("ok"),
    ]
    with FakeProviderServer(replies) as server:
        client = AnthropicClient("claude-test", api_key="k", base_url=server.url, max_retries=2)
        assert client.next_turn([UserTurn("hi")]).text == "ok"
    assert len(server.requests) == 3


def test_anthropic_auth_failure_ends_the_run_clearly():
    with FakeProviderServer([anthropic_error(401, "invalid x-api-key", "authentication_error")]) as server:
        client = AnthropicClient("claude-test", api_key="bad", base_url=server.url)
        with pytest.raises(ProviderError, match="401.*invalid x-api-key"):
            run_agent("t", client)
    assert len(server.requests) == 1  # 401 is not retried


def test_anthropic_missing_key_names_the_variable(monkeypatch):
    monkeypatch.delenv("ANTHROPIC_API_KEY", raising=False)
    with pytest.raises(ProviderConfigError, match="ANTHROPIC_API_KEY"):
        AnthropicClient("claude-test")


def test_anthropic_unreachable_server_is_a_provider_error():
    client = AnthropicClient("claude-test", api_key="k", base_url="http://127.0.0.1:9", max_retries=0, timeout=5)
    with pytest.raises(ProviderError, match="cannot reach"):
        client.next_turn([UserTurn("hi")])


# -- OpenAI ----------------------------------------------------------------------------------------
def test_openai_round_trip_keeps_ids_and_parses_arguments():
    replies = [
        openai_completion(
            tool_calls=[
                ("call_1", "execute_code", json.dumps({"code": "console.log(2)", "language": "node"})),
                ("call_2", "execute_code", "{not json"),
            ]
        ),
        openai_completion("It printed 2."),
    ]
    with FakeProviderServer(replies) as server:
        client = OpenAIClient("gpt-test", api_key="sk-test", base_url=server.url + "/v1")
        result = run_agent("compute", client, tools=TOOLS)
    assert (result.answer, result.turns, result.usage) == ("It printed 2.", 2, Usage(26, 10))
    r1, r2 = result.transcript[2:4]
    assert (r1.call_id, r1.is_error) == ("call_1", False) and "node:console.log(2)" in r1.content
    assert (r2.call_id, r2.is_error) == ("call_2", True) and "not a JSON object" in r2.content

    first, second = server.requests
    assert first.path == "/v1/chat/completions"
    assert first.headers["authorization"] == "Bearer sk-test"
    assert first.body["messages"][0]["role"] == "system"
    assert first.body["messages"][1] == {"role": "user", "content": "compute"}
    (tool,) = first.body["tools"]
    assert tool["type"] == "function" and tool["function"]["name"] == "execute_code"
    msgs = second.body["messages"]
    assistant = msgs[2]
    assert [c["id"] for c in assistant["tool_calls"]] == ["call_1", "call_2"]
    assert json.loads(assistant["tool_calls"][0]["function"]["arguments"]) == {
        "code": "console.log(2)",
        "language": "node",
    }
    assert [(m["role"], m["tool_call_id"]) for m in msgs[3:]] == [("tool", "call_1"), ("tool", "call_2")]
    assert msgs[4]["content"].startswith("ERROR: ")


def test_openai_retries_429_and_5xx():
    replies = [openai_error(429, "slow down"), openai_error(503, "busy"), openai_completion("ok")]
    with FakeProviderServer(replies) as server:
        client = OpenAIClient("gpt-test", api_key="k", base_url=server.url + "/v1", max_retries=2)
        assert client.next_turn([UserTurn("hi")]).text == "ok"
    assert len(server.requests) == 3


def test_openai_missing_key_names_the_variable_but_local_servers_need_none(monkeypatch):
    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    with pytest.raises(ProviderConfigError, match="OPENAI_API_KEY"):
        OpenAIClient("gpt-test")
    with FakeProviderServer([openai_completion("local ok")]) as server:
        client = OpenAIClient("llama3", base_url=server.url + "/v1")  # e.g. Ollama
        assert client.next_turn([UserTurn("hi")]).text == "local ok"


def test_openai_bad_request_is_a_provider_error():
    with FakeProviderServer([openai_error(400, "model not found")]) as server:
        client = OpenAIClient("nope", api_key="k", base_url=server.url + "/v1")
        with pytest.raises(ProviderError, match="400.*model not found"):
            client.next_turn([UserTurn("hi")])


def test_wire_translation_is_lossless_for_ids():
    from sandloop.agent.providers import anthropic as a
    from sandloop.agent.providers import openai as o

    transcript = [
        UserTurn("t"),
        AssistantTurn(
            "x", (ToolCall("id-1", "execute_code", {"code": "1"}), ToolCall("id-2", "execute_code", {"code": "2"}))
        ),
        ToolResult("id-1", "one"),
        ToolResult("id-2", "two", is_error=True),
    ]
    wire = a.to_wire(transcript)
    assert len(wire) == 3 and [b["tool_use_id"] for b in wire[2]["content"]] == ["id-1", "id-2"]
    wire = o.to_wire(transcript)
    assert [m.get("tool_call_id") for m in wire[2:]] == ["id-1", "id-2"]

"""Haystack's E2B tools (``e2b-haystack``: bash, read, write, list, unchanged) in a Haystack
``Agent`` against ``sandloop serve`` on loopback, driven by a scripted chat model (issue 23: a
second client built on E2B's SDK besides smolagents)."""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("haystack_integrations.tools.e2b")

from haystack import component  # noqa: E402
from haystack.components.agents import Agent  # noqa: E402
from haystack.dataclasses import ChatMessage, ToolCall  # noqa: E402
from haystack_integrations.tools.e2b import E2BToolset  # noqa: E402

from sandloop.server.app import create_app  # noqa: E402
from sandloop.server.tokens import TokenStore  # noqa: E402
from tests.servers import e2b_environment, serve_in_thread  # noqa: E402


@component
class ScriptedChatGenerator:
    """Answers each turn with the next scripted reply (tool calls, then text) and keeps what the
    tools returned."""

    def __init__(self, replies: list[ChatMessage]) -> None:
        self.replies = list(replies)
        self.tool_results: list[str] = []

    @component.output_types(replies=list[ChatMessage])
    def run(self, messages: list[ChatMessage], tools: Any = None, **kwargs: Any) -> dict[str, Any]:
        self.tool_results += [r.result for m in messages for r in m.tool_call_results][len(self.tool_results) :]
        return {"replies": [self.replies.pop(0)]}


def _call(name: str, **arguments: Any) -> ChatMessage:
    return ChatMessage.from_assistant(tool_calls=[ToolCall(tool_name=name, arguments=arguments)])


def test_a_haystack_agent_with_e2bs_toolset_works_in_a_sandloop_sandbox(tmp_path):
    tokens = TokenStore(tmp_path / "tokens.sqlite")
    key, _ = tokens.create("haystack")  # plain defaults, as `sandloop tokens create NAME`
    model = ScriptedChatGenerator(
        [
            _call("write_file", path="/home/user/notes/plan.txt", content="step one\nstep two\n"),
            _call("run_bash_command", command="wc -l < notes/plan.txt && id -u && pwd"),
            _call("list_directory", path="/home/user/notes"),
            _call("read_file", path="/home/user/notes/plan.txt"),
            ChatMessage.from_assistant("The plan has two steps."),
        ]
    )
    with serve_in_thread(create_app(tokens)) as url, e2b_environment(url, key):
        toolset = E2BToolset(sandbox_template="base", timeout=300)
        agent = Agent(chat_generator=model, tools=toolset, max_agent_steps=8)
        agent.warm_up()
        try:
            out = agent.run(messages=[ChatMessage.from_user("Write a two-step plan and check it.")])
        finally:
            toolset.sandbox.close()
        from e2b import Sandbox

        assert Sandbox.list().next_items() == []  # its close() killed the sandbox: nothing left
    assert out["messages"][-1].text == "The plan has two steps."
    wrote, ran, listed, read = model.tool_results
    assert "plan.txt" in wrote
    assert "exit_code: 0" in ran and "2\n65534\n/home/user" in ran  # unprivileged, in the workspace
    assert "plan.txt" in listed
    assert read == "step one\nstep two\n"

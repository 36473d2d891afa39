"""smolagents' CodeAgent with ``executor_type="e2b"`` (its E2B executor, unchanged) against
``sandloop serve`` on loopback, driven by a scripted model (issue 22): its first step sends
``!pip install ...`` to the code interpreter, which IPython's semantics serve."""

from __future__ import annotations

import pytest

smolagents = pytest.importorskip("smolagents")

from smolagents import CodeAgent  # noqa: E402
from smolagents.models import ChatMessage, MessageRole, Model  # noqa: E402

from sandloop.server.app import create_app  # noqa: E402
from sandloop.server.tokens import TokenStore  # noqa: E402
from tests.servers import e2b_environment, serve_in_thread  # noqa: E402


class ScriptedModel(Model):
    """Answers each step with the next scripted reply, and keeps what it was shown."""

    def __init__(self, replies: list[str]) -> None:
        super().__init__(model_id="scripted")
        self.replies = list(replies)
        self.seen: list[str] = []

    def generate(self, messages, stop_sequences=None, response_format=None, tools_to_call_from=None, **kwargs):
        self.seen.append(str(messages[-1]))
        return ChatMessage(role=MessageRole.ASSISTANT, content=self.replies.pop(0))


def test_code_agent_with_the_e2b_executor_runs_and_answers(tmp_path):
    tokens = TokenStore(tmp_path / "tokens.sqlite")
    key, _ = tokens.create("agent", max_concurrent=8, runs_per_minute=1000, max_timeout=60)
    model = ScriptedModel(
        [
            "Thought: build the numbers.\n<code>\nimport numpy as np\n"
            "values = np.arange(1, 7)\nprint('sum is', int(values.sum()))\n</code>",
            "Thought: answer.\n<code>\nfinal_answer(int(values.sum()) * 2)\n</code>",
        ]
    )
    with serve_in_thread(create_app(tokens)) as url, e2b_environment(url, key):
        agent = CodeAgent(
            tools=[], model=model, executor_type="e2b", additional_authorized_imports=["numpy"], max_steps=4
        )
        try:
            answer = agent.run("What is twice the sum of 1..6?")
        finally:
            agent.cleanup()
    assert answer == 42
    assert any("sum is 21" in seen for seen in model.seen), model.seen  # the step's logs reached the model

"""The loop's rules with a scripted client and a fake runner: no daemon, no API key."""

from __future__ import annotations

import pytest

from sandloop import EngineUnavailable, ExecutionResult, InvalidArgument, SandboxLimits
from sandloop.agent import AssistantTurn, ToolCall, ToolResult, UserTurn, execute_code_tool, run_agent
from sandloop.agent.types import ProviderError
from sandloop.testing import ForeverCallingClient, ScriptedClient, ScriptExhausted, answer, calls, code_call


class FakeRunner:
    """Stands in for run_code: records calls and returns canned results."""

    def __init__(self, result: ExecutionResult | Exception | None = None) -> None:
        self.result = result
        self.calls: list[tuple] = []

    def __call__(self, code, language, timeout, *, limits):
        self.calls.append((code, language, timeout, limits))
        if isinstance(self.result, Exception):
            raise self.result
        return self.result or ExecutionResult(stdout=f"ran {code}\n", exit_code=0, duration_seconds=0.01, limits=limits)


def _tools(runner, **kw):
    return [execute_code_tool(runner=runner, **kw)]


def test_final_answer_without_tools():
    client = ScriptedClient([answer("42")])
    result = run_agent("what is 6*7?", client)
    assert (result.answer, result.turns, result.stop_reason) == ("42", 1, "answered")
    assert result.transcript == [UserTurn("what is 6*7?"), AssistantTurn(text="42")]
    assert [s.name for s in client.tools_seen[0]] == ["execute_code"]


def test_tool_call_then_answer_feeds_the_result_back():
    runner = FakeRunner()
    client = ScriptedClient([calls(code_call("print(1)", call_id="c1")), answer("done")])
    result = run_agent("t", client, tools=_tools(runner))
    assert result.stop_reason == "answered" and result.turns == 2
    tool_result = result.transcript[2]
    assert isinstance(tool_result, ToolResult) and tool_result.call_id == "c1" and not tool_result.is_error
    assert "exit_code: 0" in tool_result.content and "ran print(1)" in tool_result.content
    assert client.transcripts[1][-1] == tool_result


def test_bounded_at_max_iterations_and_every_call_answered():
    runner = FakeRunner()
    client = ForeverCallingClient()
    result = run_agent("loop forever", client, max_iterations=3, tools=_tools(runner))
    assert result.stop_reason == "max_iterations" and result.turns == 3 and client.calls == 3
    assert len(runner.calls) == 2  # the last turn's call is answered but not run
    last = result.transcript[-1]
    assert isinstance(last, ToolResult) and last.is_error and "limit of 3 model turns" in last.content


def test_unknown_tool_is_an_error_result():
    client = ScriptedClient([calls(ToolCall("x1", "rm_rf", {})), answer("ok")])
    result = run_agent("t", client, tools=_tools(FakeRunner()))
    res = result.transcript[2]
    assert res.is_error and "unknown tool 'rm_rf'" in res.content and "execute_code" in res.content


@pytest.mark.parametrize(
    "arguments, fragment",
    [
        ({}, "missing required argument 'code'"),
        ({"code": 123}, "'code' must be a string"),
        ({"code": "x", "language": 5}, "'language' must be a string"),
        ({"code": "x", "timeout_seconds": "soon"}, "'timeout_seconds' must be a number"),
        ({"code": "x", "timeout_seconds": -1}, "timeout_seconds must be > 0"),
        ({"code": "x", "timeout_seconds": True}, "got a boolean"),
    ],
)
def test_bad_arguments_are_error_results(arguments, fragment):
    runner = FakeRunner()
    client = ScriptedClient([calls(ToolCall("b1", "execute_code", arguments)), answer("ok")])
    res = run_agent("t", client, tools=_tools(runner)).transcript[2]
    assert res.is_error and fragment in res.content and runner.calls == []


def test_arguments_that_were_not_json_are_an_error_result():
    call = ToolCall("j1", "execute_code", {}, arguments_error="Expecting value: line 1 column 1")
    res = run_agent("t", ScriptedClient([calls(call), answer("ok")]), tools=_tools(FakeRunner())).transcript[2]
    assert res.is_error and "not a JSON object" in res.content


def test_unsupported_language_is_an_error_result_from_the_real_runner():
    # the real run_code validates the language before touching any engine
    client = ScriptedClient([calls(code_call("x", language="cobol")), answer("ok")])
    res = run_agent("t", client).transcript[2]
    assert res.is_error and "unknown language 'cobol'" in res.content and "python" in res.content


def test_daemon_down_is_an_error_result():
    runner = FakeRunner(EngineUnavailable("the Docker engine did not answer. Start it with scripts/engine-up.sh"))
    res = run_agent("t", ScriptedClient([calls(code_call("print(1)")), answer("ok")]), tools=_tools(runner)).transcript[
        2
    ]
    assert res.is_error and "the sandbox could not run this" in res.content and "engine-up.sh" in res.content


def test_unexpected_tool_exception_does_not_escape():
    runner = FakeRunner(RuntimeError("kaboom"))
    res = run_agent("t", ScriptedClient([calls(code_call("1")), answer("ok")]), tools=_tools(runner)).transcript[2]
    assert res.is_error and "RuntimeError: kaboom" in res.content


def test_parallel_calls_all_run_and_are_answered_in_order_with_ids():
    runner = FakeRunner()
    turn = calls(code_call("a", call_id="p1"), ToolCall("p2", "nope", {}), code_call("c", call_id="p3"))
    result = run_agent("t", ScriptedClient([turn, answer("ok")]), tools=_tools(runner))
    results = result.transcript[2:5]
    assert [r.call_id for r in results] == ["p1", "p2", "p3"]
    assert [r.is_error for r in results] == [False, True, False]
    assert [c[0] for c in runner.calls] == ["a", "c"]


def test_failed_code_is_flagged_and_annotated_with_applied_limits():
    lim = SandboxLimits(memory="512m")
    runner = FakeRunner(ExecutionResult(exit_code=137, oom_killed=True, duration_seconds=1, limits=lim))
    res = run_agent(
        "t", ScriptedClient([calls(code_call("x")), answer("ok")]), tools=_tools(runner, limits=lim)
    ).transcript[2]
    assert res.is_error and "exit_code: 137" in res.content
    assert "killed by the sandbox (SIGKILL): it exceeded the 512m memory limit" in res.content


def test_client_failure_ends_the_run():
    def boom(_):
        raise ProviderError("401: invalid x-api-key")

    with pytest.raises(ProviderError, match="401"):
        run_agent("t", ScriptedClient([boom]))


def test_scripted_client_exhaustion_is_loud():
    with pytest.raises(ScriptExhausted):
        run_agent("t", ScriptedClient([calls(code_call("1"))]), tools=_tools(FakeRunner()))


def test_bad_loop_arguments():
    with pytest.raises(InvalidArgument):
        run_agent("", ScriptedClient([]))
    with pytest.raises(InvalidArgument):
        run_agent("t", ScriptedClient([]), max_iterations=0)


def test_client_with_seed_signature_works():
    class SeedClient:
        def next_turn(self, transcript):
            return answer("seed-style")

    assert run_agent("t", SeedClient()).answer == "seed-style"


def test_usage_is_summed():
    from sandloop.agent import Usage

    client = ScriptedClient(
        [
            AssistantTurn(tool_calls=(code_call("1"),), usage=Usage(10, 5)),
            AssistantTurn(text="ok", usage=Usage(20, 7)),
        ]
    )
    assert run_agent("t", client, tools=_tools(FakeRunner())).usage == Usage(30, 12)


def test_transcript_round_trips_through_jsonl(tmp_path):
    from sandloop.agent.transcript import load_jsonl, save_jsonl

    result = run_agent("t", ScriptedClient([calls(code_call("1")), answer("ok")]), tools=_tools(FakeRunner()))
    save_jsonl(result.transcript, tmp_path / "t.jsonl")
    assert load_jsonl(tmp_path / "t.jsonl") == result.transcript

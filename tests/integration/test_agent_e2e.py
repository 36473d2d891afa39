"""The agent loop end to end: real SDKs -> local wire-format server, real containers for the code."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from sandloop import SandboxLimits
from sandloop.agent import ToolResult, run_agent
from sandloop.agent.providers.anthropic import AnthropicClient
from sandloop.agent.providers.openai import OpenAIClient
from sandloop.testing import ScriptedClient, answer, calls, code_call
from sandloop.testing.wire import (
    FakeProviderServer,
    RecordedRequest,
    anthropic_text,
    anthropic_tool_use,
    openai_completion,
)
from tests.helpers import our_containers

PRIMES = "print(sum(n for n in range(2, 100) if all(n % d for d in range(2, n))))"


def _last_anthropic_tool_result(req: RecordedRequest) -> dict:
    return req.body["messages"][-1]["content"][-1]


def test_anthropic_adapter_drives_a_real_container():
    def conclude(req: RecordedRequest):
        block = _last_anthropic_tool_result(req)
        assert block["tool_use_id"] == "toolu_1" and not block["is_error"]
        return anthropic_text("The sum is " + block["content"].split("stdout:\n")[1].split()[0])

    with FakeProviderServer([anthropic_tool_use(("toolu_1", "execute_code", {"code": PRIMES})), conclude]) as server:
        result = run_agent("sum the primes below 100", AnthropicClient("claude-test", api_key="k", base_url=server.url))
    assert result.answer == "The sum is 1060" and result.stop_reason == "answered"
    assert our_containers() == []


def test_openai_adapter_drives_a_real_container():
    def conclude(req: RecordedRequest):
        tool_msg = req.body["messages"][-1]
        assert tool_msg["role"] == "tool" and tool_msg["tool_call_id"] == "call_1"
        return openai_completion("node says " + tool_msg["content"].split("stdout:\n")[1].split()[0])

    first = openai_completion(
        tool_calls=[("call_1", "execute_code", json.dumps({"code": "console.log(6*7)", "language": "node"}))]
    )
    with FakeProviderServer([first, conclude]) as server:
        result = run_agent("6*7 in node", OpenAIClient("gpt-test", api_key="k", base_url=server.url + "/v1"))
    assert result.answer == "node says 42"


def _tool_result(code: str, limits: SandboxLimits | None = None, **args) -> ToolResult:
    client = ScriptedClient([calls(code_call(code, call_id="k1", **args)), answer("done")])
    result = run_agent("t", client, limits=limits)
    (res,) = [t for t in result.transcript if isinstance(t, ToolResult)]
    return res


def test_oom_kill_is_annotated_with_the_applied_limit():
    res = _tool_result("x = bytearray(700 * 1024 * 1024)", SandboxLimits(memory="128m"))
    assert res.is_error and "exit_code: 137" in res.content
    assert "killed by the sandbox (SIGKILL): it exceeded the 128m memory limit" in res.content


def test_timeout_is_annotated_with_its_limit():
    res = _tool_result("import time\nprint('working')\ntime.sleep(30)", timeout_seconds=1.5)
    assert res.is_error and "timed out (killed)" in res.content and "after 1.5 s" in res.content
    assert "working" in res.content


def test_output_flood_is_annotated_with_what_was_dropped():
    res = _tool_result("print('y' * 5_000_000)")
    # 5,000,001 bytes printed, 65,536 kept by the sandbox: 4,934,465 dropped
    assert "stdout truncated: kept the first 64 KB and dropped 4.7 MB" in res.content
    assert "characters omitted here" in res.content and len(res.content) < 10_000


def test_fork_ceiling_is_annotated():
    code = "import subprocess\nps = [subprocess.Popen(['sleep', '20']) for _ in range(100)]"
    res = _tool_result(code, SandboxLimits(pids=32))
    assert res.is_error and "at most 32 at once" in res.content


def test_no_network_and_read_only_are_annotated():
    res = _tool_result("import socket; socket.getaddrinfo('example.com', 443)")
    assert "this sandbox has no network" in res.content
    res = _tool_result("open('/etc/out.txt', 'w')")
    assert "only /tmp (a 64m scratch tmpfs) is writable" in res.content


def test_silent_run_is_annotated():
    res = _tool_result("x = 6 * 7")
    assert not res.is_error and "printed nothing" in res.content


def _cli(*args: str, env_extra: dict[str, str]) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.endswith("_API_KEY")}
    env.update(env_extra)
    return subprocess.run(
        [sys.executable, "-m", "sandloop", *args], capture_output=True, text=True, env=env, timeout=300
    )


def test_cli_agent_multi_step_against_a_local_openai_compatible_server(tmp_path):
    """Step 1 runs out of memory, step 2 streams instead, step 3 answers."""
    hog = "data = [bytearray(1 << 20) for _ in range(1000)]\nprint(len(data))"
    stream = "total = 0\nfor _ in range(1000):\n    total += len(bytearray(1 << 20))\nprint(total >> 20)"

    def step2(req: RecordedRequest):
        assert "memory limit" in req.body["messages"][-1]["content"]
        return openai_completion("Streaming instead.", [("c2", "execute_code", json.dumps({"code": stream}))])

    replies = [
        openai_completion(tool_calls=[("c1", "execute_code", json.dumps({"code": hog}))]),
        step2,
        lambda req: openai_completion(
            "Processed " + req.body["messages"][-1]["content"].split("stdout:\n")[1].split()[0] + " MB."
        ),
    ]
    save = tmp_path / "t.jsonl"
    with FakeProviderServer(replies) as server:
        proc = _cli(
            "agent",
            "allocate 1000 MB",
            "--provider",
            "openai",
            "--model",
            "local-model",
            "--base-url",
            server.url + "/v1",
            "--json",
            "--save",
            str(save),
            env_extra={},
        )
    assert proc.returncode == 0, proc.stderr
    out = json.loads(proc.stdout)
    assert out["answer"] == "Processed 1000 MB." and out["turns"] == 3 and out["stop_reason"] == "answered"
    lines = [json.loads(x) for x in save.read_text().splitlines()]
    assert [x["type"] for x in lines] == ["user", "assistant", "tool_result", "assistant", "tool_result", "assistant"]
    assert lines[2]["is_error"] and not lines[4]["is_error"]


def test_cli_agent_live_view_against_a_local_anthropic_server():
    replies = [
        anthropic_tool_use(
            ("toolu_9", "execute_code", {"code": "echo hello from bash", "language": "bash"}), text="Running it."
        ),
        anthropic_text("Bash said hello."),
    ]
    with FakeProviderServer(replies) as server:
        proc = _cli(
            "agent",
            "say hello",
            "--provider",
            "anthropic",
            "--model",
            "claude-test",
            "--base-url",
            server.url,
            env_extra={"ANTHROPIC_API_KEY": "sk-local"},
        )
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "Bash said hello."
    assert "execute_code · bash · toolu_9" in proc.stderr and "hello from bash" in proc.stderr
    assert "stopped: answered after 2 model turn(s)" in proc.stderr


def test_cli_agent_missing_key_is_a_clear_error():
    proc = _cli("agent", "x", "--provider", "anthropic", env_extra={})
    assert proc.returncode == 2 and "ANTHROPIC_API_KEY is not set" in proc.stderr

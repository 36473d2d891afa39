"""The CLI as a newcomer types it: one rule for a program (FILE, '-'/stdin, or -c CODE) across
`run`, `session run` and `session cell`; piped stdin reaches a program read from a file; bad input
is a clear message and exit 2, never a traceback; --json carries the same fields as the API."""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys

import pytest

from sandloop.runner import default_root


def sandloop(*args: str, input: bytes | None = None, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "sandloop", *args], input=input, capture_output=True, timeout=120, cwd=cwd
    )


def test_piped_stdin_reaches_a_program_read_from_a_file(tmp_path):
    prog = tmp_path / "upper.py"
    prog.write_text("import sys; print(sys.stdin.read().upper(), end='')")
    r = sandloop("run", str(prog), input=b"piped in\n")
    assert (r.returncode, r.stdout) == (0, b"PIPED IN\n"), r.stderr
    r = sandloop("run", "-c", "import sys; print(len(sys.stdin.read()))", input=b"abc")
    assert (r.returncode, r.stdout) == (0, b"3\n"), r.stderr
    r = sandloop("run", input=b"print(6 * 7)")  # the program itself from stdin
    assert r.stdout == b"42\n"


@pytest.mark.parametrize(
    "args",
    [
        ("run", "print(1)"),  # inline code given as if it were a file
        ("run", "nothere.py"),
        ("run", "-c", "print(1)", "also-a-file.py"),
    ],
)
def test_a_bad_program_argument_is_a_message_not_a_traceback(args):
    r = sandloop(*args)
    assert r.returncode == 2 and b"Traceback" not in r.stderr, r.stderr
    assert b"sandloop:" in r.stderr


def test_json_has_notes_and_the_exact_bytes_of_binary_output():
    code = "import sys; sys.stdout.buffer.write(bytes([0, 255, 254, 10])); sys.stdout.flush()"
    r = sandloop("run", "--json", "-c", code)
    body = json.loads(r.stdout)
    assert base64.b64decode(body["stdout_base64"]) == b"\x00\xff\xfe\n" and "notes" in body
    assert body["stderr_base64"] is None
    plain = sandloop("run", "-c", code)
    assert plain.stdout == b"\x00\xff\xfe\n"
    oom = json.loads(sandloop("run", "--json", "--memory", "64m", "-c", "x = bytearray(300 << 20)").stdout)
    assert oom["exit_code"] == 137 and any("64m memory limit" in n for n in oom["notes"])


def test_session_commands_share_the_rule_and_never_write_files_unasked(tmp_path):
    r = sandloop("session", "create", "--ttl", "300", "--quota", "16m")
    sid = r.stdout.decode().strip()
    assert r.returncode == 0 and sid.startswith("s-"), r.stderr
    try:
        r = sandloop("session", "run", sid, "ls -la", "-l", "bash")  # before: a raw traceback
        assert r.returncode == 2 and b"-c 'ls -la'" in r.stderr and b"Traceback" not in r.stderr, r.stderr
        r = sandloop("session", "run", sid, "-c", "echo hi > note.txt && cat note.txt", "-l", "bash")
        assert (r.returncode, r.stdout) == (0, b"hi\n"), r.stderr
        chart = "import matplotlib.pyplot as plt\nplt.plot([1, 2])\n21 * 2"
        r = sandloop("session", "cell", sid, "-c", chart, cwd=tmp_path)
        assert r.returncode == 0 and r.stdout.strip() == b"42" and b"not saved: add --artifacts" in r.stderr
        assert list(tmp_path.iterdir()) == []  # before: figure-1.png appeared in the current directory
        out = tmp_path / "charts"
        for _ in range(2):
            assert sandloop("session", "cell", sid, "-c", chart, "--artifacts", str(out)).returncode == 0
        assert sorted(p.name for p in out.iterdir()) == ["figure-1-2.png", "figure-1.png"]  # never overwritten
        script = tmp_path / "cell.py"
        script.write_text("print(open('note.txt').read().strip())")
        assert sandloop("session", "cell", sid, str(script)).stdout == b"hi\n"
    finally:
        assert sandloop("session", "rm", sid).returncode == 0


@pytest.mark.parametrize("args", [("serve",), ("mcp", "--transport", "http")])
def test_a_stopped_server_leaves_no_warm_sandbox(tmp_path, args):
    """Before: SIGTERM left the warm pool's containers Exited until the next reap."""
    import signal

    import docker
    import httpx

    from sandloop.server.tokens import TokenStore
    from tests.helpers import direct_sandboxes, owned_by_pid
    from tests.servers import sandloop_process

    secret, _ = TokenStore(tmp_path / "tokens.sqlite").create("t")
    with sandloop_process(*args, home=tmp_path) as (port, proc):
        if args[0] == "serve":
            r = httpx.post(
                f"http://127.0.0.1:{port}/v1/runs",
                json={"code": "print(1)"},
                headers={"Authorization": f"Bearer {secret}"},
                timeout=120,
            )
            assert r.status_code == 200
        else:
            from tests.integration.test_mcp import _client, _text

            async def one_run() -> None:
                async with _client(f"http://127.0.0.1:{port}/mcp", secret) as client:
                    assert "exit_code: 0" in _text(await client.call_tool("run_code", {"code": "print(1)"}))

            import asyncio

            asyncio.run(one_run())
        client = docker.from_env()
        try:
            # one listing call (no per-container inspect that races with the pool replacing sandboxes)
            mine = [
                c["Id"]
                for c in client.api.containers(all=True, filters={"label": "sandloop.owner"})
                if f":{proc.pid}:" in c["Labels"]["sandloop.owner"]
            ]
            direct = direct_sandboxes(owned_by_pid(proc.pid))  # the direct backend's (no Docker container)
            assert mine or direct, "the server kept no warm sandbox: nothing to check"
            proc.send_signal(signal.SIGTERM)
            assert proc.wait(60) in (0, -signal.SIGTERM)  # uvicorn re-raises SIGTERM after its shutdown
            left = [cid for cid in mine if _exists(client, cid)]
            left += [sid for sid in direct if sid in direct_sandboxes(owned_by_pid(proc.pid))]
        finally:
            client.close()
    assert left == []


def _exists(client, container_id: str) -> bool:
    import docker.errors

    try:
        client.containers.get(container_id)
        return True
    except docker.errors.NotFound:
        return False


@pytest.mark.parametrize(
    "args",
    [
        ("run", "--allow", "a b", "-c", "print(1)"),  # an allowlist rule that is no hostname
        ("run", "--memory", "lots", "-c", "print(1)"),
        ("run", "-l", "cobol", "-c", "print(1)"),
        ("run", "--network", "--allow", "pypi.org", "-c", "print(1)"),  # both: choose one
    ],
)
def test_a_bad_limit_or_language_is_a_usage_error(args):
    r = sandloop(*args)
    assert r.returncode == 2 and b"Traceback" not in r.stderr and b"sandloop:" in r.stderr, r.stderr


def test_session_pause_resume_fork_and_snapshots_from_the_command_line():
    sid = sandloop("session", "create", "--ttl", "300", "--quota", "16m").stdout.decode().strip()
    made = [sid]
    try:
        assert sandloop("session", "cell", sid, "-c", "kept = 41").returncode == 0
        r = sandloop("session", "pause", sid)
        assert r.returncode == 0 and b"kept its picklable Python variables" in r.stdout, r
        assert b"paused" in sandloop("session", "ls").stdout
        again = sandloop("session", "pause", sid)
        assert again.returncode != 0 and b"already paused" in again.stderr, again
        assert sandloop("session", "resume", sid).returncode == 0
        child = sandloop("session", "fork", sid).stdout.decode().strip()
        made.append(child)
        assert child.startswith("s-") and child != sid
        assert sandloop("session", "cell", child, "-c", "kept + 1").stdout.decode().strip() == "42"
        later = sandloop("session", "fork", sid, "--paused").stdout.decode().strip()
        made.append(later)
        store = default_root().sessions  # made paused, for want of use: its first cell resumes it
        assert later.startswith("s-") and store.paused(later) == "state" and store.idle_paused(later)
        assert sandloop("session", "cell", later, "-c", "kept + 2").stdout.decode().strip() == "43"
        snap = sandloop("session", "snapshot", sid, "--name", "forty-one").stdout.decode().strip()
        assert snap.startswith("snap-")
        listed = sandloop("session", "snapshots", sid).stdout
        assert snap.encode() in listed and b"forty-one" in listed and b"state" in listed
        other = sandloop("session", "from-snapshot", snap).stdout.decode().strip()
        made.append(other)
        assert sandloop("session", "cell", other, "-c", "kept").stdout.decode().strip() == "41"
        assert sandloop("session", "snapshot-rm", snap).returncode == 0
        gone = sandloop("session", "snapshot-rm", snap)
        assert gone.returncode != 0 and b"no snapshot" in gone.stderr, gone
    finally:
        for s in made:
            sandloop("session", "rm", s)
        if "snap" in locals():  # a failed assertion must not leave its snapshot behind
            sandloop("session", "snapshot-rm", snap)


def test_doctor_says_what_runs_directly_and_what_still_needs_docker():
    r = subprocess.run(
        [sys.executable, "-m", "sandloop", "doctor", "--no-smoke"],
        capture_output=True,
        timeout=120,
        env={**os.environ, "COLUMNS": "400"},  # one line a check
    )
    out = r.stdout.decode()
    assert r.returncode == 0, out + r.stderr.decode()
    lines = {line.split("│")[1].strip(): line for line in out.splitlines() if line.count("│") >= 3}
    assert " ok " in lines["direct runs"] and "runc sessions' interpreters" in lines["direct runs"]
    assert "the C starter" in lines["runc-class starter"]  # the default (bubblewrap where no C compiler)
    for words in ("building the runtime image and templates", "first run of each sandbox shape", "workspaces"):
        assert words in lines["needs Docker"], words

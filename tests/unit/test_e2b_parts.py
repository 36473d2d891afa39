"""The E2B-compatible API's parts that need no engine: path mapping, the Connect framing, the
registry's access tokens, the option checks, and the process table run by a local python3."""

from __future__ import annotations

import json
import os
import stat
import struct
import subprocess
import sys
import textwrap
import time
from importlib import resources

import pytest

from sandloop.server.e2b.connect import STATUS, envelope
from sandloop.server.e2b.control import CONTROL_PATH, _asks_for
from sandloop.server.e2b.registry import Registry
from sandloop.server.e2b.service import E2BError, command_cwd, sandbox_path, workspace_path
from sandloop.server.guard import bearer_token
from sandloop.server.tokens import TokenStore


def test_paths_map_to_the_workspace_and_nothing_else():
    assert workspace_path("/home/user") == "."
    assert workspace_path("/home/user/a/b.txt") == "a/b.txt"
    assert workspace_path("a/b.txt") == "a/b.txt"
    assert workspace_path("~/x") == "x"
    assert workspace_path("/workspace/x") == "x"
    for outside in ("/etc/passwd", "/home/userx/file", "/tmp/a"):
        with pytest.raises(E2BError) as refused:
            workspace_path(outside)
        assert refused.value.status == 400 and "/home/user" in refused.value.message
    with pytest.raises(E2BError):
        workspace_path("")
    assert sandbox_path(".") == "/home/user" and sandbox_path("a/b") == "/home/user/a/b"
    assert command_cwd(None) == "/home/user" and command_cwd("~/src") == "/home/user/src"
    assert command_cwd("sub") == "/home/user/sub" and command_cwd("/tmp") == "/tmp"


def test_control_paths_are_recognised_whatever_the_version():
    for path in ("/sandboxes", "/sandboxes/s-1/connect", "/v2/sandboxes", "/v3/sandboxes/x"):
        assert CONTROL_PATH.match(path), path
    for path in ("/files", "/execute", "/sandboxesx", "/v1/sessions", "/process.Process/Start"):
        assert not CONTROL_PATH.match(path), path


def test_options_that_ask_for_something():
    assert not _asks_for(None) and not _asks_for({}) and not _asks_for([]) and not _asks_for(False)
    assert not _asks_for({"enabled": False}) and _asks_for({"enabled": True})
    assert _asks_for(True) and _asks_for({"allowOut": ["1.2.3.4"]}) and not _asks_for({"allowOut": []})


def test_connect_envelopes():
    frame = envelope({"a": 1})
    flags, length = struct.unpack(">BI", frame[:5])
    assert flags == 0 and json.loads(frame[5 : 5 + length]) == {"a": 1}
    end = envelope({"error": {"code": "not_found", "message": "x"}}, end=True)
    assert end[0] == 0b10
    assert STATUS["not_found"] == 404 and STATUS["unauthenticated"] == 401 and STATUS["unimplemented"] == 501


def test_access_tokens_are_derived_checked_and_not_stored(tmp_path):
    reg = Registry(tmp_path / "e2b.sqlite", tmp_path / "e2b-secret")
    assert stat.S_IMODE(os.stat(tmp_path / "e2b-secret").st_mode) == 0o600
    reg.add(
        "s-aaaaaaaaaaaa", "tok_1", template="base", timeout=60, metadata={}, envs={}, cpus=1, memory_mb=256, disk_mb=1
    )
    envd, traffic = reg.access_token("s-aaaaaaaaaaaa", "envd"), reg.access_token("s-aaaaaaaaaaaa", "traffic")
    assert envd != traffic and envd != reg.access_token("s-bbbbbbbbbbbb", "envd")
    assert reg.check_access("s-aaaaaaaaaaaa", envd, None) and reg.check_access("s-aaaaaaaaaaaa", envd, traffic)
    assert not reg.check_access("s-aaaaaaaaaaaa", None, None)
    assert not reg.check_access("s-aaaaaaaaaaaa", envd, "0" * 64)  # every token sent must be right
    assert not reg.check_access("s-bbbbbbbbbbbb", envd, None)
    assert envd.encode() not in (tmp_path / "e2b.sqlite").read_bytes()
    # The same secret after a restart: connect hands out the same tokens.
    again = Registry(tmp_path / "e2b.sqlite", tmp_path / "e2b-secret")
    assert again.access_token("s-aaaaaaaaaaaa", "envd") == envd
    assert again.get("s-aaaaaaaaaaaa").token_id == "tok_1"
    assert again.expired(time.time() + 120) == ["s-aaaaaaaaaaaa"] and again.expired() == []
    again.remove("s-aaaaaaaaaaaa")
    assert again.get("s-aaaaaaaaaaaa") is None


def test_api_keys_are_e2b_shaped_and_malformed_ones_refused(tmp_path):
    store = TokenStore(tmp_path / "tokens.sqlite")
    secret, token = store.create("k")
    assert secret.startswith("e2b_") and int(secret[4:], 16) >= 0
    assert bearer_token(store, "", secret) == token
    assert bearer_token(store, f"Bearer {secret}") == token
    assert "malformed" in bearer_token(store, "", "sl_abcdef")
    assert "malformed" in bearer_token(store, "", "e2b_XYZ")
    assert bearer_token(store, "", "e2b_" + "0" * 64) == "unknown or revoked API key"
    assert store.get(token.id) == token
    store.revoke("k")
    assert store.get(token.id) is None


HELPER = resources.files("sandloop.server.e2b").joinpath("procs_helper.py").read_text()
DRIVER = textwrap.dedent(
    """
    import json, sys, time
    SRC = sys.stdin.read()
    def op(**args):
        import io, contextlib
        buf = io.StringIO()
        with contextlib.redirect_stdout(buf):
            exec(SRC, {"__name__": "cell", "ARGS": args})
        return json.loads(buf.getvalue().split("\\x1esandloop-procs:")[1])
    out = {}
    script = "echo one; echo two >&2; sleep 0.3; echo three; exit 5"
    p = op(op="start", config={"cmd": "/bin/sh", "args": ["-c", script], "cwd": "/tmp"})
    pid = p["pid"]
    got, code = {"stdout": b"", "stderr": b""}, None
    import base64
    while code is None:
        r = op(op="poll", pid=pid, wait=0.5)
        for k in got:
            got[k] += base64.b64decode(r[k])
        code = r.get("exit_code")
    out["first"] = [got["stdout"].decode(), got["stderr"].decode(), code]
    out["gone"] = op(op="poll", pid=pid)
    s = op(op="start", config={"cmd": "sleep", "args": ["30"], "cwd": "/tmp"})
    out["listed"] = [x["pid"] for x in op(op="list")["processes"]] == [s["pid"]]
    out["signal"] = op(op="signal", pid=s["pid"], signal=9)
    while "exit_code" not in (r := op(op="poll", pid=s["pid"], wait=0.5)):
        pass
    out["killed"] = r["exit_code"]
    c = op(op="start", config={"cmd": "cat", "cwd": "/tmp"}, stdin=True)
    op(op="input", pid=c["pid"], data=base64.b64encode(b"fed").decode())
    op(op="input", pid=c["pid"], close=True)
    data = b""
    while "exit_code" not in (r := op(op="poll", pid=c["pid"], wait=0.5)):
        data += base64.b64decode(r["stdout"])
    out["cat"] = (data + base64.b64decode(r["stdout"])).decode()
    quiet = op(op="start", config={"cmd": "sleep", "args": ["1"], "cwd": "/tmp"})
    out["no_stdin"] = op(op="input", pid=quiet["pid"], data="")
    out["bad"] = op(op="start", config={"cmd": "/no/such/program", "cwd": "/tmp"})
    a = op(op="start", config={"cmd": "/bin/sh", "args": ["-c", "echo a"], "cwd": "/tmp"})["pid"]
    b = op(op="start", config={"cmd": "/bin/sh", "args": ["-c", "sleep 0.2; echo b"], "cwd": "/tmp"})["pid"]
    seen, ended = {a: b"", b: b""}, set()
    while len(ended) < 2:
        r = op(op="poll", pids=[a, b, 424242], wait=0.5)["replies"]
        out["missing"] = r["424242"]["kind"]
        for pid in (a, b):
            if str(pid) in r and "stdout" in r[str(pid)]:
                seen[pid] += base64.b64decode(r[str(pid)]["stdout"])
                if "exit_code" in r[str(pid)]:
                    ended.add(pid)
    out["many"] = [seen[a].decode(), seen[b].decode()]
    print(json.dumps(out))
    """
)


def test_process_table_in_a_real_interpreter():
    done = subprocess.run([sys.executable, "-c", DRIVER], input=HELPER, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["first"] == ["one\nthree\n", "two\n", 5]
    assert out["gone"]["kind"] == "not_found"  # an end, once collected, is forgotten
    assert out["listed"] and out["signal"] == {} and out["killed"] == -9
    assert out["cat"] == "fed"
    assert out["no_stdin"]["kind"] == "invalid" and "stdin" in out["no_stdin"]["error"]
    assert out["bad"]["kind"] == "invalid_argument" and "/no/such/program" in out["bad"]["error"]
    assert out["many"] == ["a\n", "b\n"] and out["missing"] == "not_found"  # several in one poll


def test_an_output_becomes_e2b_s_result_fields():
    from sandloop.server.e2b.jupyter import e2b_result

    r = e2b_result(
        {"text/plain": "'bar'", "text/html": "<b>", "image/png": "iVBO", "e2b/data": {"a": [1]}, "x/custom": 3},
        True,
    )
    assert r == {
        "type": "result",
        "is_main_result": True,
        "text": "bar",  # E2B's server drops a string's quotes
        "html": "<b>",
        "png": "iVBO",
        "data": {"a": [1]},
        "extra": {"x/custom": 3},
    }

"""E2B's official SDKs (``e2b``, ``e2b-code-interpreter``), unchanged, against sandloop's
E2B-compatible API on a real uvicorn with real sandboxes: the newest supported SDK in this
process (sync and async), the oldest in its own virtualenv (.venv-e2b-old, made by setup.sh)."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import e2b
import httpx
import pytest
from e2b import AsyncSandbox as PlainAsyncSandbox
from e2b import CommandExitException
from e2b import Sandbox as PlainSandbox
from e2b.exceptions import (
    AuthenticationException,
    InvalidArgumentException,
    NotFoundException,
    SandboxException,
    TimeoutException,
)
from e2b_code_interpreter import AsyncSandbox, Sandbox

from sandloop.server.app import create_app
from sandloop.server.tokens import TokenStore
from tests.helpers import OCI_BUNDLES, our_containers
from tests.servers import e2b_environment, serve_in_thread

ROOT = Path(__file__).resolve().parents[2]
OLD_VENV = ROOT / ".venv-e2b-old"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    tokens = TokenStore(tmp_path_factory.mktemp("e2b") / "tokens.sqlite")
    alice, _ = tokens.create("alice", max_concurrent=8, runs_per_minute=1000, max_timeout=60)
    bob, _ = tokens.create("bob")
    with serve_in_thread(create_app(tokens)) as url, e2b_environment(url, alice):
        yield {"url": url, "alice": alice, "bob": bob}


@pytest.fixture(scope="module")
def sbx(server):
    """One code-interpreter sandbox shared by the tests that only use it."""
    s = Sandbox.create(timeout=600)
    yield s
    s.kill()


def test_keys_are_e2b_shaped_and_work_on_the_native_api_too(server):
    assert server["alice"].startswith("e2b_") and all(c in "0123456789abcdef" for c in server["alice"][4:])
    r = httpx.post(
        f"{server['url']}/v1/runs",
        json={"code": "print(6*7)"},
        headers={"Authorization": f"Bearer {server['alice']}"},
        timeout=120,  # the module's first run may be the machine's first on a new image (httpx's 5 s is not a bound)
    )
    assert r.status_code == 200 and r.json()["stdout"] == "42\n"


def test_lifecycle_create_info_list_timeout_kill(server):
    s = PlainSandbox.create(timeout=120, metadata={"job": "lifecycle"})
    try:
        info = s.get_info()
        assert info.sandbox_id == s.sandbox_id and info.metadata == {"job": "lifecycle"}
        assert 100 < (info.end_at - info.started_at).total_seconds() <= 121
        listed = PlainSandbox.list(query=e2b.SandboxQuery(metadata={"job": "lifecycle"})).next_items()
        assert [i.sandbox_id for i in listed] == [s.sandbox_id]
        assert PlainSandbox.list(query=e2b.SandboxQuery(metadata={"job": "other"})).next_items() == []
        s.set_timeout(600)
        assert (s.get_info().end_at - info.started_at).total_seconds() > 590
        assert s.is_running()
        again = PlainSandbox.connect(s.sandbox_id)  # from the id alone, as another process would
        assert again.commands.run("echo connected").stdout == "connected\n"
    finally:
        s.kill()
    with pytest.raises(NotFoundException):
        PlainSandbox.get_info(s.sandbox_id)
    with pytest.raises(Exception):  # noqa: B017 - its envd is gone with it
        s.commands.run("true")
    assert s.sandbox_id not in {r.id for r in _root_sessions()}


def test_create_envs_metadata_and_list_paging(server):
    made = [PlainSandbox.create(timeout=120, metadata={"batch": "paging"}, envs={"COLOR": "green"}) for _ in range(3)]
    try:
        assert made[0].commands.run("echo $COLOR").stdout == "green\n"  # the sandbox's envs, for commands
        pages = PlainSandbox.list(query=e2b.SandboxQuery(metadata={"batch": "paging"}), limit=2)
        first = pages.next_items()
        assert len(first) == 2 and pages.has_next
        second = pages.next_items()
        assert len(second) == 1 and not pages.has_next
        assert {i.sandbox_id for i in first + second} == {s.sandbox_id for s in made}
    finally:
        for s in made:
            s.kill()


def test_a_sandbox_ends_at_its_timeout(server):
    s = PlainSandbox.create(timeout=120)  # time enough for its command however busy the machine
    sid = s.sandbox_id
    assert s.commands.run("echo alive").stdout == "alive\n"
    s.set_timeout(1)  # from now
    time.sleep(2)
    with pytest.raises(NotFoundException):
        PlainSandbox.get_info(sid)
    assert sid not in {r.id for r in _root_sessions()}


def test_run_code_state_logs_results_and_errors(sbx):
    sbx.run_code("x = 41")
    ex = sbx.run_code("import sys\nprint('out')\nprint('err', file=sys.stderr)\nx + 1")
    assert ex.text == "42" and ex.results[0].is_main_result
    assert ex.logs.stdout == ["out\n"] and ex.logs.stderr == ["err\n"]
    assert ex.error is None
    bad = sbx.run_code("def f():\n    return 1/0\nf()")
    assert bad.error.name == "ZeroDivisionError" and bad.error.value == "division by zero"
    assert "ZeroDivisionError" in bad.error.traceback and "return 1/0" in bad.error.traceback
    assert sbx.run_code("x").text == "41"  # the error kept the state


def test_stderr_written_before_a_display_comes_before_it_in_whole_lines(sbx):
    """stdout and stderr reach the server on separate streams; what the cell wrote to stderr
    before each display (a line in two writes, as print makes it) arrives whole and before it."""
    seen = []
    code = (
        "import sys\nfrom IPython.display import display\n"
        "for i in range(40):\n    sys.stderr.write('e%d' % i)\n    sys.stderr.write('\\n')\n    display(i)\n"
    )
    ex = sbx.run_code(
        code,
        on_stderr=lambda m: seen.append(("stderr", m.line)),
        on_result=lambda r: seen.append(("result", r.text)),
    )
    assert ex.error is None and ex.logs.stderr == [f"e{i}\n" for i in range(40)]
    assert seen == [pair for i in range(40) for pair in (("stderr", f"e{i}\n"), ("result", str(i)))]


def test_another_clients_cells_never_leak_into_run_code(server, sbx):
    """The same sandbox is a session the native API (and the CLI) can use too: their cells'
    output must not show up in the next run_code (the server holds no idle stream to the
    interpreter between calls)."""
    sbx.run_code("1")
    native = httpx.post(
        f"{server['url']}/v1/sessions/{sbx.sandbox_id}/cells",
        json={"code": "print('native-output')"},
        headers={"Authorization": f"Bearer {server['alice']}"},
        timeout=60,
    )
    assert native.status_code == 200 and native.json()["stdout"] == "native-output\n"
    ex = sbx.run_code("print('e2b')")
    assert ex.logs.stdout == ["e2b\n"] and ex.logs.stderr == [] and ex.error is None


def test_run_code_streams_while_it_runs(sbx):
    seen = []
    started = time.monotonic()
    sbx.run_code(
        "import time\nprint('first', flush=True)\ntime.sleep(2)\nprint('second')",
        on_stdout=lambda m: seen.append((time.monotonic() - started, m.line)),
    )
    ended = time.monotonic() - started
    assert [line for _, line in seen] == ["first\n", "second\n"]
    assert seen[0][0] < ended - 1.5, f"the first line came at {seen[0][0]:.2f} s of {ended:.2f} s: not streamed"


def test_run_code_chart_is_a_png(sbx):
    ex = sbx.run_code("import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.show()")
    pngs = [r.png for r in ex.results if r.png]
    assert len(pngs) == 1 and base64.b64decode(pngs[0]).startswith(b"\x89PNG\r\n\x1a\n")


def test_run_code_timeout_interrupts_and_keeps_state(sbx):
    sbx.run_code("kept = 'yes'")
    started = time.monotonic()
    with pytest.raises(TimeoutException):
        sbx.run_code("import time\nwhile True: time.sleep(0.1)", timeout=2)
    assert time.monotonic() - started < 10
    # The server interrupted the cell when the client gave up: the interpreter is free again.
    started = time.monotonic()
    assert sbx.run_code("kept").text == "yes"  # E2B's server drops a string's quotes
    assert time.monotonic() - started < 10


def test_run_code_envs_apply_to_that_execution_only(sbx):
    assert sbx.run_code("import os; os.environ.get('COLOR')", envs={"COLOR": "blue"}).text == "blue"
    assert sbx.run_code("import os; os.environ.get('COLOR')").text is None


def test_commands_foreground_failing_envs_cwd(sbx):
    out = []
    r = sbx.commands.run("echo hello; echo oops >&2; pwd; id -u", on_stdout=out.append)
    assert r.exit_code == 0 and r.stderr == "oops\n"
    lines = r.stdout.splitlines()
    assert lines[0] == "hello" and lines[1] == "/home/user" and lines[2] != "0"
    assert "".join(out) == r.stdout
    with pytest.raises(CommandExitException) as failed:
        sbx.commands.run("echo before; exit 3")
    assert failed.value.exit_code == 3 and failed.value.stdout == "before\n"
    sbx.files.make_dir("/home/user/sub")
    r = sbx.commands.run("echo $GREETING; pwd", envs={"GREETING": "hi"}, cwd="/home/user/sub")
    assert r.stdout == "hi\n/home/user/sub\n"


def test_commands_background_wait_list_kill_stdin(sbx):
    h = sbx.commands.run("sleep 2; echo done", background=True)
    assert h.pid in [p.pid for p in sbx.commands.list()]
    assert h.wait().stdout == "done\n"
    long = sbx.commands.run("sleep 60", background=True)
    assert long.pid in [p.pid for p in sbx.commands.list()]
    assert sbx.commands.kill(long.pid) is True
    with pytest.raises(CommandExitException):
        long.wait()
    assert long.pid not in [p.pid for p in sbx.commands.list()]
    assert sbx.commands.kill(999999) is False
    cat = sbx.commands.run("cat", background=True, stdin=True)
    sbx.commands.send_stdin(cat.pid, "from stdin\n")
    sbx.commands.close_stdin(cat.pid)
    assert cat.wait().stdout == "from stdin\n"


def test_many_streams_share_one_poll_and_are_capped(sbx):
    """16 process streams at once (the cap) are followed by one poll per sandbox: run_code stays
    quick meanwhile; a 17th is refused with the reason; output of megabytes arrives whole."""
    handles = [sbx.commands.run(f"echo start {i}; sleep 30", background=True) for i in range(16)]
    try:
        with pytest.raises(SandboxException, match="16 process streams"):
            sbx.commands.run("echo one too many", background=True)
        started = time.monotonic()
        assert sbx.run_code("6 * 7").text == "42"
        assert time.monotonic() - started < 3, "run_code waited behind the streams' polls"
    finally:
        for h in handles:
            h.kill()
    # a kill is a signal sent (as envd's): the last ones may still be listed until they are reaped
    deadline = time.monotonic() + 60
    while left := [p for p in sbx.commands.list() if p.pid in {h.pid for h in handles}]:
        assert time.monotonic() < deadline, f"killed commands still listed after 60 s: {left}"
        time.sleep(0.2)
    big = sbx.commands.run("head -c 3000000 /dev/zero | tr '\\0' 'x'; echo")
    assert len(big.stdout) == 3_000_001 and set(big.stdout[:-1]) == {"x"}
    printed = sbx.run_code("print('y' * 200_000)")
    assert "".join(printed.logs.stdout) == "y" * 200_000 + "\n"


def test_bodies_are_capped_before_they_are_read(server, sbx):
    """A declared body over the route's cap is refused from the headers alone (no byte sent)."""
    import socket
    import urllib.parse

    def status(path: str, length: int, headers: dict[str, str]) -> int:
        host, port = urllib.parse.urlsplit(server["url"]).netloc.split(":")
        with socket.create_connection((host, int(port)), timeout=10) as conn:
            lines = [f"POST {path} HTTP/1.1", f"Host: {host}", f"Content-Length: {length}"]
            lines += [f"{k}: {v}" for k, v in headers.items()]
            conn.sendall(("\r\n".join(lines) + "\r\n\r\n").encode())
            return int(conn.recv(4096).split()[1])

    route = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49983", "X-Access-Token": sbx._envd_access_token}
    assert status("/files?path=/home/user/huge", 300_000_000, route) == 413
    assert status("/process.Process/List", 50_000_000, {**route, "Content-Type": "application/json"}) == 413
    assert status("/v2/sandboxes", 50_000_000, {"X-API-Key": server["alice"]}) == 413


def test_files_and_one_workspace_for_files_commands_and_code(sbx):
    info = sbx.files.write("/home/user/notes/a.txt", "alpha")
    assert info.path == "/home/user/notes/a.txt"
    assert sbx.files.read("/home/user/notes/a.txt") == "alpha"
    assert sbx.files.read("notes/a.txt") == "alpha"  # relative to /home/user
    blob = bytes(range(256)) * 40
    sbx.files.write("/home/user/blob.bin", blob)
    assert bytes(sbx.files.read("/home/user/blob.bin", format="bytes")) == blob
    names = {e.name: e for e in sbx.files.list("/home/user")}
    assert names["notes"].type.value == "dir" and names["blob.bin"].size == len(blob)
    assert sbx.files.exists("/home/user/notes/a.txt") and not sbx.files.exists("/home/user/nope")
    # The same file from a command and from the interpreter, and theirs from files.
    assert sbx.commands.run("cat /home/user/notes/a.txt").stdout == "alpha"
    assert sbx.run_code("open('/home/user/notes/a.txt').read()").text == "alpha"
    sbx.commands.run("echo from-shell > /home/user/shell.txt")
    sbx.run_code("open('/home/user/code.txt', 'w').write('from-code')")
    assert sbx.files.read("/home/user/shell.txt") == "from-shell\n"
    assert sbx.files.read("/home/user/code.txt") == "from-code"
    sbx.files.rename("/home/user/code.txt", "/home/user/notes/moved.txt")
    assert sbx.files.read("/home/user/notes/moved.txt") == "from-code"
    sbx.files.remove("/home/user/notes")
    assert not sbx.files.exists("/home/user/notes/a.txt")
    with pytest.raises(NotFoundException):
        sbx.files.read("/home/user/notes/a.txt")


def test_file_paths_cannot_leave_the_workspace(sbx):
    for path in ("/etc/passwd", "/home/user/../../etc/passwd", "../etc/passwd"):
        with pytest.raises((InvalidArgumentException, SandboxException)):
            sbx.files.read(path)
    sbx.commands.run("ln -sf /etc/passwd /home/user/link")
    with pytest.raises(SandboxException):
        sbx.files.read("/home/user/link")  # a symlink out is refused inside the sandbox
    with pytest.raises(SandboxException):
        sbx.files.write("/home/user/link", "x")


def test_isolation_holds_from_inside(sbx):
    assert sbx.run_code("import os; os.getuid()").text != "0"
    net = sbx.run_code(
        "import socket\ns = socket.socket()\ns.settimeout(2)\ntry:\n    s.connect(('1.1.1.1', 80)); r = 'connected'\n"
        "except OSError as e:\n    r = type(e).__name__\nr"
    )
    assert net.text != "'connected'"
    r = sbx.commands.run("cat /proc/net/dev | tail -n +3 | cut -d: -f1")
    assert r.stdout.split() == ["lo"]  # no interface but loopback
    with pytest.raises(SandboxException):
        sbx.commands.run("id", user="root")


@pytest.mark.runsc
def test_isolation_holds_under_gvisor(server, tmp_path, runtime):
    """A server whose E2B sandboxes run on ``runtime`` (SANDLOOP_E2B_RUNTIME): the same checks
    from inside, and the kernel the code sees is the one that runtime gives it."""
    from sandloop import Sandloop, Settings

    root = Sandloop(Settings(e2b_runtime=runtime, pool_size=0))
    tokens = TokenStore(tmp_path / "tokens.sqlite")
    key, _ = tokens.create("g")
    try:
        with serve_in_thread(create_app(tokens, sandloop=root)) as url:
            opts = {"api_key": key, "api_url": url, "sandbox_url": url}
            s = Sandbox.create(**opts)
            try:
                assert s.run_code("import os; os.getuid()").text != "0"
                dmesg = s.commands.run("dmesg 2>/dev/null | head -1 || true").stdout
                assert ("gVisor" in dmesg) == (runtime == "runsc"), dmesg
                assert s.commands.run("cat /proc/net/dev | tail -n +3 | cut -d: -f1").stdout.split() == ["lo"]
                # The sandbox's interpreter container, seen from the host: its runtime and memory.
                import docker

                from sandloop.sessions.store import SESSION_LABEL

                client = docker.from_env()
                try:
                    kernels = client.containers.list(filters={"label": f"{SESSION_LABEL}={s.sandbox_id}"})
                finally:
                    client.close()
                if kernels:  # through Docker
                    host = kernels[0].attrs["HostConfig"]
                    runtime_used, memory = host["Runtime"], host["Memory"]
                else:  # gVisor's interpreters start under runsc directly (runtime/oci/kernels.py)
                    configs = [
                        json.loads(c.read_text())
                        for c in Path(OCI_BUNDLES).glob("*/config.json")
                        if s.sandbox_id in c.read_text()
                    ]
                    (config,) = [c for c in configs if c["annotations"].get(SESSION_LABEL) == s.sandbox_id]
                    runtime_used = config["annotations"]["sandloop.oci.runtime"]
                    memory = config["linux"]["resources"]["memory"]["limit"]
                assert runtime_used.startswith(runtime) and memory == 256 * 2**20
                if runtime == "runc":  # and from inside, where the cgroup files are visible
                    limit = s.commands.run(
                        "cat /sys/fs/cgroup/memory/memory.limit_in_bytes 2>/dev/null || cat /sys/fs/cgroup/memory.max"
                    ).stdout.strip()
                    assert int(limit) == 256 * 2**20, limit
            finally:
                s.kill()
    finally:
        root.close()


def test_a_key_never_reaches_another_keys_sandbox(server, sbx):
    bob = {"api_key": server["bob"]}
    with pytest.raises(NotFoundException):
        PlainSandbox.get_info(sbx.sandbox_id, **bob)
    with pytest.raises(NotFoundException):
        PlainSandbox.connect(sbx.sandbox_id, **bob)
    assert PlainSandbox.kill(sbx.sandbox_id, **bob) is False
    assert sbx.sandbox_id not in [i.sandbox_id for i in PlainSandbox.list(**bob).next_items()]
    assert sbx.run_code("1 + 1").text == "2"  # untouched


def test_malformed_keys_and_missing_access_tokens_are_refused(server, sbx):
    url = server["url"]
    for key in ("sl_abc", "e2b_nothex!", "e2b_" + "0" * 40):
        r = httpx.post(f"{url}/v2/sandboxes", json={"templateID": "base"}, headers={"X-API-Key": key})
        assert r.status_code == 401, key
        assert isinstance(r.json()["message"], str)
    with pytest.raises(AuthenticationException):
        PlainSandbox.create(api_key="e2b_" + "0" * 40)
    route = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49999"}
    r = httpx.post(f"{url}/execute", json={"code": "1"}, headers=route)
    assert r.status_code == 401 and "access token" in r.json()["message"]
    r = httpx.post(f"{url}/execute", json={"code": "1"}, headers={**route, "X-Access-Token": "0" * 64})
    assert r.status_code == 401
    envd = {"E2b-Sandbox-Id": sbx.sandbox_id, "E2b-Sandbox-Port": "49983"}
    r = httpx.get(f"{url}/files", params={"path": "/home/user/x"}, headers=envd)
    assert r.status_code == 401
    # The control plane is the control plane even with the routing headers (old SDKs send them).
    r = httpx.get(f"{url}/sandboxes/{sbx.sandbox_id}", headers={**envd, "X-API-Key": server["alice"]})
    assert r.status_code == 200 and r.json()["sandboxID"] == sbx.sandbox_id


def test_unsupported_options_say_so(server):
    with pytest.raises(SandboxException, match="no network"):
        PlainSandbox.create(allow_internet_access=True)
    with pytest.raises(SandboxException, match="template"):
        PlainSandbox.create(template="my-custom-template")


def test_async_sdk(server):
    async def main():
        s = await AsyncSandbox.create()
        try:
            await s.run_code("y = 6")
            ex = await s.run_code("print('async'); y * 7")
            r = await s.commands.run("echo $((6*7))")
            await s.files.write("/home/user/async.txt", "async file")
            text = await s.files.read("/home/user/async.txt")
            plain = await PlainAsyncSandbox.connect(s.sandbox_id)
            listed = await plain.files.list("/home/user")
            return ex, r, text, [e.name for e in listed]
        finally:
            await s.kill()

    ex, r, text, names = asyncio.run(main())
    assert ex.text == "42" and ex.logs.stdout == ["async\n"]
    assert r.stdout == "42\n" and text == "async file" and "async.txt" in names


OLD_SDK_SCRIPT = r"""
import json, e2b, e2b_code_interpreter
from e2b_code_interpreter import Sandbox
from e2b import CommandExitException
s = Sandbox.create()
out = {"versions": [e2b.__version__ if hasattr(e2b, "__version__") else "", ""]}
try:
    s.run_code("z = 5")
    ex = s.run_code("print('old'); z * 2")
    out["code"] = [ex.text, ex.logs.stdout]
    out["error"] = s.run_code("undefined_name").error.name
    out["cmd"] = s.commands.run("echo cmd; pwd").stdout
    try:
        s.commands.run("exit 4")
    except CommandExitException as e:
        out["exit"] = e.exit_code
    ctx = s.create_code_context(language="js")
    out["js"] = s.run_code("const a = 20; a + 22", context=ctx).text
    out["df"] = s.run_code("import pandas as pd; pd.DataFrame({'a': [1]})").results[0].data
    s.files.write("/home/user/old.txt", "old sdk")
    out["file"] = s.files.read("/home/user/old.txt")
    out["seen"] = s.commands.run("cat /home/user/old.txt").stdout
    out["list"] = [e.name for e in s.files.list("/home/user")]
    out["info"] = s.get_info().sandbox_id == s.sandbox_id
    h = s.files.watch_dir("/home/user")
    s.files.write("/home/user/w.txt", "w")
    out["watch"] = [[e.name, e.type.name] for e in h.get_new_events()]
    h.stop()
    import urllib.request
    out["signed"] = urllib.request.urlopen(s.download_url("/home/user/old.txt")).read().decode()
finally:
    s.kill()
print(json.dumps(out))
"""


def test_oldest_supported_sdk(server):
    python = OLD_VENV / "bin" / "python"
    if not python.exists():
        pytest.fail(f"{OLD_VENV} is missing: scripts/setup.sh makes it (e2b==2.26.0, e2b-code-interpreter==2.9.0)")
    versions = subprocess.run(
        [
            str(python),
            "-c",
            "import importlib.metadata as m; print(m.version('e2b'), m.version('e2b-code-interpreter'))",
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    assert versions == ["2.26.0", "2.9.0"]
    env = {**os.environ, "E2B_API_URL": server["url"], "E2B_SANDBOX_URL": server["url"], "E2B_API_KEY": server["alice"]}
    done = subprocess.run([str(python), "-c", OLD_SDK_SCRIPT], capture_output=True, text=True, env=env, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["code"] == ["10", ["old\n"]] and out["error"] == "NameError"
    assert out["cmd"] == "cmd\n/home/user\n" and out["exit"] == 4
    assert out["file"] == "old sdk" and out["seen"] == "old sdk" and "old.txt" in out["list"] and out["info"]
    assert out["js"] == "42" and out["df"] == {"a": [1]}
    assert ["w.txt", "CREATE"] in out["watch"] and ["w.txt", "WRITE"] in out["watch"]
    assert out["signed"] == "old sdk"


def test_run_code_rich_results_in_display_order(sbx):
    """Issue 22: each output a Result with E2B's fields, streamed in order with the logs."""
    seen = []
    ex = sbx.run_code(
        "import pandas as pd\nfrom IPython.display import display, HTML\nprint('one')\n"
        "display(HTML('<p>shown</p>'))\nprint('two')\npd.DataFrame({'x': [1, 2], 'y': ['a', 'b']})",
        on_stdout=lambda m: seen.append(("stdout", m.line)),
        on_result=lambda r: seen.append(("result", r.html[:10] if r.html else r.text)),
    )
    shown, frame = ex.results
    assert (shown.html, shown.is_main_result) == ("<p>shown</p>", False)
    assert frame.is_main_result and frame.data == {"x": [1, 2], "y": ["a", "b"]} and "<table" in frame.html
    assert [kind for kind, _ in seen] == ["stdout", "result", "stdout", "result"]
    assert ex.execution_count is not None and ex.execution_count >= 1
    chart = sbx.run_code("import matplotlib.pyplot as plt\nplt.bar(['a', 'b'], [1, 3])\nplt.title('t');")
    (fig,) = chart.results
    assert fig.chart is not None and fig.chart.title == "t" and fig.png


def test_code_contexts_and_languages(sbx):
    ctx = sbx.create_code_context(language="python")
    sbx.run_code("mine = 1", context=ctx)
    assert sbx.run_code("mine", context=ctx).text == "1"
    assert sbx.run_code("mine").error.name == "NameError"  # the default context is another interpreter
    assert ctx.id in [c.id for c in sbx.list_code_contexts()]
    sbx.restart_code_context(ctx)
    assert sbx.run_code("mine", context=ctx).error.name == "NameError"
    sbx.remove_code_context(ctx)
    assert ctx.id not in [c.id for c in sbx.list_code_contexts()]
    assert {"python", "javascript"} <= {c.language for c in sbx.list_code_contexts()}
    assert sbx.run_code("await Promise.resolve('js')", language="js").text == "js"
    assert sbx.run_code("const s: string = 'ts'; s", language="ts").text == "ts"
    bash = sbx.run_code("cd /tmp; echo $FOO; pwd", language="bash", envs={"FOO": "bar"})
    assert "".join(bash.logs.stdout) == "bar\n/tmp\n"  # (in one chunk or two, as the pipe cut it)
    assert sbx.run_code("pwd", language="bash").logs.stdout == ["/tmp\n"]  # the shell kept its cwd
    assert sbx.run_code("from pathlib import Path; print(Path.cwd())").logs.stdout == ["/home/user\n"]
    assert sbx.run_code("!pwd").logs.stdout == ["/home/user\n"]


def test_run_code_on_a_sandbox_killed_under_it_says_killed(server):
    """As E2B's: the execution's connection breaks and the SDK, finding the sandbox gone, raises
    "the sandbox was killed while the request was in progress" (before: an error result)."""
    import threading

    s = Sandbox.create(timeout=120)
    killers: list[threading.Thread] = []

    def kill_once_running(_line: object) -> None:  # the cell has started: now kill its sandbox
        if not killers:
            killers.append(threading.Thread(target=s.kill))
            killers[0].start()

    try:
        with pytest.raises(TimeoutException, match="killed while the request was in progress"):
            s.run_code("import time\nprint('running', flush=True)\ntime.sleep(300)", on_stdout=kill_once_running)
    finally:
        for k in killers:
            k.join()
    assert killers and not s.is_running()


def test_code_contexts_async(server):
    async def main():
        s = await AsyncSandbox.create(timeout=120)
        try:
            ctx = await s.create_code_context(language="javascript")
            first = await s.run_code("let n = 41", context=ctx)
            second = await s.run_code("n + 1", context=ctx)
            contexts = await s.list_code_contexts()
            return first.error, second.text, ctx.id in [c.id for c in contexts]
        finally:
            await s.kill()

    assert asyncio.run(main()) == (None, "42", True)


def test_a_sandbox_whose_record_is_damaged_still_dies_whole(server):
    from sandloop.root import default_root

    s = PlainSandbox.create(timeout=120)
    assert s.commands.run("echo up").stdout == "up\n"
    path = default_root().sessions.root / s.sandbox_id / "session.json"
    path.write_text(path.read_text() + "}")  # what two interleaved saves once left
    s.kill()
    assert not path.parent.exists()
    with pytest.raises(NotFoundException):
        PlainSandbox.get_info(s.sandbox_id)


def test_nothing_left_after_kill(server, sbx):
    sbx.kill()
    assert not PlainSandbox.list().next_items()
    assert sbx.sandbox_id not in {r.id for r in _root_sessions()}
    assert our_containers() == []


def _root_sessions():
    from sandloop.root import default_root

    return default_root().list_sessions()


if __name__ == "__main__":  # pragma: no cover
    sys.exit(pytest.main([__file__, "-q"]))

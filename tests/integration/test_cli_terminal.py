"""The CLI as a person at a terminal and a script in a pipeline see it: output streams as the program
writes it (in a pseudo-terminal), tables and help fit 80 columns without cutting a value, piped
listings are plain lines, errors name the flag that was typed, a cut output is never silent."""

from __future__ import annotations

import contextlib
import os
import pty
import select
import subprocess
import sys
import time

import pytest

from tests.integration.test_cli import sandloop


class Terminal:
    """``sandloop ARGS`` with stdin, stdout and stderr on a pseudo-terminal of ``columns``."""

    def __init__(self, *args: str, columns: int = 80, env: dict[str, str] | None = None) -> None:
        self.master, slave = pty.openpty()
        os.set_blocking(self.master, False)
        import fcntl
        import struct
        import termios

        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", 40, columns, 0, 0))
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "sandloop", *args],
            stdin=slave,
            stdout=slave,
            stderr=slave,
            env={**os.environ, "COLUMNS": str(columns), **(env or {})},
            close_fds=True,
        )
        os.close(slave)
        self.seen = b""

    def read_until(self, needle: bytes, timeout: float = 120) -> bytes:
        deadline = time.monotonic() + timeout
        while needle not in self.seen:
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"{needle!r} did not appear; seen: {self.seen[-2000:]!r}")
            ready, _, _ = select.select([self.master], [], [], min(left, 1))
            if ready:
                try:
                    self.seen += os.read(self.master, 65536)
                except OSError:  # EIO: the other side closed
                    if self.proc.poll() is not None:
                        raise AssertionError(f"{needle!r} never came; seen: {self.seen[-2000:]!r}") from None
        return self.seen

    def write(self, data: bytes) -> None:
        os.write(self.master, data)

    def finish(self, timeout: float = 120) -> int:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            ready, _, _ = select.select([self.master], [], [], 0.2)
            if ready:
                with contextlib.suppress(OSError):
                    self.seen += os.read(self.master, 65536)
        code = self.proc.wait(1)
        for _ in range(100):  # what was written before exit
            try:
                chunk = os.read(self.master, 65536)
            except OSError:
                break
            if not chunk:
                break
            self.seen += chunk
        os.close(self.master)
        return code

    @property
    def text(self) -> str:
        """What the screen shows (colours left out)."""
        import re

        return re.sub(r"\x1b\[[0-9;]*m", "", self.seen.decode(errors="replace").replace("\r\n", "\n"))


# The program waits long after its first line: seeing that line while the CLI still runs proves it
# was streamed (nothing here is timed: the wait only has to outlast the line's way to the screen).
SLOW = "import time\nprint('first', flush=True)\ntime.sleep(8)\nprint('second')"


def test_run_streams_its_output_to_a_terminal():
    term = Terminal("run", "-c", SLOW)
    term.read_until(b"first")
    assert term.proc.poll() is None and b"second" not in term.seen  # before: all of it arrived at exit
    assert term.finish() == 0
    assert term.text.index("first") < term.text.index("second")


def test_session_cells_and_runs_stream_too():
    r = sandloop("session", "create", "--ttl", "300", "--quota", "16m")
    sid = r.stdout.decode().strip()
    assert r.returncode == 0, r.stderr
    try:
        for args in (("session", "cell", sid, "-c", SLOW), ("session", "run", sid, "-c", SLOW)):
            term = Terminal(*args)
            term.read_until(b"first")
            assert term.proc.poll() is None and b"second" not in term.seen, args
            assert term.finish() == 0, term.text
    finally:
        assert sandloop("session", "rm", sid).returncode == 0


def test_a_terminal_on_stdin_is_told_the_program_is_read_from_it():
    term = Terminal("run")
    term.read_until(b"reading the program from stdin")  # before: a silent wait like a hang
    term.write(b"print(6 * 7)\n")
    term.write(b"\x04")  # Ctrl-D ends the program
    assert term.finish() == 0
    assert "42" in term.text


def test_a_cut_output_is_never_silent_in_a_pipeline():
    r = sandloop("run", "-c", "print('x' * 100_000, end='')")
    assert len(r.stdout) == 65536 and r.returncode == 123, r.returncode  # before: exit 0
    assert b"--output-limit" in r.stderr and b"truncated" in r.stderr
    r = sandloop("run", "--output-limit", "1m", "-c", "print('x' * 100_000, end='')")
    assert (r.returncode, len(r.stdout)) == (0, 100_000), r.stderr
    r = sandloop("run", "--output-limit", "lots", "-c", "print(1)")
    assert r.returncode == 2 and b"--output-limit: invalid size 'lots'" in r.stderr


def test_a_cut_line_and_the_note_do_not_share_a_line_on_a_terminal():
    term = Terminal("run", "-c", "print('x' * 70_000, end='')")
    assert term.finish() == 123
    assert "\nsandloop: stdout truncated" in term.text  # before: xxxx…xsandloop: stdout truncated


@pytest.mark.parametrize(
    "args, said",
    [
        (("--memory", "lots"), "--memory: invalid size 'lots'"),
        (("--runtime", "kata"), "--runtime: must be 'runc' or 'runsc', got 'kata'"),
        (("--cpus", "0"), "--cpus: must be between 0.01 and 256"),
        (("--timeout", "0"), "--timeout: must be more than 0"),
        (("--allow", "http://pypi.org"), "--allow: rule 'http://pypi.org' is a URL or a path: give a host name"),
    ],
)
def test_errors_name_the_flag_that_was_typed(args, said):
    r = sandloop("run", *args, "-c", "print(1)")
    text = r.stderr.decode()
    assert r.returncode == 2 and said in text, text
    for leak in ("SandboxLimits", "Value error", "Input should", "timeout_seconds", "port must be"):
        assert leak not in text, text


def test_a_missing_file_or_session_says_so_and_exits_1_or_2():
    r = sandloop("run", "nosuch.py")
    assert r.returncode == 2 and r.stderr.decode().strip() == "sandloop: no such file: nosuch.py"
    r = sandloop("session", "cell", "s-nosuch", "-c", "1")
    assert r.returncode == 1 and b"no session s-nosuch" in r.stderr  # before: 125, "the sandbox failed"


def test_tokens_ls_fits_80_columns_and_pipes_as_plain_lines(tmp_path):
    env = {"SANDLOOP_HOME": str(tmp_path)}
    name = "newcomer-with-a-long-name"
    made = subprocess.run(
        [sys.executable, "-m", "sandloop", "tokens", "create", name, "--max-memory", "128m"],
        capture_output=True,
        env={**os.environ, **env},
    )
    assert made.returncode == 0, made.stderr
    piped = subprocess.run(
        [sys.executable, "-m", "sandloop", "tokens", "ls"], capture_output=True, env={**os.environ, **env}, text=True
    )
    header, row = piped.stdout.splitlines()
    assert header.split("\t")[:3] == ["id", "name", "state"]
    fields = row.split("\t")
    assert fields[1] == name and fields[5] == "128m" and "…" not in piped.stdout  # before: "new…", "12…"
    term = Terminal("tokens", "ls", columns=80, env=env)
    assert term.finish() == 0
    text = term.text
    assert "…" not in text and "128m" in text and fields[0] in text
    assert all(len(line) <= 80 for line in text.splitlines()), text
    lines = text.splitlines()
    start, end = lines[0].index("name"), lines[0].index("state")
    assert "".join(line[start:end].strip() for line in lines[1:]) == name  # whole, folded if need be


def test_help_keeps_every_option_name_whole_at_80_columns():
    term = Terminal("serve", "--help", columns=80)
    assert term.finish() == 0
    for name in ("--official-providers", "--no-official-providers", "--provider-url", "--metrics"):
        assert name in term.text, term.text
    assert "…" not in term.text


def test_session_tracebacks_show_their_source_and_cp_keeps_a_trees_name(tmp_path):
    r = sandloop("session", "create", "--ttl", "300", "--quota", "16m")
    sid = r.stdout.decode().strip()
    assert r.returncode == 0, r.stderr
    try:
        r = sandloop("session", "cell", sid, "-c", "def f(x):\n    return 1 / x\nf(0)")
        text = r.stderr.decode()
        assert r.returncode == 1 and "ZeroDivisionError" in text, text
        # IPython's traceback, with each frame's source (before: file and line numbers only)
        assert "----> 2     return 1 / x" in text and "----> 3 f(0)" in text, text
        tree = tmp_path / "data"
        (tree / "sub").mkdir(parents=True)
        (tree / "sub" / "a.txt").write_text("a")
        assert sandloop("session", "cp", str(tree), f"{sid}:").returncode == 0  # into the workspace
        assert sandloop("session", "cp", str(tree), f"{sid}:inbox/").returncode == 0  # into a directory
        assert sandloop("session", "cp", str(tree), f"{sid}:renamed").returncode == 0  # a new name
        r = sandloop(
            "session", "run", sid, "-l", "bash", "-c", "find data inbox renamed -type f | sort"
        )  # as cp -r: a tree keeps its name in a directory, as a download keeps it
        assert r.stdout.decode().split() == ["data/sub/a.txt", "inbox/data/sub/a.txt", "renamed/sub/a.txt"], r
        out = tmp_path / "back"
        out.mkdir()
        assert sandloop("session", "cp", f"{sid}:data", str(out)).returncode == 0
        assert (out / "data" / "sub" / "a.txt").read_text() == "a"
    finally:
        assert sandloop("session", "rm", sid).returncode == 0


def test_session_shell_is_an_interactive_terminal_inside_that_follows_a_resize():
    r = sandloop("session", "create", "--ttl", "300", "--quota", "16m")
    sid = r.stdout.decode().strip()
    assert r.returncode == 0, r.stderr
    try:
        term = Terminal("session", "shell", sid, columns=90)
        term.read_until(b"$ ")  # bash's prompt, from inside
        term.write(b"echo in-$(pwd)-$(id -u)-$(tput cols)\r")
        term.read_until(b"in-/workspace-65534-90")  # the workspace, the sandbox's user, this size
        import fcntl
        import signal
        import struct
        import termios

        fcntl.ioctl(term.master, termios.TIOCSWINSZ, struct.pack("HHHH", 40, 120, 0, 0))
        term.proc.send_signal(signal.SIGWINCH)  # as the terminal emulator does on a resize
        term.write(b"sleep 0.5; echo now-$(tput cols)\r")
        term.read_until(b"now-120")
        term.write(b"exit 7\r")
        assert term.finish() == 7, term.text  # the shell's own exit code
    finally:
        sandloop("session", "rm", sid)


def test_session_shell_of_a_session_that_is_not_there_says_so():
    r = sandloop("session", "shell", "s-nosuchsession")
    assert r.returncode != 0 and b"s-nosuchsession" in r.stderr, r.stderr
    assert b"Traceback" not in r.stderr


SERVE_INDEX = """
import socket, subprocess, time
open('index.html', 'w').write('hi from inside')
server = subprocess.Popen(['python3', '-m', 'http.server', '8000'], stderr=subprocess.DEVNULL)
while socket.socket().connect_ex(('127.0.0.1', 8000)):
    time.sleep(0.05)
"""


@contextlib.contextmanager
def _exposed(sid: str, port: str):
    """``sandloop session expose SID PORT`` running: (its process, the URL it printed)."""
    argv = [sys.executable, "-m", "sandloop", "session", "expose", sid, port]
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        ready, _, _ = select.select([proc.stdout], [], [], 120)
        assert ready, "expose printed no URL"
        yield proc, proc.stdout.readline().decode().strip()  # the URL alone on stdout, for scripts
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_session_expose_serves_a_port_inside_here_until_interrupted():
    import signal

    import httpx

    sid = sandloop("session", "create", "--ttl", "300", "--quota", "16m").stdout.decode().strip()
    try:
        assert sandloop("session", "cell", sid, "-c", SERVE_INDEX).returncode == 0
        with _exposed(sid, "8000") as (proc, url):
            assert url.startswith("http://127.0.0.1:"), url
            assert httpx.get(f"{url}/index.html", timeout=60).text == "hi from inside"
            proc.send_signal(signal.SIGINT)
            assert proc.wait(60) == 0, proc.stderr.read()
            with pytest.raises(httpx.ConnectError):  # stopped: nothing listens here any more
                httpx.get(url, timeout=10)
        bad = sandloop("session", "expose", sid, "70000")
        assert bad.returncode == 2 and b"PORT must be 1-65535" in bad.stderr, bad.stderr
        with _exposed(sid, "8000") as (proc, url):  # the session deleted under it: each connection says so
            assert sandloop("session", "rm", sid).returncode == 0
            answer = httpx.get(url, timeout=60)
            assert answer.status_code == 502 and f"no session {sid}" in answer.text, answer.text
            proc.send_signal(signal.SIGINT)
            assert proc.wait(60) == 0 and b"Traceback" not in proc.stderr.read()
    finally:
        sandloop("session", "rm", sid)
    gone = sandloop("session", "expose", sid, "8000")
    assert gone.returncode != 0 and f"no session {sid}".encode() in gone.stderr and b"Traceback" not in gone.stderr

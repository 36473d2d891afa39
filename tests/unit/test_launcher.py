"""The in-sandbox launcher is plain Python: run it here to check its protocol byte for byte."""

import json
import subprocess
import sys

from sandloop.images import RECIPE_DIR

LAUNCHER = RECIPE_DIR / "launcher.py"


def _launch(tmp_path, code: bytes, stdin: bytes, argv=None):
    path = tmp_path / "stage" / "main.py"
    header = {"argv": argv or [sys.executable], "file": str(path), "code": len(code), "cwd": str(tmp_path)}
    return subprocess.run(
        [sys.executable, "-I", "-S", str(LAUNCHER)],
        input=json.dumps(header).encode() + b"\n" + code + stdin,
        capture_output=True,
        timeout=30,
    )


def test_stdin_after_the_code_reaches_the_program_untouched(tmp_path):
    code = b"import sys\ndata = sys.stdin.buffer.read()\nprint(len(data), data[:5])\n"
    stdin = b"hello" + bytes(range(256)) * 1000
    proc = _launch(tmp_path, code, stdin)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.decode().strip() == f"{len(stdin)} b'hello'"


def test_exit_code_and_streams_are_the_programs(tmp_path):
    proc = _launch(tmp_path, b"import sys; print('o'); print('e', file=sys.stderr); sys.exit(9)", b"")
    assert (proc.returncode, proc.stdout, proc.stderr) == (9, b"o\n", b"e\n")


def test_truncated_program_is_a_clear_launcher_failure(tmp_path):
    header = {"argv": [sys.executable], "file": str(tmp_path / "m.py"), "code": 100, "cwd": str(tmp_path)}
    proc = subprocess.run(
        [sys.executable, "-I", "-S", str(LAUNCHER)],
        input=json.dumps(header).encode() + b"\nprint(1)",
        capture_output=True,
    )
    assert proc.returncode == 125
    assert b"sandloop: stdin closed before the whole program arrived" in proc.stderr


def test_unstartable_interpreter_is_reported(tmp_path):
    proc = _launch(tmp_path, b"x", b"", argv=["/nonexistent/interpreter"])
    assert proc.returncode == 125 and b"cannot start /nonexistent/interpreter" in proc.stderr

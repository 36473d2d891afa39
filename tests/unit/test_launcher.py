"""The in-sandbox launcher is plain Python: run it here to check its protocol byte for byte."""

import json
import subprocess
import sys

import pytest

from sandloop.images import RECIPE_DIR

LAUNCHER = RECIPE_DIR / "launcher.py"


def _frame(header: dict) -> bytes:
    raw = json.dumps(header).encode()
    return b"SANDLOOP1 %08d\n" % len(raw) + raw


def _launch(tmp_path, code: bytes, stdin: bytes, argv=None, inproc=False):
    path = tmp_path / "stage" / "main.py"
    header = {"argv": argv or [sys.executable], "file": str(path), "code": len(code), "cwd": str(tmp_path)}
    header["inproc"] = inproc
    return subprocess.run(
        [sys.executable, str(LAUNCHER)],
        input=_frame(header) + code + stdin,
        capture_output=True,
        timeout=30,
    )


@pytest.mark.parametrize("inproc", [False, True])
def test_stdin_after_the_code_reaches_the_program_untouched(tmp_path, inproc):
    code = b"import sys\ndata = sys.stdin.buffer.read()\nprint(len(data), data[:5])\n"
    stdin = b"hello" + bytes(range(256)) * 1000
    proc = _launch(tmp_path, code, stdin, inproc=inproc)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.decode().strip() == f"{len(stdin)} b'hello'"


@pytest.mark.parametrize("inproc", [False, True])
def test_exit_code_and_streams_are_the_programs(tmp_path, inproc):
    proc = _launch(tmp_path, b"import sys; print('o'); print('e', file=sys.stderr); sys.exit(9)", b"", inproc=inproc)
    assert (proc.returncode, proc.stdout, proc.stderr) == (9, b"o\n", b"e\n")


@pytest.mark.parametrize(
    "code",
    [
        b"def f():\n    raise ValueError('boom')\nf()\n",
        b"def f(:\n",
        b"import sys\nsys.exit('bye')\n",
        b"raise SystemExit(3)\n",
        b"import sys\nprint(__name__, __file__ == sys.argv[0], sys.argv[0].endswith('main.py'))\n",
        b"import threading, atexit\natexit.register(print, 'bye')\nthreading.Thread(target=print).start()\n",
        b"x = 1\x00\n",
        b"import pickle\nclass A: pass\nprint(type(pickle.loads(pickle.dumps(A()))).__module__)\n",
    ],
)
def test_inproc_python_behaves_like_python_running_the_file(tmp_path, code):
    """Same stdout, stderr and exit code as `python3 main.py`, tracebacks included."""
    inproc = _launch(tmp_path, code, b"", inproc=True)
    direct = _launch(tmp_path, code, b"", inproc=False)
    assert (inproc.returncode, inproc.stdout, inproc.stderr) == (direct.returncode, direct.stdout, direct.stderr)


def test_truncated_program_is_a_clear_launcher_failure(tmp_path):
    header = {"argv": [sys.executable], "file": str(tmp_path / "m.py"), "code": 100, "cwd": str(tmp_path)}
    proc = subprocess.run([sys.executable, str(LAUNCHER)], input=_frame(header) + b"print(1)", capture_output=True)
    assert proc.returncode == 125
    assert b"sandloop: stdin closed before the whole program arrived" in proc.stderr


def test_unstartable_interpreter_is_reported(tmp_path):
    proc = _launch(tmp_path, b"x", b"", argv=["/nonexistent/interpreter"])
    assert proc.returncode == 125 and b"cannot start /nonexistent/interpreter" in proc.stderr


@pytest.mark.parametrize(
    "header",
    [
        {"argv": ["python3"], "file": "/tmp/a b/ü.py", "code": 3, "cwd": "/tmp", "inproc": True, "nonce": "n"},
        {"env": {"TOKEN": 'q"\\\n\u2603\U0001f600', "EMPTY": ""}, "ca": None, "size": 1.5e3, "n": -3, "x": [[], {}]},
    ],
)
def test_the_header_parses_as_json_loads_parses_it(header):
    """The launcher reads its header with CPython's own C scanner (no ``json`` import): the same
    values as ``json.loads``, for ASCII-escaped and raw UTF-8 text alike."""
    sys.path.insert(0, str(RECIPE_DIR))
    try:
        import launcher
    finally:
        sys.path.remove(str(RECIPE_DIR))
    for text in (json.dumps(header), json.dumps(header, ensure_ascii=False)):
        assert launcher.parse_json(text) == json.loads(text) == header


@pytest.mark.parametrize("header", [b"not json", b'{"a": 1} trailing', b'{"a": NaN}', b'{"a": '])
def test_a_malformed_header_is_a_clear_launcher_failure(header):
    proc = subprocess.run(
        [sys.executable, str(LAUNCHER)], input=b"SANDLOOP1 %08d\n" % len(header) + header, capture_output=True
    )
    assert proc.returncode == 125 and b"sandloop: bad run header" in proc.stderr, proc.stderr


def test_the_launcher_imports_nothing_a_program_did_not_ask_for(tmp_path):
    """Every cold run starts a launcher: json (with re, enum ...), subprocess and threading were
    ~8 ms of CPU of each start, measured in the sandbox. A program gets a clean interpreter."""
    code = (
        b"import sys\nprint(sorted(m for m in ('json', 're', 'subprocess', 'threading', 'enum') if m in sys.modules))\n"
    )
    header = {"argv": [sys.executable], "file": str(tmp_path / "m.py"), "code": len(code), "cwd": str(tmp_path)}
    header["inproc"] = True
    proc = subprocess.run([sys.executable, "-S", str(LAUNCHER)], input=_frame(header) + code, capture_output=True)
    assert (proc.returncode, proc.stdout) == (0, b"[]\n"), proc.stderr

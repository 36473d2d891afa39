"""A stateful Python interpreter for sessions (``launcher.py --kernel``), like a notebook kernel.

Reads cells from stdin with the launcher's framing (preamble + JSON header ``{"code": N, "nonce":
...}`` + N bytes), runs each in one persistent ``__main__`` namespace, and ends each cell with the
launcher's end-of-run line on stdout and stderr. The stdout line carries a base64 JSON payload:
``{"value": repr of a last expression or null, "value_omitted": characters cut from that repr,
"artifacts": [{"name", "mime", "data"}]}``; open
matplotlib figures become PNG artifacts and are closed. SIGINT (the host's timeout) interrupts the
cell with KeyboardInterrupt and keeps the state. The cell cannot read stdin (it carries cells).
"""

import ast
import base64
import io
import json
import linecache
import os
import signal
import sys
import traceback
import types

import launcher

MAX_VALUE_CHARS = 20000


def _figures():
    plt = sys.modules.get("matplotlib.pyplot")
    if plt is None:
        return []
    out = []
    for num in plt.get_fignums():
        buf = io.BytesIO()
        try:
            plt.figure(num).savefig(buf, format="png", dpi=100)
        except Exception as exc:  # a broken figure must not take the kernel down
            sys.stderr.write("sandloop: could not render figure %s: %s\n" % (num, exc))
            continue
        data = base64.b64encode(buf.getvalue()).decode()
        out.append({"name": "figure-%d.png" % num, "mime": "image/png", "data": data})
    plt.close("all")
    return out


def _error(exc, tb):
    """The exception as a notebook reports it: name, message, formatted traceback."""
    try:
        text = "".join(traceback.format_exception(type(exc), exc, tb))
    except Exception:
        text = "%s: %s\n" % (type(exc).__name__, exc)
    return {"name": type(exc).__name__, "value": str(exc), "traceback": text[-MAX_VALUE_CHARS:]}


def _report(exc, tb):
    """Print the traceback to stderr with its source lines. The default excepthook (C) reads them
    from files, so a cell's lines (only in linecache) were left out; traceback's reads linecache."""
    if sys.excepthook is not sys.__excepthook__:  # the cell installed its own: respect it
        sys.excepthook(type(exc), exc, tb)
        return
    try:
        traceback.print_exception(type(exc), exc, tb, file=sys.stderr)
    except Exception:
        sys.__excepthook__(type(exc), exc, tb)


def run_cell(code, namespace):
    """Returns (status, value repr or None, characters of the repr omitted, error or None)."""
    filename = "<cell>"
    linecache.cache[filename] = (len(code), None, code.splitlines(True), filename)  # tracebacks show source
    try:
        tree = ast.parse(code, filename)
    except SyntaxError as exc:
        _report(exc.with_traceback(None), None)
        return 1, None, 0, _error(exc, None)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
    try:
        exec(compile(tree, filename, "exec"), namespace)
        value = eval(compile(last, filename, "eval"), namespace) if last is not None else None
    except SystemExit as exc:
        return launcher.exit_status(exc.code), None, 0, None
    except BaseException as exc:
        tb = exc.__traceback__.tb_next if exc.__traceback__ else None
        _report(exc.with_traceback(tb), tb)
        return (130 if isinstance(exc, KeyboardInterrupt) else 1), None, 0, _error(exc, tb)
    if value is None:
        return 0, None, 0, None
    namespace["_"] = value
    text = repr(value)
    omitted = max(0, len(text) - MAX_VALUE_CHARS)
    if omitted:
        text = text[:MAX_VALUE_CHARS] + "... [%d characters omitted]" % omitted
    return 0, text, omitted, None


def serve():
    # The host interrupts a cell with SIGINT. A process started with SIGINT ignored (a background
    # job's child, as the test double's interpreters can be) would never see it: take it back.
    signal.signal(signal.SIGINT, signal.default_int_handler)
    main = types.ModuleType("__main__")
    main.__dict__["__builtins__"] = __builtins__
    sys.modules["__main__"] = main
    sys.argv = [""]
    sys.path[0] = os.getcwd()
    sys.stdin = io.StringIO("")  # fd 0 carries the cells
    while True:
        try:
            pre = os.read(0, launcher.PREAMBLE_LEN)
        except KeyboardInterrupt:
            continue  # an interrupt that arrived between cells
        if not pre:
            return  # the host closed stdin: the session's interpreter ends
        while len(pre) < launcher.PREAMBLE_LEN:
            more = os.read(0, launcher.PREAMBLE_LEN - len(pre))
            if not more:
                return
            pre += more
        header = json.loads(launcher.read_exact(int(pre[len(launcher.PREAMBLE) : -1]), "cell header").decode())
        code = launcher.read_exact(int(header["code"]), "cell").decode("utf-8", "replace")
        nonce = str(header.get("nonce") or "")
        armed = header.get("env") or {}
        os.environ.update(armed)  # secrets' placeholders (never their values), for this cell only
        if header.get("ca"):
            launcher.trust(header["ca"])
        try:
            status, value, omitted, error = run_cell(code, main.__dict__)
            artifacts = _figures()
        except KeyboardInterrupt:
            status, value, omitted, artifacts = 130, None, 0, []
            error = {"name": "KeyboardInterrupt", "value": "", "traceback": "KeyboardInterrupt\n"}
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        for name, placeholder in armed.items():  # the proxy forgets them too: a later cell gets none
            if os.environ.get(name) == placeholder:
                del os.environ[name]
        reply = {"value": value, "value_omitted": omitted, "artifacts": artifacts, "error": error}
        payload = base64.b64encode(json.dumps(reply).encode())
        line = b"\0\x1esandloop-exit:%s:%d" % (nonce.encode(), status)
        for fd, data in ((1, line + b":" + payload + b"\n"), (2, line + b"\n")):
            try:
                os.write(fd, data) if len(data) < 65536 else _write_all(fd, data)
            except OSError:
                pass


def _write_all(fd, data):
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


if __name__ == "__main__":
    try:
        serve()
    except Exception:
        traceback.print_exc()
        sys.exit(125)

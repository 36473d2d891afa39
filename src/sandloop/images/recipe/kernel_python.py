"""A Python context of a session (see ``kernel.py``): IPython's ``InteractiveShell``, in-process.

Cells behave as in IPython and Jupyter: ``!cmd``, ``%magic`` and ``%%magic``, top-level
``await``, dedented cells, ``display()`` and every ``_repr_*_`` / ``_repr_mimebundle_``, an
execution count, IPython's tracebacks. What a cell displays is an ordered list of outputs, each
a MIME bundle (``display_data``, or ``execute_result`` for the last expression), with E2B's
extras: a DataFrame's ``e2b/data`` and a matplotlib figure's ``e2b/chart``; figures are shown at
the end of the cell (matplotlib's inline backend); PIL images display on ``show()`` and ``save()``.

``preload()`` runs once, in the supervisor, before any context exists: imports and the shell, so
every context (a fork) starts with them. ``serve()`` runs in the context: one cell per message
on ``cmd_fd`` (a JSON line then the code), one JSON line back on ``reply_fd``.
"""

import base64
import json
import os
import sys
import warnings

import host_wire
from kernel_wire import read_message, write_all

#: Modules the supervisor imports before forking contexts (``SANDLOOP_PRELOAD``, comma-separated,
#: e.g. "numpy,pandas,matplotlib.pyplot"): free for every context, but resident in every session
#: (measured: pandas + matplotlib + PIL take a session from 43 to 104 MiB, past a 128m runsc
#: sandbox's room). PIL.Image by default, so a cold session's first ``import pandas`` costs what it
#: costs; a warm session's interpreter (``sessions/reserve.py``) adds numpy, pandas and pyplot
#: (``--kernel --preload=...``) while it waits, off the caller's path.
PRELOAD = tuple(m for m in os.environ.get("SANDLOOP_PRELOAD", "PIL.Image").split(",") if m.strip())
#: matplotlib, whenever a cell imports it, draws inline: figures are displayed at the cell's end.
INLINE_BACKEND = "module://matplotlib_inline.backend_inline"
MAX_VALUE_CHARS = 20000
#: A displayed output, streamed on stdout: ``OUTPUT_MARKER<nonce>:<base64 JSON>\n`` (the host
#: takes these lines out of the cell's stdout; runtime/protocol.py), each after its mark on
#: stderr, ``OUTPUT_MARKER<nonce>:\n`` (the host keeps the two streams in order by it).
OUTPUT_MARKER = b"\0\x1esandloop-output:"
#: Bytes of display data one cell may return (the rest is dropped, and the cell says so).
MAX_OUTPUT_BYTES = 16 * 1024 * 1024


class _Cell:
    """What the running cell has displayed and raised."""

    def __init__(self, nonce=""):
        self.outputs, self.error, self.exit_status, self.size, self.dropped = [], None, None, 0, 0
        self.nonce = nonce.encode()
        self.kept = []  # outputs that go with the reply (no nonce to stream them with)

    def add(self, kind, data, metadata):
        bundle = {}
        for mime, value in data.items():
            if isinstance(value, bytes):
                value = base64.b64encode(value).decode()
            bundle[mime] = value
        try:
            size = len(json.dumps(bundle, default=str))
        except (TypeError, ValueError):
            bundle = {"text/plain": bundle.get("text/plain") or repr(data)[:MAX_VALUE_CHARS]}
            size = len(bundle["text/plain"])
        if self.size + size > MAX_OUTPUT_BYTES:
            self.dropped += 1
            return
        self.size += size
        output = {"type": kind, "data": bundle, "metadata": _jsonable(metadata or {})}
        self.outputs.append(output)
        if self.nonce:  # on its way as it is displayed, in order with what the cell prints
            line = OUTPUT_MARKER + self.nonce + b":" + base64.b64encode(json.dumps(output, default=str).encode())
            try:  # its place in stderr: the host shows it once what stderr had before it is read
                write_all(2, OUTPUT_MARKER + self.nonce + b":\n")
            except OSError:
                pass  # the cell closed its stderr: the display goes when the cell ends
            write_all(1, line + b"\n")
        else:
            self.kept.append(output)


CELL = _Cell()


def _jsonable(value):
    try:
        json.dumps(value)
        return value
    except (TypeError, ValueError):
        return {}


def _flush():
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass


def preload(extra=()):
    """Import what every context should have (``PRELOAD``, then ``extra``), and build the shell
    they fork with."""
    os.environ["MPLBACKEND"] = INLINE_BACKEND
    for name in PRELOAD + tuple(extra):
        try:
            __import__(name)
        except Exception:  # the test double's host may lack one: then a cell imports it
            pass
    warnings.filterwarnings("ignore", message="To exit: use 'exit', 'quit', or Ctrl-D.")
    warnings.filterwarnings("ignore", message="You executed the system command !pip")
    return _make_shell()


def _make_shell():
    # IPython's completer imports jedi (6 MiB resident, measured) for tab completion, which no
    # cell uses: hide it while IPython loads, so a cell can still import it itself.
    hidden = "jedi" not in sys.modules
    if hidden:
        sys.modules["jedi"] = None
    try:
        return _build_shell()
    finally:
        if hidden and sys.modules.get("jedi", 0) is None:
            del sys.modules["jedi"]


def _build_shell():
    try:
        from IPython.core.displayhook import DisplayHook
        from IPython.core.displaypub import DisplayPublisher
        from IPython.core.formatters import BaseFormatter
        from IPython.core.interactiveshell import InteractiveShell
        from traitlets import ObjectName, Unicode
        from traitlets.config import Config
    except ImportError:
        sys.stderr.write("sandloop: a session's interpreter needs IPython (pip install ipython)\n")
        raise

    class Publisher(DisplayPublisher):
        def publish(self, data, metadata=None, source=None, *, transient=None, update=False, **kwargs):
            _flush()  # what was printed before the display comes before it
            CELL.add("display_data", data, metadata)

        def clear_output(self, wait=False):
            pass

    class Hook(DisplayHook):
        def write_output_prompt(self):
            pass

        def write_format_data(self, format_dict, md_dict=None):
            _flush()
            CELL.add("execute_result", format_dict, md_dict)

    class Shell(InteractiveShell):
        def enable_gui(self, gui=None):
            """No GUI event loop in a sandbox: figures are shown inline (as ipykernel does)."""

        def _showtraceback(self, etype, evalue, stb):
            if isinstance(evalue, SystemExit):
                CELL.exit_status = host_wire.exit_status(evalue.code)
                return
            text = self.InteractiveTB.stb2text(stb)
            name = getattr(etype, "__name__", str(etype))
            CELL.error = {"name": name, "value": str(evalue), "traceback": text[-MAX_VALUE_CHARS:]}
            _flush()
            try:
                sys.stderr.write(text + "\n")
            except Exception:
                pass

    class DataFormatter(BaseFormatter):
        """A DataFrame's columns as E2B's ``e2b/data``."""

        format_type = Unicode("e2b/data")
        print_method = ObjectName("_repr_e2b_data_")
        _return_type = (dict, str)

        def __call__(self, obj):
            pandas = sys.modules.get("pandas")
            if pandas is None or not isinstance(obj, pandas.DataFrame):
                return super().__call__(obj)
            if obj.size > 100000:  # a preview, not a copy of a big frame
                return None
            columns = obj.to_dict(orient="list")
            return {
                str(k): [v.isoformat() if isinstance(v, pandas.Timestamp) else _plain(v) for v in values]
                for k, values in columns.items()
            }

    class ChartFormatter(BaseFormatter):
        """A matplotlib figure's data as E2B's ``e2b/chart`` (its ``e2b_charts`` package)."""

        format_type = Unicode("e2b/chart")
        print_method = ObjectName("_repr_e2b_chart_")
        _return_type = (dict, str)

        def __call__(self, obj):
            if "matplotlib" not in sys.modules:
                return super().__call__(obj)
            from matplotlib.figure import Figure

            if not isinstance(obj, Figure):
                return super().__call__(obj)
            try:
                from e2b_charts import chart_figure_to_dict

                return chart_figure_to_dict(obj)
            except Exception:
                return None

    config = Config()
    config.HistoryManager.enabled = False  # no sqlite file, no thread
    config.InteractiveShell.colors = "nocolor"
    config.InteractiveShell.autoindent = False
    config.PlainTextFormatter.max_seq_length = 0
    shell = Shell.instance(config=config, displayhook_class=Hook, display_pub_class=Publisher)
    shell.system = shell.system_raw  # !cmd writes straight to the cell's stdout and stderr (no pty)
    formatter = shell.display_formatter
    formatter.formatters["e2b/data"] = DataFormatter(parent=formatter)
    formatter.formatters["e2b/chart"] = ChartFormatter(parent=formatter)
    if "matplotlib" in sys.modules:
        try:
            shell.enable_matplotlib("inline")
        except Exception as exc:
            sys.stderr.write("sandloop: matplotlib's inline backend is off: %s\n" % exc)
    _patch_pil()
    shell.events.register("pre_run_cell", lambda *args: _patch_pil())  # PIL imported by a cell
    return shell


def _plain(value):
    item = getattr(value, "item", None)  # numpy scalars
    if callable(item):
        try:
            return item()
        except Exception:
            return str(value)
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    return str(value)


def _patch_pil():
    """PIL images display on ``show()`` (there is no viewer) and on ``save(path)``, as in E2B."""
    image = sys.modules.get("PIL.Image")
    if image is None or getattr(image, "_sandloop_patched", False):
        return
    image._sandloop_patched = True
    from IPython.display import display

    original_save = image.Image.save

    def show(self, title=None):
        display(self)

    def save(self, fp, format=None, **params):
        if isinstance(fp, (str, os.PathLike)):
            display(self)
        return original_save(self, fp, format, **params)

    image.Image.show = show
    image.Image.save = save


def _warm_up(shell):
    """What a context's first cell pays once (IPython's input transformers and compiler, pandas'
    HTML formatting and lazy imports), paid ahead: a warm session's context does this before its
    first cell (``op: warm``). Silent and outside the history: no output, no execution count, no
    name left in the user's namespace."""
    global CELL
    CELL = _Cell()
    try:
        shell.run_cell("None", store_history=False, silent=True)
        pandas = sys.modules.get("pandas")
        if pandas is not None:
            shell.display_formatter.format(pandas.DataFrame({"a": range(3)}))
    except Exception:
        pass
    CELL = _Cell()


def serve(cmd_fd, reply_fd, shell):
    global CELL
    sys.path[0] = os.getcwd()  # as `python3 cell.py` in the context's directory would have it
    buffered = b""
    while True:
        try:
            message, buffered = read_message(cmd_fd, buffered)
        except KeyboardInterrupt:
            continue  # an interrupt between cells
        if message is None:
            return
        header, code = message
        if header.get("warmup"):
            _warm_up(shell)
            write_all(reply_fd, json.dumps({"status": 0, "warm": True}).encode() + b"\n")
            continue
        if header.get("chdir"):  # a warm session's default context, moved before its first cell
            os.chdir(header["chdir"])
            sys.path[0] = os.getcwd()
        env = header.get("env") or {}
        saved = {name: os.environ.get(name) for name in env}
        os.environ.update(env)  # for this cell only: secrets' placeholders, E2B's envs
        if header.get("ca"):
            host_wire.trust(header["ca"])
        CELL = _Cell(str(header.get("nonce") or ""))
        status = 0
        try:
            result = shell.run_cell(code, store_history=True)
            if CELL.exit_status is not None:
                status = CELL.exit_status
            elif not result.success:
                failure = result.error_in_exec or result.error_before_exec
                status = 130 if isinstance(failure, KeyboardInterrupt) else 1
        except KeyboardInterrupt:  # between IPython's own handlers
            status = 130
            CELL.error = CELL.error or {"name": "KeyboardInterrupt", "value": "", "traceback": "KeyboardInterrupt\n"}
        _flush()
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        reply = {
            "status": status,
            "outputs": CELL.kept,
            "outputs_dropped": CELL.dropped,
            "execution_count": shell.execution_count - 1,
            "error": CELL.error,
        }
        main = [o for o in CELL.outputs if o["type"] == "execute_result"]
        if main:
            text = str(main[-1]["data"].get("text/plain", ""))
            reply["value_omitted"] = max(0, len(text) - MAX_VALUE_CHARS)
            if reply["value_omitted"]:
                text = text[:MAX_VALUE_CHARS] + "... [%d characters omitted]" % reply["value_omitted"]
            reply["value"] = text
        write_all(reply_fd, json.dumps(reply, default=str).encode() + b"\n")

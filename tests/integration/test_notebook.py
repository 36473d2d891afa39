"""Notebook semantics in a session, against the real engine on runc and runsc (issue 22):
IPython's cells (magics, ``!cmd``, display, rich outputs), contexts, JavaScript, TypeScript and
bash interpreters, and what happens to a context that will not stop or runs out of memory."""

from __future__ import annotations

import base64
import json

import pytest

from sandloop import SandboxLimits
from sandloop.contract import ContextNotFound, InvalidArgument
from sandloop.sessions import Session


@pytest.fixture(scope="module", params=["runc", pytest.param("runsc", marks=pytest.mark.runsc)])
def nb(request):
    s = Session.create(limits=SandboxLimits(runtime=request.param), ttl=900, quota="64m")
    yield s
    s.delete()


def test_ipython_cells_magics_shell_and_dedent(nb):
    first = nb.run_cell("n = 6")
    second = nb.run_cell("    m = n * 7\n    m")  # a uniformly indented cell is dedented
    assert second.value == "42" and second.execution_count == first.execution_count + 1
    shell = nb.run_cell("!echo from-shell; pwd")
    assert shell.stdout == "from-shell\n/workspace\n" and shell.ok
    assert nb.run_cell("%pwd").value == "'/workspace'"
    assert nb.run_cell("%env COLOR=blue\nimport os; os.environ['COLOR']").value == "'blue'"
    assert nb.run_cell("%%bash\necho $((2 + 3))").stdout == "5\n"
    assert nb.run_cell("%%writefile made.txt\nhello").ok
    assert nb.run("print(open('made.txt').read().strip())").stdout == "hello\n"
    timed = nb.run_cell("%timeit -n 2 -r 2 sum(range(10))")
    assert "loops each" in timed.stdout
    assert nb.run_cell("!pip install numpy pillow").stdout.count("Requirement already satisfied") == 2


def test_display_and_rich_outputs_in_order(nb):
    r = nb.run_cell(
        "from IPython.display import display, HTML, Markdown, SVG\n"
        "class Card:\n"
        "    def _repr_html_(self): return '<b>card</b>'\n"
        "    def _repr_mimebundle_(self, include=None, exclude=None):\n"
        "        return {'text/plain': 'card', 'application/json': {'k': 1}}\n"
        "print('before')\n"
        "display(HTML('<i>x</i>'))\n"
        "display({'text/plain': 'raw text', 'text/markdown': '# raw'}, raw=True)\n"
        'display(SVG(\'<svg xmlns="http://www.w3.org/2000/svg" width="4" height="4"/>\'))\n'
        "Card()"
    )
    assert r.stdout == "before\n" and r.ok
    kinds = [(o.type, sorted(o.data)) for o in r.outputs]
    assert kinds == [
        ("display_data", ["text/html", "text/plain"]),
        ("display_data", ["text/markdown", "text/plain"]),
        ("display_data", ["image/svg+xml", "text/plain"]),
        ("execute_result", ["application/json", "text/html", "text/plain"]),
    ]
    assert r.outputs[0].data["text/html"] == "<i>x</i>" and r.outputs[3].data["application/json"] == {"k": 1}
    assert r.outputs[3].is_main_result and r.value == "card"
    assert [a.mime_type for a in r.artifacts] == ["image/svg+xml"]


def test_dataframe_chart_and_pil_image(nb):
    df = nb.run_cell("import pandas as pd\ndf = pd.DataFrame({'a': [1, 2], 'b': ['x', 'y']})\ndf")
    (out,) = df.outputs
    assert "<table" in out.data["text/html"] and out.data["e2b/data"] == {"a": [1, 2], "b": ["x", "y"]}
    chart = nb.run_cell("import matplotlib.pyplot as plt\nplt.plot([1, 2, 3], [1, 4, 9])\nplt.title('sq')\nplt.show()")
    (fig,) = chart.outputs
    assert fig.type == "display_data" and fig.data["e2b/chart"]["type"] == "line"
    assert fig.data["e2b/chart"]["title"] == "sq"
    assert base64.b64decode(fig.data["image/png"]).startswith(b"\x89PNG")
    assert [a.name for a in chart.artifacts] == ["figure-1.png"]
    img = nb.run_cell("from PIL import Image\nim = Image.new('RGB', (8, 8), 'red')\nim.show()\nim.save('red.png')")
    assert [o.type for o in img.outputs] == ["display_data", "display_data"]  # show() and save() display it
    assert all("image/png" in o.data for o in img.outputs)


def test_errors_exit_and_tracebacks_as_ipython_prints_them(nb):
    nb.run_cell("n = 6")  # its own state: tests of one module may run in any order
    bad = nb.run_cell("def f():\n    return 1 / 0\nf()")
    assert bad.exit_code == 1 and bad.error.name == "ZeroDivisionError" and bad.error.value == "division by zero"
    assert "----> 3 f()" in bad.error.traceback and "ZeroDivisionError" in bad.stderr
    syntax = nb.run_cell("def (")
    assert syntax.error.name == "SyntaxError" and syntax.exit_code == 1
    assert nb.run_cell("import sys; sys.exit(3)").exit_code == 3
    assert nb.run_cell("n").value == "6"  # state survived all of it


def test_contexts_are_independent_and_managed(nb):
    nb.run_cell("shared = 'default'")
    ctx = nb.create_context("python")
    assert ctx.language == "python" and ctx.cwd == "/workspace"
    assert nb.run_cell("shared", context=ctx).error.value == "name 'shared' is not defined"
    nb.run_cell("own = 1", context=ctx)
    assert nb.run_cell("own", context=ctx.id).value == "1"
    assert ctx.id in [c.id for c in nb.list_contexts()]
    nb.restart_context(ctx)
    assert nb.run_cell("own", context=ctx).error.name == "NameError"
    nb.remove_context(ctx)
    assert ctx.id not in [c.id for c in nb.list_contexts()]
    with pytest.raises(ContextNotFound):
        nb.run_cell("1", context=ctx)
    with pytest.raises(InvalidArgument, match="runs python, not javascript"):
        nb.run_cell("1", context="default", language="javascript")
    with pytest.raises(InvalidArgument, match="no interpreter"):
        nb.create_context("cobol")
    elsewhere = nb.create_context("bash", cwd="/tmp/elsewhere")
    assert nb.run_cell("pwd", context=elsewhere).stdout == "/tmp/elsewhere\n"
    nb.remove_context(elsewhere)
    assert nb.run_cell("shared").value == "'default'"


def test_a_context_cannot_read_the_frames_or_another_contexts_pipes(nb):
    """fd 0 of a context is /dev/null (the host's frames arrive on the supervisor's); a bash cell's
    stdin is /dev/null too (it would otherwise read the cells that follow)."""
    other = nb.create_context("python")
    nb.run_cell("1", context=other)
    assert nb.run_cell("import os; os.read(0, 100)").value == "b''"
    listing = (
        "import os\nlinks = []\nfor f in sorted(os.listdir('/proc/self/fd'), key=int):\n"
        "    try:\n        links.append(os.readlink(f'/proc/self/fd/{f}'))\n"
        "    except OSError:\n        pass  # the listing's own descriptor, closed by now\nlinks"
    )
    fds = eval(nb.run_cell(listing).value)
    assert fds[0] == "/dev/null", fds
    # stdout, stderr, its own cell and reply pipes: none of the other context's nor the supervisor's
    assert sum(link.startswith("pipe:") for link in fds) <= 4, fds
    assert nb.run_cell("cat; echo after", language="bash").stdout == "after\n"
    nb.remove_context(other)


def test_bash_context_keeps_its_shell(nb):
    assert nb.run_cell('cd /tmp && X=7 && f() { echo "f$1"; }', language="bash").ok
    r = nb.run_cell("pwd; echo $X; f 2", language="bash")
    assert (r.stdout, r.language, r.context) == ("/tmp\n7\nf2\n", "bash", "default-bash")
    assert nb.run_cell("echo $FOO", language="bash", env={"FOO": "bar"}).stdout == "bar\n"
    assert nb.run_cell("echo ${FOO:-unset}", language="bash").stdout == "unset\n"
    assert nb.run_cell("false", language="bash").exit_code == 1
    slow = nb.run_cell("sleep 30", language="bash", timeout_seconds=1)
    assert slow.timed_out and not slow.interpreter_restarted
    assert nb.run_cell("echo $X", language="bash").stdout == "7\n"


def test_javascript_and_typescript_contexts(nb):
    r = nb.run_cell("console.log('hi')\nconst q = 40\nq + 2", language="js")
    assert (r.stdout, r.value, r.language) == ("hi\n", "42", "javascript")
    assert nb.run_cell("const q = 1; q", language="javascript").value == "1"  # a cell can run again
    assert nb.run_cell("await Promise.resolve('later')", language="js").value == "'later'"
    imported = nb.run_cell("import { readFileSync } from 'fs'\nconsole.log(typeof readFileSync)", language="js")
    assert imported.stdout == "function\n"
    obj = nb.run_cell("({a: 1, b: [2]})", language="js")
    assert obj.outputs[0].data["application/json"] == {"a": 1, "b": [2]}
    assert nb.run_cell("process.env.FOO", language="js", env={"FOO": "bar"}).value == "'bar'"
    assert nb.run_cell("process.env.FOO || 'unset'", language="js").value == "'unset'"
    err = nb.run_cell("throw new TypeError('nope')", language="js")
    assert (err.exit_code, err.error.name, err.error.value) == (1, "TypeError", "nope")
    waiting = nb.run_cell("await new Promise(r => setTimeout(r, 60000))", language="js", timeout_seconds=1)
    assert waiting.timed_out and not waiting.interpreter_restarted
    assert nb.run_cell("q", language="js").value == "1"  # the interrupt kept the context
    busy = nb.run_cell("var spins = 0; while (true) { spins++ }", language="js", timeout_seconds=1)
    assert busy.timed_out and not busy.interpreter_restarted, busy
    assert busy.error is not None and busy.error.name == "KeyboardInterrupt"
    assert nb.run_cell("spins > 0 && q", language="js").value == "1"  # a busy loop broken, state kept
    again = nb.run_cell("while (true) {}", language="js", timeout_seconds=1)  # and the next interrupt too
    assert again.timed_out and not again.interpreter_restarted
    assert nb.run_cell("q + 1", language="js").value == "2"


def test_typescript_context(runtime):
    """A session of its own: TypeScript's compiler takes ~80 MiB in its node, and under gVisor a
    sandbox at its memory limit goes whole (the module's session holds pandas and matplotlib)."""
    with Session(limits=SandboxLimits(runtime=runtime), ttl=600, quota="16m") as s:
        typed = "const m: string = 'typed'; interface P { x: number }\nconst p: P = {x: 3}; m + p.x"
        ts = s.run_cell(typed, language="ts", timeout_seconds=120)
        assert (ts.value, ts.language, ts.context) == ("'typed3'", "typescript", "default-typescript"), ts
        assert s.run_cell("m.toUpperCase()", language="typescript").value == "'TYPED'"
        bad = s.run_cell("const n: number = ", language="ts")
        assert bad.exit_code == 1 and bad.error is not None


def test_a_context_that_ignores_its_interrupt_is_replaced_alone(runtime):
    with Session(limits=SandboxLimits(runtime=runtime), ttl=600, quota="16m") as s:
        s.run_cell("survivor = 'yes'")
        stubborn = s.create_context("python")
        s.run_cell("kept = 1", context=stubborn)
        r = s.run_cell(
            "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True: time.sleep(0.05)",
            context=stubborn,
            timeout_seconds=1,
        )
        assert r.timed_out and r.interpreter_restarted and not r.sandbox_replaced
        assert r.error.name == "ContextRestarted"
        assert s.run_cell("kept", context=stubborn).error.name == "NameError"  # a fresh interpreter
        assert s.run_cell("survivor").value == "'yes'"  # its sibling never noticed


def test_a_context_killed_by_the_memory_limit_is_replaced_alone(runtime):
    if runtime == "runsc":
        pytest.skip("gVisor's sentry takes the whole sandbox at its memory limit (covered in test_sessions)")
    with Session(limits=SandboxLimits(runtime=runtime, memory="256m"), ttl=600, quota="16m") as s:
        s.run_cell("survivor = 'yes'")
        hog = s.create_context("python")
        r = s.run_cell("blocks = []\nwhile True: blocks.append(bytearray(16 * 2**20))", context=hog, timeout_seconds=60)
        assert r.interpreter_restarted and not r.sandbox_replaced and r.oom_killed, r
        assert s.run_cell("survivor").value == "'yes'"
        assert s.run_cell("1 + 1", context=hog).value == "2"


def test_outputs_travel_through_the_result_json(nb):
    r = nb.run_cell("from IPython.display import display, HTML\ndisplay(HTML('<p>p</p>'))\n7")
    again = type(r).model_validate(json.loads(r.model_dump_json()))
    assert [o.data for o in again.outputs] == [o.data for o in r.outputs]
    assert "reply" not in json.loads(r.model_dump_json())

"""The web playground in headless Chromium (Debian's, driven by Playwright): run code, see the
output, open a session, see a chart."""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

import pytest
from playwright.sync_api import expect

from sandloop.server.app import create_app
from sandloop.server.providers import ProviderEndpoints
from sandloop.server.tokens import TokenStore
from sandloop.testing.wire import FakeProviderServer
from tests.servers import serve_in_thread

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]


@pytest.fixture(scope="module")
def provider():
    """A scripted model endpoint the server lists as its default OpenAI-compatible endpoint."""
    with FakeProviderServer([]) as fake:
        yield fake


@pytest.fixture(scope="module")
def server(tmp_path_factory, provider):
    tokens = TokenStore(tmp_path_factory.mktemp("playground") / "tokens.sqlite")
    app = create_app(tokens, providers=ProviderEndpoints([f"openai={provider.url}/v1"]))
    with serve_in_thread(app) as url:
        yield url, tokens


@pytest.fixture
def page(server, tmp_path):
    playwright_api = pytest.importorskip("playwright.sync_api")
    if not os.path.exists(CHROMIUM):
        pytest.fail("Debian's chromium is not installed (scripts/setup.sh installs it)")
    url, tokens = server
    secret, _ = tokens.create(f"browser-{tmp_path.name}")  # names are unique among active tokens
    with playwright_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=FLAGS, headless=True)
        ctx = browser.new_context(viewport={"width": 1400, "height": 1000})
        pg = ctx.new_page()
        violations: list[str] = []
        pg.on("console", lambda m: violations.append(m.text) if "Content Security Policy" in m.text else None)
        dialogs: list[str] = []

        def on_dialog(dialog) -> None:  # confirmations: recorded, and answered as the test says
            dialogs.append(dialog.message)
            dialog.accept() if pg.accept_dialogs else dialog.dismiss()

        pg.on("dialog", on_dialog)
        pg.accept_dialogs = True
        pg.dialogs = dialogs
        pg.goto(url + "/")
        pg.fill("#token", secret)
        pg.dispatch_event("#token", "change")
        pg.secret = secret  # for tests that open a second page
        pg.base_url = url
        try:
            yield pg
        finally:
            browser.close()
            import httpx  # the sessions the page made (it starts as a notebook) go with the test

            auth = {"Authorization": f"Bearer {secret}"}
            for s in httpx.get(f"{url}/v1/sessions", headers=auth, timeout=60).json():
                httpx.delete(f"{url}/v1/sessions/{s['id']}", headers=auth, timeout=120)
    assert violations == [], violations  # the page runs under its own CSP without breaking it


SHOTS = os.environ.get("SANDLOOP_SCREENSHOTS")


def shot(page, tmp_path, name: str) -> None:
    """A full-page screenshot; kept in $SANDLOOP_SCREENSHOTS (to look at) when set."""
    path = tmp_path / f"{name}.png"
    page.screenshot(path=str(path), full_page=True)
    if SHOTS:
        os.makedirs(SHOTS, exist_ok=True)
        shutil.copy(path, os.path.join(SHOTS, f"{name}.png"))


def set_code(page, index: int, code: str) -> None:
    """Type into a cell's editor as a person pasting would."""
    page.locator(".cell .CodeMirror").nth(index).click()
    page.keyboard.press("Control+A")
    page.keyboard.insert_text(code)


def test_the_first_page_is_a_notebook_that_shows_a_value_and_a_chart(page, tmp_path):
    """Before: no session, so the two starting cells showed "printed nothing ... a last expression
    is not shown" instead of the array and the chart."""
    expect(page.locator("#session-id")).to_have_text(re.compile(r"^s-"), timeout=60_000)
    expect(page.locator(".cell")).to_have_count(2)
    page.click("#run-all")
    first, second = page.locator(".cell").nth(0), page.locator(".cell").nth(1)
    expect(second.locator(".status")).to_have_text("exit 0", timeout=60_000)
    assert first.locator(".stdout").inner_text() == "hello from the sandbox\n"
    assert first.locator(".value").inner_text().startswith("array([[0, 1, 2, 3, 4],")
    assert second.locator(".charts img").evaluate("img => img.naturalWidth") > 100  # a real decoded PNG
    assert page.locator(".cell .note").count() == 0  # no false "printed nothing"
    shot(page, tmp_path, "playground-first-page")


def test_cells_stream_can_be_stopped_and_have_notes(page, tmp_path):
    expect(page.locator("#session-id")).to_have_text(re.compile(r"^s-"), timeout=60_000)
    expect(page.locator(".cell")).to_have_count(2)
    assert page.locator(".cell .CodeMirror .cm-keyword").count() > 0  # highlighted by the editor
    set_code(
        page, 0, "kept = 'yes'\nimport time\nprint('hello from the browser', flush=True)\nwhile True: time.sleep(0.1)"
    )
    first = page.locator(".cell").nth(0)
    first.locator(".run").click()
    # streamed: the line is on the page while the cell runs (it never ends by itself)
    expect(first.locator(".stdout")).to_have_text("hello from the browser\n", timeout=60_000)
    assert first.locator(".status").inner_text() == "running…"
    expect(first.locator(".run")).to_have_text("■ Stop")
    first.locator(".run").click()  # interrupts the cell; the interpreter keeps its variables
    expect(first.locator(".status")).to_have_text("interrupted (variables kept)", timeout=60_000)
    set_code(page, 1, "import sys\nprint('to stderr', file=sys.stderr)\nkept")
    second = page.locator(".cell").nth(1)
    second.locator(".run").click()
    expect(second.locator(".value")).to_have_text("'yes'", timeout=60_000)
    assert "to stderr" in second.locator(".stderr").inner_text()
    assert second.locator(".prompt").inner_text() == "[1]"
    page.click("#add-cell")
    expect(page.locator(".cell")).to_have_count(3)
    set_code(page, 2, "x = bytearray(900 * 1024 * 1024)")
    page.keyboard.press("Shift+Enter")
    third = page.locator(".cell").nth(2)
    expect(third.locator(".status")).to_have_text("exit 137", timeout=60_000)
    assert "memory limit" in third.locator(".notes").inner_text()
    third.locator(".lang").select_option("bash")  # each cell has its language
    set_code(page, 2, "echo from bash; pwd")
    third.locator(".run").click()
    expect(third.locator(".stdout")).to_have_text("from bash\n/workspace\n", timeout=60_000)
    page.click("#detach-session")  # one-off runs: each cell in a fresh sandbox, still streamed
    expect(page.locator("#session-id")).to_have_text("none")
    set_code(page, 0, "print('once')")
    page.locator(".cell").nth(0).locator(".run").click()
    expect(page.locator(".cell").nth(0).locator(".stdout")).to_have_text("once\n", timeout=60_000)
    shot(page, tmp_path, "playground-runs")


def test_rich_outputs_render_a_dataframe_as_a_table_a_chart_as_an_image_and_node_keeps_state(page, tmp_path):
    expect(page.locator("#session-id")).to_have_text(re.compile(r"^s-"), timeout=60_000)
    set_code(
        page,
        0,
        "import pandas as pd\nfrom IPython.display import display, Markdown\n"
        "display(Markdown('**shown**'))\npd.DataFrame({'city': ['Oslo', 'Lima'], 'temp': [4, 19]})",
    )
    set_code(page, 1, "import matplotlib.pyplot as plt\nplt.bar(['a', 'b'], [3, 5])\nplt.title('bars')")
    page.click("#run-all")
    first, second = page.locator(".cell").nth(0), page.locator(".cell").nth(1)
    expect(second.locator(".status")).to_have_text("exit 0", timeout=60_000)
    frame = first.frame_locator("iframe.html-output")
    expect(frame.locator("table td").first).to_have_text("Oslo", timeout=10_000)
    assert frame.locator("table tr").count() == 3  # the header and two rows
    assert first.locator(".value").inner_text() == ""  # shown as the table, not twice
    assert first.locator("pre.display-text").inner_text() == "**shown**"
    assert second.locator(".charts img").evaluate("img => img.naturalWidth") > 100
    page.click("#add-cell")
    third = page.locator(".cell").nth(2)
    third.locator(".lang").select_option("node")
    set_code(page, 2, "const n = 21")
    third.locator(".run").click()
    expect(third.locator(".status")).to_have_text("exit 0", timeout=60_000)
    set_code(page, 2, "n * 2")
    third.locator(".run").click()
    expect(third.locator(".value")).to_have_text("42", timeout=60_000)  # the node context kept n
    shot(page, tmp_path, "playground-rich-outputs")
    page.reload()  # outputs, the table among them, come back with the page
    expect(page.locator(".cell").nth(0).frame_locator("iframe.html-output").locator("td").first).to_have_text(
        "Oslo", timeout=30_000
    )


def test_a_session_notebook_with_files_survives_a_reload(page, tmp_path):
    expect(page.locator("#session-id")).to_have_text(re.compile(r"^s-"), timeout=60_000)  # the page's own
    first_sid = page.inner_text("#session-id")
    page.click("#new-session")
    expect(page.locator("#session-id")).not_to_have_text(first_sid, timeout=60_000)
    expect(page.locator("#session-id")).to_have_text(re.compile(r"^s-"), timeout=60_000)
    sid = page.inner_text("#session-id")
    set_code(page, 0, "total = 40\nopen('out.txt', 'w').write('from a cell')\ntotal")
    set_code(page, 1, "import matplotlib.pyplot as plt\nplt.bar(['a', 'b', 'c'], [3, 1, 2])\ntotal + 2")
    page.click("#run-all")
    second = page.locator(".cell").nth(1)
    expect(second.locator(".value")).to_have_text("42", timeout=60_000)  # state shared between cells
    assert second.locator(".charts img").evaluate("img => img.naturalWidth") > 100  # a real decoded PNG
    expect(page.locator("#files")).to_contain_text("out.txt", timeout=30_000)
    data = tmp_path / "data.csv"
    data.write_text("v\n1\n2\n")
    page.set_input_files("#upload", str(data))
    expect(page.locator("#files")).to_contain_text("data.csv", timeout=30_000)
    page.locator("#files td", has_text="out.txt").click()
    expect(page.locator("#preview pre")).to_have_text("from a cell", timeout=30_000)
    with page.expect_download() as download:
        page.locator("#files tr", has_text="data.csv").locator("button[title=download]").click()
    assert Path(download.value.path()).read_text() == "v\n1\n2\n"
    shot(page, tmp_path, "playground-session")
    page.reload()  # the session and the notebook come back, with what the cells showed
    expect(page.locator("#session-id")).to_have_text(sid, timeout=30_000)
    expect(page.locator("#sessions li.current")).to_have_count(1, timeout=30_000)
    assert "total + 2" in page.locator(".cell").nth(1).inner_text()
    expect(page.locator(".cell").nth(1).locator(".value")).to_have_text("42")  # before: outputs lost
    assert page.locator(".cell").nth(1).locator(".charts img").count() == 1
    shot(page, tmp_path, "playground-reloaded")
    page.locator(".cell").nth(1).locator(".run").click()
    expect(page.locator(".cell").nth(1).locator(".value")).to_have_text("42", timeout=60_000)
    page.accept_dialogs = False
    page.click("#delete-session")  # asks first; dismissed, nothing is deleted
    assert page.dialogs and "Delete session " + sid in page.dialogs[-1]
    expect(page.locator("#session-id")).to_have_text(sid)
    page.accept_dialogs = True
    page.click("#delete-session")
    expect(page.locator("#session-id")).to_have_text("none", timeout=60_000)


def test_a_session_pauses_resumes_and_forks_from_its_buttons(page, tmp_path):
    expect(page.locator("#session-id")).to_have_text(re.compile(r"^s-[0-9a-f]+$"), timeout=60_000)  # the page's own
    sid = page.inner_text("#session-id")
    set_code(page, 0, "kept = 41\nkept")
    page.locator(".cell").nth(0).locator(".run").click()
    expect(page.locator(".cell").nth(0).locator(".value")).to_have_text("41", timeout=60_000)
    page.click("#pause-session")
    expect(page.locator("#session-id")).to_have_text(f"{sid} (paused: state kept)", timeout=60_000)  # runc
    expect(page.locator("#pause-session")).to_have_text("Resume")
    expect(page.locator("#sessions li.current")).to_contain_text("paused")
    shot(page, tmp_path, "playground-paused")
    page.click("#pause-session")
    expect(page.locator("#session-id")).to_have_text(sid, timeout=60_000)
    set_code(page, 0, "kept + 1")
    page.locator(".cell").nth(0).locator(".run").click()
    expect(page.locator(".cell").nth(0).locator(".value")).to_have_text("42", timeout=60_000)
    page.click("#fork-session")
    expect(page.locator("#session-id")).not_to_have_text(sid, timeout=60_000)
    expect(page.locator("#session-id")).to_have_text(re.compile(r"^s-[0-9a-f]+$"), timeout=60_000)
    assert "kept + 1" in page.locator(".cell").nth(0).inner_text()  # the notebook went with the fork
    set_code(page, 0, "kept = 0\nkept")
    page.locator(".cell").nth(0).locator(".run").click()
    expect(page.locator(".cell").nth(0).locator(".value")).to_have_text("0", timeout=60_000)
    shot(page, tmp_path, "playground-forked")
    page.accept_dialogs = True
    page.click("#delete-session")
    expect(page.locator("#session-id")).to_have_text("none", timeout=60_000)
    page.locator("#sessions li", has_text=sid).locator("button").click()  # the parent kept its own
    expect(page.locator("#session-id")).to_have_text(sid, timeout=30_000)
    set_code(page, 0, "kept")
    page.locator(".cell").nth(0).locator(".run").click()
    expect(page.locator(".cell").nth(0).locator(".value")).to_have_text("41", timeout=60_000)
    page.click("#delete-session")
    expect(page.locator("#session-id")).to_have_text("none", timeout=60_000)


def test_the_page_stacks_on_a_phone(page, tmp_path):
    page.set_viewport_size({"width": 390, "height": 844})
    main, aside = page.locator("main").bounding_box(), page.locator("aside").bounding_box()
    assert main["width"] <= 390 and aside["width"] <= 390 and aside["y"] > main["y"]  # one column
    assert page.evaluate("document.documentElement.scrollWidth") <= 390  # nothing sticks out sideways
    shot(page, tmp_path, "playground-phone")


def test_watch_an_agent_run_stream_in(page, provider):
    import json

    from sandloop.testing.wire import openai_completion

    first = openai_completion(
        "Let me compute.", [("call_7", "execute_code", json.dumps({"code": "print(sum(range(101)))"}))]
    )
    provider.queue(first, openai_completion("The sum is 5050."))
    page.fill("#task", "sum 0..100")  # base URL left empty: the server's default endpoint
    page.click("#run-agent")
    page.wait_for_selector("#agent-log .ev.done", timeout=60_000)
    log = page.inner_text("#agent-log")
    assert "Let me compute." in log and "print(sum(range(101)))" in log and "5050" in log
    assert "answer (answered, 2 turns): The sum is 5050." in log


def test_the_api_docs_render_with_their_operations(page, tmp_path):
    """/docs (Swagger UI from this server) reads the server's OpenAPI 3.1 schema: operations are
    listed, not "Unable to render this definition"."""
    errors: list[str] = []
    page.on("pageerror", lambda e: errors.append(str(e)))
    page.goto(page.base_url + "/docs")
    runs = page.locator(".opblock", has_text="/v1/runs").first
    expect(runs).to_be_visible(timeout=30_000)
    assert page.locator(".opblock").count() > 10
    assert "Unable to render" not in page.inner_text("body")
    assert page.locator(".info .title").inner_text().startswith("sandloop")
    shot(page, tmp_path, "api-docs")
    assert errors == []


@pytest.fixture
def operator_template(tmp_path):
    """A template the host's operator built (every token may use it), removed afterwards."""
    import uuid

    from sandloop.images.templates import parse_steps_file
    from sandloop.root import default_root

    (tmp_path / "mytool.py").write_text("def answer():\n    return 42\n")
    (tmp_path / "steps.yaml").write_text(
        "steps:\n  - copy: {src: mytool.py, dest: /opt/tools/mytool.py}\n  - env: {PYTHONPATH: /opt/tools}\n"
    )
    ref = f"playground-{uuid.uuid4().hex[:8]}:v1"
    templates = default_root().templates
    templates.build(parse_steps_file(tmp_path / "steps.yaml", ref))
    yield ref
    templates.remove(ref)


def test_a_session_and_a_run_from_a_template(operator_template, page, tmp_path):
    expect(page.locator("#session-id")).to_have_text(re.compile(r"^s-"), timeout=60_000)
    expect(page.locator(f"#template option[value='{operator_template}']")).to_have_count(1, timeout=30_000)
    page.select_option("#template", operator_template)
    before = page.locator("#session-id").inner_text()
    page.click("#new-session")
    expect(page.locator("#session-id")).not_to_have_text(before, timeout=60_000)
    set_code(page, 0, "import mytool\nprint(mytool.answer())")
    first = page.locator(".cell").nth(0)
    first.locator(".run").click()
    expect(first.locator(".stdout")).to_have_text("42\n", timeout=60_000)
    shot(page, tmp_path, "playground-template")


def preview_port(page, port: int, where: str, text: str):
    """The playground's port preview of ``port``, opened until ``where`` in its frame shows
    ``text`` (the server inside takes a moment to listen: the preview answers 502 until then)."""
    page.fill("#preview-port", str(port))
    frame = page.frame_locator("#port-frame")
    for _ in range(60):
        page.click("#open-port")
        try:
            expect(frame.locator(where)).to_contain_text(text, timeout=2_000)
            break
        except AssertionError:
            continue
    return frame


def test_a_terminal_panel_types_inside_and_a_port_is_previewed(page, tmp_path):
    """The terminal panel (xterm.js, shipped offline) types into a bash inside the session; a server
    started there is shown by the port preview (redirected to the preview's own keyed origin)."""
    expect(page.locator("#session-id")).to_have_text(re.compile(r"^s-"), timeout=60_000)
    expect(page.locator("#open-terminal")).to_be_enabled(timeout=60_000)
    page.click("#open-terminal")
    expect(page.locator("#terminal-status")).to_have_text(re.compile(r"^bash \(pid \d+\)"), timeout=60_000)
    screen = page.locator("#terminal .xterm-rows")
    expect(screen).to_contain_text("$", timeout=60_000)  # the prompt, from inside
    page.locator("#terminal").click()
    page.keyboard.type("echo typed-$((6*7)) > page.html; cat page.html\n")
    expect(screen).to_contain_text("typed-42", timeout=60_000)
    page.keyboard.type("python3 -m http.server 8000 >/dev/null 2>&1 &\n")
    frame = preview_port(page, 8000, "body", "page.html")
    expect(frame.locator("body")).to_contain_text("page.html")  # http.server's listing of /workspace
    shot(page, tmp_path, "playground-terminal-and-port")
    page.locator("#terminal").click()
    page.keyboard.type("exit\n")
    expect(page.locator("#terminal-status")).to_have_text("the shell ended (exit 0)", timeout=60_000)
    expect(page.locator("#open-terminal")).to_be_enabled()


#: A hostile page in the sandbox (issue 52 findings 1 and 2): it reports where it runs and what
#: of the playground's it can read; the server beside it logs every request it is sent.
HOSTILE_PAGE = """<!doctype html><html><body><pre id="out">waiting</pre><script>
document.getElementById("out").textContent = JSON.stringify({
  origin: location.origin, href: location.href, cookie: document.cookie, referrer: document.referrer,
  token: (() => { try { return localStorage.getItem("sandloop-token"); } catch (e) { return "error:" + e; } })(),
});
</script></body></html>"""
LOGGING_SERVER = r"""
import http.server, subprocess, sys
class Logged(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass
    def do_GET(self):
        with open("/workspace/requests.log", "a") as log:
            log.write(self.requestline + "\n" + str(self.headers) + "\n")
        super().do_GET()
http.server.ThreadingHTTPServer(("127.0.0.1", 8000), Logged).serve_forever()
"""


def test_a_previewed_page_runs_on_its_own_origin_and_sees_no_token(page, tmp_path):
    """The playground's port preview of a hostile page: the page runs on the preview's own
    origin (not the API's: it cannot read the playground's token from its storage), cannot read
    the preview cookie, and its server never sees the token, however it was given."""
    import httpx

    expect(page.locator("#session-id")).to_have_text(re.compile(r"^s-"), timeout=60_000)
    sid = page.locator("#session-id").inner_text()
    auth = {"Authorization": f"Bearer {page.secret}"}
    with httpx.Client(base_url=page.base_url, timeout=60, headers=auth) as client:
        assert client.put(f"/v1/sessions/{sid}/files/index.html", content=HOSTILE_PAGE.encode()).status_code == 200
        assert client.put(f"/v1/sessions/{sid}/files/serve.py", content=LOGGING_SERVER.encode()).status_code == 200
        cell = client.post(
            f"/v1/sessions/{sid}/cells",
            json={"code": "import subprocess; subprocess.Popen(['python3', '/workspace/serve.py'], cwd='/workspace')"},
        )
        assert cell.status_code == 200, cell.text
    frame = preview_port(page, 8000, "#out", "origin")
    seen = json.loads(frame.locator("#out").inner_text())
    port = page.base_url.rsplit(":", 1)[1]
    # the preview's own keyed origin, not the API's
    assert re.fullmatch(rf"http://8000-{sid}\.k[0-9a-f]{{36}}\.localhost:{port}", seen["origin"]), seen
    # the playground's storage is not this origin's (Chromium refuses a third-party frame any at all)
    assert (seen["token"] is None or seen["token"].startswith("error:")) and page.secret not in json.dumps(seen)
    assert seen["cookie"] == "" and seen["referrer"] == "", seen
    assert "sandloop_token" not in seen["href"], seen
    shot(page, tmp_path, "playground-hostile-preview")
    with httpx.Client(base_url=page.base_url, timeout=60, headers=auth) as client:
        log = client.get(f"/v1/sessions/{sid}/files/requests.log")
    assert log.status_code == 200 and "GET / HTTP/1.1" in log.text, log.text
    assert page.secret not in log.text and "sandloop_preview" not in log.text, log.text

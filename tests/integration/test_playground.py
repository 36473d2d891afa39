"""The web playground in headless Chromium (Debian's, driven by Playwright): run code, see the
output, open a session, see a chart."""

from __future__ import annotations

import os
import re
import shutil

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
        pg.goto(url + "/")
        pg.fill("#token", secret)
        pg.dispatch_event("#token", "change")
        yield pg
        browser.close()
    assert violations == [], violations  # the page runs under its own CSP without breaking it


def test_run_code_and_see_the_output(page):
    page.select_option("#language", "python")
    page.fill("#code", "import sys\nprint('hello from the browser')\nprint('to stderr', file=sys.stderr)")
    page.click("#run")
    expect(page.locator("#status")).to_have_text(re.compile(r"^exit"), timeout=60_000)
    assert page.inner_text("#stdout") == "hello from the browser\n"
    assert "to stderr" in page.inner_text("#stderr")
    assert page.inner_text("#status") == "exit 0"
    page.fill("#code", "x = bytearray(900 * 1024 * 1024)")
    page.click("#run")
    expect(page.locator("#status")).to_have_text("exit 137", timeout=60_000)
    assert "memory limit" in page.inner_text("#notes")


def test_session_cell_shows_a_chart_and_files(page, tmp_path):
    page.click("#new-session")
    expect(page.locator("#session-id")).to_have_text(re.compile(r"^s-"), timeout=60_000)
    page.fill(
        "#cell",
        "import matplotlib.pyplot as plt\nplt.bar(['a', 'b', 'c'], [3, 1, 2])\nopen('out.txt', 'w').write('x')\n6 * 7",
    )
    page.click("#run-cell")
    page.wait_for_selector("#charts img", timeout=60_000)
    assert page.inner_text("#cell-value") == "42"
    natural = page.eval_on_selector("#charts img", "img => img.naturalWidth")
    assert natural > 100  # a real decoded PNG
    expect(page.locator("#files")).to_contain_text("out.txt", timeout=30_000)
    page.screenshot(path=str(tmp_path / "playground.png"), full_page=True)
    if os.environ.get("SANDLOOP_SCREENSHOT"):
        shutil.copy(tmp_path / "playground.png", os.environ["SANDLOOP_SCREENSHOT"])
    page.click("#delete-session")
    expect(page.locator("#session-id")).to_have_text("none", timeout=60_000)


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

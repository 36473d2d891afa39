"""Every Python example in the README runs, as written, against the real engine.

The only substitution: the agent example's model endpoints (Anthropic's, and an Ollama URL on
localhost) point at a loopback ``FakeProviderServer``, since no key or model exists here.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from sandloop.sessions import Session
from sandloop.sessions.snapshots import SnapshotStore
from sandloop.sessions.store import SessionStore
from sandloop.testing.wire import FakeProviderServer, anthropic_text, openai_completion
from tests.helpers import our_containers

README = (Path(__file__).parents[2] / "README.md").read_text()
BLOCKS = re.findall(r"```python\n(.*?)```", README, re.S)


@pytest.fixture
def made(monkeypatch):
    """The ids of the sessions and snapshots this test's calls create (other test workers make
    theirs in the same home meanwhile: only these are checked for leftovers)."""
    ids: dict[str, list[str]] = {"sessions": [], "snapshots": []}
    create, commit = SessionStore.create, SnapshotStore.commit

    def created(self, *a, **kw):
        record = create(self, *a, **kw)
        ids["sessions"].append(record.id)
        return record

    def committed(self, record):
        ids["snapshots"].append(record.id)
        return commit(self, record)

    monkeypatch.setattr(SessionStore, "create", created)
    monkeypatch.setattr(SnapshotStore, "commit", committed)
    return ids


def left(made) -> tuple[set[str], set[str]]:
    """Of what the example made, the sessions and snapshots still there."""
    return (
        set(made["sessions"]) & {r.id for r in Session.list()},
        set(made["snapshots"]) & {r.id for r in Session.snapshots()},
    )


def test_the_readme_has_the_examples_this_file_runs():
    assert len(BLOCKS) == 9, "a Python block was added to or removed from the README: run it here too"


def test_run_code_example(capsys):
    exec(compile(BLOCKS[0], "README.md:run_code", "exec"), {})
    assert capsys.readouterr().out == "hi\n 0 True\n"


def test_sandloop_example(capsys):
    exec(compile(BLOCKS[1], "README.md:Sandloop", "exec"), {})
    assert capsys.readouterr().out.startswith("42\n\n42\noci ReapReport(")
    assert our_containers() == []


def test_sessions_example(tmp_path, monkeypatch, capsys, made):
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "sales.csv").write_text("region,revenue\nnorth,120\nsouth,80\n")
    monkeypatch.chdir(tmp_path)
    namespace: dict = {}
    exec(compile(BLOCKS[2], "README.md:sessions", "exec"), namespace)
    assert capsys.readouterr().out == "np.int64(200)\n"  # the cell's value is its repr, as in Jupyter
    assert made["sessions"] and left(made) == (set(), set()), "the example leaves a session behind"
    assert our_containers() == []


def test_pause_fork_snapshot_example(capsys, made):
    exec(compile(BLOCKS[3], "README.md:pause", "exec"), {})
    assert capsys.readouterr().out == "memory\nnp.int64(6) np.int64(60)\n3\n"
    assert made["sessions"] and made["snapshots"]  # it made both, and removed them:
    assert left(made) == (set(), set()), "the example leaves a session or a snapshot behind"
    assert our_containers() == []


def test_templates_example(tmp_path, monkeypatch, capsys, made):
    monkeypatch.chdir(tmp_path)
    exec(compile(BLOCKS[4], "README.md:templates", "exec"), {})
    assert capsys.readouterr().out == "42\n42\n"
    assert made["sessions"] and left(made) == (set(), set()), "the example leaves a session behind"
    assert our_containers() == []


def test_agent_example(monkeypatch, capsys):
    with FakeProviderServer([anthropic_text("102334155"), openai_completion("102334155")]) as fake:
        monkeypatch.setenv("ANTHROPIC_API_KEY", "test-key")
        monkeypatch.setenv("ANTHROPIC_BASE_URL", fake.url)
        code = BLOCKS[5].replace("http://localhost:11434/v1", fake.url + "/v1")
        exec(compile(code, "README.md:agent", "exec"), {})
    out = capsys.readouterr().out
    assert out.startswith("102334155 answered 1 Usage(") and len(fake.requests) == 2, out


def test_egress_example(capsys):
    """No traffic leaves the host: the first run is refused at the proxy before any lookup, the
    second only prints its placeholder."""
    exec(compile(BLOCKS[6], "README.md:egress", "exec"), {})
    first, second = capsys.readouterr().out.splitlines()
    assert first.startswith("False example.com:443 is not on this sandbox's allowlist"), first
    assert second == "True"
    assert our_containers() == []


def test_coming_from_e2b_example(tmp_path, monkeypatch, capsys):
    """E2B's SDK against `sandloop serve` (a real uvicorn here), with the README's three variables."""
    from sandloop.server.app import create_app
    from sandloop.server.tokens import TokenStore
    from tests.servers import serve_in_thread

    tokens = TokenStore(tmp_path / "tokens.sqlite")
    key, _ = tokens.create("alice")
    with serve_in_thread(create_app(tokens)) as url:
        for name, value in (("E2B_API_URL", url), ("E2B_SANDBOX_URL", url), ("E2B_API_KEY", key)):
            monkeypatch.setenv(name, value)
        exec(compile(BLOCKS[7], "README.md:e2b", "exec"), {})
    assert capsys.readouterr().out == "42\nhello\nfrom /home/user\n\n"
    assert our_containers() == []


def test_reaching_in_example(capsys, made):
    exec(compile(BLOCKS[8], "README.md:reaching in", "exec"), {})
    assert capsys.readouterr().out == "<h1>hello from the sandbox</h1>\nTrue 3\n"
    assert made["sessions"] and left(made) == (set(), set()), "the example leaves a session behind"
    assert our_containers() == []

"""The server's terminals (server/terminals.py) over a real agent run as a local process (as in
test_reach_mux.py): a terminal's channel is released the moment it ends, followed or not; a
follower still gets what it showed and its exit code; a sandbox's agent gone releases all; a
revoked token ends its streams (issue 52, findings 5 and 11). Over HTTP and in sandboxes:
tests/integration/test_terminal_release.py."""

from __future__ import annotations

import asyncio
import subprocess
import threading

import pytest

from sandloop.runtime.oci.kernels import ProcessStream
from sandloop.runtime.reach import mux
from sandloop.runtime.reach.mux import Reach, ReachError
from sandloop.server import tokens as tokens_module
from sandloop.server.terminals import ENDED_TAIL, Held, TerminalTable, TokenRevoked, follow
from sandloop.server.tokens import TokenStore

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def agent(tmp_path):
    argv = [*mux.AGENT_ARGV]
    argv[0] = "python3"
    process = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE, bufsize=0, cwd=tmp_path)
    made = Reach(ProcessStream(process), max_channels=4)
    yield made, process
    made.close()


async def _drain(held: Held, **kw) -> tuple[bytes, list[object]]:
    shown, ends = b"", []
    async for kind, value in follow(held, **kw):
        if kind == "data":
            shown += value
        elif kind == "exit":
            ends.append(value)
    return shown, ends


def test_ended_terminals_nobody_follows_free_their_channels(agent):
    """Before: each ended terminal kept its channel until a follower read its exit; the fifth of
    a 4-channel agent was refused (a sandbox's 64, over HTTP: 503 for terminals and previews)."""
    reach, _ = agent
    table = TerminalTable()
    for _ in range(3 * reach.max_channels):
        term = reach.terminal(cwd="/", cmd=["/bin/true"])
        table.add("s", term, {})
        assert table.wait_gone("s", term.pid, 20), "the terminal's end was not handled within 20 s"
    assert reach.open_count() == 0
    assert table.listed("s") == [] and table.count("s") == 0


def test_a_follower_gets_all_output_and_the_exit_code_after_the_release(agent):
    reach, _ = agent
    table = TerminalTable()
    term = reach.terminal(cwd="/", cmd=["sh", "-c", "read x; echo got-$x; exit 3"])
    held = table.add("s", term, {})

    async def scenario() -> tuple[bytes, list[object]]:
        task = asyncio.create_task(_drain(held))
        term.send(b"one\n")
        return await task

    shown, ends = asyncio.run(scenario())
    assert b"got-one" in shown and ends == [3]
    assert table.wait_gone("s", term.pid, 20) and reach.open_count() == 0

    # nobody follows: ended, released, and a follower right after still gets its end
    late = reach.terminal(cwd="/", cmd=["sh", "-c", "head -c 100000 /dev/zero | tr '\\0' x; exit 4"])
    table.add("s", late, {})
    assert table.wait_gone("s", late.pid, 20) and reach.open_count() == 0
    assert table.running("s", late.pid) is None  # no input, no resize: it does not run
    kept = table.held("s", late.pid)
    assert kept is not None
    shown, ends = asyncio.run(_drain(kept))
    assert ends == [4] and shown == b"x" * ENDED_TAIL  # its last output, capped: nobody followed it
    assert table.close("s", late.pid) and table.held("s", late.pid) is None


def test_a_hung_up_terminal_ends_its_follower_at_once(agent):
    reach, _ = agent
    table = TerminalTable()
    term = reach.terminal(cwd="/", cmd=["sleep", "600"])
    held = table.add("s", term, {})

    async def scenario() -> None:
        task = asyncio.create_task(_drain(held))
        await asyncio.sleep(0)  # the follower is waiting (one turn of the loop, not a delay)
        assert table.close("s", term.pid)
        with pytest.raises(ReachError):
            await asyncio.wait_for(task, 10)

    asyncio.run(scenario())
    assert reach.open_count() == 0 and not table.close("s", term.pid)


def test_an_agent_gone_releases_its_terminals_and_ends_their_followers(agent):
    """A session deleted, paused (idle too) or expired ends its agent (``close_reach``, or its
    sandbox's end): its terminals leave the table and free their channels on that alone."""
    reach, process = agent
    table = TerminalTable()
    terms = [reach.terminal(cwd="/", cmd=["sleep", "600"]) for _ in range(3)]
    helds = [table.add("s", t, {}) for t in terms]
    assert reach.open_count() == 3

    async def scenario() -> None:
        task = asyncio.create_task(_drain(helds[0]))
        await asyncio.sleep(0)
        process.kill()  # the sandbox went under the reach
        with pytest.raises(ReachError):
            await asyncio.wait_for(task, 20)

    asyncio.run(scenario())
    for t in terms:
        assert table.wait_gone("s", t.pid, 20)
    assert reach.open_count() == 0 and table.listed("s") == []
    assert all(h.released for h in helds)


def test_forget_releases_a_sessions_terminals(agent):
    reach, _ = agent
    table = TerminalTable()
    terms = [reach.terminal(cwd="/", cmd=["sleep", "600"]) for _ in range(2)]
    for t in terms:
        table.add("s", t, {})
    table.forget("s")
    assert reach.open_count() == 0 and table.listed("s") == [] and table.held("s", terms[0].pid) is None


def test_a_revoked_token_ends_its_stream(agent, tmp_path):
    reach, _ = agent
    store = TokenStore(tmp_path / "tokens.sqlite")
    _, token = store.create("t")
    _, other = store.create("u")
    table = TerminalTable()
    term = reach.terminal(cwd="/", cmd=["sleep", "600"])
    held = table.add("s", term, {})

    async def scenario() -> None:
        listening = threading.Event()
        real = store.on_revoke

        def on_revoke(callback):  # knows when the stream listens: revoking earlier tests less
            off = real(callback)
            listening.set()
            return off

        store.on_revoke = on_revoke  # type: ignore[method-assign]
        task = asyncio.create_task(_drain(held, tokens=store, token_id=token.id))
        await asyncio.to_thread(listening.wait, 10)
        store.revoke(other.id)  # another token's revocation ends nothing
        await asyncio.sleep(0)
        assert not task.done()
        store.revoke(token.id)
        with pytest.raises(TokenRevoked):
            await asyncio.wait_for(task, 10)

    asyncio.run(scenario())
    assert table.running("s", term.pid) is not None  # the terminal itself runs on for its session


def test_a_revocation_by_another_process_is_heard(tmp_path, monkeypatch):
    """``sandloop tokens revoke`` writes the database from its own process: heard by the poller."""
    monkeypatch.setattr(tokens_module, "REVOKE_POLL", 0.05)
    store = TokenStore(tmp_path / "tokens.sqlite")
    _, token = store.create("t")
    heard: list[str] = []
    done = threading.Event()

    def on_revoke(token_id: str) -> None:
        heard.append(token_id)
        done.set()

    off = store.on_revoke(on_revoke)
    try:
        assert TokenStore(tmp_path / "tokens.sqlite").revoke("t") is not None  # another connection
        assert done.wait(20), "the revocation was not heard within 20 s"
        assert heard == [token.id]
    finally:
        off()

"""Idle sessions paused to disk and resumed by their next call (issue 40;
``Settings.session_idle_pause_seconds``, ``sessions/idle.py``), against the real engine.

A test makes its sessions idle by moving their records' last use back, never by waiting; every
sweep here pauses only the test's own sessions (the host's store is shared by the suite's
workers), but for the one through the server's own pauser, whose idle time no other session of
the suite reaches."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from dataclasses import replace

import httpx
import pytest

from sandloop import SandboxLimits
from sandloop.contract import SessionPaused
from sandloop.runner import default_root
from sandloop.server.app import create_app
from sandloop.server.tokens import TokenStore
from sandloop.sessions import Session
from sandloop.sessions.idle import IdlePauser
from tests.servers import serve_in_thread

pytestmark = pytest.mark.timeout(600)

IDLE = 3600.0


def age(session: Session | str, seconds: float = 2 * IDLE) -> None:
    """Make a session look unused for ``seconds`` (its record's last use moved back)."""
    store = default_root().sessions
    session_id = session if isinstance(session, str) else session.id
    store.save(replace(store.load(session_id), last_used=time.time() - seconds))


def pauser_of(*sessions: Session, idle: float = IDLE) -> IdlePauser:
    """A pauser that sees only ``sessions``."""
    mine = {s.id for s in sessions}
    pauser = IdlePauser(default_root(), idle)
    pauser.skip(lambda session_id: session_id not in mine)
    return pauser


def test_an_idle_session_is_paused_to_disk_and_its_next_cell_resumes_it():
    with Session.create(ttl=IDLE * 4, quota="16m") as idle, Session.create(ttl=IDLE * 4, quota="16m") as used:
        idle.run_cell("import pandas as pd; df = pd.DataFrame({'a': [1, 2]}); n = 5")
        idle.write_file("w.txt", "kept")
        used.run_cell("m = 7")
        age(idle)
        pauser = pauser_of(idle, used)
        held = idle._kernel._sandbox  # this object's stream to its interpreter
        assert held is not None
        assert pauser.sweep() == {idle.id: "state"}  # runc keeps the picklable state; `used` was used just now
        # the pauser paused it through a Session of its own: this one lets its dead stream go (a
        # process holding ~700 idle-paused sessions ran out of select()'s 1024 descriptors)
        assert idle._kernel._sandbox is None and held.channel.sock.fileno() == -1
        assert idle.paused == "state" and idle.paused_for_idleness
        assert idle.interpreter_id() is None  # its memory is given back: no interpreter runs
        assert used.paused is None and used.interpreter_id() is not None
        listed = subprocess.run(
            [sys.executable, "-m", "sandloop", "session", "ls"],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "COLUMNS": "300"},
        ).stdout
        row = next(line for line in listed.splitlines() if idle.id in line)
        assert "paused (state, idle: resumes on use)" in row, listed  # the CLI says a call resumes it
        # the next cell resumes it, with its state, and it is no longer paused
        assert idle.run_cell("print(int(df.a.sum()), n, pd.__name__)").stdout.split() == ["3", "5", "pandas"]
        assert idle.paused is None and idle.read_file("w.txt") == b"kept"
        assert pauser.sweep() == {}  # just used: left running


def test_a_session_is_not_paused_while_a_cell_runs_and_its_other_calls_resume_it():
    with Session.create(ttl=IDLE * 4, quota="16m") as s:
        s.run_cell("x = 1")
        started, done = threading.Event(), threading.Event()

        def long_cell() -> None:
            s.run_cell("print('in', flush=True); import time; time.sleep(5); x = 2", on_output=lambda *_: started.set())
            done.set()

        worker = threading.Thread(target=long_cell)
        worker.start()
        assert started.wait(120)
        age(s)
        pauser = pauser_of(s)
        assert pauser.sweep() == {}  # the cell holds it: the pauser does not wait for it
        worker.join(120)
        assert done.is_set() and s.paused is None
        age(s)
        assert pauser.sweep() == {s.id: "state"}
        # a file call, a run and an attach each resume an idle-paused session as a cell does
        s.write_file("f.txt", "after")
        assert s.paused is None
        assert s.run_cell("print(x)").stdout == "2\n"
        age(s)
        assert pauser.sweep() == {s.id: "state"}
        assert s.run("cat f.txt", language="bash").stdout == "after"
        age(s)
        assert pauser.sweep() == {s.id: "state"}
        other = Session.attach(s.id)
        assert other.paused is None
        other.close()


def test_a_callers_pause_stays_until_they_resume_it_and_both_pauses_keep_the_ttl():
    store = default_root().sessions
    with Session.create(ttl=IDLE * 4, quota="16m") as s:
        s.run_cell("y = 3")
        age(s)
        pauser = pauser_of(s)
        assert pauser.sweep() == {s.id: "state"}
        # the idle pause counts the TTL: past it, the session expires ...
        assert store.expired(replace(store.load(s.id), last_used=time.time() - IDLE * 5))
        # ... a caller's pause of it makes it the caller's: calls refused, and its TTL counts from
        # that pause (issue 52 finding 9: it was kept 30 days, past its TTL)
        assert s.pause() == "state" and not s.paused_for_idleness
        assert not store.expired(store.load(s.id))
        assert store.expired(replace(store.load(s.id), last_used=time.time() - IDLE * 5))
        with pytest.raises(SessionPaused, match="resume it"):
            s.run_cell("y")
        assert pauser.sweep() == {}  # paused already
        s.resume()
        assert s.run_cell("print(y)").stdout == "3\n"


def test_a_session_without_an_interpreter_or_with_a_terminal_is_left_running():
    with Session.create(ttl=IDLE * 4, quota="16m") as bare, Session.create(ttl=IDLE * 4, quota="16m") as shell:
        bare.write_file("a.txt", "a")  # no interpreter: nothing in memory for a pause to give back
        shell.run_cell("z = 1")
        term = shell.terminal()
        try:
            term.send(b"echo hi\n")
            age(bare)
            age(shell)
            pauser = pauser_of(bare, shell)
            assert pauser.sweep() == {}
        finally:
            term.close()
        assert bare.paused is None and shell.paused is None
        assert pauser.sweep() == {shell.id: "state"}  # its terminal closed: nothing holds it now


def test_the_pausers_own_thread_pauses_an_idle_session():
    with Session.create(ttl=600, quota="16m") as s:
        s.run_cell("w = 9")
        pauser = pauser_of(s, idle=1.0)  # sweeps every 0.5 s
        pauser.start()
        try:
            deadline = time.monotonic() + 300
            while s.paused is None and time.monotonic() < deadline:
                time.sleep(0.2)
        finally:
            pauser.close()
        assert s.paused == "state" and s.paused_for_idleness
        assert s.run_cell("print(w)").stdout == "9\n"


@pytest.mark.runsc
def test_an_idle_gvisor_session_keeps_its_memory_and_processes():
    with Session.create(limits=SandboxLimits(runtime="runsc"), ttl=IDLE * 4, quota="16m") as s:
        pid = s.run_cell("import subprocess; p = subprocess.Popen(['sleep', '3600']); print(p.pid)").stdout.strip()
        age(s)
        assert pauser_of(s).sweep() == {s.id: "memory"}
        assert s.interpreter_id() is None
        assert s.run_cell("print(p.pid, p.poll())").stdout.split() == [pid, "None"]


def test_over_the_http_api_an_idle_session_answers_its_next_cell_and_an_e2b_sandbox_is_left_alone(tmp_path):
    root = default_root()
    tokens = TokenStore(tmp_path / "tokens.sqlite")
    secret, _ = tokens.create("idle", max_concurrent=8, runs_per_minute=1000, max_timeout=60)
    with (
        serve_in_thread(create_app(tokens)) as url,
        httpx.Client(base_url=url, headers={"Authorization": f"Bearer {secret}"}, timeout=120) as api,
    ):
        sid = api.post("/v1/sessions", json={"ttl_seconds": IDLE * 4, "quota": "16m"}).json()["id"]
        made = api.post("/v2/sandboxes", json={"templateID": "base", "timeout": 300}, headers={"X-API-Key": secret})
        assert made.status_code == 201, made.text
        box = made.json()["sandboxID"]
        was = root.idle.idle_seconds
        try:
            for session_id in (sid, box):  # both have an interpreter running
                r = api.post(f"/v1/sessions/{session_id}/cells", json={"code": "v = 11"})
                assert r.status_code == 200, r.text
                age(session_id)
            root.idle.idle_seconds = IDLE  # the server's own pauser, which skips E2B's sandboxes
            paused = root.idle.sweep()
            assert paused.get(sid) == "state" and box not in paused
            assert root.sessions.paused(box) is None
            shown = api.get(f"/v1/sessions/{sid}").json()
            assert shown["paused"] == "state" and shown["idle_paused"] is True
            assert [s["idle_paused"] for s in api.get("/v1/sessions").json() if s["id"] == sid] == [True]
            r = api.post(f"/v1/sessions/{sid}/cells", json={"code": "print(v)"})
            assert r.status_code == 200 and r.json()["stdout"] == "11\n", r.text
            assert api.get(f"/v1/sessions/{sid}").json()["paused"] is None
            forked = api.post(f"/v1/sessions/{sid}/fork", json={"count": 2, "paused": True})
            assert forked.status_code == 201, forked.text
            kids = [k["id"] for k in forked.json()]
            for kid in kids:  # made paused for want of use, the token's; the first cell resumes each
                shown = api.get(f"/v1/sessions/{kid}").json()
                assert shown["paused"] == "state" and shown["idle_paused"] is True, shown
            r = api.post(f"/v1/sessions/{kids[0]}/cells", json={"code": "print(v + 1)"})
            assert r.status_code == 200 and r.json()["stdout"] == "12\n", r.text
            assert api.get(f"/v1/sessions/{kids[1]}").json()["paused"] == "state"
        finally:
            root.idle.idle_seconds = was
            for kid in locals().get("kids", []):
                api.delete(f"/v1/sessions/{kid}")
            api.delete(f"/v1/sessions/{sid}")
            api.delete(f"/sandboxes/{box}", headers={"X-API-Key": secret})

"""The pool, sessions and the HTTP API on the test double: their own logic (refill, waiters,
back-off, admission, session bookkeeping, ownership and metering) with no engine.

What they decide does not depend on the backend; isolation is proven on the real engine only.
"""

from __future__ import annotations

import socket
import threading
import time

import httpx
import pytest

from sandloop import SandboxBusy, SandboxError, SandboxLimits, Sandloop, SessionNotFound, Settings
from sandloop.contract import EngineUnavailable, ImageMissing, SessionDamaged
from sandloop.runtime.base import SandboxSpec
from sandloop.testing.fake import FakeBackend
from tests.servers import serve_in_thread


@pytest.fixture
def fake(tmp_path):
    with Sandloop(Settings(backend="fake", home=tmp_path, pool_size=2)) as root:
        yield root


def test_a_warm_hit_is_served_from_the_pool_and_never_reused(fake):
    spec = SandboxSpec(fake.image, SandboxLimits().for_container())
    assert fake.dispatcher.prewarm(spec, timeout=30)
    pooled = fake.dispatcher.pooled_ids()
    assert len(pooled) == 2
    assert fake.run_code("print(1)").stdout == "1\n"
    assert fake.dispatcher.warm_runs == 1 and fake.dispatcher.cold_runs == 0
    assert fake.dispatcher.settle(30)  # refilled to 2, the used one destroyed
    now = fake.dispatcher.pooled_ids()
    assert len(now) == 2 and len(pooled - now) == 1  # the one used is gone for good
    owned = {i.id for i in fake.backend.owned() if i.kind == "sandbox"}
    assert owned == now


class _FailingLaunches(FakeBackend):
    """Launches fail (an engine restarting) until ``healthy`` is set."""

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.healthy = threading.Event()
        self.attempts = 0

    def launch(self, spec, *, purpose, lifetime_seconds):
        self.attempts += 1
        if not self.healthy.is_set():
            raise EngineUnavailable("simulated: the engine is restarting")
        return super().launch(spec, purpose=purpose, lifetime_seconds=lifetime_seconds)


def test_a_failing_pool_backs_off_then_recovers(tmp_path):
    backend = _FailingLaunches(home=tmp_path)
    with Sandloop(Settings(backend="fake", home=tmp_path, pool_size=2), backend=backend) as root:
        with pytest.raises(EngineUnavailable):
            root.run_code("print(1)")  # the pool could not fill, the cold path fails too
        pool = next(iter(root.dispatcher._pools.values()))
        deadline = time.monotonic() + 10
        while not pool.failing and time.monotonic() < deadline:
            time.sleep(0.05)
        assert pool.failing and pool.stats.refill_errors >= 1
        tried = backend.attempts
        time.sleep(0.3)
        pool.top_up()  # inside the back-off window: no new attempt
        assert backend.attempts == tried
        backend.healthy.set()
        time.sleep(1.1)
        assert root.run_code("print(2)").stdout == "2\n"
        assert pool.wait_ready(30) and not pool.failing


def test_a_pool_for_an_image_that_can_never_start_is_dropped(tmp_path):
    class NoImage(FakeBackend):
        def launch(self, spec, *, purpose, lifetime_seconds):
            raise ImageMissing("simulated: no such image")

    with Sandloop(Settings(backend="fake", home=tmp_path, pool_size=2), backend=NoImage(home=tmp_path)) as root:
        with pytest.raises(ImageMissing):
            root.run_code("print(1)")
        assert root.dispatcher.stats()["pools"] == {}


def test_admission_says_busy_instead_of_hanging(tmp_path):
    settings = Settings(backend="fake", home=tmp_path, pool_size=0, max_running=1, queue_wait_seconds=0.3)
    with Sandloop(settings) as root:
        slow = threading.Thread(target=root.run_code, args=("import time; time.sleep(2)",))
        slow.start()
        deadline = time.monotonic() + 30
        while root.dispatcher.stats()["in_flight"] < 1 and time.monotonic() < deadline:
            time.sleep(0.01)  # the slow run holds the one slot (observed, not assumed)
        started = time.monotonic()
        with pytest.raises(SandboxBusy, match="SANDLOOP_MAX_RUNNING"):
            root.run_code("print(1)")
        assert time.monotonic() - started < 2
        slow.join()
        assert root.dispatcher.stats()["rejected"] == 1


def test_sessions_bookkeeping(fake):
    with fake.create_session(quota="16m", ttl=60) as s:
        sid = s.id
        s.write_file("in/a.txt", "hello")
        assert s.run_cell("x = open('in/a.txt').read()\nx.upper()").value == "'HELLO'"
        with fake.attach_session(sid) as again:  # `with` on an attached session only detaches
            assert again.run_cell("x").value == "'hello'"
        assert sid in [r.id for r in fake.list_sessions()]
        assert [e["name"] for e in s.list_files("in")] == ["a.txt"]
    assert sid not in [r.id for r in fake.list_sessions()]  # the `with` that created it deleted it
    with pytest.raises(SessionNotFound):
        fake.attach_session(sid)


def test_a_record_saved_by_many_threads_at_once_stays_whole(fake):
    """Requests touch a session's record at once (every attach restarts its idle clock). With one
    shared temporary file two saves interleaved into a damaged record (CI: a stray ``}``, and every
    later call on the session failed); each save now writes its own and the last rename wins."""
    from dataclasses import replace

    s = fake.create_session(quota="16m")
    s.close()
    store = fake.sessions
    record = store.load(s.id)
    stop = threading.Event()
    damaged: list[str] = []
    failed: list[str] = []

    def writer(n: int) -> None:
        i = 0
        while not stop.is_set():
            i += 1  # records of different lengths: an interleaving would show
            try:
                store.save(replace(record, last_used=record.last_used + n * 10**i % 9973, ttl_seconds=60 + i % 7 * 1e5))
            except OSError as exc:  # (a save that lost its temporary file to another: touch ignores it)
                failed.append(repr(exc))

    def reader() -> None:
        while not stop.is_set():
            try:
                store.load(s.id)
            except SandboxError as exc:
                damaged.append(str(exc))
                return

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(1, 5)] + [threading.Thread(target=reader)]
    for t in threads:
        t.start()
    time.sleep(2)
    stop.set()
    for t in threads:
        t.join(30)
    assert damaged == [] and failed == [], (damaged[:1], failed[:1])
    assert [p.name for p in (store.root / s.id).iterdir() if p.name.endswith(".tmp")] == []  # none left
    fake.delete_session(s.id)
    assert not (store.root / s.id).exists()


def test_a_session_with_a_damaged_record_says_so_and_can_still_be_deleted(fake):
    s = fake.create_session(quota="16m")
    s.close()
    path = fake.sessions.root / s.id / "session.json"
    path.write_text(path.read_text() + "}")  # what two interleaved saves once left
    with pytest.raises(SessionDamaged, match="is damaged .*delete the session"):
        fake.attach_session(s.id)
    fake.delete_session(s.id)
    assert not path.parent.exists()
    with pytest.raises(SessionNotFound):
        fake.attach_session(s.id)


def test_over_http_a_damaged_session_answers_its_code_and_deletes(tmp_path, fake):
    from sandloop.server.app import create_app
    from sandloop.server.tokens import TokenStore

    tokens = TokenStore(tmp_path / "tokens.sqlite")
    secret, _ = tokens.create("alice")
    with serve_in_thread(create_app(tokens, sandloop=fake)) as url:
        c = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {secret}"}, timeout=60)
        sid = c.post("/v1/sessions", json={"quota": "16m"}).json()["id"]
        path = fake.sessions.root / sid / "session.json"
        path.write_text(path.read_text() + "}")
        r = c.get(f"/v1/sessions/{sid}/files")
        assert r.status_code == 500 and r.json()["code"] == "session_damaged", r.text
        assert "delete the session" in r.json()["message"]
        assert c.delete(f"/v1/sessions/{sid}").status_code == 204
        assert c.get(f"/v1/sessions/{sid}").status_code == 404
        assert not path.parent.exists()
        c.close()


def test_reap_removes_expired_sessions_and_dead_owners_leftovers(fake):
    s = fake.create_session(quota="16m", ttl=1)
    sid = s.id
    s.close()
    time.sleep(1.2)
    report = fake.reap()
    assert sid in report.expired_sessions and sid not in [r.id for r in fake.list_sessions()]
    gone = f"{socket.gethostname()}:{2**22 + 1}:1"  # a pid above the kernel's maximum: never alive
    dead_owner = SandboxSpec(fake.image, SandboxLimits(), labels=(("sandloop.owner", gone),))
    leftover = fake.backend.launch(dead_owner, purpose="run", lifetime_seconds=60)
    dry = fake.reap(dry_run=True)
    assert leftover.id in [i.id for i in dry.items]  # the owner label names a process that is gone
    fake.reap()
    assert leftover.id not in {i.id for i in fake.backend.owned()}


def test_the_api_scopes_and_meters_on_the_fake(tmp_path, fake):
    from sandloop.server.app import create_app
    from sandloop.server.tokens import TokenStore

    tokens = TokenStore(tmp_path / "tokens.sqlite")
    alice, _ = tokens.create("alice", runs_per_minute=5)
    bob, _ = tokens.create("bob")
    with serve_in_thread(create_app(tokens, sandloop=fake)) as url:
        a = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {alice}"}, timeout=60)
        b = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {bob}"}, timeout=60)
        assert a.post("/v1/runs", json={"code": "print(6*7)"}).json()["stdout"] == "42\n"  # 1
        sid = a.post("/v1/sessions", json={"quota": "16m"}).json()["id"]  # 2
        assert a.put(f"/v1/sessions/{sid}/files/x.txt", content=b"x").status_code == 200  # 3
        assert b.get(f"/v1/sessions/{sid}/files/x.txt").status_code == 404  # bob cannot see it
        assert a.get(f"/v1/sessions/{sid}/files/x.txt").content == b"x"  # 4
        assert a.get(f"/v1/sessions/{sid}/files").status_code == 200  # 5
        limited = a.post(f"/v1/sessions/{sid}/cells", json={"code": "1"})
        assert limited.status_code == 429 and limited.json()["code"] == "rate_limited"
        assert b.post("/v1/runs", json={"code": "print(1)"}).status_code == 200  # bob has his own window
        a.close()
        b.close()


def test_a_bug_in_the_server_answers_in_the_apis_shape_and_is_logged(tmp_path, fake, monkeypatch, caplog):
    """An exception nobody mapped (a bug) still answers ``{code, message}`` (500 ``internal``), with
    an incident id that the server's log repeats beside the traceback: a client never gets a bare
    text body, and an operator can find what happened."""
    from sandloop.server.app import create_app
    from sandloop.server.tokens import TokenStore

    tokens = TokenStore(tmp_path / "tokens.sqlite")
    secret, _ = tokens.create("alice")

    def broken() -> list:
        raise RuntimeError("a bug")

    monkeypatch.setattr(fake, "list_sessions", broken)
    with serve_in_thread(create_app(tokens, sandloop=fake)) as url:
        r = httpx.get(f"{url}/v1/sessions", headers={"Authorization": f"Bearer {secret}"}, timeout=60)
    assert r.status_code == 500, r.text
    body = r.json()
    assert body["code"] == "internal" and "RuntimeError" in body["message"], body
    incident = body["message"].rsplit(" ", 1)[-1]
    assert any(incident in rec.getMessage() and "a bug" in rec.getMessage() for rec in caplog.records)


class _ClusterFake(FakeBackend):
    """The fake with records kept in the backend (``SharedRecords``), as the Ray backend keeps
    them in its registry: what two drivers on different hosts share."""

    def __init__(self, home):
        super().__init__(home)
        self.records: dict[str, dict] = {}

    def get_record(self, session_id):
        return self.records.get(session_id)

    def put_record(self, session_id, record):
        self.records[session_id] = dict(record)

    def remove_record(self, session_id):
        self.records.pop(session_id, None)

    def all_records(self):
        return {k: dict(v) for k, v in self.records.items()}


def test_shared_records_let_a_driver_with_another_home_attach_list_and_reap(tmp_path):
    import os

    backend = _ClusterFake(tmp_path / "engine")
    here = Sandloop(Settings(backend="fake", home=tmp_path / "here", pool_size=0), backend=backend)
    there = Sandloop(Settings(backend="fake", home=tmp_path / "there", pool_size=0), backend=backend)
    s = here.create_session(quota="8m")
    s.run_cell("x = 41")
    assert not (tmp_path / "here" / "sessions" / s.id / "session.json").exists()  # the record is the backend's
    other = there.attach_session(s.id)
    assert other.run_cell("x + 1").value == "42"
    assert [r.id for r in there.list_sessions()] == [s.id]
    other.close()
    # Idle past its TTL: whichever driver reaps removes it everywhere (record and sandboxes).
    backend.records[s.id]["last_used"] -= 10 * 3600
    assert there.sessions.reap_expired() == [s.id]
    assert backend.records == {} and here.list_sessions() == []
    with pytest.raises(SessionNotFound):
        here.attach_session(s.id)
    # A directory here with no record anywhere for an hour (a create that died, or a session
    # another host deleted) is removed; a fresh one (a create in progress) is kept.
    stale, fresh = (tmp_path / "here" / "sessions" / name for name in ("s-0000000000aa", "s-0000000000bb"))
    stale.mkdir()
    fresh.mkdir()
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    here.sessions.reap_expired()
    assert not stale.exists() and fresh.exists()
    here.close()
    there.close()


def test_the_file_store_keeps_a_damaged_record_and_removes_a_create_that_died(fake):
    import os

    sessions = fake.sessions.root
    damaged, died, fresh = (sessions / n for n in ("s-0000000000aa", "s-0000000000bb", "s-0000000000cc"))
    for d in (damaged, died, fresh):
        d.mkdir(parents=True)
    (damaged / "session.json").write_text("{not json")
    for d in (damaged, died):
        os.utime(d, (time.time() - 7200, time.time() - 7200))
    s = fake.create_session(quota="8m")  # a create reaps first
    assert damaged.exists() and not died.exists() and fresh.exists()
    assert [r.id for r in fake.list_sessions()] == [s.id]
    s.delete()


def test_the_session_interpreters_supervisor_on_the_fake(fake):
    """kernel.py's own logic with no engine: contexts, languages, per-cell env, a displayed
    output streamed in order with the prints, an interrupt that keeps the context, and a context
    that ignores its interrupt replaced alone."""
    with fake.create_session(quota="16m") as s:
        seen: list[str] = []  # the order of what came, however the pipe cut it
        r = s.run_cell(
            "from IPython.display import display, HTML\nprint('a')\ndisplay(HTML('<b>b</b>'))\nprint('c')\n7",
            on_output=lambda kind, data: seen.append(data.decode()),
            on_display=lambda output: seen.append(f"[{output.data.get('text/html') or output.text}]"),
        )
        assert r.value == "7" and [o.type for o in r.outputs] == ["display_data", "execute_result"]
        assert "".join(seen) == "a\n[<b>b</b>]c\n[7]"
        assert s.run_cell("import os; os.environ.get('K')", env={"K": "v"}).value == "'v'"
        assert s.run_cell("import os; os.environ.get('K')").value is None
        ctx = s.create_context("bash")
        assert s.run_cell("cd /; Y=1", context=ctx).ok
        assert s.run_cell("echo $Y; pwd", context=ctx).stdout == "1\n/\n"
        assert s.run_cell("1 + 1", language="javascript").value == "2"
        slow = s.run_cell("import time; time.sleep(60)", timeout_seconds=0.5)
        assert slow.timed_out and not slow.interpreter_restarted and slow.error.name == "KeyboardInterrupt"
        stubborn = s.run_cell(
            "import signal, time\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\ntime.sleep(60)", timeout_seconds=0.5
        )
        assert stubborn.interpreter_restarted and not stubborn.sandbox_replaced
        assert s.run_cell("echo $Y", context=ctx).stdout == "1\n"  # its sibling kept its shell
        assert [c.id for c in s.list_contexts()] == ["default", "default-javascript", ctx.id]


def test_a_backend_that_cannot_reach_in_says_so(fake):
    """Ports and terminals need a backend that can start a program in a running sandbox
    (``Reachable``): the test double cannot, and says which backends can."""
    with fake.create_session() as s:
        with pytest.raises(SandboxError, match="cannot reach into a sandbox .*docker or oci backend"):
            s.terminal()
        with pytest.raises(SandboxError, match="cannot reach into a sandbox"):
            s.connect(8000)

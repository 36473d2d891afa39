"""Issue 52 finding 9, on the test double: a caller's pause ends at the session's TTL, and with
its token's revocation (it was kept 30 days after its last use either way). The sessions here
pause their files only (no interpreter runs: the double's cannot write its state to
/workspace); which kind a pause kept does not change when it ends. That a pause's bytes count
against the token's --max-workspace is in tests/integration/test_api.py (a real pause)."""

from __future__ import annotations

import time

import httpx
import pytest

from sandloop import Sandloop, Settings
from sandloop.server.app import create_app
from sandloop.server.tokens import TokenStore
from tests.servers import serve_in_thread


@pytest.fixture
def fake(tmp_path):
    with Sandloop(Settings(backend="fake", home=tmp_path, pool_size=0, reap_interval_seconds=0.5)) as root:
        yield root


def test_a_callers_pause_ends_at_the_sessions_ttl_counted_from_the_pause(fake):
    s = fake.create_session(quota="16m", ttl=3)
    sid = s.id
    time.sleep(2)
    assert s.pause() == "files"  # a use: its 3 s count from here
    s.close()
    time.sleep(1.5)  # 3.5 s after its creation, 1.5 s after its pause
    assert sid in [r.id for r in fake.list_sessions()]
    time.sleep(2)
    assert sid in fake.reap().expired_sessions  # was kept for paused_retention_seconds (30 days)
    assert not (fake.sessions.root / sid).exists()


def test_a_revoked_tokens_sessions_are_removed_by_the_servers_sweep(tmp_path, fake):
    tokens = TokenStore(tmp_path / "tokens.sqlite")
    alice, _ = tokens.create("alice")
    bob, _ = tokens.create("bob")
    with serve_in_thread(create_app(tokens, sandloop=fake)) as url:
        a = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {alice}"}, timeout=60)
        b = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {bob}"}, timeout=60)
        paused = a.post("/v1/sessions", json={"quota": "16m", "ttl_seconds": 86400}).json()["id"]
        assert a.post(f"/v1/sessions/{paused}/pause").json()["paused"] == "files"
        running = a.post("/v1/sessions", json={"quota": "16m", "ttl_seconds": 86400}).json()["id"]
        kept = b.post("/v1/sessions", json={"quota": "16m", "ttl_seconds": 86400}).json()["id"]
        # revoked by another process's store (`sandloop tokens revoke`), as an operator does
        TokenStore(tmp_path / "tokens.sqlite").revoke("alice")
        alice_id = next(t.id for t in tokens.list() if t.name == "alice")
        deadline = time.monotonic() + 20  # the sweep runs every reap_interval_seconds (0.5 here)
        while {paused, running} & {r.id for r in fake.list_sessions()} or tokens.sessions_of(alice_id):
            assert time.monotonic() < deadline, "a revoked token's sessions were kept"
            time.sleep(0.2)
        assert not (fake.sessions.root / paused).exists()
        assert b.get(f"/v1/sessions/{kept}").status_code == 200  # another token's are left alone
        a.close()
        b.close()

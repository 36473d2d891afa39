"""Chaos: ``sandloop serve`` SIGTERMed or SIGKILLed in the middle of a burst of HTTP runs and session
cells, then started again on the same home.

Every request ends in a correct result, a clean HTTP error, or a refused connection while no server
is up -- never a wrong result, never a hang; the session made before the fault reattaches on the
new server with its files intact; and once the second server is stopped nothing of either server
is left (a SIGKILLed server's sandboxes are reaped by the next one: their owner is dead).
"""

from __future__ import annotations

import os
import shutil
import signal
import threading
import time
from pathlib import Path

import docker
import httpx
import pytest

from sandloop.server.tokens import TokenStore
from tests.helpers import direct_sandboxes, owned_by_pid
from tests.servers import sandloop_process, server_log

BOUND = 90.0

pytestmark = [
    pytest.mark.chaos,
    pytest.mark.docker,
    # It kills only the servers it started and counts only what their pids (and its session) own.
    pytest.mark.parallel_ok,
    pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("dockerd"), reason="needs root and a local dockerd"),
]


def _owned_by(pids: list[int], session_id: str) -> list[str]:
    """What any of these processes (or the session) still has: containers, bundles, volumes."""
    left = []
    client = docker.from_env()
    try:
        for c in client.api.containers(all=True, filters={"label": "sandloop.owner"}):
            owner = c["Labels"]["sandloop.owner"]
            if any(f":{pid}:" in owner for pid in pids) or c["Labels"].get("sandloop.session") == session_id:
                left.append(f"container {c['Id'][:12]} {c['State']}")
        label = f"sandloop.session={session_id}"
        left += [f"volume {v.name}" for v in client.volumes.list(filters={"label": label})]
    finally:
        client.close()
    left += [f"bundle {name}" for name in direct_sandboxes(owned_by_pid(*pids))]
    if session_id in Path("/proc/mounts").read_text():
        left.append(f"mount of {session_id}")
    return left


@pytest.mark.timeout(300)
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["SIGTERM", "SIGKILL"])
def test_server_dies_mid_burst_then_restarts(sig, tmp_path):
    secret, _ = TokenStore(tmp_path / "tokens.sqlite").create("chaos", runs_per_minute=100_000, max_concurrent=16)
    headers = {"Authorization": f"Bearer {secret}"}
    state = {"url": ""}
    outcomes: list[tuple[str, str, float, bool]] = []  # kind, outcome, seconds, sound
    oks: list[tuple[str, float]] = []  # kind, when the request was sent: what was served right
    lock = threading.Lock()
    stop = threading.Event()

    def record(kind: str, outcome: str, started: float, sound: bool) -> None:
        with lock:
            outcomes.append((kind, outcome, time.monotonic() - started, sound))
            if outcome == "ok":
                oks.append((kind, started))

    def post(kind: str, path: str, code: str, started: float) -> dict | None:
        """The JSON answer, or None once the outcome is recorded (no server up, an HTTP error)."""
        try:
            r = httpx.post(
                f"{state['url']}{path}", json={"code": code, "timeout_seconds": 10}, headers=headers, timeout=BOUND
            )
        except httpx.TransportError as exc:  # no server up (between the kill and the restart)
            record(kind, type(exc).__name__, started, True)
            time.sleep(0.2)
            return None
        if r.status_code != 200:
            # a clean error: the API's {"code", "message"} with a 4xx/5xx
            try:
                clean = r.status_code >= 400 and "code" in r.json()
            except ValueError:  # not the API's JSON error: an unhandled exception in the server
                clean = False
            record(kind, f"HTTP {r.status_code} {r.text[:200]}", started, clean)
            return None
        body: dict = r.json()
        return body

    def runs(worker: int) -> None:
        i = 0
        while not stop.is_set():
            i += 1
            n = worker * 100_000 + i
            started = time.monotonic()
            body = post("run", "/v1/runs", f"import time\ntime.sleep(0.1)\nprint({n} * {n})", started)
            if body is not None:
                right = body["exit_code"] == 0 and body["stdout"] == f"{n * n}\n"
                record("run", "ok" if right else "failed run", started, right or body["exit_code"] != 0)

    def cells(session_id: str) -> None:
        i = 0
        while not stop.is_set():
            i += 1
            started = time.monotonic()
            body = post("cell", f"/v1/sessions/{session_id}/cells", f"{i} * 3", started)
            if body is not None:
                right = body.get("value") == str(i * 3)
                sound = right or body.get("interpreter_restarted") or body["exit_code"] != 0
                record("cell", "ok" if right else "failed cell", started, bool(sound))

    def served(after: float) -> None:
        """Wait (bounded) until a run and a cell started after ``after`` were served right: the
        fault comes, and the burst ends, once each server has done work (on a busy host a fixed
        number of seconds may see none)."""
        deadline = time.monotonic() + BOUND
        while time.monotonic() < deadline:
            with lock:
                done = {kind for kind, sent in oks if sent >= after}
            if done >= {"run", "cell"}:
                return
            time.sleep(0.2)
        raise AssertionError(f"no run and cell served within {BOUND:.0f} s: {outcomes[-5:]}")

    pids: list[int] = []
    with sandloop_process("serve", home=tmp_path) as (port, first):
        pids.append(first.pid)
        state["url"] = f"http://127.0.0.1:{port}"
        made = httpx.post(f"{state['url']}/v1/sessions", json={"quota": "32m"}, headers=headers, timeout=120)
        assert made.status_code == 201, made.text
        session_id = made.json()["id"]
        put = httpx.put(
            f"{state['url']}/v1/sessions/{session_id}/files/keep.txt", content=b"intact", headers=headers, timeout=120
        )
        assert put.status_code == 200, put.text
        threads = [threading.Thread(target=runs, args=(w,)) for w in range(3)]
        threads.append(threading.Thread(target=cells, args=(session_id,)))
        for t in threads:
            t.start()
        served(time.monotonic())
        first.send_signal(sig)
        first.wait(60)
    killed_at = time.monotonic()
    try:
        with sandloop_process("serve", home=tmp_path) as (port, second):
            pids.append(second.pid)
            state["url"] = f"http://127.0.0.1:{port}"
            back = time.monotonic()
            got = httpx.get(f"{state['url']}/v1/sessions/{session_id}/files/keep.txt", headers=headers, timeout=120)
            assert got.status_code == 200 and got.content == b"intact", got.text  # reattached, files intact
            served(back)
            stop.set()
            for t in threads:
                t.join(BOUND + 30)
            assert not any(t.is_alive() for t in threads), "a request hung"
            errors = [o for o in outcomes if not o[3]]
            assert not errors, (errors, server_log(second))
            gone = httpx.delete(f"{state['url']}/v1/sessions/{session_id}", headers=headers, timeout=120)
            assert gone.status_code == 204, (gone.text, server_log(second))
    finally:
        stop.set()
    summary: dict[str, int] = {}
    for kind, outcome, *_ in outcomes:
        summary[f"{kind} {outcome}"] = summary.get(f"{kind} {outcome}", 0) + 1
    print(f"\nserver {sig.name}: {len(outcomes)} requests {summary}; the restart took {back - killed_at:.1f} s")
    assert all(o[3] for o in outcomes), [o for o in outcomes if not o[3]]
    assert max(o[2] for o in outcomes) < BOUND
    assert summary.get("run ok", 0) > 0 and summary.get("cell ok", 0) > 0
    deadline = time.monotonic() + 60
    while (left := _owned_by(pids, session_id)) and time.monotonic() < deadline:
        time.sleep(1)
    assert left == []

"""The Ray backend on a real local cluster (a head and two sandbox nodes, sandloop.testing.ray_cluster),
shared with the contract suite's ``ray`` parameter: runs spread over the nodes, sessions across
drivers, the HTTP API over the cluster, a node killed mid-run (its runs fail fast, nothing runs
twice, the live node takes the next), and nothing left behind."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import docker
import httpx
import pytest

from sandloop import Sandloop
from sandloop.contract import NodeLost, SandboxLimits, SessionLost, SessionNotPaused, SessionPaused, SnapshotNotFound
from sandloop.runtime.labels import LABEL_PREFIX, OWNER_LABEL, SESSION_LABEL
from tests.conftest import ray_settings
from tests.helpers import owned_by_pid
from tests.servers import serve_in_thread

pytestmark = pytest.mark.ray
#: Sessions the tests here made and deleted (their workspaces must be gone at the end).
DELETED: list[str] = []


@pytest.fixture(scope="module")
def root(ray_cluster):
    sl = Sandloop(ray_settings(ray_cluster))
    yield sl
    sl.close()


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env.pop("RAY_ADDRESS", None)
    return env


def _other_driver(cluster, tmp_path, body: str):
    """Run ``body`` in a driver of its own (``sl``: its Sandloop, with a SANDLOOP_HOME of its own,
    as a driver on another host would have); what its last line printed, as JSON."""
    backend = {"type": "ray", "address": cluster.address, "node_backend": "docker"}
    script = (
        "import json\n"
        "from sandloop import Sandloop, Settings\n"
        f"sl = Sandloop(Settings(backend={backend!r}, pool_size=0, home={str(tmp_path / 'other-host')!r}))\n"
        f"{body}sl.close()\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=_env(), timeout=180)
    assert done.returncode == 0, done.stderr[-2000:]
    return json.loads(done.stdout.strip().splitlines()[-1])


def test_runs_spread_over_both_nodes_with_correct_results(root):
    nodes = root.backend.node_ids()
    assert len(nodes) == 2
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda i: root.run_code(f"print({i} * {i})"), range(12)))
    assert [r.stdout for r in results] == [f"{i * i}\n" for i in range(12)]
    assert {r.host for r in results} == set(nodes)  # both nodes took runs; each result says which
    assert all(r.ok and r.backend == "docker" for r in results)
    assert root.run_code("import os; print(os.getuid())").stdout != "0\n"  # the sandbox's isolation, unchanged


def test_cluster_status_lists_the_nodes_and_their_state(root, ray_cluster):
    states = root.backend.status()
    assert sorted(s["node_id"] for s in states) == sorted(root.backend.node_ids())
    assert all(s["has_image"] and s["max_running"] > 0 and s["backend"] == "docker" for s in states)
    assert all("runc" in s["runtimes"] for s in states)  # what each node's engine has, asked there
    assert "runc" in root.backend.info().runtimes
    backend = json.dumps({"type": "ray", "address": ray_cluster.address, "node_backend": "docker"})
    done = subprocess.run(
        [sys.executable, "-m", "sandloop", "cluster", "status", "--json"],
        capture_output=True,
        text=True,
        env={**_env(), "SANDLOOP_BACKEND": backend},
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert sorted(n["node_id"] for n in json.loads(done.stdout)) == sorted(root.backend.node_ids())
    local = subprocess.run(
        [sys.executable, "-m", "sandloop", "cluster", "status"], capture_output=True, text=True, env=_env(), timeout=120
    )
    assert local.returncode == 2 and "SANDLOOP_BACKEND=ray" in local.stderr
    # The front doors take the backend from the environment: one variable and Ray's own address.
    ran = subprocess.run(
        [sys.executable, "-m", "sandloop", "run", "--json", "-c", "print(6 * 7)"],
        capture_output=True,
        text=True,
        env={**_env(), "SANDLOOP_BACKEND": "ray", "RAY_ADDRESS": ray_cluster.address},
        timeout=120,
    )
    assert ran.returncode == 0, ran.stderr
    result = json.loads(ran.stdout)
    assert result["stdout"] == "42\n" and result["host"] in root.backend.node_ids()


def test_a_session_made_by_one_driver_is_attached_from_another(root, ray_cluster, tmp_path):
    """The other driver has its own SANDLOOP_HOME, as a driver on another host would: the record
    comes from the cluster's registry, not this host's files."""
    s = root.create_session(quota="32m")
    try:
        s.run_cell("x = 41")
        s.write_file("notes.txt", "kept")
        value, notes, host, listed = _other_driver(
            ray_cluster,
            tmp_path,
            f"s = sl.attach_session({s.id!r})\n"
            "c = s.run_cell('x + 1')\n"
            "listed = [r.id for r in sl.list_sessions()]\n"
            "print(json.dumps([c.value, s.read_file('notes.txt').decode(), c.host, listed]))\n"
            "s.close()\n",
        )
        assert value == "42" and notes == "kept" and host in root.backend.node_ids() and s.id in listed
        assert not (root.settings.home / "sessions" / s.id / "session.json").exists()  # not this host's file
        assert s.run_cell("x").value == "41"  # and from this driver again
    finally:
        s.delete()
        DELETED.append(s.id)


def test_output_streams_across_the_cluster_and_a_caller_who_gives_up_interrupts(root):
    """Output comes as the code writes it (not all at the end), for cells and runs; a cell whose
    caller gives up (``cancel``) is interrupted on its node and the interpreter keeps its state."""
    s = root.create_session(quota="32m")
    try:
        seen: list[tuple[float, str, bytes]] = []
        code = "import time\nprint('first', flush=True)\ntime.sleep(2)\nprint('second')\n'done'"
        c = s.run_cell(code, on_output=lambda name, data: seen.append((time.monotonic(), name, data)))
        ended = time.monotonic()
        assert c.value == "'done'" and c.stdout == "first\nsecond\n"
        assert b"".join(d for _, _, d in seen) == b"first\nsecond\n"
        first_at = next(t for t, _, d in seen if b"first" in d)
        assert ended - first_at > 1.0, "the first line came with the result, not as it was printed"

        s.run_cell("kept = 'yes'")
        cancel = threading.Event()
        threading.Timer(1.0, cancel.set).start()
        t0 = time.monotonic()
        c = s.run_cell("import time\nwhile True: time.sleep(0.1)", timeout_seconds=120, cancel=cancel)
        assert c.timed_out and not c.interpreter_restarted and "KeyboardInterrupt" in c.stderr
        assert time.monotonic() - t0 < 30  # interrupted on its node, not at its two-minute timeout
        assert s.run_cell("kept").value == "'yes'"
    finally:
        s.delete()
        DELETED.append(s.id)
    seen = []
    r = root.run_code(
        "import time\nprint('a', flush=True)\ntime.sleep(2)\nprint('b')",
        on_output=lambda name, data: seen.append((time.monotonic(), name, data)),
    )
    ended = time.monotonic()
    assert r.stdout == "a\nb\n" and b"".join(d for _, _, d in seen) == b"a\nb\n"
    assert ended - next(t for t, _, d in seen if b"a" in d) > 1.0


def test_the_http_api_serves_the_cluster(root, tmp_path, monkeypatch):
    from e2b_code_interpreter import Sandbox

    from sandloop.server.app import create_app
    from sandloop.server.tokens import TokenStore

    tokens = TokenStore(tmp_path / "tokens.sqlite")
    key, _ = tokens.create("ray")
    with serve_in_thread(create_app(tokens, sandloop=root)) as url:
        headers = {"Authorization": f"Bearer {key}"}
        r = httpx.post(f"{url}/v1/runs", json={"code": "print(6 * 7)"}, headers=headers, timeout=120).json()
        assert r["stdout"] == "42\n" and r["host"] in root.backend.node_ids()
        sid = httpx.post(f"{url}/v1/sessions", json={}, headers=headers, timeout=120).json()["id"]
        cell = httpx.post(f"{url}/v1/sessions/{sid}/cells", json={"code": "2 + 2"}, headers=headers, timeout=120)
        assert cell.json()["value"] == "4"
        paused = httpx.post(f"{url}/v1/sessions/{sid}/pause", headers=headers, timeout=300)
        assert paused.status_code == 200 and paused.json()["paused"] == "state", paused.text
        listed = httpx.get(f"{url}/v1/sessions", headers=headers, timeout=120).json()
        assert [x["paused"] for x in listed if x["id"] == sid] == ["state"]
        refused = httpx.post(f"{url}/v1/sessions/{sid}/cells", json={"code": "1"}, headers=headers, timeout=120)
        assert refused.status_code == 409 and refused.json()["code"] == "session_paused", refused.text
        resumed = httpx.post(f"{url}/v1/sessions/{sid}/resume", headers=headers, timeout=300)
        assert resumed.status_code == 200 and resumed.json()["resumed"] == "state", resumed.text
        assert httpx.delete(f"{url}/v1/sessions/{sid}", headers=headers, timeout=120).status_code == 204
        DELETED.append(sid)
        # The E2B API over the cluster: the official SDK, output streamed as it is printed.
        for name in ("E2B_API_URL", "E2B_SANDBOX_URL"):
            monkeypatch.setenv(name, url)
        monkeypatch.setenv("E2B_API_KEY", key)
        sbx = Sandbox.create(timeout=300)
        try:
            seen: list[float] = []
            code = "import time\nprint('a', flush=True)\ntime.sleep(2)\nprint('b')\n6 * 7"
            execution = sbx.run_code(code, on_stdout=lambda _msg: seen.append(time.monotonic()))
            ended = time.monotonic()
            assert execution.text == "42" and "".join(execution.logs.stdout) == "a\nb\n"
            assert ended - seen[0] > 1.0, "run_code's output came at the end, not as printed"
            assert sbx.commands.run("echo hi").stdout == "hi\n"
            # E2B's pause and connect-resumes, over the cluster (its Python state on runc nodes)
            sbx.run_code("kept = 'here'")
            sbx.beta_pause()
            assert not sbx.is_running()
            assert [x.state for x in Sandbox.list().next_items() if x.sandbox_id == sbx.sandbox_id] == ["paused"]
            sbx = Sandbox.connect(sbx.sandbox_id)
            assert sbx.run_code("kept").text == "here"
        finally:
            sbx.kill()
            DELETED.append(sbx.sandbox_id)


def test_a_node_without_the_image_says_so_and_a_full_cluster_is_busy(ray_cluster):
    """Other actors (their own namespace) with other node settings: an image no node has makes
    every node say so and take no runs (SandboxBusy, not a hang); one run slot per node and a
    short queue wait make a third concurrent run SandboxBusy after that wait."""
    from sandloop import Settings
    from sandloop.contract import SandboxBusy

    missing = Sandloop(
        Settings(
            backend={
                "type": "ray",
                "address": ray_cluster.address,
                "node_backend": "docker",
                "namespace": "sl-noimage",
            },
            image="sandloop-runtime:not-built",
            pool_size=0,
        )
    )
    try:
        states = missing.backend.status()
        assert len(states) == 2 and not any(s["has_image"] for s in states)
        assert all("sandloop images build" in s["problem"] for s in states)
        started = time.monotonic()
        with pytest.raises(SandboxBusy, match="no node"):
            missing.run_code("print(1)")
        assert time.monotonic() - started < 60
    finally:
        missing.backend.shutdown_nodes()
        missing.close()
    small = Sandloop(
        Settings(
            backend={"type": "ray", "address": ray_cluster.address, "node_backend": "docker", "namespace": "sl-small"},
            pool_size=0,
            max_running=1,
            queue_wait_seconds=2,
        )
    )
    try:
        outcomes: list[str] = []

        def one() -> None:
            try:
                outcomes.append(small.run_code("import time; time.sleep(6)").stdout or "ran")
            except SandboxBusy as exc:
                outcomes.append(f"busy: {exc}")

        threads = [threading.Thread(target=one) for _ in range(3)]
        for t in threads:
            t.start()
            time.sleep(0.5)
        for t in threads:
            t.join(60)
        busy = [o for o in outcomes if o.startswith("busy")]
        assert len(outcomes) == 3 and len(busy) == 1 and "every node of the cluster is full" in busy[0], outcomes
    finally:
        small.backend.shutdown_nodes()
        small.close()


def _by(pids: set[int], labels: dict[str, str] | None) -> bool:
    """Whether these labels are a container's made by one of these node processes (other test
    workers start run containers on the same engine meanwhile)."""
    return owned_by_pid(*pids)((labels or {}).get(OWNER_LABEL, ""))


class _RunStarts:
    """Run containers the nodes ``pids`` start on the engine (both share this host's), counted
    from a live stream of its events: a later ``since`` query would see only the engine's last 256
    events, which other test workers' sandboxes push out."""

    def __init__(self, pids: set[int], since: float):
        self._client = docker.from_env()
        # since: the engine replays what came between ``since`` and the subscription, then streams
        self._stream = self._client.events(
            since=since, decode=True, filters={"event": "start", "label": [f"{LABEL_PREFIX}purpose=run"]}
        )
        self._started: list[str] = []  # the nodes' run containers, one entry per start
        self._broken: Exception | None = None
        self._reader = threading.Thread(target=self._read, args=(pids,), daemon=True)
        self._reader.start()

    def _read(self, pids: set[int]) -> None:
        try:
            for event in self._stream:
                actor = event.get("Actor", {})
                if _by(pids, actor.get("Attributes")):
                    self._started.append(actor.get("ID", ""))
        except Exception as exc:  # close() ends the stream under the reader; anything before is the engine's
            self._broken = exc

    def count(self, at_least: int) -> int:
        """Starts seen once ``at_least`` have come (or 30 s passed): the stream is in the engine's
        order, so whatever started before the last of them has been seen too."""
        deadline = time.monotonic() + 30
        while len(self._started) < at_least and self._reader.is_alive() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert self._broken is None, f"the engine's event stream broke: {self._broken!r}"
        return len(self._started)

    def close(self) -> None:
        self._stream.close()
        self._reader.join(10)
        self._client.close()


@pytest.mark.timeout(300)
def test_a_node_killed_mid_run_loses_its_runs_and_nothing_runs_twice(root, ray_cluster, request):
    """Four runs sleeping on the two nodes (two of them streaming their output); the raylet of the
    node that holds a session is SIGKILLed. Its runs raise NodeLost within seconds, the other
    node's finish, the session is SessionLost, no run's sandbox was started twice (counted on the
    engine), later runs go to the live node; when the node comes back its reaper removes what the
    lost one left."""
    session = root.create_session(quota="16m")
    session.run_cell("kept = 1")  # its interpreter holds the workspace on the node
    (paused,) = session.fork()  # lives where its parent does
    assert paused.pause() == "state"  # and stays there, paused, when that node is lost
    paused.close()
    session.close()
    victim = root.backend._session_node(session.id)
    assert root.backend._session_node(paused.id) == victim
    survivor = next(n for n in root.backend.node_ids() if n != victim)
    nodes = {s["pid"] for s in root.backend.status()}  # the node actors' processes: their runs are counted
    t0 = time.time()
    starts = _RunStarts(nodes, since=t0)
    request.addfinalizer(starts.close)
    outcomes: dict[int, tuple] = {}

    def one(i: int) -> None:
        started = time.monotonic()
        try:
            streams = (lambda name, data: None) if i < 2 else None  # each node gets a streamed run and a plain one
            r = root.run_code(
                f"import time\nprint('run-{i}', flush=True)\ntime.sleep(10)", timeout_seconds=30, on_output=streams
            )
            outcomes[i] = ("ok", r.host, time.monotonic() - started)
        except NodeLost as exc:
            outcomes[i] = ("lost", str(exc), time.monotonic() - started, time.monotonic())

    threads = [threading.Thread(target=one, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    # all four inside their sandboxes (observed on the engine, not assumed after a pause)
    deadline = time.monotonic() + 60
    while len(_leftover_runs(t0, nodes, running=True)) < 4 and time.monotonic() < deadline:
        time.sleep(0.2)
    assert len(_leftover_runs(t0, nodes, running=True)) == 4
    ray_cluster.kill_node(ray_cluster.node_index(victim))
    killed = time.monotonic()
    for t in threads:
        t.join(90)
    lost = {i: o for i, o in outcomes.items() if o[0] == "lost"}
    ok = {i: o for i, o in outcomes.items() if o[0] == "ok"}
    assert len(outcomes) == 4 and lost and ok, outcomes
    assert all(o[1] == survivor for o in ok.values()), outcomes
    assert all(o[3] - killed < 20 for o in lost.values()), outcomes  # failed within seconds of the kill
    later = root.run_code("print('after')")
    assert later.ok and later.host == survivor
    # Until the cluster marks the node dead, its session's calls raise NodeLost; then SessionLost.
    deadline = time.monotonic() + 90
    while victim in root.backend.node_ids() and time.monotonic() < deadline:
        try:
            root.attach_session(session.id)
        except NodeLost:
            pass
        except SessionLost:  # the cluster marked the node dead between the check and the call (CI saw it)
            assert victim not in root.backend.node_ids()
            break
        else:
            pytest.fail("a session on a killed node was attached")
        time.sleep(1)
    with pytest.raises(SessionLost, match="gone"):
        root.attach_session(session.id)
    with pytest.raises(SessionLost, match="gone"):  # a paused session is lost with its node
        root.attach_session(paused.id)
    assert starts.count(at_least=5) == 5  # four runs and the later one: none started a second time
    # The session is deleted while its node is gone; the node returns (a new Ray node on the same
    # host and home): its reaper removes the lost actor's leftovers (their owner is dead) once they
    # ended, and the deleted session's workspace.
    root.sessions.delete(session.id)
    root.sessions.delete(paused.id)
    ray_cluster.restart_node(ray_cluster.last_killed)
    home = ray_cluster.homes[ray_cluster.last_killed]
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        if len(root.backend.node_ids()) == 2:
            root.backend.status()  # reaches the new node's actor: its reaper runs at start
            if (
                not _leftover_runs(t0, nodes)
                and not _volume_of(session.id)
                and not _volume_of(paused.id)
                and not _containers_of(session.id)
                and not (home / "sessions" / paused.id).exists()
            ):
                break
        time.sleep(2)
    assert len(root.backend.node_ids()) == 2
    assert not _leftover_runs(t0, nodes)
    assert not _volume_of(session.id) and not _volume_of(paused.id)
    assert not _containers_of(session.id)  # its interpreter too
    kept = home / "sessions" / paused.id
    assert not kept.exists(), (  # what its pause kept went with it
        sorted(str(p.relative_to(kept)) for p in kept.rglob("*")),
        [line for line in Path("/proc/self/mounts").read_text().splitlines() if str(kept) in line],
    )


def _volume_of(session_id: str) -> list[str]:
    client = docker.from_env()
    try:
        return [v.name for v in client.volumes.list(filters={"label": f"{SESSION_LABEL}={session_id}"})]
    finally:
        client.close()


def _containers_of(session_id: str) -> list[str]:
    client = docker.from_env()
    try:
        found = client.containers.list(all=True, sparse=True, filters={"label": f"{SESSION_LABEL}={session_id}"})
        return [c.id for c in found]
    finally:
        client.close()


def _leftover_runs(since: float, pids: set[int], running: bool = False) -> list[str]:
    """Run containers (running or not, or ``running`` only) the nodes ``pids`` made since
    ``since``: a finished run's is removed at once."""
    client = docker.from_env()
    try:
        # sparse: one listing, no inspect per container (one removed meanwhile would be a 404)
        found = client.containers.list(all=not running, sparse=True, filters={"label": f"{LABEL_PREFIX}purpose=run"})
        created = f"{LABEL_PREFIX}created"
        return [
            c.id
            for c in found
            if _by(pids, c.attrs.get("Labels")) and float((c.attrs.get("Labels") or {}).get(created, "0")) >= since - 1
        ]
    finally:
        client.close()


def test_a_template_is_built_on_one_node_and_runs_on_every_node(root, tmp_path):
    """Issue 24 on Ray: the steps run on the build node (a helper step's package sent from the
    driver, RUN's log streamed back as it comes), runs and sessions from the template land on
    both nodes, an image goes node to node keeping its id, removal reaches every node."""
    from sandloop.images.templates import parse_steps_file
    from sandloop.images.templates.build import image_name
    from tests.template_packages import make_wheel

    wheel = make_wheel(tmp_path)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "note.txt").write_text("from the template\n")
    (tmp_path / "steps.yaml").write_text(
        f"steps:\n  - pip_install: [{wheel}]\n  - run: echo started; mkdir -p /opt/t && echo 42 > /opt/t/answer\n"
        "  - copy: {src: data, dest: /opt/data}\n  - env: {ON_RAY: cluster}\n"
    )
    name = f"ray-{uuid.uuid4().hex[:8]}"
    ref, tagged = f"{name}:v1", image_name(name, "v1")
    lines: list[str] = []
    result = root.templates.build(
        parse_steps_file(tmp_path / "steps.yaml", ref), on_event=lambda e: lines.append(e.line or "")
    )
    builder = root.backend.image_builder()
    try:
        assert any("started" in line for line in lines)  # the step's own output, from the build node
        assert root.templates.get(ref).image_id == result.image_id
        probe = "import tinypkg, os; print(tinypkg.ANSWER, open('/opt/t/answer').read().strip(), os.environ['ON_RAY'])"
        with ThreadPoolExecutor(4) as pool:
            runs = list(pool.map(lambda _: root.run_code(probe, template=ref), range(8)))
        assert all(r.ok and r.stdout == "42 42 cluster\n" for r in runs), [r.stderr for r in runs]
        assert {r.host for r in runs} == set(root.backend.node_ids())  # both nodes ran it
        with root.create_session(template=ref) as s:
            assert s.run_cell("print(open('/opt/data/note.txt').read(), end='')").stdout == "from the template\n"
        build, other = builder.build_node(), next(n for n in root.backend.node_ids() if n != builder.build_node())
        root.backend.node_call(other, "receive_image", build, tagged, timeout=600)  # docker save -> load
        assert root.backend.node_call(other, "build", "inspect", tagged)["Id"] == result.image_id
    finally:
        root.templates.remove(ref)
    assert all(root.backend.node_call(n, "build", "inspect", tagged) is None for n in root.backend.node_ids())


def _kernels_of(backend, session_id: str) -> list[str]:
    """The session's interpreters, as every node lists them."""
    return [i.id for i in backend.owned() if i.kind == "sandbox" and i.labels.get(SESSION_LABEL) == session_id]


def test_a_session_pauses_on_its_node_and_resumes_from_another_driver(root, ray_cluster, tmp_path):
    """Issue 25 on Ray: the pause happens on the node holding the session (runc on these Docker
    nodes keeps the Python state), nothing of it runs there while paused, every driver sees it
    paused and is refused its cells, and another driver's attach resumes it where it lives."""
    s = root.create_session(quota="32m")
    try:
        first = s.run_cell("import json; x = 41; names = ['a', 'b']")
        s.write_file("notes.txt", "kept")
        assert s.pause() == "state"
        assert s.paused == "state"
        assert _kernels_of(root.backend, s.id) == []  # no interpreter on its node while paused
        with pytest.raises(SessionPaused):
            s.run_cell("x")
        with pytest.raises(SessionPaused):
            s.run("print(1)")
        with pytest.raises(SessionNotPaused):
            s.pause()
        assert root.sessions.paused(s.id) == "state"
        value, host, notes, paused = _other_driver(
            ray_cluster,
            tmp_path,
            f"s = sl.attach_session({s.id!r})\n"  # attaching resumes it, on its node
            "c = s.run_cell('json.dumps([x + 1, names])')\n"
            "print(json.dumps([c.value, c.host, s.read_file('notes.txt').decode(), s.paused]))\n"
            "s.close()\n",
        )
        assert json.loads(ast.literal_eval(value)) == [42, ["a", "b"]] and notes == "kept" and paused is None
        assert host == first.host  # resumed where it lives
        assert s.run_cell("x").value == "41"  # this driver's next cell finds the resumed interpreter
        with pytest.raises(SessionNotPaused):
            s.resume()
        # A fork lives where its parent does (its snapshot is kept there), with its own workspace.
        (child,) = s.fork()
        try:
            assert child.run_cell("x").value == "41" and child.run_cell("x = 0").host == first.host
            child.write_file("notes.txt", "the child's")
            assert s.read_file("notes.txt") == b"kept" and s.run_cell("x").value == "41"
            assert root.snapshots.list(s.id) == []  # a fork's own snapshot is gone once it is made
        finally:
            child.delete()
            DELETED.append(child.id)
    finally:
        s.delete()
        DELETED.append(s.id)
    assert _kernels_of(root.backend, s.id) == []


@pytest.mark.timeout(600)
def test_a_gvisor_session_keeps_its_memory_on_a_ray_node(ray_cluster):
    """Nodes on the direct backend (the default ``node_backend``; these actors in a namespace of
    their own beside the Docker ones): a runsc session's memory is checkpointed on its node, a
    background process keeps its pid and a generator its place across pause and resume, and
    a deleted session leaves nothing of its pause on the node."""
    from sandloop import Settings
    from sandloop.sessions import Session

    backend = {"type": "ray", "address": ray_cluster.address, "node_backend": "oci", "namespace": "sandloop-oci"}
    sl = Sandloop(Settings(backend=backend, pool_size=0))
    try:
        s = sl.create_session(SandboxLimits(runtime="runsc"), quota="32m")
        try:
            s.run_cell("import subprocess; p = subprocess.Popen(['sleep', '3600']); g = iter(range(10)); next(g)")
            pid = s.run_cell("p.pid").value
            assert s.pause() == "memory"
            assert _kernels_of(sl.backend, s.id) == []
            assert s.resume() == "memory"
            assert s.run_cell("[next(g), p.pid, p.poll()]").value == f"[1, {pid}, None]"
            # Snapshots are kept by the node; every driver lists them; sessions start from them there.
            snap = s.snapshot(name="at two")
            assert snap.kind == "memory" and [r.id for r in sl.snapshots.list(s.id)] == [snap.id]
            assert s.run_cell("next(g)").value == "2"  # the session goes on
            with Session.from_snapshot(snap.id, root=sl) as again:
                assert again.run_cell("[next(g), p.pid]").value == f"[2, {pid}]"  # its own copy of the memory
                assert again.run_cell("x = 1").host == s.run_cell("1").host
            a, b = s.fork(2)
            try:
                assert a.run_cell("next(g)").value == b.run_cell("next(g)").value == s.run_cell("next(g)").value == "3"
            finally:
                a.delete()
                b.delete()
            Session.delete_snapshot(snap.id, root=sl)
            assert sl.snapshots.list() == []
            with pytest.raises(SnapshotNotFound):
                sl.snapshots.get(snap.id)
        finally:
            s.delete()
        assert _kernels_of(sl.backend, s.id) == []
        # nothing of its pauses, forks or snapshot is left on the nodes' disks
        assert not [p for h in ray_cluster.homes for p in (h / "sessions").glob("*") if p.name == s.id]
        assert not [p for h in ray_cluster.homes for p in (h / "snapshots").glob("*") if p.name.endswith(snap.id)]
    finally:
        sl.backend.shutdown_nodes()  # this namespace's actors: the Docker ones stay for the rest
        sl.close()


def test_nothing_is_left_when_the_nodes_stop(root, ray_cluster):
    """Last here: the node actors stopped the clean way (as before taking a cluster down) leave no
    container or workspace behind; then the cluster stops (nothing later needs it: the rest of
    the suite runs without its processes)."""
    pids = {s["pid"] for s in root.backend.status()}
    assert root.backend.shutdown_nodes() == 2
    client = docker.from_env()
    try:
        left = [
            c.id
            for c in client.containers.list(all=True, sparse=True, filters={"label": OWNER_LABEL})
            if _by(pids, c.attrs.get("Labels"))
        ]
        volumes = client.volumes.list(filters={"label": f"{LABEL_PREFIX}session"})
    finally:
        client.close()
    import ray

    ray.shutdown()
    ray_cluster.stop()
    assert not ray_cluster.processes()
    assert left == []
    assert DELETED and not [v.name for v in volumes if (v.attrs.get("Labels") or {}).get(SESSION_LABEL) in DELETED]

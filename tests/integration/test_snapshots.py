"""Pause, resume, snapshot and fork (issue 25) against the real engine: gVisor keeps the memory
(runsc checkpoint on the direct backend), runc keeps the picklable Python state; both keep files."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sandloop import SandboxLimits
from sandloop.contract import InvalidArgument, SessionNotPaused, SessionPaused, SnapshotIncompatible, SnapshotNotFound
from sandloop.runner import default_root
from sandloop.runtime.labels import SESSION_LABEL
from sandloop.sessions import Session

pytestmark = pytest.mark.timeout(600)

#: A cell that leaves behind what a memory snapshot must keep: a module, data, a generator part-way,
#: a background process, an open file, a /tmp file, and a loopback server with a live connection.
LIVE_STATE = """
import numpy as np, os, socket, subprocess
data = np.arange(1_000_000)
gen = (i for i in range(100)); next(gen)
sleeper = subprocess.Popen(['sleep', '3600'])
log = open('/workspace/log.txt', 'w'); log.write('first '); log.flush()
open('/tmp/scratch.txt', 'w').write('in tmp')
server = socket.socket(); server.bind(('127.0.0.1', 0)); server.listen()
client = socket.create_connection(server.getsockname()); peer, _ = server.accept()
print(sleeper.pid)
"""

CHECK_STATE = """
log.write('second'); log.flush()
client.sendall(b'ping'); got = peer.recv(4)
print(int(data.sum()), next(gen), sleeper.poll(), sleeper.pid, open('/tmp/scratch.txt').read(), got.decode(),
      open('/workspace/log.txt').read())
"""


def direct_interpreters(session_id: str) -> list[Path]:
    from tests.helpers import OCI_BUNDLES

    found = []
    for config in Path(OCI_BUNDLES).glob("*/config.json"):
        if json.loads(config.read_text()).get("annotations", {}).get("sandloop.session") == session_id:
            found.append(config.parent)
    return found


def cpu_quota(session_id: str) -> str:
    """The CFS quota of the session's (one) direct interpreter, from the host's cgroup file; its
    bundle keeps no quota for later."""
    from sandloop.runtime.oci.kernels import QUOTA_AFTER

    [bundle] = direct_interpreters(session_id)
    assert not (bundle / QUOTA_AFTER).exists()
    return Path(f"/sys/fs/cgroup/cpu/sandloop/{bundle.name}/cpu.cfs_quota_us").read_text().strip()


@pytest.fixture
def gvisor_session():
    s = Session.create(limits=SandboxLimits(runtime="runsc"), ttl=600, quota="64m")
    yield s
    s.delete()


@pytest.mark.runsc
def test_gvisor_pause_keeps_memory_processes_files_and_sockets_and_holds_nothing(gvisor_session):
    s = gvisor_session
    started = s.run_cell(LIVE_STATE)
    assert started.ok, started.stderr
    pid = int(started.stdout.strip())
    [bundle] = direct_interpreters(s.id)  # gVisor's interpreter runs directly, not through Docker
    cgroup = Path("/sys/fs/cgroup/memory/sandloop") / bundle.name
    assert cgroup.is_dir()

    assert s.pause() == "memory"
    assert s.paused == "memory"
    # paused: no sandbox, no process, no memory cgroup on the host
    assert direct_interpreters(s.id) == [] and not cgroup.exists()
    assert not [p for p in Path("/proc").glob("[0-9]*") if _cmdline_has(p, bundle.name)]
    with pytest.raises(SessionPaused, match="resume"):
        s.run_cell("1")
    with pytest.raises(SessionNotPaused):
        s.pause()

    assert s.resume() == "memory" and s.paused is None
    # the memory image loaded without the CPU quota (sandloop's work); the code runs under it again
    assert cpu_quota(s.id) == "50000"  # 0.5 CPU, read from the host's cgroup
    r = s.run_cell(CHECK_STATE)
    assert r.ok, r.stderr
    assert r.stdout.split() == [
        str(sum(range(1_000_000))),
        "1",
        "None",
        str(pid),
        "in",
        "tmp",
        "ping",
        "first",
        "second",
    ]
    with pytest.raises(SessionNotPaused):
        s.resume()


def _cmdline_has(proc: Path, text: str) -> bool:
    """A live process (a zombie holds nothing: reaping it is init's business) naming ``text``."""
    try:
        state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        return state != "Z" and text.encode() in (proc / "cmdline").read_bytes()
    except (OSError, IndexError):
        return False


@pytest.mark.runsc
def test_ten_pause_resume_cycles_lose_nothing(gvisor_session):
    s = gvisor_session
    s.run_cell("count = 0")
    for i in range(10):
        s.write_file(f"f{i}.txt", str(i))
        assert s.run_cell("count += 1; count").value == str(i + 1)
        assert s.pause() == "memory"
        s.resume()
    assert s.run_cell("count").value == "10"
    assert sorted(f["name"] for f in s.list_files()) == [f"f{i}.txt" for i in range(10)]
    assert [s.read_file(f"f{i}.txt") for i in range(10)] == [str(i).encode() for i in range(10)]


@pytest.mark.runsc
def test_attach_from_another_process_resumes_a_paused_session(gvisor_session):
    s = gvisor_session
    s.run_cell("kept = 'from before'")
    s.pause()
    code = (
        "from sandloop.sessions import Session; import sys\n"
        f"s = Session.attach({s.id!r}); print(s.paused, s.run_cell('kept').value)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert out.stdout.split() == ["None", "'from", "before'"], out.stderr
    assert s.run_cell("kept").value == "'from before'"  # this handle finds the resumed interpreter


@pytest.mark.runsc
def test_a_gvisor_fork_has_its_own_memory_and_workspace(gvisor_session):
    s = gvisor_session
    s.run_cell("import numpy as np; arr = np.zeros(3)")
    s.write_file("shared.txt", "parent")
    kids = s.fork(2)
    try:
        assert len({k.id for k in kids} | {s.id}) == 3
        kids[0].run_cell("arr[0] = 7")
        kids[0].write_file("shared.txt", "kid0")
        kids[1].write_file("new.txt", "only kid1")
        assert s.run_cell("float(arr[0])").value == "0.0"
        assert kids[0].run_cell("float(arr[0])").value == "7.0"
        assert kids[1].run_cell("float(arr[0])").value == "0.0"
        assert s.read_file("shared.txt") == b"parent" and kids[1].read_file("shared.txt") == b"parent"
        assert kids[0].read_file("shared.txt") == b"kid0"
        assert "new.txt" not in [f["name"] for f in s.list_files()]
    finally:
        for k in kids:
            k.delete()
    assert Session.snapshots(s.id) == []  # the fork's own snapshot is gone


@pytest.mark.runsc
def test_paused_forks_hold_no_memory_and_resume_with_their_own_copy_at_first_use(gvisor_session):
    """``fork(paused=True)``: each child is an idle pause with its own copy of the memory image
    (nothing restored now, no sandbox of its own), resumed at its first call with the parent's
    variables and workspace; what one then changes no other sees."""
    s = gvisor_session
    s.run_cell("import numpy as np; arr = np.zeros(3); n = 41")
    s.write_file("shared.txt", "parent")
    kids = s.fork(3, paused=True)
    try:
        assert [k.paused for k in kids] == ["memory"] * 3 and all(k.paused_for_idleness for k in kids)
        assert all(direct_interpreters(k.id) == [] for k in kids)  # no sandbox holds their memory
        root = default_root()
        images = [root.sessions.root / k.id / "paused" / "memory" for k in kids]
        assert all(p.is_dir() for p in images) and len({os.stat(p).st_ino for p in images}) == 3  # copies
        assert s.run_cell("n + 1").value == "42"  # the parent runs on
        assert kids[0].run_cell("arr[0] = 7; n + 1").value == "42"  # resumed at its first call
        assert kids[0].paused is None and len(direct_interpreters(kids[0].id)) == 1
        assert kids[1].read_file("shared.txt") == b"parent"
        assert kids[1].run_cell("float(arr[0])").value == "0.0"
        assert kids[2].paused == "memory"  # untouched: still paused, still nothing held
        assert s.run_cell("float(arr[0])").value == "0.0"
    finally:
        for k in kids:
            k.delete()
    assert Session.snapshots(s.id) == []


def test_a_paused_fork_of_a_runc_session_keeps_its_state_and_the_flag_is_checked():
    s = Session.create(ttl=600, quota="64m")
    try:
        s.run_cell("x = {'a': 1}")
        with pytest.raises(InvalidArgument, match="paused must be true or false"):
            s.fork(1, paused="yes")  # type: ignore[arg-type]
        [kid] = s.fork(1, paused=True)
        try:
            assert kid.paused == "state" and kid.paused_for_idleness
            assert kid.run_cell("x['a'] + 1").value == "2" and kid.paused is None
        finally:
            kid.delete()
    finally:
        s.delete()


@pytest.mark.runsc
@pytest.mark.serial  # no staged snapshot left anywhere in the host's store: others stage theirs meanwhile
def test_a_failed_snapshot_or_fork_never_loses_the_sessions_memory(gvisor_session, monkeypatch):
    """A snapshot that fails after its checkpoint restores the interpreter from it before removing
    it; a fork whose parent does not come back (restored beside its children) keeps the parent's
    memory in the fork's snapshot and says how to start it, and leaves no child."""
    from sandloop.sessions import snapshots as snapshot_store

    s = gvisor_session
    s.run_cell("x = 41")
    root = default_root()
    commit = snapshot_store.SnapshotStore.commit

    def full_disk(self, record):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(snapshot_store.SnapshotStore, "commit", full_disk)
    with pytest.raises(OSError, match="No space"):
        s.snapshot(name="doomed")
    monkeypatch.setattr(snapshot_store.SnapshotStore, "commit", commit)
    assert s.run_cell("x + 1").value == "42"  # its memory came back from the failed snapshot's checkpoint
    assert Session.snapshots(s.id) == [] and not list(root.snapshots.root.glob(".snap-*"))

    bring_back = Session._bring_back
    sessions_before = {r.id for r in root.list_sessions()}

    def parent_fails(self, directory, kind):
        if self.id == s.id:
            raise RuntimeError("runsc restore failed")
        return bring_back(self, directory, kind)

    monkeypatch.setattr(Session, "_bring_back", parent_fails)
    with pytest.raises(Exception, match="Session.from_snapshot") as raised:
        s.fork(2)
    monkeypatch.setattr(Session, "_bring_back", bring_back)
    assert {r.id for r in root.list_sessions()} == sessions_before  # no child left
    [kept] = Session.snapshots(s.id)
    assert kept.id in str(raised.value) and kept.kind == "memory"
    with Session.from_snapshot(kept.id) as again:
        assert again.run_cell("x").value == "41"
    Session.delete_snapshot(kept.id)


@pytest.mark.runsc
def test_a_restore_nobody_answered_gets_its_cpu_quota_from_its_holder(gvisor_session, monkeypatch):
    """The first answer applies a restore's CPU quota; when it never comes (the restoring process
    died), the holder applies it after its deadline (2 s here, 30 by default)."""
    from sandloop.runtime.oci.kernels import QUOTA_AFTER, DirectKernels

    monkeypatch.setenv("SANDLOOP_RESTORE_QUOTA_SECONDS", "2")  # read by the holder this test starts
    monkeypatch.setattr(DirectKernels, "throttle", lambda self, kernel: None)  # as if the restorer died
    s = gvisor_session
    s.run_cell("x = 5")
    snap = s.snapshot()
    try:
        with Session.from_snapshot(snap.id) as other:
            [bundle] = direct_interpreters(other.id)
            # restored without a quota in its config: whatever quota it has later was applied after
            assert "quota" not in json.loads((bundle / "config.json").read_text())["linux"]["resources"]["cpu"]
            quota = Path(f"/sys/fs/cgroup/cpu/sandloop/{bundle.name}/cpu.cfs_quota_us")
            deadline = time.monotonic() + 120  # the holder's loop wakes every 0.5 s
            while (bundle / QUOTA_AFTER).exists() and time.monotonic() < deadline:
                time.sleep(0.2)
            assert quota.read_text().strip() == "50000" and not (bundle / QUOTA_AFTER).exists()
            assert other.run_cell("x").value == "5"
    finally:
        Session.delete_snapshot(snap.id)


@pytest.mark.runsc
def test_snapshots_list_start_sessions_and_delete(gvisor_session):
    s = gvisor_session
    s.run_cell("x = 1")
    snap = s.snapshot(name="x is 1")
    assert (snap.kind, snap.name, snap.session_id) == ("memory", "x is 1", s.id) and snap.size_bytes > 0
    s.run_cell("x = 2")  # the session went on running
    assert [r.id for r in Session.snapshots(s.id)] == [snap.id]
    with Session.from_snapshot(snap.id) as other:
        assert other.run_cell("x").value == "1"
        assert other.id != s.id
    assert s.run_cell("x").value == "2"
    Session.delete_snapshot(snap.id)
    with pytest.raises(SnapshotNotFound):
        Session.from_snapshot(snap.id)
    with pytest.raises(SnapshotNotFound):
        Session.delete_snapshot(snap.id)


@pytest.mark.runsc
def test_a_memory_snapshot_of_another_runsc_is_refused_and_starts_nothing(gvisor_session, monkeypatch):
    s = gvisor_session
    s.run_cell("x = 1")
    snap = s.snapshot()
    facts = default_root().snapshots.dir(snap.id) / "memory" / "facts.json"
    facts.write_text(json.dumps({**json.loads(facts.read_text()), "runsc": "runsc version 0.0~20200101.0"}))
    # the sessions this call makes (other test workers make theirs on the same host meanwhile)
    store, made = default_root().sessions, []
    create = store.create
    monkeypatch.setattr(store, "create", lambda **kw: made.append(create(**kw)) or made[-1])
    with pytest.raises(SnapshotIncompatible, match="another runsc version"):
        Session.from_snapshot(snap.id)
    assert len(made) == 1  # it began one session ...
    assert made[0].id not in {r.id for r in Session.list()}  # ... and the half-made session went
    owned = default_root().backend.owned()
    assert not [o for o in owned if o.labels.get(SESSION_LABEL) == made[0].id]  # nor any sandbox of it
    Session.delete_snapshot(snap.id)


def test_runc_pause_keeps_the_picklable_state_and_says_what_it_dropped():
    with Session.create(ttl=600, quota="16m") as s:
        s.run_cell("import pandas as pd; df = pd.DataFrame({'a': [1, 2]}); n = 5; fn = lambda: 1")
        s.write_file("w.txt", "kept")
        assert s.pause() == "state"  # runc keeps no memory on this host: it says so
        s.resume()
        r = s.run_cell("print(int(df.a.sum()), n, pd.__name__, 'fn' in globals())")
        assert r.stdout.split() == ["3", "5", "pandas", "False"]
        assert s.read_file("w.txt") == b"kept"
        snap = s.snapshot()
        assert snap.kind == "state" and snap.dropped == []  # nothing unpicklable is left now
        s.run_cell("gen = (i for i in range(3))")
        snap2 = s.snapshot()
        assert snap2.dropped == ["gen"]
        [kid] = s.fork()
        try:
            assert kid.run_cell("print(int(df.a.sum()), n)").stdout.split() == ["3", "5"]
            kid.write_file("w.txt", "kid")
            assert s.read_file("w.txt") == b"kept"
        finally:
            kid.delete()
        for snap_id in (snap.id, snap2.id):
            Session.delete_snapshot(snap_id)


def test_a_session_without_an_interpreter_pauses_its_files():
    with Session.create(ttl=600, quota="16m") as s:
        s.write_file("a.txt", "a")
        assert s.pause() == "files"
        assert s.resume() == "files"
        assert s.read_file("a.txt") == b"a"


@pytest.mark.runsc
def test_a_process_killed_mid_pause_leaves_the_session_running_or_paused_never_neither(gvisor_session):
    s = gvisor_session
    s.run_cell("kept = 41")
    home = default_root().sessions.root / s.id
    code = f"from sandloop.sessions import Session; Session.attach({s.id!r}).pause()"
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    # killed once the pause has begun: its staging folder exists (or it already finished)
    while not (home / ".paused").exists() and not (home / "paused").exists() and proc.poll() is None:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    again = Session.attach(s.id)  # resumes what the pause kept, or finds the interpreter running
    assert again.paused is None
    assert again.run_cell("kept + 1").value == "42"
    assert not (home / ".paused").exists()


@pytest.mark.runsc
def test_a_process_killed_mid_resume_leaves_the_session_resumable(gvisor_session):
    s = gvisor_session
    s.run_cell("kept = 41")
    s.pause()
    code = f"from sandloop.sessions import Session; Session.attach({s.id!r})"
    proc = subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
    # killed once its restore has begun (the restored interpreter's bundle exists), or after it is done
    while not direct_interpreters(s.id) and proc.poll() is None:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    again = Session.attach(s.id)  # the restore went on in its own holder, or starts again
    assert again.paused is None
    assert again.run_cell("kept + 1").value == "42"
    assert len(direct_interpreters(s.id)) == 1
    assert cpu_quota(s.id) == "50000"  # a restore whose restorer died is throttled by whoever finds it

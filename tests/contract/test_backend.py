"""What any backend must do (``runtime/base.py``), on every backend (see conftest.py).

The fake isolates nothing, so the tests of limits (OOM) apply where ``info().isolated``;
isolation itself is proven against the real engine in ``integration/`` and ``adversarial/``.
"""

from __future__ import annotations

import os
import time

import pytest

from sandloop.contract import SandboxError
from sandloop.runtime.labels import LABEL_PREFIX, SESSION_LABEL

#: Session ids of this process (pytest-xdist runs backends side by side on one engine), shaped as
#: sessions' ids are (s- and 12 hex digits).
SID1, SID2, SID3, SID4 = (f"s-{(os.getpid() << 8 | i) & (16**12 - 1):012x}" for i in range(1, 5))


def ids(backend, kind="sandbox"):
    return {item.id for item in backend.owned() if item.kind == kind}


def test_a_run_gives_separate_streams_stdin_and_the_exit_code(under):
    code = "import sys\nprint('out ' + sys.stdin.read())\nprint('err', file=sys.stderr)\nsys.exit(3)"
    r = under.backend.run(under.request(code, stdin="in"))
    assert (r.stdout, r.stderr, r.exit_code, r.timed_out, r.ok) == ("out in\n", "err\n", 3, False, False)
    node = under.backend.run(under.request("echo $((6 * 7)); exit 0", "bash"))
    assert node.stdout == "42\n" and node.ok


def test_a_sandbox_is_single_use(under):
    b = under.backend
    sandbox = b.launch(under.spec(), purpose="run", lifetime_seconds=60)
    try:
        assert b.execute(sandbox, under.request("print(1)")).stdout == "1\n"
        with pytest.raises(SandboxError, match="twice"):
            b.execute(sandbox, under.request("print(2)"))
    finally:
        b.destroy(sandbox)


def test_a_timeout_gives_minus_one_and_keeps_partial_output(under):
    # started first, so the timeout is the program's alone: a cold gVisor start on a busy machine
    # took more than the 1.5 s this gave the whole run (CI saw no "started")
    request = under.request("import time\nprint('started', flush=True)\ntime.sleep(120)", timeout=5)
    sandbox = under.backend.launch(request.spec, purpose="run", lifetime_seconds=60)
    try:
        r = under.backend.execute(sandbox, request)
    finally:
        under.backend.destroy(sandbox)
    assert r.timed_out and r.exit_code == -1 and not r.ok and r.stdout == "started\n"
    assert r.duration_seconds < 60


def test_truncation_counts_what_was_dropped(under):
    r = under.backend.run(under.request("print('x' * 100_000, end='')", limits=under.limits(output_limit=1000)))
    assert len(r.stdout) == 1000 and r.stdout_truncated and r.stdout_dropped_bytes == 99_000
    assert not r.stderr_truncated and r.stderr_dropped_bytes == 0


def test_a_kill_at_the_memory_ceiling_is_flagged(under):
    if not under.isolated:
        pytest.skip("the test double enforces no memory limit (info().isolated is False)")
    r = under.backend.run(under.request("x = bytearray(400 * 1024 * 1024)", limits=under.limits(memory="128m")))
    assert r.exit_code == 137 and r.oom_killed


def test_owned_sandboxes_carry_labels_until_destroyed(under):
    b = under.backend
    sandbox = b.launch(under.spec(labels=((SESSION_LABEL, SID1),)), purpose="pool", lifetime_seconds=60)
    try:
        item = next(i for i in b.owned() if i.id == sandbox.id)
        assert item.kind == "sandbox" and item.labels[f"{LABEL_PREFIX}purpose"] == "pool"
        assert item.labels[SESSION_LABEL] == SID1 and f"{LABEL_PREFIX}owner" in item.labels
        assert b.is_alive(sandbox) and sandbox.started_at <= time.monotonic()
    finally:
        b.destroy(sandbox)
    assert sandbox.id not in ids(b)
    b.destroy(sandbox)  # destroy never raises, even twice
    b.retry_removals()


def test_remove_labelled_removes_a_sessions_sandboxes(under):
    b = under.backend
    spec = under.spec(labels=((SESSION_LABEL, SID2),))
    made = [b.launch(spec, purpose="run", lifetime_seconds=60) for _ in range(2)]
    other = b.launch(under.spec(), purpose="run", lifetime_seconds=60)
    try:
        assert b.remove_labelled(SESSION_LABEL, SID2) == 2
        assert not ({s.id for s in made} & ids(b)) and other.id in ids(b)
    finally:
        b.destroy(other)
        for s in made:
            b.destroy(s)
    deadline = time.monotonic() + 30  # a backend may tear down in the background: pending until done
    while b.retry_removals() and time.monotonic() < deadline:
        time.sleep(0.1)
    assert b.retry_removals() == 0


def test_a_workspace_survives_its_sandboxes(under):
    b = under.backend
    ref = b.create_workspace(SID3, 16 * 1024 * 1024, "65534:65534")
    try:
        mounted = under.spec(cwd="/workspace", volumes=((ref.name, "/workspace"),))
        for code, expected in (("open('kept.txt', 'w').write('hi')", ""), ("print(open('kept.txt').read())", "hi\n")):
            sandbox = b.launch(mounted, purpose="run", lifetime_seconds=60)
            try:
                r = b.execute(sandbox, under.request(code, cwd="/workspace", volumes=mounted.volumes))
                assert r.ok and r.stdout == expected, r
            finally:
                b.destroy(sandbox)
        assert ref.name in ids(b, "workspace")
    finally:
        b.delete_workspace(SID3)
    assert ref.name not in ids(b, "workspace")


def test_a_kernel_keeps_state_survives_an_interrupt_and_is_found_again(under):
    b = under.backend
    labels = ((SESSION_LABEL, SID4), (f"{LABEL_PREFIX}owner", "session:" + SID4))
    spec = under.spec(labels=labels, command=("--kernel",))
    limits = under.limits()
    kernel = b.launch(spec, purpose="kernel", lifetime_seconds=60)
    try:
        first = b.run_cell(kernel, "x = 20\nx + 1", limits=limits, interrupt_after=30, grace=3)
        assert first.value == "21" and first.ok
        slow = b.run_cell(kernel, "import time\nwhile True: time.sleep(0.1)", limits=limits, interrupt_after=1, grace=5)
        assert slow.timed_out and not slow.interpreter_restarted and "KeyboardInterrupt" in slow.stderr
        b.detach(kernel)
        again = b.find_kernel(SID4, spec)
        assert again is not None and again.id == kernel.id
        assert b.run_cell(again, "x * 2", limits=limits, interrupt_after=30, grace=3).value == "40"
        kernel = again
    finally:
        b.destroy(kernel)
    assert b.find_kernel(SID4, spec) is None


def test_info_names_the_backend(under):
    info = under.backend.info()
    assert info.name in ("docker", "oci", "fake", "ray") and under.runtime in info.runtimes and info.version

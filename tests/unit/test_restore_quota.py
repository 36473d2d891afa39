"""A restored gVisor interpreter's CPU quota, applied after its restore (``shim.apply_pending_quota``,
shared by its first answer and its holder): read back from the host's cgroup file, the pending
note removed only once it took, and a clear reason when it cannot be applied."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from sandloop.runtime.oci.shim import NOT_YET, QUOTA_AFTER, apply_pending_quota

CPU = Path("/sys/fs/cgroup/cpu")


@pytest.fixture
def cgroup():
    if os.geteuid() != 0 or not CPU.is_dir():
        pytest.skip("needs root and a cgroup v1 cpu hierarchy")
    directory = CPU / f"sandloop-unit-{os.getpid()}"
    directory.mkdir()
    yield directory
    directory.rmdir()


def _bundle(tmp_path: Path, cgroups_path: str, pending: str | None) -> Path:
    (tmp_path / "config.json").write_text(json.dumps({"linux": {"cgroupsPath": cgroups_path}}))
    if pending is not None:
        (tmp_path / QUOTA_AFTER).write_text(pending)
    return tmp_path


def test_the_pending_quota_is_applied_read_back_and_forgotten(tmp_path, cgroup):
    bundle = _bundle(tmp_path, f"/{cgroup.name}", "50000 100000")
    assert (cgroup / "cpu.cfs_quota_us").read_text().strip() == "-1"
    assert apply_pending_quota(str(bundle)) is None
    assert (cgroup / "cpu.cfs_quota_us").read_text().strip() == "50000"
    assert (cgroup / "cpu.cfs_period_us").read_text().strip() == "100000"
    assert not (bundle / QUOTA_AFTER).exists()
    assert apply_pending_quota(str(bundle)) is None  # nothing pending: nothing to do


def test_a_quota_that_cannot_be_applied_says_why_and_stays_pending(tmp_path, cgroup):
    # found while its restore is still starting (no cpu cgroup yet): pending, for the first answer
    bundle = _bundle(tmp_path, "/no-such-cgroup-here", "50000 100000")
    assert apply_pending_quota(str(bundle)) == NOT_YET
    assert (bundle / QUOTA_AFTER).exists()
    (bundle / QUOTA_AFTER).write_text("garbage")
    why = apply_pending_quota(str(bundle))  # unreadable: said, not raised
    assert why and why != NOT_YET
    assert (bundle / QUOTA_AFTER).exists()
    bundle = _bundle(tmp_path, f"/{cgroup.name}", "not-a-number 100000")
    why = apply_pending_quota(str(bundle))  # the kernel refuses the value: said, still pending
    assert why and why != NOT_YET and (bundle / QUOTA_AFTER).exists()

"""Chaos: the host's disk nearly full, and a workspace that fills in the middle of a write.

sandloop's home and the direct backend's image store are put on a small tmpfs, most of it taken
by a filler file, as an operator's nearly full disk would be. Required: clear errors, never lost or
half-replaced data, and nothing left behind.

Before: a session whose quota exceeded the free space was created (its image is sparse); a 100 MB
write inside got ENOSPC only at fsync, the file kept its full length, and the kernel logged lost
page writes under the workspace's ext4 ("potential data loss").
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import pytest

from sandloop import HostDiskFull, Sandloop, Settings, WorkspaceFull
from sandloop.settings import OCIConfig
from tests.helpers import our_containers

MiB = 1024 * 1024

pytestmark = [
    pytest.mark.chaos,
    pytest.mark.docker,
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (a tmpfs for the small disk, loop mounts)"),
]


def _free(path: Path) -> int:
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


@pytest.fixture
def small_disk(tmp_path):
    """A 320 MiB disk with ``leave`` MiB left free (call it)."""
    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=320m", "tmpfs", str(disk)], check=True)

    def fill(leave_mib: int) -> Path:
        filler = disk / "filler"
        filler.unlink(missing_ok=True)
        size = _free(disk) - leave_mib * MiB
        subprocess.run(["fallocate", "-l", str(size), str(filler)], check=True)
        return disk

    try:
        yield fill
    finally:
        subprocess.run(["umount", "-R", str(disk)], check=False)
        if os.path.ismount(disk):
            subprocess.run(["umount", "-R", "-l", str(disk)], check=False)


def _sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


@pytest.mark.timeout(300)
def test_sessions_on_a_nearly_full_disk_get_clear_errors_and_keep_their_data(small_disk):
    disk = small_disk(leave_mib=170)
    home = disk / "home"
    with Sandloop(Settings(home=home, pool_size=0)) as root:
        first = root.create_session(quota="64m")  # 64 + 64 reserve fit in 170
        try:
            # A second 64m workspace would not fit beside what the first may still grow by.
            with pytest.raises(HostDiskFull, match="smaller quota"):
                root.create_session(quota="64m")
            assert [s.id for s in root.list_sessions()] == [first.id]  # nothing of the refused one
            assert sorted(p.name for p in (home / "sessions").iterdir()) == [first.id]

            # The first fills its own quota: ENOSPC inside, and every byte it wrote reads back.
            code = (
                "import hashlib, os\n"
                "data = bytes(range(256)) * 4096 * 40\n"  # 40 MiB
                "with open('kept.bin', 'wb') as f:\n"
                "    f.write(data); f.flush(); os.fsync(f.fileno())\n"
                "print(hashlib.sha256(data).hexdigest())\n"
                "try:\n"
                "    with open('overflow.bin', 'wb') as f:\n"
                "        while True:\n"
                "            f.write(os.urandom(1 << 20)); f.flush(); os.fsync(f.fileno())\n"
                "except OSError as e:\n"
                "    print(e.errno)\n"
            )
            r = first.run(code, timeout_seconds=120)
            digest, errno_seen = r.stdout.split()
            assert r.ok and errno_seen == "28", (r.stdout, r.stderr)  # ENOSPC, inside the workspace
            check = "import hashlib; print(hashlib.sha256(open('kept.bin','rb').read()).hexdigest())"
            assert first.run(check).stdout.strip() == digest

            # A file replaced by a write that cannot fit is not half-replaced.
            first.run("import os; os.remove('overflow.bin')")
            original = os.urandom(MiB)
            first.write_file("doc.bin", original)
            first.run("open('pad.bin', 'wb').write(b'x' * (16 << 20))")
            with pytest.raises(WorkspaceFull):
                first.write_file("doc.bin", os.urandom(8 * MiB))
            assert _sha(first.read_file("doc.bin")) == _sha(original)
            names = [e["name"] for e in first.list_files()]
            assert not [n for n in names if "sandloop-tmp" in n], names

            # The disk itself full to the last byte: a new session is refused, nothing is written.
            small_disk(leave_mib=1)
            with pytest.raises(HostDiskFull):
                root.create_session(quota="8m")
            assert sorted(p.name for p in (home / "sessions").iterdir()) == [first.id]
            assert first.run(check).stdout.strip() == digest  # the existing session still reads back
        finally:
            small_disk(leave_mib=170)
            first.delete()
    assert not list((home / "sessions").iterdir())
    assert str(home) not in Path("/proc/mounts").read_text()


@pytest.mark.timeout(300)
def test_the_image_export_on_a_full_disk_is_a_clear_error_or_runs_through_docker(small_disk):
    disk = small_disk(leave_mib=150)  # the image is ~400 MB: its export cannot fit
    store = disk / "store"
    state = Path("/run/sandloop/oci-diskfull-test")
    strict = Settings(home=disk / "home", pool_size=0, backend=OCIConfig(store=store, state=state, fallback=False))
    with Sandloop(strict) as root, pytest.raises(HostDiskFull, match="free space there"):
        root.run_code("print(1)")
    lenient = Settings(home=disk / "home", pool_size=0, backend=OCIConfig(store=store, state=state))
    with Sandloop(lenient) as root:
        r = root.run_code("print(6 * 7)")
        assert (r.ok, r.stdout, r.backend) == (True, "42\n", "docker")  # Docker's disk has room
    leftovers = [p.name for p in store.rglob("*")] if store.exists() else []
    assert not [n for n in leftovers if n.startswith(".export")], leftovers  # no half-written export
    assert _free(disk) >= 149 * MiB  # nothing written and left there
    assert not our_containers(patience=30)
    shutil.rmtree(state, ignore_errors=True)

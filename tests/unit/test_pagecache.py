"""The page-cache prefetch reads a runtime image's programs and libraries, and nothing else."""

from __future__ import annotations

import os

from sandloop.runtime import pagecache


def test_prefetch_reads_executables_and_shared_objects_only(tmp_path):
    (tmp_path / "usr/bin").mkdir(parents=True)
    (tmp_path / "usr/lib").mkdir(parents=True)
    tool = tmp_path / "usr/bin/tool"
    tool.write_bytes(b"x" * 1000)
    tool.chmod(0o755)
    (tmp_path / "usr/lib/libz.so.1.2").write_bytes(b"y" * 300)
    (tmp_path / "usr/lib/libq.so").write_bytes(b"y" * 30)
    (tmp_path / "usr/lib/notes.txt").write_bytes(b"z" * 5000)
    os.symlink("/etc/shadow", tmp_path / "usr/bin/evil.so")  # never followed
    assert pagecache.prefetch([tmp_path]) == 1330
    assert 0 < pagecache.prefetch([tmp_path], budget=1100) <= 1100
    assert pagecache.prefetch([tmp_path / "missing"]) == 0


def test_prefetch_once_runs_once_per_key_until_forced(tmp_path):
    calls = []

    def roots():
        calls.append(1)
        return [tmp_path]

    pagecache.prefetch_once("test:key", roots, wait=True)
    pagecache.prefetch_once("test:key", roots, wait=True)
    assert len(calls) == 1
    pagecache.prefetch_once("test:key", roots, wait=True, force=True)
    assert len(calls) == 2


def test_prefetch_never_raises():
    def broken():
        raise RuntimeError("engine away")

    pagecache.prefetch_once("test:broken", broken, wait=True)  # logged, not raised

"""The host side of a runc session's state pause: the file crosses the sandbox's boundary in its
workspace, where the sandbox may have put a link to a host path instead (issue 25's threat model)."""

from __future__ import annotations

import os

import pytest

from sandloop.contract import SandboxError
from sandloop.sessions.snapshots import SnapshotStore, place_file, take_file


def test_take_file_moves_a_regular_file_out(tmp_path):
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "state.pkl").write_bytes(b"state")
    take_file(tmp_path / "ws" / "state.pkl", tmp_path / "kept.pkl")
    assert (tmp_path / "kept.pkl").read_bytes() == b"state"
    assert not (tmp_path / "ws" / "state.pkl").exists()


def test_take_file_never_follows_a_link_to_a_host_file(tmp_path):
    secret = tmp_path / "host-secret"
    secret.write_text("host only")
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "state.pkl").symlink_to(secret)
    with pytest.raises(SandboxError, match="could not be read safely"):
        take_file(tmp_path / "ws" / "state.pkl", tmp_path / "kept.pkl")
    assert not (tmp_path / "kept.pkl").exists()
    assert not os.path.lexists(tmp_path / "ws" / "state.pkl") and secret.read_text() == "host only"


def test_take_file_refuses_what_is_not_a_regular_file(tmp_path):
    (tmp_path / "ws").mkdir()
    os.mkfifo(tmp_path / "ws" / "state.pkl")  # a reader would block on it forever
    with pytest.raises(SandboxError, match="not a regular file"):
        take_file(tmp_path / "ws" / "state.pkl", tmp_path / "kept.pkl")


def test_place_file_replaces_a_link_instead_of_writing_through_it(tmp_path):
    victim = tmp_path / "host-file"
    victim.write_text("untouched")
    (tmp_path / "ws").mkdir()
    (tmp_path / "ws" / "state.pkl").symlink_to(victim)
    (tmp_path / "kept.pkl").write_bytes(b"state")
    place_file(tmp_path / "kept.pkl", tmp_path / "ws" / "state.pkl", os.getuid(), os.getgid())
    assert victim.read_text() == "untouched"
    assert not (tmp_path / "ws" / "state.pkl").is_symlink()
    assert (tmp_path / "ws" / "state.pkl").read_bytes() == b"state"


def test_place_file_replaces_a_directory_left_at_its_name(tmp_path):
    (tmp_path / "ws" / "state.pkl" / "inner").mkdir(parents=True)
    (tmp_path / "kept.pkl").write_bytes(b"state")
    place_file(tmp_path / "kept.pkl", tmp_path / "ws" / "state.pkl", os.getuid(), os.getgid())
    assert (tmp_path / "ws" / "state.pkl").read_bytes() == b"state"


def test_snapshot_ids_are_checked_before_any_path_is_made(tmp_path):
    store = SnapshotStore(tmp_path)
    for bad in ("../../etc", "snap-../x", "snap-", "s-123", "snap-a/b"):
        with pytest.raises(SandboxError, match="not a snapshot id"):
            store.get(bad)
    assert store.list() == [] and store.expire(0) == [] and store.sweep(0) == []

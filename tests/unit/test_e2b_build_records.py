"""E2B template builds outlive the server that ran them (server/e2b/templates.py): each build's
status and log are a record on disk, read back after a restart; a build the server stopped in the
middle of says so; records and memory are bounded per key; a build id from a URL is never a path."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest

from sandloop.server.e2b import template_uploads as uploads_module
from sandloop.server.e2b import templates as module
from sandloop.server.e2b.service import E2BError
from sandloop.server.e2b.templates import E2BTemplates


def _server(home):
    return E2BTemplates(SimpleNamespace(api=SimpleNamespace(root=SimpleNamespace(settings=SimpleNamespace(home=home)))))


ME, OTHER = SimpleNamespace(id="tok-me"), SimpleNamespace(id="tok-other")


def _finished(server, name, status="ready"):
    build_id = server.request(ME, {"name": f"{name}:v1"})["buildID"]
    build = server._builds[build_id]
    build.status = "building"
    server._save(build)
    build.log(f"built {name}")
    build.status = status
    server._save(build)
    return build_id


def test_a_finished_build_is_read_back_after_a_restart(tmp_path):
    first = _server(tmp_path)
    build_id = _finished(first, "mine")
    again = _server(tmp_path)  # a new server process: nothing in memory
    status = again.status(ME, "mine", build_id, 0)
    assert status["status"] == "ready" and status["logs"] == ["built mine"]
    with pytest.raises(E2BError) as other:  # another key's build is not found, on disk either
        again.status(OTHER, "mine", build_id, 0)
    assert other.value.status == 404


def test_a_build_the_server_stopped_in_the_middle_of_says_so(tmp_path):
    first = _server(tmp_path)
    build_id = first.request(ME, {"name": "cut:v1"})["buildID"]
    build = first._builds[build_id]
    build.status = "building"
    first._save(build)
    status = _server(tmp_path).status(ME, "cut", build_id, 0)
    assert status["status"] == "error" and "server stopped during this build" in status["reason"]["message"]


@pytest.mark.parametrize("build_id", ["../../etc/passwd", "..", "x" * 300, ""])
def test_a_build_id_from_the_url_is_never_a_path(tmp_path, build_id):
    with pytest.raises(E2BError) as found:
        _server(tmp_path).status(ME, "mine", build_id, 0)
    assert found.value.status == 404


def test_records_and_memory_are_bounded(tmp_path, monkeypatch):
    monkeypatch.setattr(module, "KEPT_PER_KEY", 3)
    monkeypatch.setattr(module, "IN_MEMORY", 2)
    server = _server(tmp_path)
    ids = [_finished(server, f"t{i}", "ready" if i % 2 else "error") for i in range(6)]
    kept = sorted(p.stem for p in (tmp_path / "e2b-builds").glob("*.json"))
    assert kept == sorted(ids[-3:])  # the newest three of this key
    assert len([b for b in server._builds.values() if b.status in ("ready", "error")]) == 2
    assert server.status(ME, "t5", ids[-1], 0)["status"] == "ready"
    assert server.status(ME, "t3", ids[-3], 0)["status"] == "ready"  # read back from disk
    with pytest.raises(E2BError):
        server.status(ME, "t0", ids[0], 0)  # pruned


def test_deleting_a_template_deletes_its_builds_records(tmp_path):
    """E2B deletes a template with its builds: their records go (status is then 404), a template
    whose builds all failed (nothing in the store) can be deleted, another key's records stay."""
    server = _server(tmp_path)
    server.root.templates = SimpleNamespace(list=lambda owner=None: [])  # every build failed
    failed = [_finished(server, "gone", status="error") for _ in range(2)]
    kept = _finished(server, "other")
    theirs = server.request(OTHER, {"name": "gone:v1"})["buildID"]
    server._builds[theirs].status = "error"
    server._save(server._builds[theirs])
    server.delete(ME, "gone")
    for build_id in failed:
        with pytest.raises(E2BError) as found:
            _server(tmp_path).status(ME, "gone", build_id, 0)
        assert found.value.status == 404
        with pytest.raises(E2BError):
            server.status(ME, "gone", build_id, 0)  # not from memory either
    assert _server(tmp_path).status(ME, "other", kept, 0)["status"] == "ready"
    assert _server(tmp_path).status(OTHER, "gone", theirs, 0)["status"] == "error"
    with pytest.raises(E2BError) as again:
        server.delete(ME, "gone")
    assert again.value.status == 404


def test_a_keys_uploads_are_a_bounded_cache(tmp_path, monkeypatch):
    """A valid key cannot fill the disk with COPY archives: its folder holds at most
    ``MAX_UPLOADS_BYTES_PER_KEY`` with what uploads in flight reserve; the least recently used
    archive goes first (a use marks it), and past the budget an upload is refused with 429."""
    monkeypatch.setattr(uploads_module, "MAX_UPLOADS_BYTES_PER_KEY", 100)
    monkeypatch.setattr(uploads_module, "MAX_UPLOAD_BYTES", 40)
    server = _server(tmp_path).uploads
    folder = tmp_path / "key"
    folder.mkdir()
    for age, name in enumerate(("old", "used", "new")):
        (folder / f"{name}.tar").write_bytes(b"x" * 30)
        os.utime(folder / f"{name}.tar", (1000 + age, 1000 + age))
    assert uploads_module.touch(folder / "old.tar")  # used just now: kept longest
    first = server.reserve_upload(folder / "a.tar")
    assert first == 40 and sorted(p.name for p in folder.iterdir()) == ["new.tar", "old.tar"]
    assert server.reserve_upload(folder / "b.tar") == 40  # beside 40 reserved: both others go
    assert list(folder.iterdir()) == []
    assert server.reserve_upload(folder / "c.tar") == 20  # what 80 reserved leave
    with pytest.raises(E2BError) as full:
        server.reserve_upload(folder / "d.tar")
    assert full.value.status == 429 and "wait for them to finish" in full.value.message
    server.release_upload(folder / "a.tar", first)
    assert server.reserve_upload(folder / "d.tar") == 40
    assert not uploads_module.touch(folder / "missing.tar")

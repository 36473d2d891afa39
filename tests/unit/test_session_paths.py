import io
import tarfile
import zipfile

import pytest

from sandloop import InvalidArgument
from sandloop.contract import PathRefused
from sandloop.sessions import check_path
from sandloop.sessions.session_files import _check_archive


@pytest.mark.parametrize(
    "path, expected",
    [
        ("a.txt", "a.txt"),
        ("./d/e.csv", "d/e.csv"),
        ("/workspace/x/y", "x/y"),
        ("/workspace", "."),
        (".", "."),
        ("", "."),
    ],
)
def test_good_paths(path, expected):
    assert check_path(path) == expected


@pytest.mark.parametrize(
    "path", ["../etc/passwd", "a/../../b", "/etc/passwd", "/workspace/../etc", "a\0b", "/workspacex/a"]
)
def test_bad_paths_are_refused(path):
    with pytest.raises(PathRefused):
        check_path(path)


def _tar(members: dict[str, int]) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for name, size in members.items():
            info = tarfile.TarInfo(name)
            info.size = size
            tar.addfile(info, io.BytesIO(b"\0" * size))
    return buf.getvalue()


def test_tar_bomb_is_refused_before_sending():
    bomb = _tar({f"f{i}": 4 * 1024 * 1024 for i in range(20)})  # 80 MB of zeros, a few KB gzipped
    assert len(bomb) < 200_000
    with pytest.raises(PathRefused, match="expands to more than"):
        _check_archive(bomb, 64 * 1024 * 1024)
    _check_archive(_tar({"ok": 10}), 64 * 1024 * 1024)


def test_zip_bomb_is_refused_before_sending():
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for i in range(10):
            z.writestr(f"z{i}", b"\0" * (10 * 1024 * 1024))
    with pytest.raises(PathRefused):
        _check_archive(buf.getvalue(), 64 * 1024 * 1024)


def test_garbage_archive_is_a_clear_error():
    with pytest.raises(InvalidArgument, match="not a tar"):
        _check_archive(b"this is not an archive at all" * 10, 1 << 20)

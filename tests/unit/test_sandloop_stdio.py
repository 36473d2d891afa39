"""The runtime image's sandloop_stdio (images/recipe/sandloop_stdio.py), loaded on the host: a
write that comes back short is finished, so no output vanishes (gVisor's pipes return short past
64 KiB); a write leaves at once (nothing waits in a buffer) unless it is part of a long burst,
whose writes are gathered and still all arrive, in order, without a flush (issue 60)."""

from __future__ import annotations

import importlib.util
import io
import os
import threading

from sandloop.images import RECIPE_DIR

SOURCE = RECIPE_DIR / "sandloop_stdio.py"


def _module():
    spec = importlib.util.spec_from_file_location("sandloop_stdio_under_test", SOURCE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _read(fd: int, size: int) -> bytes:
    got = b""
    while len(got) < size:
        got += os.read(fd, 65536)
    return got


def test_a_short_write_is_finished_and_nothing_waits_in_a_buffer():
    stdio = _module()
    calls: list[int] = []

    def three_bytes_at_most(fd: int, data) -> int:  # a pipe that takes 3 bytes a call
        data = bytes(data)
        calls.append(len(data))
        return os.write(fd, data[:3])

    class Short(stdio._WholeWrites):
        def write(self, data, _write=three_bytes_at_most):
            return super().write(data, _write)

    r, w = os.pipe()
    try:
        text = io.TextIOWrapper(Short(w, "wb", closefd=False), encoding="utf-8", write_through=True)
        print("héllo", file=text)  # 6 bytes, then the newline: two writes
        assert os.read(r, 100) == "héllo\n".encode()  # there already, no flush
        assert calls == [6, 3, 1]
        assert text.buffer.write(memoryview(b"abcdefg")[1:]) == 6  # bytes-like objects too
        assert os.read(r, 100) == b"bcdefg"
    finally:
        os.close(r)
        os.close(w)


def test_it_replaces_only_an_unbuffered_stream(monkeypatch):
    stdio = _module()
    r, w = os.pipe()
    try:
        unbuffered = io.TextIOWrapper(io.FileIO(w, "wb", closefd=False), encoding="utf-8", write_through=True)
        buffered = io.TextIOWrapper(io.BufferedWriter(io.FileIO(w, "wb", closefd=False)), encoding="utf-8")
        for name, stream in (("stdout", unbuffered), ("stderr", buffered)):
            monkeypatch.setattr(f"sys.{name}", stream)
            monkeypatch.setattr(f"sys.__{name}__", stream)
        stdio._install()
        import sys

        assert isinstance(sys.stdout.buffer, stdio._WholeWrites) and sys.stdout.encoding == "utf-8"
        assert sys.stderr is buffered  # a buffered stream retries short writes itself
        got = bytearray()
        reader = threading.Thread(target=lambda: got.extend(_read(r, 70000)))
        reader.start()
        sys.stdout.write("x" * 70000)  # more than the pipe holds: written whole, as it is read
        reader.join(30)
        assert bytes(got) == b"x" * 70000
    finally:
        os.close(r)
        os.close(w)


def test_a_long_burst_is_gathered_and_arrives_whole_without_a_flush():
    stdio = _module()
    calls: list[int] = []

    def counted(fd: int, data) -> int:
        calls.append(1)
        return os.write(fd, data)

    class Counted(stdio._WholeWrites):
        def write(self, data, _write=counted):
            return super().write(data, _write)

    r, w = os.pipe()
    try:
        raw = Counted(w, "wb", closefd=False)
        stdio._streams.append(raw)
        text = io.TextIOWrapper(raw, encoding="utf-8", write_through=True)
        for i in range(10):  # a short burst: each write at once, no thread of ours
            text.write(f"{i}\n")
        assert len(calls) == 10 and not stdio._flusher[0]
        wanted = "".join(f"{i}\n" for i in range(3000))
        for i in range(3000):
            text.write(f"{i}\n")
        got = b""
        while len(got) < len(wanted) + len("0\n1\n2\n3\n4\n5\n6\n7\n8\n9\n"):  # the flusher sends the tail
            got += os.read(r, 1 << 20)
        assert got.decode() == "".join(f"{i}\n" for i in range(10)) + wanted
        assert len(calls) < 3000 / 4  # gathered: far fewer writes than lines
    finally:
        os.close(r)
        os.close(w)

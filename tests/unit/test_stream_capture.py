import random

from sandloop.runtime.docker_engine import _CappedStream, _Demuxer


def _frame(stream: int, data: bytes) -> bytes:
    return bytes([stream, 0, 0, 0]) + len(data).to_bytes(4, "big") + data


def test_demuxer_routes_frames_split_at_any_byte():
    frames = [(1, b"out-1 "), (2, b"err-1 "), (1, b"x" * 70000), (2, b""), (1, b"tail")]
    wire = b"".join(_frame(s, d) for s, d in frames)
    rng = random.Random(7)
    for _ in range(50):
        out, err = _CappedStream(10**6), _CappedStream(10**6)
        demux = _Demuxer(out, err)
        i = 0
        while i < len(wire):
            step = rng.randint(1, 9000)
            demux.feed(wire[i : i + step])
            i += step
        assert bytes(out.data) == b"out-1 " + b"x" * 70000 + b"tail"
        assert bytes(err.data) == b"err-1 "


def test_capped_stream_keeps_the_head_and_counts_the_rest():
    s = _CappedStream(10)
    for chunk in (b"12345", b"67890abc", b"def"):
        s.feed(chunk)
    assert bytes(s.data) == b"1234567890" and s.dropped == 6


def test_invalid_utf8_is_replaced_not_raised():
    s = _CappedStream(100)
    s.feed(b"ok \xff\xfe \x00 end")
    assert s.text() == "ok \ufffd\ufffd \x00 end"

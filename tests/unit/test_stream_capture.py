import random

from sandloop.runtime.docker.stream import FrameDemux
from sandloop.runtime.streams import END_MARKER, CappedStream, Collector


def _frame(stream: int, data: bytes) -> bytes:
    return bytes([stream, 0, 0, 0]) + len(data).to_bytes(4, "big") + data


def test_frames_split_at_any_byte_are_routed_whole():
    frames = [(1, b"out-1 "), (2, b"err-1 "), (1, b"x" * 70000), (2, b""), (1, b"tail")]
    wire = b"".join(_frame(s, d) for s, d in frames)
    rng = random.Random(7)
    for _ in range(50):
        out, err = CappedStream(10**6), CappedStream(10**6)
        collector = Collector(out, err, None)
        demux = FrameDemux()
        i = 0
        while i < len(wire):
            step = rng.randint(1, 9000)
            for stream, chunk in demux.feed(wire[i : i + step]):
                collector.feed(stream, chunk)
            i += step
        assert bytes(out.data) == b"out-1 " + b"x" * 70000 + b"tail"
        assert bytes(err.data) == b"err-1 "


def test_end_lines_split_across_reads_are_found_and_late_output_carries_over():
    line = END_MARKER + b"n1:0:payload\n"
    stream = b"hello " + line + b"late"
    for cut in range(1, len(stream)):
        out, err = CappedStream(100), CappedStream(100)
        c = Collector(out, err, "n1")
        c.feed(1, stream[:cut])
        c.feed(1, stream[cut:])
        c.feed(2, END_MARKER + b"n1:0\n")
        assert (bytes(out.data), c.exit_status, c.payload) == (b"hello ", 0, b"payload")
        following = c.next(CappedStream(100), CappedStream(100), "n2")
        assert bytes(following.stdout.data) == b"late"


def test_a_forged_end_line_with_another_nonce_is_output():
    out, err = CappedStream(100), CappedStream(100)
    c = Collector(out, err, "real")
    c.feed(1, END_MARKER + b"fake:0\nafter")
    assert c.exit_status is None and bytes(out.data).endswith(b"after")


def test_capped_stream_keeps_the_head_and_counts_the_rest():
    s = CappedStream(10)
    for chunk in (b"12345", b"67890abc", b"def"):
        s.feed(chunk)
    assert bytes(s.data) == b"1234567890" and s.dropped == 6


def test_invalid_utf8_is_replaced_not_raised():
    s = CappedStream(100)
    s.feed(b"ok \xff\xfe \x00 end")
    assert s.text() == "ok \ufffd\ufffd \x00 end"


def test_a_long_end_line_is_kept_whole_across_many_reads_and_outputs_become_artifacts():
    import base64 as b64
    import json as js

    from sandloop.runtime import protocol, streams

    outputs = [
        {
            "type": "display_data",
            "data": {"text/plain": "<Figure>", "image/png": b64.b64encode(b"\x89PNG" + b"x" * 300_000).decode()},
        }
    ]
    payload = b64.b64encode(js.dumps({"outputs": outputs, "execution_count": 3, "context": "default"}).encode())
    line = streams.END_MARKER + b"n1:0:" + payload + b"\n"
    collector = protocol.cell_collector(None, 1 << 20, "n1")
    data = b"printed\n" + line
    for i in range(0, len(data), 4096):  # as a pipe delivers it
        collector.feed(streams.STDOUT, data[i : i + 4096])
    collector.feed(streams.STDERR, streams.END_MARKER + b"n1:0\n")
    reply = protocol.cell_reply(collector)
    assert reply["execution_count"] == 3 and bytes(collector.stdout.data) == b"printed\n"
    (art,) = protocol.artifacts_of([protocol.Output(**o) for o in reply["outputs"]])
    assert art.name == "figure-1.png" and art.data.startswith(b"\x89PNG") and len(art.data) == 300_004


def test_streamed_outputs_are_bounded_on_the_host():
    """Code that learns its cell's nonce could stream outputs without end: past MAX_OUTPUT_BYTES
    they are counted and dropped, and the cell still ends."""
    import base64 as b64
    import json as js

    from sandloop.runtime import protocol, streams

    one = b64.b64encode(js.dumps({"type": "display_data", "data": {"text/plain": "x" * 1_000_000}}).encode())
    collector = protocol.cell_collector(None, 1 << 20, "n2")
    watch = collector._watches[streams.STDOUT]
    for _ in range(60):
        collector.feed(streams.STDOUT, streams.OUTPUT_MARKER + b"n2:" + one + b"\n")
    collector.feed(streams.STDOUT, streams.END_MARKER + b"n2:0:\n")
    collector.feed(streams.STDERR, streams.END_MARKER + b"n2:0\n")
    assert collector.exit_status == 0
    assert watch.output_bytes <= streams.MAX_OUTPUT_BYTES and watch.outputs_dropped > 0
    assert len(collector.outputs) * len(one) <= streams.MAX_OUTPUT_BYTES


def test_a_display_keeps_its_place_in_both_streams_however_they_interleave():
    """The engine forwards stdout and stderr independently: a display's line on stdout can be read
    before what the cell wrote to stderr just before it. Its mark on stderr holds it back, so a
    caller sees all of stderr before the display, then the display, then stdout after it; in every
    interleaving and at every cut of the reads (a stderr line written in two is not cut by it)."""
    import base64 as b64
    import json as js

    from sandloop.runtime import protocol, streams

    shown = b64.b64encode(js.dumps({"type": "execute_result", "data": {"text/plain": "2"}}).encode())
    out = b"before\n" + streams.OUTPUT_MARKER + b"n3:" + shown + b"\nafter\n" + END_MARKER + b"n3:0:\n"
    err = b"err" + b"\n" + streams.OUTPUT_MARKER + b"n3:\n" + b"later\n" + END_MARKER + b"n3:0\n"
    rng = random.Random(11)
    for _ in range(300):
        seen: list[tuple[str, bytes]] = []
        collector = protocol.cell_collector(
            None, 1 << 20, "n3", lambda kind, data, seen=seen: seen.append((kind, data))
        )
        pieces = []
        for stream, data in ((streams.STDOUT, out), (streams.STDERR, err)):
            cuts = sorted(rng.sample(range(1, len(data)), rng.randint(0, 6)))
            pieces.append([(stream, data[a:b]) for a, b in zip([0, *cuts], [*cuts, len(data)], strict=True)])
        while pieces[0] or pieces[1]:  # the two streams interleaved at random, each in its order
            side = rng.choice([p for p in pieces if p])
            collector.feed(*side.pop(0))
        assert collector.exit_status == 0
        at = next(i for i, (kind, _) in enumerate(seen) if kind == "display")
        before, after = seen[:at], seen[at + 1 :]
        assert b"".join(d for k, d in before if k == "stderr") == b"err\n"
        assert b"".join(d for k, d in before if k == "stdout") == b"before\n"
        assert b"".join(d for k, d in after if k == "stdout") == b"after\n"
        assert b"".join(d for k, d in after if k == "stderr") == b"later\n"
        assert len(collector.outputs) == 1


def test_thousands_of_displays_in_one_read_keep_their_order():
    """A read can carry thousands of displays and marks: the streams take turns in a loop (no
    recursion between them), and each stderr line lands between its displays."""
    import base64 as b64
    import json as js

    from sandloop.runtime import protocol, streams

    n = 5000
    lines = [
        b64.b64encode(js.dumps({"type": "display_data", "data": {"text/plain": str(i)}}).encode()) for i in range(n)
    ]
    out = b"".join(streams.OUTPUT_MARKER + b"n5:" + line + b"\n" for line in lines) + END_MARKER + b"n5:0:\n"
    err = b"".join(b"e%d\n" % i + streams.OUTPUT_MARKER + b"n5:\n" for i in range(n)) + END_MARKER + b"n5:0\n"
    seen: list[tuple[str, bytes]] = []
    collector = protocol.cell_collector(None, 1 << 24, "n5", lambda kind, data: seen.append((kind, data)))
    collector.feed(streams.STDOUT, out)
    collector.feed(streams.STDERR, err)
    assert collector.exit_status == 0
    assert [(k, d if k == "stderr" else js.loads(d)["data"]["text/plain"]) for k, d in seen] == [
        pair for i in range(n) for pair in (("stderr", b"e%d\n" % i), ("display", str(i)))
    ]


def test_a_display_whose_mark_never_comes_still_goes_when_stderr_ends():
    """A cell that closed its stderr writes no marks: its displays wait for stderr's end line, then
    go in stdout's order (nothing lost, nothing out of order on stdout)."""
    import base64 as b64
    import json as js

    from sandloop.runtime import protocol, streams

    shown = b64.b64encode(js.dumps({"type": "display_data", "data": {"text/plain": "x"}}).encode())
    seen: list[tuple[str, bytes]] = []
    collector = protocol.cell_collector(None, 1 << 20, "n4", lambda kind, data: seen.append((kind, data)))
    collector.feed(streams.STDOUT, b"a\n" + streams.OUTPUT_MARKER + b"n4:" + shown + b"\nb\n" + END_MARKER + b"n4:0:\n")
    assert [k for k, _ in seen] == ["stdout"] and collector.exit_status is None
    collector.feed(streams.STDERR, END_MARKER + b"n4:0\n")
    assert [(k, d) for k, d in seen if k == "stdout"] == [("stdout", b"a\n"), ("stdout", b"b\n")]
    assert [k for k, _ in seen] == ["stdout", "display", "stdout"] and collector.exit_status == 0


def test_channels_read_descriptors_past_select_limit():
    """A server holding hundreds of sessions has attach sockets past fd 1024, where select()
    raises; reads wait with poll (bench/idle.py --hold 1000 failed at ~700 sessions)."""
    import os
    import socket

    from sandloop.runtime.docker.stream import SocketChannel
    from sandloop.runtime.oci.stream import PipeChannel

    ours, theirs = socket.socketpair()
    high = os.dup2(ours.fileno(), 1500)
    ours.close()
    channel = SocketChannel(socket.socket(fileno=high))
    try:
        assert channel.read(0.01) == []  # nothing yet: waits, then answers empty
        theirs.sendall(_frame(1, b"hello"))
        assert channel.drain() is True
        assert channel.read(5) == [(1, b"hello")]
        theirs.close()
        assert channel.read(5) is None  # EOF
    finally:
        channel.close()

    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    high_out, high_err = os.dup2(out_r, 1600), os.dup2(err_r, 1601)
    os.close(out_r)
    os.close(err_r)
    pipes = PipeChannel(high_out, high_err)
    os.write(out_w, b"out")
    os.close(out_w)
    os.close(err_w)
    got = []
    while (chunks := pipes.read(5)) is not None:
        got += chunks
    assert got == [(1, b"out")]

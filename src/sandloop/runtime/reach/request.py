"""One HTTP request over a reach channel (``mux.Channel``: a connection to a port inside a
sandbox), its answer read whole and bounded: the standard library's ``http.client`` speaks the
protocol over the channel, so nothing is opened for the sandbox and no HTTP is parsed by hand.

The server answering is the sandbox's: untrusted. ``http.client`` caps a header line (64 KiB) and
the header count (100); at most ``max_bytes`` of the body is read; one deadline bounds it all.
"""

from __future__ import annotations

import http.client
import io
import time
from collections.abc import Iterator
from typing import Any

from sandloop.contract import HttpAnswer
from sandloop.runtime.reach.mux import Channel, ReachError
from sandloop.runtime.streams import ChunkReader

#: Most bytes of an answer's body kept by default (the rest is not read: ``truncated``).
MAX_ANSWER_BYTES = 1024 * 1024


def http_request(
    channel: Channel,
    port: int,
    method: str,
    path: str,
    body: bytes,
    headers: dict[str, str],
    timeout: float,
    max_bytes: int = MAX_ANSWER_BYTES,
) -> HttpAnswer:
    """Send the request on ``channel`` (closed at the end, whatever happens) and read the answer.

    Raises:
        ReachError: no whole answer within ``timeout`` seconds, or not HTTP.
    """
    deadline = time.monotonic() + timeout
    conn = http.client.HTTPConnection("127.0.0.1", port)
    conn.sock = _ChannelSocket(channel, deadline)
    try:
        conn.putrequest(method, path, skip_accept_encoding=True)
        for name, value in {"Connection": "close", **headers}.items():
            conn.putheader(name, value)
        if body or method in ("POST", "PUT", "PATCH"):
            conn.putheader("Content-Length", str(len(body)))
        conn.endheaders(body or None)
        answer = conn.getresponse()
        kept = answer.read(max_bytes + 1) if answer.status != 204 and method != "HEAD" else b""
        named: dict[str, str] = {}
        for name, value in answer.getheaders():  # names lowercased, repeated ones joined
            key = name.lower()
            named[key] = f"{named[key]}, {value}" if key in named else value
        return HttpAnswer(
            status=answer.status,
            reason=answer.reason,
            headers=named,
            body=kept[:max_bytes],
            truncated=len(kept) > max_bytes,
        )
    except TimeoutError:
        why = f"the server on port {port} in the sandbox gave no whole answer within {timeout:g} s"
        raise ReachError(why) from None
    except (http.client.HTTPException, ValueError) as exc:
        raise ReachError(f"the server on port {port} in the sandbox did not answer in HTTP: {exc!r}") from None
    finally:
        channel.close()


class _ChannelSocket:
    """What ``http.client`` asks of a socket, over a reach channel, every read bounded by one
    deadline."""

    def __init__(self, channel: Channel, deadline: float) -> None:
        self.channel, self.deadline = channel, deadline

    def sendall(self, data: bytes) -> None:
        self.channel.send(bytes(data))

    def makefile(self, mode: str = "rb", *args: Any, **kwargs: Any) -> io.BufferedReader:
        return io.BufferedReader(ChunkReader(_chunks(self.channel, self.deadline)))

    def close(self) -> None:
        pass  # the channel is closed by ``http_request``


def _chunks(channel: Channel, deadline: float) -> Iterator[bytes]:
    """What arrives on ``channel`` until it ends, each wait bounded by ``deadline``."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError
        data = channel.recv(left)  # TimeoutError: nothing came in time
        if not data:  # the server closed
            return
        yield data

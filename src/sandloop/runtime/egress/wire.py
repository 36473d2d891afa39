"""What the egress proxy (``proxy.py``) reads and writes on a connection: a request's head, checked
strictly (one Host, no smuggling, bounded), the server name of a TLS ClientHello, bodies and
their lengths, the bytes piped each way (counted, capped, scanned for secrets' placeholders), and
its own refusals. No state here: the proxy holds the boxes, rules and secrets.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import urlsplit

from sandloop.contract.egress import EgressAttempt, is_hostname

HEAD_LIMIT = 64 * 1024
PIPE_CHUNK = 1 << 20
#: A relay with no byte either way for this long is closed (a held connection costs descriptors).
RELAY_IDLE_SECONDS = 300.0


class Refused(Exception):
    pass


@dataclass
class Attempt:
    """One attempt, updated while its connection lives (bytes), frozen on read."""

    host: str
    port: int
    method: str
    allowed: bool = True
    note: str = ""
    bytes_out: int = 0
    bytes_in: int = 0

    def frozen(self) -> EgressAttempt:
        return EgressAttempt(**self.__dict__)

    def add_note(self, note: str) -> None:
        self.note = f"{self.note}; {note}" if self.note else note


class BadRequest(Exception):
    pass


def is_global_address(address: str) -> bool:
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return bool(ip.is_global)


_HOP_BY_HOP = ("proxy-authorization", "proxy-connection", "connection")


def _checked_host(host: str) -> str:
    """A request's host if it is a host name or an IP address (``a..allowed.test`` once escaped as
    an unhandled error with an "allowed" audit entry and no reply)."""
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    if not is_hostname(host):
        raise BadRequest(f"{host[:100]!r} is not a host name")
    return host


def tunnel_refusal(host: str, hello: bytes | None) -> str | None:
    """Why a tunnel to ``host`` that starts with ``hello`` is refused, or None. Only TLS, and its
    server name is the tunnel's host (none only for an IP address, where clients send none)."""
    if hello is None:
        return "the tunnel did not start with a TLS ClientHello or an HTTP request (only HTTP(S) goes through)"
    sni = _sni(hello)
    if sni is None:
        try:
            ipaddress.ip_address(host)
            return None
        except ValueError:
            return f"the TLS ClientHello names no server (SNI) in a tunnel to {host!r}"
    if sni.lower().rstrip(".") != host:
        return f"the TLS server name {sni!r} does not match the tunnel's host {host!r}"
    return None


def _strict_lines(head: bytes) -> list[str]:
    """A request head's lines, refusing a bare LF or CR: a server that ends lines at a bare LF
    would see a header (a second ``Host``) that this proxy never checked."""
    text = head.decode("latin-1")
    if "\n" in text.replace("\r\n", "") or "\r" in text.replace("\r\n", ""):
        raise BadRequest("a request head may end its lines only with CRLF (a bare LF or CR was sent)")
    return text.split("\r\n")


def authority_header(host: str, port: int, default_port: int) -> str:
    name = f"[{host}]" if ":" in host else host
    return name if port == default_port else f"{name}:{port}"


def _bound(lines: list[str], request_line: str, host: str, port: int, default_port: int) -> bytes:
    """The head to send upstream: hop-by-hop headers dropped, exactly one ``Host`` and it names the
    host this request was allowed for (a virtual host or CDN serves whoever ``Host`` names), and a
    request to close after its response (the next request on the connection would go unchecked)."""
    kept = [line for line in lines if line and line.split(":", 1)[0].strip().lower() not in (*_HOP_BY_HOP, "host")]
    out = [request_line, f"Host: {authority_header(host, port, default_port)}", *kept, "Connection: close", "", ""]
    return "\r\n".join(out).encode("latin-1")


def closing_head(head: bytes, host: str, port: int, default_port: int = 443) -> bytes:
    """A request head read inside a tunnel, bound to the tunnel's host (see _bound); an absolute
    URL naming another host is refused."""
    lines = _strict_lines(head)
    parts = lines[0].split(" ")
    if len(parts) != 3:
        raise BadRequest(f"not an HTTP request: {lines[0][:100]!r}")
    target = parts[1]
    if "://" in target:
        url = urlsplit(target)
        if (url.hostname or "").lower().rstrip(".") != host or (url.port or default_port) != port:
            raise Refused(f"the request names {url.hostname!r} inside a tunnel to {host!r}")
        parts[1] = (url.path or "/") + (f"?{url.query}" if url.query else "")
    return _bound(lines[1:], " ".join(parts), host, port, default_port)


def parse_head(head: bytes) -> tuple[str, str, int, bytes]:
    """(method, host, port, the bytes to send upstream) of a proxy request's head."""
    lines = _strict_lines(head)
    try:
        method, target, version = lines[0].split(" ")
    except ValueError:
        raise BadRequest(f"not an HTTP proxy request: {lines[0][:100]!r}") from None
    if method == "CONNECT":
        host, _, port = target.rpartition(":")
        if not port.isdigit() or not host:
            raise BadRequest(f"CONNECT needs host:port, got {target[:100]!r}")
        name = _checked_host(host.strip("[]").lower().rstrip("."))
        if not 1 <= int(port) <= 65535:
            raise BadRequest(f"CONNECT needs a port from 1 to 65535, got {port[:10]!r}")
        return method, name, int(port), b""
    url = urlsplit(target)
    if url.scheme != "http" or not url.hostname:
        raise BadRequest(
            f"a proxy request needs an absolute http:// URL (use CONNECT, i.e. an https:// URL, for TLS), "
            f"got {target[:100]!r}"
        )
    path = (url.path or "/") + (f"?{url.query}" if url.query else "")
    try:
        number = url.port or 80
    except ValueError:
        raise BadRequest(f"a bad port in {target[:100]!r}") from None
    name = _checked_host(url.hostname.lower().rstrip("."))
    return method, name, number, _bound(lines[1:], f"{method} {path} {version}", name, number, 80)


#: The most of a ClientHello read before deciding (one is rarely over 2 KiB; post-quantum ~1.8 KiB).
MAX_CLIENT_HELLO = 64 * 1024


async def tunnel_start(reader: asyncio.StreamReader) -> tuple[bytes, bytes | None, bytes | None]:
    """(every byte read, the whole ClientHello handshake message or None, a plain HTTP request
    head or None) of a tunnel's first bytes. The hello is reassembled across TLS records: split
    over two, its server name was once in the second, which the proxy did not read (issue 27
    #2). A tunnel may instead start with a plain HTTP request (Node's fetch tunnels http:// URLs
    too): its head is read whole, for the caller to check like any plain request."""
    header = await asyncio.wait_for(reader.readexactly(5), 30)
    if header[0] != 0x16:
        method = header.split(b" ", 1)[0]
        if method.isalpha() and method.isupper():  # an HTTP method (GET, POST, OPTIONS...) begins it
            rest = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)  # at most HEAD_LIMIT
            return header + rest, None, header + rest
        return header, None, None
    raw = hello = b""
    while True:
        raw += header
        length = int.from_bytes(header[3:5], "big")
        if header[0] != 0x16 or not 0 < length <= (1 << 14):
            return raw, None, None
        body = await asyncio.wait_for(reader.readexactly(length), 30)
        raw, hello = raw + body, hello + body
        if len(hello) >= 4:
            if hello[0] != 0x01:  # not a ClientHello
                return raw, None, None
            need = 4 + int.from_bytes(hello[1:4], "big")
            if need > MAX_CLIENT_HELLO:
                return raw, None, None
            if len(hello) >= need:
                return raw, hello[:need], None
        header = await asyncio.wait_for(reader.readexactly(5), 30)


def _sni(hello: bytes) -> str | None:
    """The server name of a ClientHello handshake message, or None (none, or unreadable)."""
    try:
        i = 4 + 2 + 32  # handshake header, version, random
        i += 1 + hello[i]  # session id
        i += 2 + int.from_bytes(hello[i : i + 2], "big")  # cipher suites
        i += 1 + hello[i]  # compression methods
        end = i + 2 + int.from_bytes(hello[i : i + 2], "big")
        i += 2
        while i + 4 <= end:
            kind, size = int.from_bytes(hello[i : i + 2], "big"), int.from_bytes(hello[i + 2 : i + 4], "big")
            if kind == 0:  # server_name: list length, name type, name length, name
                n = int.from_bytes(hello[i + 7 : i + 9], "big")
                return hello[i + 9 : i + 9 + n].decode("ascii")
            i += 4 + size
    except (IndexError, UnicodeDecodeError):
        return None
    return None


async def pipe_bytes(
    first: bytes,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    up_reader: asyncio.StreamReader,
    up_writer: asyncio.StreamWriter,
    attempt: Attempt,
    client_bytes: int | None = None,
    scan: Callable[[bytes], None] | None = None,
) -> None:
    """Send ``first`` upstream, then copy both ways until both sides are done, counting bytes
    (``client_bytes``: at most that many more of the client's, a request's body, which ``scan``
    sees on its way)."""
    up_writer.write(first)
    attempt.bytes_out += len(first)
    activity = [asyncio.get_running_loop().time()]  # the last byte either way
    await asyncio.gather(
        _pipe(reader, up_writer, attempt, "bytes_out", activity, client_bytes, scan),
        _pipe(up_reader, writer, attempt, "bytes_in", activity),
        return_exceptions=True,
    )


def body_length(head: bytes) -> int:
    """The body a request head announces (0 without one). A chunked body is refused: a request
    needs its length, so that nothing after it goes up unchecked."""
    length = 0
    for line in head.decode("latin-1").split("\r\n")[1:]:
        name, _, value = line.partition(":")
        name = name.strip().lower()
        if name == "transfer-encoding":
            raise Refused("a request with a chunked body: send its Content-Length (one request per connection)")
        if name == "content-length":
            if not value.strip().isdigit():
                raise Refused(f"Content-Length {value.strip()[:20]!r} is not a number of bytes")
            length = int(value.strip())
    return length


async def _pipe(
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    attempt: Attempt,
    count: str,
    activity: list[float],
    limit: int | None = None,
    scan: Callable[[bytes], None] | None = None,
) -> None:
    # Big reads and a deep write buffer: per-chunk overhead, not bandwidth, is what a Python copy
    # pays (measured: 64 KiB chunks nearly doubled a 1 MB transfer's time).
    writer.transport.set_write_buffer_limits(high=PIPE_CHUNK * 4)
    loop = asyncio.get_running_loop()
    check = min(30.0, RELAY_IDLE_SECONDS)
    said = False
    try:
        while True:
            want = PIPE_CHUNK if limit is None or limit <= 0 else min(PIPE_CHUNK, limit)
            try:
                data = await asyncio.wait_for(reader.read(want), check)
            except TimeoutError:
                if loop.time() - activity[0] >= RELAY_IDLE_SECONDS:  # quiet both ways: let it go
                    attempt.add_note(f"closed after {RELAY_IDLE_SECONDS:g} s without a byte either way")
                    return
                continue
            if not data:
                return
            activity[0] = loop.time()
            if limit is not None:
                if limit <= 0:  # past the request: read and dropped (no half-close, which some
                    if not said:  # servers take for the client leaving and abort the answer)
                        attempt.add_note("bytes after the request were not sent (one request per connection)")
                        said = True
                    continue
                limit -= len(data)
            if scan is not None:
                scan(data)
            writer.write(data)
            setattr(attempt, count, getattr(attempt, count) + len(data))
            await writer.drain()
    finally:
        with contextlib.suppress(Exception):
            if writer.can_write_eof():
                writer.write_eof()
            else:
                writer.close()


async def send_refusal(writer: asyncio.StreamWriter, status: int, message: str) -> None:
    reason = {400: "Bad Request", 403: "Forbidden", 431: "Request Header Fields Too Large", 502: "Bad Gateway"}[status]
    body = f"sandloop egress: {message}\n".encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    with contextlib.suppress(Exception):
        writer.write(head.encode() + body)
        await writer.drain()

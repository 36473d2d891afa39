"""Loopback HTTP and HTTPS servers for egress tests, with a test CA (trustme), that record what
they receive (the path and every header), so a test can say what reached which host."""

from __future__ import annotations

import http.server
import io
import ssl
import threading
import zipfile
from dataclasses import dataclass, field

import trustme


@dataclass
class Seen:
    requests: list[tuple[str, str, dict[str, str]]] = field(default_factory=list)  # (server, path, headers)


WHEEL_NAME = "demo-1.0-py3-none-any.whl"


def demo_wheel() -> bytes:
    """A minimal valid wheel: one module, its metadata and record."""
    files = {
        "demo.py": b"ANSWER = 42\n",
        "demo-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n",
        "demo-1.0.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{name},,\n" for name in files) + "demo-1.0.dist-info/RECORD,,\n"
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as wheel:
        for name, data in files.items():
            wheel.writestr(name, data)
        wheel.writestr("demo-1.0.dist-info/RECORD", record)
    return buf.getvalue()


def _handler(name: str, seen: Seen, payload: bytes) -> type[http.server.BaseHTTPRequestHandler]:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def do_GET(self) -> None:  # noqa: N802 - the stdlib's name
            seen.requests.append((name, self.path, dict(self.headers.items())))
            kind = "application/octet-stream"
            if self.path.startswith("/big"):
                body = payload
            elif self.path.rstrip("/") == "/simple/demo":  # a package index (PEP 503) with one wheel
                body = f'<a href="/files/{WHEEL_NAME}">{WHEEL_NAME}</a>'.encode()
                kind = "text/html"
            elif self.path == f"/files/{WHEEL_NAME}":
                body = demo_wheel()
            else:
                body = f"hello from {name} {self.path}\n".encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Content-Type", kind)
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    return Handler


class Servers:
    """An HTTP and an HTTPS server on loopback; certificates for the test names, from a test CA."""

    NAMES = ("allowed.test", "other.test", "inward.test")

    def __init__(self, payload: bytes = b"") -> None:
        self.seen = Seen()
        self.ca = trustme.CA()
        self.ca_pem = self.ca.cert_pem.bytes().decode()
        cert = self.ca.issue_cert(*self.NAMES)
        self.http = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler("http", self.seen, payload))
        self.https = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _handler("https", self.seen, payload))
        context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
        cert.configure_cert(context)
        self.https.socket = context.wrap_socket(self.https.socket, server_side=True)
        for server in (self.http, self.https):
            threading.Thread(target=server.serve_forever, daemon=True).start()

    def hosts(self, *names: str) -> dict[str, str]:
        """The egress proxy's name map: each name's ports 80 and 443 to these servers."""
        out = {}
        for name in names or self.NAMES:
            out[f"{name}:80"] = f"127.0.0.1:{self.http.server_address[1]}"
            out[f"{name}:443"] = f"127.0.0.1:{self.https.server_address[1]}"
        return out

    def close(self) -> None:
        for server in (self.http, self.https):
            server.shutdown()
            server.server_close()

"""The egress proxy: a sandbox's only way out when it has an allowlist (``SandboxLimits.egress``).

One proxy per process serves every such sandbox, on its own event loop thread. Each sandbox gets
its own Unix socket (``<state>/<key>/proxy.sock``) and that directory bind-mounted into it; the
sandbox has no network interface but loopback, so there is no route and no DNS server to reach, and
the socket it connects through is its identity (nothing to forge or strip). Inside,
``HTTP_PROXY``/``HTTPS_PROXY`` point at ``127.0.0.1:3128``: under runc (as root) the proxy listens
there itself, in the sandbox's network namespace (``listen_in``: no process of the sandbox's in the
path, nothing charged to its CPU); under gVisor, whose loopback is its own, the launcher relays that
port to the socket.

For each request the proxy checks, in order: the host and port against the sandbox's rules; for
a tunnel (CONNECT), that the TLS ClientHello's SNI names the same host; and that the destination
does not resolve inward (loopback, private, link-local, the metadata address, anything not
globally routable) unless that address is itself on the list. It resolves names itself and
connects to the address it checked (no second lookup for a rebinding answer to slip into).
Names the operator maps (``hosts``: ``"name:port" -> "ip:port"``) are trusted as given. Refusals
are an HTTP 403 whose body says why; every attempt is recorded with the bytes each way.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import ipaddress
import json
import logging
import os
import shutil
import socket
import ssl
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from sandloop.contract.egress import EgressAttempt, Secret, allows, is_hostname
from sandloop.runtime.egress.authority import CertificateAuthority
from sandloop.runtime.labels import owner_id

log = logging.getLogger(__name__)

#: Where the socket appears inside the sandbox (the launcher and the image know it).
SANDBOX_DIR = "/run/sandloop-egress"
SOCKET_NAME = "proxy.sock"
#: The relay's address inside the sandbox.
RELAY = "127.0.0.1:3128"
#: Most attempts kept per sandbox (the rest are counted).
MAX_ATTEMPTS = 1000
#: Most connections one sandbox may hold open through the proxy at once.
MAX_CONNECTIONS = 64
#: Connections through this process's proxy at once, all sandboxes together: each holds two
#: descriptors (before, 8 egress sandboxes holding their 64 each took a 1024-descriptor process
#: down: every run then failed). ``raise_open_files`` lifts the servers' soft limit to the hard one.
MAX_CONNECTIONS_TOTAL = 384
#: A relay with no byte either way for this long is closed (a held connection costs descriptors).
RELAY_IDLE_SECONDS = 300.0
HEAD_LIMIT = 64 * 1024
PIPE_CHUNK = 1 << 20
CONNECT_TIMEOUT = 10.0

Resolver = Callable[[str, int], list[str]]


def egress_state() -> Path:
    """Where sandboxes' proxy sockets live: a short path (a socket's is limited to 107 bytes)."""
    if os.geteuid() == 0:
        return Path("/run/sandloop/egress")
    return Path(tempfile.gettempdir()) / f"sandloop-egress-{os.getuid()}"


def kernel_egress_key(session_id: str) -> str:
    """A session's interpreter's egress directory name: found again from any process."""
    return f"kernel-{session_id}"


def system_resolve(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


def sandbox_env(relay: bool) -> dict[str, str]:
    """The environment that points a sandbox's tools at ``RELAY``: served by the launcher's relay
    to the socket (``relay``), or by the proxy itself inside the sandbox's network namespace."""
    url = f"http://{RELAY}"
    return {
        **({"SANDLOOP_EGRESS_SOCKET": f"{SANDBOX_DIR}/{SOCKET_NAME}"} if relay else {}),
        "HTTP_PROXY": url,
        "HTTPS_PROXY": url,
        "http_proxy": url,
        "https_proxy": url,
        "NO_PROXY": "",
        "no_proxy": "",
        "PIP_PROXY": url,
        "npm_config_proxy": url,
        "npm_config_https_proxy": url,
        "NODE_OPTIONS": "--require /opt/sandloop/egress-fetch.js",
    }


class Refused(Exception):
    pass


@dataclass
class _Attempt:
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


@dataclass
class _Box:
    rules: tuple[str, ...]
    #: A long-lived sandbox's (a session's interpreter): its directory outlives this process.
    keep: bool = False
    server: asyncio.AbstractServer | None = None
    extra_servers: list[asyncio.AbstractServer] = field(default_factory=list)
    attempts: list[_Attempt] = field(default_factory=list)
    #: placeholder -> (variable name, secret), for the run in progress.
    secrets: dict[str, tuple[str, Secret]] = field(default_factory=dict)
    dropped: int = 0
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, attempt: _Attempt) -> None:
        with self.lock:
            if len(self.attempts) < MAX_ATTEMPTS:
                self.attempts.append(attempt)
            else:
                self.dropped += 1


class EgressProxy:
    def __init__(
        self,
        state: Path,
        *,
        hosts: Mapping[str, str] | None = None,
        resolve: Resolver = system_resolve,
        ca_dir: Path | None = None,
        upstream_ca: str | None = None,
    ) -> None:
        self.state = state
        self.hosts = {k.lower(): v for k, v in (hosts or {}).items()}
        self._resolve = resolve
        self._ca_dir = ca_dir or state.parent / "egress-ca"
        self._upstream_ca = upstream_ca
        self._authority: CertificateAuthority | None = None
        self._boxes: dict[str, _Box] = {}
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None

    # -- lifecycle (called from any thread) ---------------------------------------------------
    def _ensure_loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None:
                loop = asyncio.new_event_loop()
                threading.Thread(target=loop.run_forever, name="sandloop-egress", daemon=True).start()
                self._loop = loop
            return self._loop

    def _call(self, coro: object, timeout: float = 10.0) -> object:
        return asyncio.run_coroutine_threadsafe(coro, self._ensure_loop()).result(timeout)  # type: ignore[arg-type]

    def open(self, key: str, rules: tuple[str, ...], *, owner: str | None = None) -> Path:
        """Start serving a sandbox: its directory (to bind-mount at ``SANDBOX_DIR``). ``owner``
        (default: this process) is what the reaper checks; a session's interpreter, which outlives
        this process, is owned by its session (``session:<id>``) and its directory is kept until
        the session ends (``release`` at exit, ``close`` when it is destroyed)."""
        directory = self.state / key
        directory.mkdir(parents=True, mode=0o755)
        directory.chmod(0o755)
        (directory / "owner.json").write_text(json.dumps({"owner": owner or owner_id(), "created": time.time()}))
        try:
            return self._serve_socket(key, rules, keep=owner is not None)
        except BaseException:
            shutil.rmtree(directory, ignore_errors=True)
            raise

    def reopen(self, key: str, rules: tuple[str, ...]) -> None:
        """Serve a long-lived sandbox found again (a session's interpreter, from another process):
        its socket too, unless a live process still serves it there. Idempotent."""
        if key in self._boxes:
            return
        path = self.state / key / SOCKET_NAME
        if not path.parent.is_dir():
            raise OSError(f"the egress directory of {key} is gone")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
            served = True
        except OSError:
            served = False
        finally:
            probe.close()
        if served:  # another process serves the socket (gVisor's path); this one serves its own listener
            with self._lock:
                self._boxes.setdefault(key, _Box(rules, keep=True))
            return
        path.unlink(missing_ok=True)  # left by a process that is gone
        self._serve_socket(key, rules, keep=True)

    def _serve_socket(self, key: str, rules: tuple[str, ...], *, keep: bool) -> Path:
        directory = self.state / key
        box = _Box(rules, keep=keep)
        path = directory / SOCKET_NAME

        async def start() -> asyncio.AbstractServer:
            return await asyncio.start_unix_server(
                lambda r, w: self._accept(box, r, w), path=str(path), limit=HEAD_LIMIT
            )

        box.server = self._call(start())  # type: ignore[assignment]
        path.chmod(0o666)  # the sandbox's user connects; only this directory is mounted
        with self._lock:
            self._boxes[key] = box
        return directory

    def listen_in(self, key: str, pid: int) -> None:
        """Also serve the sandbox on ``RELAY`` inside the network namespace of process ``pid`` (a
        runc sandbox's; needs root): its clients then reach the proxy directly, with no relay of
        its own (measured: the in-sandbox relay added ~5 ms to every CONNECT)."""
        box = self._boxes[key]
        listener = _listener_in_netns(pid)

        async def start() -> asyncio.AbstractServer:
            return await asyncio.start_server(lambda r, w: self._accept(box, r, w), sock=listener, limit=HEAD_LIMIT)

        try:
            box.extra_servers.append(self._call(start()))  # type: ignore[arg-type]
        except BaseException:
            listener.close()
            raise

    # -- secrets --------------------------------------------------------------------------------
    @property
    def authority(self) -> CertificateAuthority:
        """This install's CA (made on first use, never shipped): what the sandbox trusts when the
        proxy reads its HTTPS to put secrets in."""
        with self._lock:
            if self._authority is None:
                self._authority = CertificateAuthority(self._ca_dir)
            return self._authority

    def arm(self, key: str, secrets: Mapping[str, Secret]) -> dict[str, str]:
        """Hold ``secrets`` for a sandbox's run; returns the placeholders its variables get."""
        box = self._boxes[key]
        placeholders = {}
        for name, secret in secrets.items():
            placeholder = f"sandloop-secret-{name}-{uuid.uuid4().hex}"
            box.secrets[placeholder] = (name, secret)
            placeholders[name] = placeholder
        return placeholders

    @staticmethod
    def _body_scanner(box: _Box, attempt: _Attempt) -> Callable[[bytes], None] | None:
        """What looks through a request body the proxy can read: a secret's placeholder there is
        never replaced (only headers carry a value) and is said in the audit."""
        if not box.secrets:
            return None
        wanted = {p.encode(): name for p, (name, _) in box.secrets.items()}
        overlap = max(len(p) for p in wanted) - 1
        tail = b""
        said: set[str] = set()

        def scan(data: bytes) -> None:
            nonlocal tail
            window = tail + data
            for placeholder, name in wanted.items():
                if name not in said and placeholder in window:
                    said.add(name)
                    attempt.add_note(
                        f"the placeholder of secret {name} was in a request body: sent as it is, not replaced"
                    )
            tail = window[-overlap:]

        return scan

    def disarm(self, key: str, placeholders: Mapping[str, str] | None) -> None:
        """Forget a run's or a cell's secrets: their placeholders are plain strings from now on (a
        later cell of the same interpreter, or a thread the cell left running, gets nothing)."""
        box = self._boxes.get(key)
        if box is None or not placeholders:
            return
        for placeholder in placeholders.values():
            box.secrets.pop(placeholder, None)

    def _with_secrets(self, box: _Box, attempt: _Attempt, head: bytes, *, tls: bool) -> bytes:
        """A request head with each placeholder replaced by its value, where this host is one of
        its secret's hosts, only in the value of one of the secret's headers, and only over TLS
        (or plain HTTP where the secret allows it). A placeholder sent to another host is left as
        it is and flagged (it is not the value). To one of its hosts, a placeholder anywhere else
        (the request line, ``Host``, another header) refuses the request: a server would echo it
        back (a redirect's ``Location``, a 404 page), and the value with it."""
        if not box.secrets:
            return head
        text = head.decode("latin-1")
        found = [(p, name, secret) for p, (name, secret) in box.secrets.items() if p in text]
        if not found:
            return head
        request_line, _, rest = text.partition("\r\n")
        lines = rest.split("\r\n")
        notes = []
        for placeholder, name, secret in found:
            if not allows(secret.hosts, attempt.host, attempt.port):
                notes.append(
                    f"carried the placeholder of secret {name} to {attempt.host}, not one of its hosts "
                    f"({', '.join(secret.hosts)}): not replaced"
                )
                continue
            if placeholder in request_line:
                raise Refused(
                    f"the placeholder of secret {name} is in the request line (the URL): a secret is sent "
                    f"only in a header ({', '.join(secret.headers)}), never where a server can echo it back"
                )
            if not tls and not secret.plain_http:
                raise Refused(
                    f"secret {name} goes over HTTPS only (this request to {attempt.host} is plain HTTP); "
                    "use https://, or allow plain HTTP for this secret (plain_http)"
                )
            for i, line in enumerate(lines):
                if placeholder not in line:
                    continue
                header, colon, value = line.partition(":")
                if not colon or header.strip().lower() not in secret.headers or placeholder in header:
                    where = header.strip() if colon else "a malformed header line"
                    raise Refused(
                        f"the placeholder of secret {name} is in {where!s}: it is sent only in "
                        f"{', '.join(secret.headers)} (name others with the secret's headers)"
                    )
                lines[i] = f"{header}:{value.replace(placeholder, secret.value.get_secret_value())}"
            notes.append(f"secret {name} sent")
        for note in notes:
            attempt.add_note(note)
        return "\r\n".join([request_line, *lines]).encode("latin-1")

    def attempt_count(self, key: str) -> int:
        box = self._boxes.get(key)
        if box is None:
            return 0
        with box.lock:
            return len(box.attempts)

    def attempts(self, key: str, settle: float = 0.5) -> list[EgressAttempt]:
        """What the sandbox tried so far. Waits up to ``settle`` seconds for its connections to
        finish first (the program has ended: its last bytes are still being counted)."""
        box = self._boxes.get(key)
        if box is None:
            return []
        deadline = time.monotonic() + settle
        while box.tasks and time.monotonic() < deadline:
            time.sleep(0.01)
        with box.lock:
            out = [a.frozen() for a in box.attempts]
            if box.dropped:
                note = f"{box.dropped} more attempts were made and not recorded (the first {MAX_ATTEMPTS} are)"
                out.append(EgressAttempt(host="-", port=0, method="-", allowed=False, note=note))
            return out

    def close(self, key: str) -> None:
        """Stop serving a sandbox (its open connections too) and remove its directory. Idempotent."""
        self.release(key)
        shutil.rmtree(self.state / key, ignore_errors=True)

    def release(self, key: str) -> None:
        """Stop serving a sandbox from this process; its directory stays (a session's interpreter
        lives on, and the next process to attach serves it again)."""
        with self._lock:
            box = self._boxes.pop(key, None)
        if box is not None and self._loop is not None:

            async def stop() -> None:
                for server in (box.server, *box.extra_servers):
                    if server is not None:
                        server.close()
                tasks = list(box.tasks)
                for task in tasks:
                    task.cancel()
                if tasks:  # let them finish cancelling (else a loop stopped next destroys them pending)
                    await asyncio.wait(tasks, timeout=5)

            with contextlib.suppress(Exception):
                self._call(stop())

    def shutdown(self) -> None:
        for key, box in list(self._boxes.items()):
            (self.release if box.keep else self.close)(key)
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._loop.stop)

    def leftovers(self) -> list[tuple[str, str]]:
        """(key, owner) of every sandbox directory here that this proxy does not serve."""
        out = []
        if self.state.is_dir():
            for directory in self.state.iterdir():
                if directory.name in self._boxes:
                    continue
                try:
                    owner = str(json.loads((directory / "owner.json").read_text())["owner"])
                except (OSError, ValueError, KeyError):
                    owner = ""
                out.append((directory.name, owner))
        return out

    def remove(self, key: str) -> None:
        shutil.rmtree(self.state / key, ignore_errors=True)

    def collect_garbage(self) -> list[str]:
        """Directories of sandboxes whose owner process is gone (SIGKILLed). A session's stay: its
        interpreter lives on (they go with the session's workspace)."""
        from sandloop.runtime.labels import owner_alive

        removed = []
        if self.state.is_dir():
            for directory in self.state.iterdir():
                try:
                    owner = json.loads((directory / "owner.json").read_text())["owner"]
                except (OSError, ValueError, KeyError):
                    owner = ""
                if directory.name not in self._boxes and owner_alive(owner) is False:
                    shutil.rmtree(directory, ignore_errors=True)
                    removed.append(directory.name)
        return removed

    # -- one connection (on the loop) ---------------------------------------------------------
    def _accept(self, box: _Box, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        note = None
        if len(box.tasks) >= MAX_CONNECTIONS:  # each costs this process descriptors and memory
            note = f"more than {MAX_CONNECTIONS} connections at once: refused"
        elif sum(len(b.tasks) for b in list(self._boxes.values())) >= MAX_CONNECTIONS_TOTAL:
            note = f"the proxy holds {MAX_CONNECTIONS_TOTAL} connections for all sandboxes: refused, retry later"
        if note is not None:
            box.record(_Attempt("?", 0, "?", allowed=False, note=note))
            writer.close()
            return
        task = asyncio.ensure_future(self._serve(box, reader, writer))
        box.tasks.add(task)
        task.add_done_callback(box.tasks.discard)

    async def _serve(self, box: _Box, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream: asyncio.StreamWriter | None = None
        attempt: _Attempt | None = None
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
            except (asyncio.LimitOverrunError, ValueError):  # over HEAD_LIMIT: said, not dropped
                note = f"the request head is over {HEAD_LIMIT // 1024} KiB"
                box.record(_Attempt("?", 0, "?", allowed=False, note=note))
                await _reply(writer, 431, note)
                return
            try:
                method, host, port, forward = _parse_head(head)
            except _BadRequest as exc:
                box.record(_Attempt("?", 0, "?", allowed=False, note=str(exc)))
                await _reply(writer, 400, str(exc))
                return
            attempt = _Attempt(host, port, method)
            box.record(attempt)
            if not allows(box.rules, host, port):
                raise Refused(f"{host}:{port} is not on this sandbox's allowlist ({', '.join(box.rules)})")
            address = await self._destination(box, host, port)
            if method == "CONNECT" and box.secrets:  # read the requests to put secrets in
                writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
                await writer.drain()
                upstream = await self._intercept(box, attempt, reader, writer, address)
                return
            plain: bytes | None = None
            if method == "CONNECT":
                writer.write(b"HTTP/1.1 200 Connection established\r\n\r\n")
                await writer.drain()
                forward, hello, plain = await _tunnel_start(reader)
                if plain is not None:  # plain HTTP inside the tunnel: bound to its host as any
                    forward = _closing(plain, host, port, default_port=80)
                else:
                    refusal = _tunnel_refusal(host, hello)
                    if refusal:
                        attempt.allowed, attempt.note = False, refusal
                        return
            try:
                up_reader, up_writer = await asyncio.wait_for(
                    asyncio.open_connection(address[0], address[1], limit=PIPE_CHUNK), CONNECT_TIMEOUT
                )
            except (TimeoutError, OSError) as exc:
                attempt.note = f"could not connect to {host}:{port}: {exc or 'timed out'}"
                if method != "CONNECT":
                    await _reply(writer, 502, attempt.note)
                return
            upstream = up_writer
            head = self._with_secrets(box, attempt, forward, tls=False)
            # one HTTP request per connection: after its head and body nothing more of the client's
            # goes up (a second request on it would go unchecked and unaudited); TLS goes on as is
            body = None if method == "CONNECT" and plain is None else _body_length(head)
            scan = self._body_scanner(box, attempt) if body is not None else None
            await _relay(head, reader, writer, up_reader, up_writer, attempt, client_bytes=body, scan=scan)
        except Refused as exc:
            if attempt is not None:
                attempt.allowed, attempt.note = False, str(exc)
            await _reply(writer, 403, str(exc))
        except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError, ConnectionError):
            pass
        finally:
            for w in (writer, upstream):
                if w is not None:
                    with contextlib.suppress(Exception):
                        w.close()

    async def _intercept(
        self,
        box: _Box,
        attempt: _Attempt,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        address: tuple[str, int],
    ) -> asyncio.StreamWriter | None:
        """A tunnel of a run with secrets: TLS with the sandbox under a certificate for the CONNECT
        host from this install's CA (an SNI naming another host fails the handshake), the request
        head read and given its secrets, then TLS to the destination, verified as any client would."""
        host = attempt.host
        seen: dict[str, str] = {}
        try:
            await writer.start_tls(self.authority.server_context(host, seen))
        except (ssl.SSLError, OSError) as exc:
            attempt.allowed = False
            attempt.note = (
                f"the TLS server name {seen['sni']!r} does not match the tunnel's host {host!r}"
                if "sni" in seen
                else f"TLS with the sandbox failed: {exc}"
            )
            return None
        head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
        head = self._with_secrets(box, attempt, _closing(head, host, attempt.port), tls=True)
        client = ssl.create_default_context(cafile=self._upstream_ca)
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(address[0], address[1], ssl=client, server_hostname=host, limit=PIPE_CHUNK),
                CONNECT_TIMEOUT,
            )
        except (TimeoutError, OSError) as exc:
            attempt.add_note(f"could not reach {host}:{attempt.port}: {exc}")
            await _reply(writer, 502, f"could not reach {host}:{attempt.port}")
            return None
        await _relay(
            head,
            reader,
            writer,
            up_reader,
            up_writer,
            attempt,
            client_bytes=_body_length(head),
            scan=self._body_scanner(box, attempt),
        )
        return up_writer

    async def _destination(self, box: _Box, host: str, port: int) -> tuple[str, int]:
        mapped = self.hosts.get(f"{host}:{port}")
        if mapped is not None:  # the operator's own mapping: trusted as given
            ip, _, mapped_port = mapped.rpartition(":")
            return ip.strip("[]"), int(mapped_port)
        try:
            literal = ipaddress.ip_address(host)
        except ValueError:
            literal = None
        if literal is not None:  # the rules matched the address itself: it is on the list
            return str(literal), port
        loop = asyncio.get_running_loop()
        try:
            addresses = await loop.run_in_executor(None, self._resolve, host, port)
        except OSError as exc:
            raise Refused(f"{host} does not resolve: {exc}") from None
        inward = [a for a in addresses if not _global(a) and not allows(box.rules, a, port)]
        if inward:
            raise Refused(
                f"{host} resolves to {inward[0]}, an inward address (loopback, private, link-local or "
                f"metadata): refused unless that address itself is on the allowlist"
            )
        if not addresses:
            raise Refused(f"{host} does not resolve")
        return addresses[0], port


class _BadRequest(Exception):
    pass


_CLONE_NEWNET = 0x40000000


def _listener_in_netns(pid: int) -> socket.socket:
    """A TCP socket listening on ``RELAY`` in the network namespace of ``pid``. Made on a thread of
    its own that enters the namespace and then ends (a socket keeps the namespace it was made in;
    no other thread of this process ever changes namespace)."""
    made: dict[str, object] = {}

    def make() -> None:
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/proc/{pid}/ns/net", os.O_RDONLY)
            try:
                if libc.setns(fd, _CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise OSError(err, f"setns into the sandbox's network namespace: {os.strerror(err)}")
            finally:
                os.close(fd)
            host, port = RELAY.split(":")
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            # A session's interpreter may be served by two processes at once (each attached).
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEPORT, 1)
            sock.bind((host, int(port)))
            sock.listen(128)
            sock.setblocking(False)
            made["socket"] = sock
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            made["error"] = exc

    thread = threading.Thread(target=make, name="sandloop-egress-netns")
    thread.start()
    thread.join()
    if "error" in made:
        raise made["error"]  # type: ignore[misc]
    return made["socket"]  # type: ignore[return-value]


def _global(address: str) -> bool:
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
        raise _BadRequest(f"{host[:100]!r} is not a host name")
    return host


def _tunnel_refusal(host: str, hello: bytes | None) -> str | None:
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
        raise _BadRequest("a request head may end its lines only with CRLF (a bare LF or CR was sent)")
    return text.split("\r\n")


def _authority(host: str, port: int, default_port: int) -> str:
    name = f"[{host}]" if ":" in host else host
    return name if port == default_port else f"{name}:{port}"


def _bound(lines: list[str], request_line: str, host: str, port: int, default_port: int) -> bytes:
    """The head to send upstream: hop-by-hop headers dropped, exactly one ``Host`` and it names the
    host this request was allowed for (a virtual host or CDN serves whoever ``Host`` names), and a
    request to close after its response (the next request on the connection would go unchecked)."""
    kept = [line for line in lines if line and line.split(":", 1)[0].strip().lower() not in (*_HOP_BY_HOP, "host")]
    out = [request_line, f"Host: {_authority(host, port, default_port)}", *kept, "Connection: close", "", ""]
    return "\r\n".join(out).encode("latin-1")


def _closing(head: bytes, host: str, port: int, default_port: int = 443) -> bytes:
    """A request head read inside a tunnel, bound to the tunnel's host (see _bound); an absolute
    URL naming another host is refused."""
    lines = _strict_lines(head)
    parts = lines[0].split(" ")
    if len(parts) != 3:
        raise _BadRequest(f"not an HTTP request: {lines[0][:100]!r}")
    target = parts[1]
    if "://" in target:
        url = urlsplit(target)
        if (url.hostname or "").lower().rstrip(".") != host or (url.port or default_port) != port:
            raise Refused(f"the request names {url.hostname!r} inside a tunnel to {host!r}")
        parts[1] = (url.path or "/") + (f"?{url.query}" if url.query else "")
    return _bound(lines[1:], " ".join(parts), host, port, default_port)


def _parse_head(head: bytes) -> tuple[str, str, int, bytes]:
    """(method, host, port, the bytes to send upstream) of a proxy request's head."""
    lines = _strict_lines(head)
    try:
        method, target, version = lines[0].split(" ")
    except ValueError:
        raise _BadRequest(f"not an HTTP proxy request: {lines[0][:100]!r}") from None
    if method == "CONNECT":
        host, _, port = target.rpartition(":")
        if not port.isdigit() or not host:
            raise _BadRequest(f"CONNECT needs host:port, got {target[:100]!r}")
        name = _checked_host(host.strip("[]").lower().rstrip("."))
        if not 1 <= int(port) <= 65535:
            raise _BadRequest(f"CONNECT needs a port from 1 to 65535, got {port[:10]!r}")
        return method, name, int(port), b""
    url = urlsplit(target)
    if url.scheme != "http" or not url.hostname:
        raise _BadRequest(
            f"a proxy request needs an absolute http:// URL (use CONNECT, i.e. an https:// URL, for TLS), "
            f"got {target[:100]!r}"
        )
    path = (url.path or "/") + (f"?{url.query}" if url.query else "")
    try:
        number = url.port or 80
    except ValueError:
        raise _BadRequest(f"a bad port in {target[:100]!r}") from None
    name = _checked_host(url.hostname.lower().rstrip("."))
    return method, name, number, _bound(lines[1:], f"{method} {path} {version}", name, number, 80)


#: The most of a ClientHello read before deciding (one is rarely over 2 KiB; post-quantum ~1.8 KiB).
MAX_CLIENT_HELLO = 64 * 1024


async def _tunnel_start(reader: asyncio.StreamReader) -> tuple[bytes, bytes | None, bytes | None]:
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


async def _relay(
    first: bytes,
    reader: asyncio.StreamReader,
    writer: asyncio.StreamWriter,
    up_reader: asyncio.StreamReader,
    up_writer: asyncio.StreamWriter,
    attempt: _Attempt,
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


def _body_length(head: bytes) -> int:
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
    attempt: _Attempt,
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


async def _reply(writer: asyncio.StreamWriter, status: int, message: str) -> None:
    reason = {400: "Bad Request", 403: "Forbidden", 431: "Request Header Fields Too Large", 502: "Bad Gateway"}[status]
    body = f"sandloop egress: {message}\n".encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\nContent-Type: text/plain; charset=utf-8\r\n"
        f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n"
    )
    with contextlib.suppress(Exception):
        writer.write(head.encode() + body)
        await writer.drain()


def raise_open_files() -> int:
    """Lift this process's soft descriptor limit to its hard one (a server holds a relay's two
    descriptors per proxied connection); returns the limit now in force. Never raises."""
    import resource

    try:
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY:
            hard = max(soft, 1 << 20)
        if soft < hard:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        return resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    except (ValueError, OSError):
        return -1


def sandbox_mount(directory: Path) -> tuple[str, str]:
    """(host directory, where it goes in the sandbox)."""
    return str(directory), SANDBOX_DIR

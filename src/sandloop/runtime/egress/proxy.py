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
import ipaddress
import json
import logging
import shutil
import socket
import ssl
import threading
import time
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from sandloop.contract.egress import EgressAttempt, Secret, allows
from sandloop.runtime.egress.authority import CertificateAuthority
from sandloop.runtime.egress.host import SOCKET_NAME, listener_in_netns
from sandloop.runtime.egress.wire import (  # noqa: F401 - HEAD_LIMIT, as tests read it here
    HEAD_LIMIT,
    PIPE_CHUNK,
    Attempt,
    BadRequest,
    Refused,
    authority_header,
    body_length,
    closing_head,
    is_global_address,
    parse_head,
    pipe_bytes,
    send_refusal,
    tunnel_refusal,
    tunnel_start,
)
from sandloop.runtime.labels import owner_id

log = logging.getLogger(__name__)

#: Most attempts kept per sandbox (the rest are counted).
MAX_ATTEMPTS = 1000
#: Most connections one sandbox may hold open through the proxy at once.
MAX_CONNECTIONS = 64
#: Connections through this process's proxy at once, all sandboxes together: each holds two
#: descriptors (before, 8 egress sandboxes holding their 64 each took a 1024-descriptor process
#: down: every run then failed). ``raise_open_files`` lifts the servers' soft limit to the hard one.
MAX_CONNECTIONS_TOTAL = 384
CONNECT_TIMEOUT = 10.0

Resolver = Callable[[str, int], list[str]]


def system_resolve(host: str, port: int) -> list[str]:
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    return list(dict.fromkeys(str(info[4][0]) for info in infos))


@dataclass
class _Box:
    rules: tuple[str, ...]
    #: A long-lived sandbox's (a session's interpreter): its directory outlives this process.
    keep: bool = False
    server: asyncio.AbstractServer | None = None
    extra_servers: list[asyncio.AbstractServer] = field(default_factory=list)
    attempts: list[Attempt] = field(default_factory=list)
    #: placeholder -> (variable name, secret), for the run in progress.
    secrets: dict[str, tuple[str, Secret]] = field(default_factory=dict)
    dropped: int = 0
    tasks: set[asyncio.Task[None]] = field(default_factory=set)
    lock: threading.Lock = field(default_factory=threading.Lock)

    def record(self, attempt: Attempt) -> None:
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
        listener = listener_in_netns(pid)

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
    def _body_scanner(box: _Box, attempt: Attempt) -> Callable[[bytes], None] | None:
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

    def _with_secrets(self, box: _Box, attempt: Attempt, head: bytes, *, tls: bool) -> bytes:
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
            box.record(Attempt("?", 0, "?", allowed=False, note=note))
            writer.close()
            return
        task = asyncio.ensure_future(self._serve(box, reader, writer))
        box.tasks.add(task)
        task.add_done_callback(box.tasks.discard)

    async def _serve(self, box: _Box, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        upstream: asyncio.StreamWriter | None = None
        attempt: Attempt | None = None
        try:
            try:
                head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), 30)
            except (asyncio.LimitOverrunError, ValueError):  # over HEAD_LIMIT: said, not dropped
                note = f"the request head is over {HEAD_LIMIT // 1024} KiB"
                box.record(Attempt("?", 0, "?", allowed=False, note=note))
                await send_refusal(writer, 431, note)
                return
            try:
                method, host, port, forward = parse_head(head)
            except BadRequest as exc:
                box.record(Attempt("?", 0, "?", allowed=False, note=str(exc)))
                await send_refusal(writer, 400, str(exc))
                return
            attempt = Attempt(host, port, method)
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
                forward, hello, plain = await tunnel_start(reader)
                if plain is not None:  # plain HTTP inside the tunnel: bound to its host as any
                    forward = closing_head(plain, host, port, default_port=80)
                else:
                    refusal = tunnel_refusal(host, hello)
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
                    await send_refusal(writer, 502, attempt.note)
                return
            upstream = up_writer
            head = self._with_secrets(box, attempt, forward, tls=False)
            # one HTTP request per connection: after its head and body nothing more of the client's
            # goes up (a second request on it would go unchecked and unaudited); TLS goes on as is
            body = None if method == "CONNECT" and plain is None else body_length(head)
            scan = self._body_scanner(box, attempt) if body is not None else None
            await pipe_bytes(head, reader, writer, up_reader, up_writer, attempt, client_bytes=body, scan=scan)
        except Refused as exc:
            if attempt is not None:
                attempt.allowed, attempt.note = False, str(exc)
            await send_refusal(writer, 403, str(exc))
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
        attempt: Attempt,
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
        head = self._with_secrets(box, attempt, closing_head(head, host, attempt.port), tls=True)
        client = ssl.create_default_context(cafile=self._upstream_ca)
        try:
            up_reader, up_writer = await asyncio.wait_for(
                asyncio.open_connection(address[0], address[1], ssl=client, server_hostname=host, limit=PIPE_CHUNK),
                CONNECT_TIMEOUT,
            )
        except (TimeoutError, OSError) as exc:
            attempt.add_note(f"could not reach {host}:{attempt.port}: {exc}")
            await send_refusal(writer, 502, f"could not reach {host}:{attempt.port}")
            return None
        await pipe_bytes(
            head,
            reader,
            writer,
            up_reader,
            up_writer,
            attempt,
            client_bytes=body_length(head),
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
        inward = [a for a in addresses if not is_global_address(a) and not allows(box.rules, a, port)]
        if inward:
            raise Refused(
                f"{host} resolves to {inward[0]}, an inward address (loopback, private, link-local or "
                f"metadata): refused unless that address itself is on the allowlist"
            )
        if not addresses:
            raise Refused(f"{host} does not resolve")
        return addresses[0], port

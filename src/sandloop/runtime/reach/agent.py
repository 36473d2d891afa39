"""Inside a sandbox: the other end of the host's reach into it (``runtime/reach/mux.py``).

Not imported by sandloop: the host starts it in a running sandbox (``Reachable.exec_stream``:
the sandbox's own namespaces, cgroup, user and filters) as ``python3 -I -S -c SOURCE``, with its
stdin and stdout as one byte stream. Over it, frames (``>BII``: kind, channel, length, then
the payload) carry many channels at once:

- ``TCP`` (payload: a port): a connection to that port on the sandbox's own loopback;
- ``PTY`` (payload: JSON ``cmd``, ``cols``, ``rows``, ``envs``, ``cwd``): a program on a new
  terminal, in a session of its own;
- then ``DATA``, ``EOF`` (no more input), ``CLOSE``, ``RESIZE`` (JSON ``cols``, ``rows``) and
  ``SIGNAL`` (a number, to the terminal's process group).

It answers ``OPENED`` (JSON, a terminal's ``pid``) or ``REFUSED`` (why), then ``DATA``, ``EOF``
(the port or terminal has no more output) and, for a terminal, ``EXIT`` (the exit code, or minus
the signal that ended it). It reaches nothing the sandbox's code could not reach itself: its
loopback, its programs. It ends when its stdin ends (the host went away): every connection is
closed and every terminal hung up.
"""

import fcntl
import json
import os
import pty
import queue
import select
import signal
import socket
import struct
import termios
import threading

HEADER = struct.Struct(">BII")
TCP, PTY, DATA, EOF, CLOSE, RESIZE, SIGNAL, OPENED, REFUSED, EXIT = range(1, 11)
CHUNK = 65536
#: Frames of input waiting for one channel; past it the reader of stdin waits (the sandbox's
#: program is not reading what it is sent).
QUEUED = 256

out_lock = threading.Lock()


def send(kind, channel, payload=b""):
    frame = HEADER.pack(kind, channel, len(payload)) + payload
    with out_lock:
        view = memoryview(frame)
        while view:
            n = os.write(1, view)
            view = view[n:]


def read_exact(n):
    parts, left = [], n
    while left:
        chunk = os.read(0, left)
        if not chunk:
            return None
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


class Channel:
    def __init__(self, number):
        self.number = number
        self.inbox = queue.Queue(QUEUED)
        self.closed = False

    def start(self):
        threading.Thread(target=self.pump_in, daemon=True).start()
        threading.Thread(target=self.pump_out, daemon=True).start()

    def pump_in(self):
        """Input from the host, written in order."""
        while True:
            kind, data = self.inbox.get()
            if kind is None or self.closed:
                return
            try:
                if kind == DATA:
                    self.write(data)
                elif kind == EOF:
                    self.end_input()
            except OSError:
                pass


class Port(Channel):
    def __init__(self, number, port):
        super().__init__(number)
        self.sock = None
        for family, address in ((socket.AF_INET, ("127.0.0.1", port)), (socket.AF_INET6, ("::1", port))):
            sock = socket.socket(family, socket.SOCK_STREAM)
            try:
                sock.connect(address)
            except OSError as exc:
                sock.close()
                error = exc
                continue
            self.sock = sock
            break
        if self.sock is None:
            raise OSError("nothing listens on port %d in the sandbox (%s)" % (port, error.strerror or error))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)

    def opened(self):
        return {}

    def write(self, data):
        self.sock.sendall(data)

    def end_input(self):
        self.sock.shutdown(socket.SHUT_WR)

    def pump_out(self):
        try:
            while True:
                data = self.sock.recv(CHUNK)
                if not data:
                    break
                send(DATA, self.number, data)
        except OSError:
            pass
        send(EOF, self.number)

    def close(self):
        self.closed = True
        self.inbox.put((None, None))
        try:
            self.sock.close()
        except OSError:
            pass


def set_size(fd, cols, rows):
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", int(rows), int(cols), 0, 0))


class Terminal(Channel):
    def __init__(self, number, spec):
        super().__init__(number)
        cmd = spec.get("cmd") or ["/bin/bash", "-i", "-l"]
        env = dict(os.environ)
        env.update({"TERM": "xterm-256color", "LANG": env.get("LANG", "C.UTF-8")})
        env.update(spec.get("envs") or {})
        cwd = spec.get("cwd") or "/workspace"
        env["PWD"] = cwd
        cols, rows = int(spec.get("cols") or 80), int(spec.get("rows") or 24)
        if not os.path.isdir(cwd):
            raise OSError("no such directory in the sandbox: %s" % cwd)
        # pty.fork: the child is a session leader with the terminal as its controlling one
        pid, fd = pty.fork()
        if pid == 0:
            try:
                set_size(0, cols, rows)
                os.chdir(cwd)
                for number in (signal.SIGINT, signal.SIGQUIT, signal.SIGPIPE):
                    signal.signal(number, signal.SIG_DFL)
                os.execvpe(cmd[0], cmd, env)
            except BaseException as exc:  # noqa: BLE001 - the terminal shows why, then it ends
                os.write(2, ("cannot start %s: %s\r\n" % (cmd[0], exc)).encode())
            os._exit(127)
        self.pid, self.fd = pid, fd
        set_size(fd, cols, rows)

    def opened(self):
        return {"pid": self.pid}

    def write(self, data):
        view = memoryview(data)
        while view:
            view = view[os.write(self.fd, view) :]

    def end_input(self):
        self.write(b"\x04")

    def resize(self, cols, rows):
        set_size(self.fd, cols, rows)

    def signal(self, number):
        try:
            os.killpg(self.pid, number)
        except OSError:
            pass

    def pump_out(self):
        # Its end is its process's end: a terminal's reads end with EIO once every holder let go
        # under Linux, but not under gVisor, so the process is asked after each quiet moment.
        status = None
        while True:
            ready, _, _ = select.select([self.fd], [], [], 0.2 if status is None else 0)
            if not ready:
                if status is not None:
                    break
                pid, status = os.waitpid(self.pid, os.WNOHANG)
                if pid == 0:
                    status = None
                continue
            try:
                data = os.read(self.fd, CHUNK)
            except OSError:  # EIO: every process holding the terminal has let go of it
                data = b""
            if not data:
                break
            send(DATA, self.number, data)
        if status is None:
            _, status = os.waitpid(self.pid, 0)
        code = os.waitstatus_to_exitcode(status)
        send(EOF, self.number)
        send(EXIT, self.number, str(code).encode())
        try:
            os.close(self.fd)
        except OSError:
            pass

    def close(self):
        self.closed = True
        self.inbox.put((None, None))
        self.signal(signal.SIGHUP)
        self.signal(signal.SIGCONT)


def main():
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    channels = {}
    while True:
        header = read_exact(HEADER.size)
        if header is None:
            break
        kind, number, length = HEADER.unpack(header)
        payload = read_exact(length) if length else b""
        if payload is None:
            break
        channel = channels.get(number)
        try:
            if kind in (TCP, PTY):
                if channel is not None:
                    raise OSError("channel %d is open already" % number)
                made = Port(number, int(payload)) if kind == TCP else Terminal(number, json.loads(payload))
                channels[number] = made
                send(OPENED, number, json.dumps(made.opened()).encode())
                made.start()
            elif channel is None:
                continue  # closed meanwhile: what was in flight for it goes nowhere
            elif kind in (DATA, EOF):
                channel.inbox.put((kind, payload))
            elif kind == CLOSE:
                channels.pop(number).close()
            elif kind == RESIZE and isinstance(channel, Terminal):
                size = json.loads(payload)
                channel.resize(size["cols"], size["rows"])
            elif kind == SIGNAL and isinstance(channel, Terminal):
                channel.signal(int(payload))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            send(REFUSED, number, str(getattr(exc, "strerror", None) or exc).encode())
    for channel in list(channels.values()):
        channel.close()


main()

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
the signal that ended it). ``CREDIT`` (a 4-byte count) goes both ways: the agent says how much
of a channel's input it handed on, the host how much of a connection's output it took; a
connection's socket is not read while ``WINDOW`` bytes of its output are not yet taken (so the
host never waits for one slow client, and the host's stream is always read: a full channel
never stops the others). It reaches nothing the sandbox's code could not reach itself: its
loopback, its programs. It ends when its stdin ends (the host went away): every connection is
closed and every terminal hung up.

One thread, one loop (``selectors``): a frame from the host is handled where it is read, and a
sandbox's answer is framed where it is read, with no hand-over between threads on the way (each
costs a futex round trip, dear under gVisor's ptrace platform: issue 38's first-byte target).
Input for a channel waits in its own buffer until the socket or terminal takes it (the host
sends at most ``WINDOW`` bytes before credit). Connecting never blocks the loop: a port whose
backlog is full cost every channel 10 s when connects were synchronous (issue 52 finding 6).
"""

import errno
import fcntl
import json
import os
import pty
import select
import selectors
import signal
import socket
import struct
import termios
import time

HEADER = struct.Struct(">BII")
TCP, PTY, DATA, EOF, CLOSE, RESIZE, SIGNAL, OPENED, REFUSED, EXIT, CREDIT = range(1, 12)
COUNT = struct.Struct(">I")
CHUNK = 65536
#: A channel's bytes in flight each way before the other end's credit (mux.WINDOW).
WINDOW = 256 * 1024
#: Input waiting for one channel past which the host broke its window: the channel is closed.
QUEUED = 4 * WINDOW
#: Seconds a hung-up terminal's processes have to end before they are killed (a program that
#: ignores SIGHUP -- one started with it ignored, as under nohup -- outlived its terminal).
KILL_AFTER = 2.0
#: A terminal read within CHATTY seconds of the one before rests PACE seconds first: under gVisor's
#: ptrace platform every write that wakes a waiting reader costs ~0.5 ms (issue 60), so in a burst
#: the output gathers in the terminal; a keystroke's echo, alone, still comes at once.
CHATTY = 0.01
PACE = 0.004
#: How often a terminal whose output is quiet is asked whether its process ended (gVisor gives
#: no EIO at a terminal's end), and a closed terminal's process reaped.
POLL = 0.2
CONNECT_TIMEOUT = 10.0
#: How long after the host's resize the agent keeps the terminal at that size. bash's readline
#: reads the size and sets it back (``set_winsize`` in ``rl_prep_terminal``, at each prompt): a
#: resize landing between its two calls was undone, and stayed undone. Under gVisor's ptrace
#: platform every system call is a host round trip, so the window is wide: 11 of 160 resizes
#: sent beside 4 busy terminals were lost (none with ``bash --noediting``, none on runc).
SETTLE = 5.0

selector = selectors.DefaultSelector()


def send(kind, channel, payload=b""):
    """A frame to the host, whole (it reads all the time: its buffers are its own)."""
    view = memoryview(HEADER.pack(kind, channel, len(payload)) + payload)
    while view:
        try:
            view = view[os.write(1, view) :]
        except BlockingIOError:  # stdout shares stdin's non-blocking file (one socket)
            select.select([], [1], [])


def set_size(fd, cols, rows):
    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", int(rows), int(cols), 0, 0))


def get_size(fd):
    rows, cols, _, _ = struct.unpack("HHHH", fcntl.ioctl(fd, termios.TIOCGWINSZ, bytes(8)))
    return cols, rows


class Channel:
    def __init__(self, number):
        self.number = number
        self.pending = bytearray()  # input from the host, not yet taken
        self.input_ended = False
        self.output_ended = False
        self.gone = False  # closed: events already selected for it are dropped
        self.unacked = 0  # output sent, not yet taken by the host (connections only)
        self.credit_due = 0  # input handed on, not yet credited to the host

    def reading(self):
        return not self.output_ended

    def want(self):
        events = selectors.EVENT_READ if self.reading() else 0
        return events | (selectors.EVENT_WRITE if self.pending else 0)

    def credited(self, count):
        self.unacked = max(0, self.unacked - count)
        self.watch()

    def watch(self):
        if self.gone or self.fd < 0:
            return
        events = self.want()
        try:
            key = selector.get_key(self.fd)
        except KeyError:
            if events:
                selector.register(self.fd, events, self)
            return
        if not events:
            selector.unregister(self.fd)
        elif key.events != events:
            selector.modify(self.fd, events, self)

    def give(self, data):
        self.pending += data
        if len(self.pending) > QUEUED:
            raise OSError("the host sent more than its window")
        self.watch()

    def flush(self):
        before = len(self.pending)
        try:
            while self.pending:
                n = self.write(self.pending)
                del self.pending[:n]
        except BlockingIOError:
            pass
        except OSError:
            self.pending.clear()
            self.input_ended = False
        self.credit_due += before - len(self.pending)
        # Credit only in quarter windows: a frame per request would cost a write and a wake-up
        # each (dear under gVisor). No stall: a host waiting for room has a whole window in
        # flight, so once it is handed on at least a quarter is due.
        if self.credit_due >= WINDOW // 4:
            send(CREDIT, self.number, COUNT.pack(self.credit_due))
            self.credit_due = 0
        if not self.pending and self.input_ended:
            self.input_ended = False
            self.end_input()
        self.watch()

    def readable(self):
        try:
            data = self.read()
        except BlockingIOError:
            return
        except OSError:  # a reset connection; EIO: every holder of the terminal let go of it
            data = b""
        if data:
            send(DATA, self.number, data)
            if not self.reading():
                self.watch()  # its window is full: not read until the host takes some
        else:
            self.ended()

    def ended(self):
        self.output_ended = True
        self.watch()
        send(EOF, self.number)


class Port(Channel):
    def __init__(self, number, port):
        super().__init__(number)
        self.port = port
        self.sock = None
        self.fd = -1
        self.connecting = True
        self.deadline = time.monotonic() + CONNECT_TIMEOUT
        self.addresses = [(socket.AF_INET, ("127.0.0.1", port)), (socket.AF_INET6, ("::1", port))]
        self.error = None
        self.attempt()

    def attempt(self):
        """The next address, connected without waiting: its end is a writable socket."""
        while self.addresses:
            family, address = self.addresses.pop(0)
            sock = socket.socket(family, socket.SOCK_STREAM)
            sock.setblocking(False)
            code = sock.connect_ex(address)
            if code in (0, errno.EINPROGRESS):
                self.sock, self.fd = sock, sock.fileno()
                selector.register(self.fd, selectors.EVENT_WRITE, self)
                if code == 0 or select.select([], [self.fd], [], 0)[1]:
                    self.connected()  # a loopback handshake is often done already: no loop round
                return
            sock.close()
            self.error = code
        self.refuse()

    def refuse(self):
        self.connecting, self.gone = False, True
        why = os.strerror(self.error) if self.error else "timed out"
        send(REFUSED, self.number, ("nothing listens on port %d in the sandbox (%s)" % (self.port, why)).encode())

    def connected(self):
        """Its socket became writable: connected, or the next address is tried."""
        code = self.sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if code:
            self.drop()
            self.error = code
            self.attempt()
            return
        self.connecting = False
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        send(OPENED, self.number, b"{}")
        self.flush()  # what came behind the open (a request's head)

    def expired(self, now):
        if self.connecting and now > self.deadline:
            self.drop()
            self.addresses, self.error = [], None
            self.refuse()
            return True
        return False

    def drop(self):
        if self.fd in selector.get_map():
            selector.unregister(self.fd)
        self.sock.close()
        self.sock, self.fd = None, -1

    def watch(self):
        if not self.connecting:
            super().watch()

    def flush(self):
        if not self.connecting:
            super().flush()

    def reading(self):
        return not self.output_ended and self.unacked < WINDOW

    def opened(self):
        return {}

    def read(self):
        data = self.sock.recv(CHUNK)
        self.unacked += len(data)
        return data

    def write(self, data):
        return self.sock.send(data)

    def end_input(self):
        try:
            self.sock.shutdown(socket.SHUT_WR)
        except OSError:
            pass

    def close(self):
        self.gone = True
        if self.sock is not None:
            self.drop()
        return True


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
                # every signal as a new program expects it: the agent's own dispositions and any
                # inherited SIG_IGN (SIGHUP under nohup) would outlive the exec
                for number in range(1, signal.NSIG):
                    try:
                        signal.signal(number, signal.SIG_DFL)
                    except (OSError, ValueError, RuntimeError):
                        pass
                signal.pthread_sigmask(signal.SIG_SETMASK, [])
                os.execvpe(cmd[0], cmd, env)
            except BaseException as exc:  # noqa: BLE001 - the terminal shows why, then it ends
                os.write(2, ("cannot start %s: %s\r\n" % (cmd[0], exc)).encode())
            os._exit(127)
        self.pid, self.fd = pid, fd
        os.set_blocking(fd, False)
        set_size(fd, cols, rows)
        self.size = (cols, rows)  # what the host asked for last
        self.kept_until = 0.0
        self.status = None
        self.heard = time.monotonic()
        self.exited = False  # EXIT sent
        self.kill_at = None  # hung up: killed then if it has not ended
        self.rest_until = 0.0  # in a burst: not read until then

    def opened(self):
        return {"pid": self.pid}

    def reading(self):
        return not self.output_ended and time.monotonic() >= self.rest_until

    def read(self):
        data = os.read(self.fd, CHUNK)
        now = time.monotonic()
        if data and now - self.heard < CHATTY:
            self.rest_until = now + PACE
        self.heard = now
        return data

    def write(self, data):
        return os.write(self.fd, data)

    def end_input(self):
        self.give(b"\x04")

    def resize(self, cols, rows):
        now = time.monotonic()
        self.size = (int(cols), int(rows))
        self.kept_until = now + SETTLE
        self.keep_size(now)

    def keep_size(self, now):
        """The terminal at the host's size (for SETTLE seconds after a resize, see there); its
        programs told with SIGWINCH whenever it changes. gVisor (runsc 20221219) sends none on a
        new size, so a full-screen program never redrew; on Linux the kernel's and this one
        coalesce while pending."""
        if self.fd < 0 or now > self.kept_until:
            return
        try:
            if get_size(self.fd) == self.size:
                return
            set_size(self.fd, *self.size)
            try:
                group = os.tcgetpgrp(self.fd)
            except OSError:
                group = self.pid
            os.killpg(group, signal.SIGWINCH)
        except OSError:
            pass

    def signal(self, number):
        try:
            os.killpg(self.pid, number)
        except ProcessLookupError:
            # no such group yet: pty.fork returns here before its child's setsid, and a signal
            # sent at once was lost (62 of 100 SIGKILLs right after the start, on the host): the
            # child alone is all there is to signal then
            try:
                os.kill(self.pid, number)
            except OSError:
                pass
        except OSError:
            pass

    def reaped(self):
        if self.status is None:
            try:
                pid, status = os.waitpid(self.pid, os.WNOHANG)
            except ChildProcessError:
                pid, status = self.pid, 0
            if pid:
                self.status = status
        return self.status is not None

    def tick(self, now):
        """Asked each loop once quiet for POLL: True once a closed terminal's process is reaped."""
        if self.exited or now - self.heard < POLL:
            return self.gone and self.exited
        self.heard = now
        if not self.reaped():
            if self.kill_at is not None and now >= self.kill_at:
                # still there KILL_AFTER seconds after its hang-up: killed, its group and itself (the
                # pid is this agent's unreaped child, so it names no other process)
                self.signal(signal.SIGKILL)
                try:
                    os.kill(self.pid, signal.SIGKILL)
                except OSError:
                    pass
                self.kill_at = now + KILL_AFTER
            return False
        self.exited = True
        if not self.gone:
            for _ in range(256):  # what it wrote before it ended (bounded), then its end
                if self.output_ended:
                    break
                self.readable()
                if not self.output_ended and not select_ready(self.fd):
                    self.ended()
            if not self.output_ended:
                self.ended()
            send(EXIT, self.number, str(os.waitstatus_to_exitcode(self.status)).encode())
        self.release()
        return self.gone

    def release(self):
        if self.fd < 0:
            return
        if self.fd in selector.get_map():
            selector.unregister(self.fd)
        os.close(self.fd)
        self.fd = -1

    def close(self):
        """Hung up; True once its process is reaped (else ``tick`` reaps it when it ends)."""
        self.gone = True
        if not self.reaped():
            self.signal(signal.SIGHUP)
            self.signal(signal.SIGCONT)
            self.kill_at = time.monotonic() + KILL_AFTER
            self.heard = 0.0  # asked at the next tick
        self.release()
        self.exited = self.exited or self.status is not None
        return self.exited


def select_ready(fd):
    probe = selectors.DefaultSelector()
    try:
        probe.register(fd, selectors.EVENT_READ)
        return bool(probe.select(0))
    finally:
        probe.close()


class Host:
    """The stream from the host: frames in, read as they come (stdin, non-blocking)."""

    def __init__(self, channels):
        self.channels = channels
        self.buffer = bytearray()
        self.ended = False
        os.set_blocking(0, False)
        selector.register(0, selectors.EVENT_READ, self)

    def readable(self):
        try:
            data = os.read(0, CHUNK)
        except BlockingIOError:
            return
        if not data:
            self.ended = True
            selector.unregister(0)
            return
        self.buffer += data
        self.frames()

    def frames(self):
        buffer = self.buffer
        while len(buffer) >= HEADER.size:
            kind, number, length = HEADER.unpack_from(buffer)
            if len(buffer) < HEADER.size + length:
                break
            payload = bytes(buffer[HEADER.size : HEADER.size + length])
            del buffer[: HEADER.size + length]
            self.handle(kind, number, payload)

    def handle(self, kind, number, payload):
        channels = self.channels
        channel = channels.get(number)
        try:
            if kind in (TCP, PTY):
                if channel is not None:
                    raise OSError("channel %d is open already" % number)
                if kind == TCP:
                    made = Port(number, int(payload))  # answers when its connect ends
                    if not made.gone:
                        channels[number] = made
                    return
                made = Terminal(number, json.loads(payload))
                channels[number] = made
                send(OPENED, number, json.dumps(made.opened()).encode())
                made.watch()
            elif channel is None or channel.gone:
                return  # closed meanwhile: what was in flight for it goes nowhere
            elif kind == CLOSE:
                if channel.close():
                    del channels[number]
            elif isinstance(channel, Terminal) and channel.fd < 0:
                return  # its process ended: input, sizes and signals go nowhere
            elif kind == DATA:
                channel.give(payload)
                channel.flush()
            elif kind == EOF:
                channel.input_ended = True
                channel.flush()
            elif kind == CREDIT:
                channel.credited(COUNT.unpack(payload)[0])
            elif kind == RESIZE and isinstance(channel, Terminal):
                size = json.loads(payload)
                channel.resize(size["cols"], size["rows"])
            elif kind == SIGNAL and isinstance(channel, Terminal):
                channel.signal(int(payload))
        except (OSError, ValueError, KeyError, TypeError, struct.error) as exc:
            if channel is not None and kind == DATA:  # the host broke the window: the channel ends
                channel.close()
                channels.pop(number, None)
                send(EOF, number)
                return
            send(REFUSED, number, str(getattr(exc, "strerror", None) or exc).encode())


def main():
    signal.signal(signal.SIGPIPE, signal.SIG_IGN)
    channels = {}
    host = Host(channels)
    while not host.ended:
        timed = any(isinstance(c, Terminal) or getattr(c, "connecting", False) for c in channels.values())
        wait = POLL if timed else None
        if timed:
            now = time.monotonic()
            for channel in channels.values():
                if isinstance(channel, Terminal) and channel.rest_until > now:
                    wait = min(wait, channel.rest_until - now)
        for key, events in selector.select(wait):
            owner = key.data
            if owner is host:
                host.readable()
                continue
            if owner.gone:
                continue
            if getattr(owner, "connecting", False):
                owner.connected()
                if owner.gone:
                    channels.pop(owner.number, None)
                continue
            if events & selectors.EVENT_WRITE:
                owner.flush()
            if events & selectors.EVENT_READ and owner.reading():
                owner.readable()
        if timed:
            now = time.monotonic()
            for number, channel in list(channels.items()):
                if isinstance(channel, Terminal):
                    if channel.rest_until and now >= channel.rest_until:
                        channel.rest_until = 0.0
                        channel.watch()  # read again after its rest
                    channel.keep_size(now)
                    if channel.tick(now):
                        del channels[number]
                elif isinstance(channel, Port) and channel.expired(now):
                    del channels[number]
    for channel in list(channels.values()):
        channel.close()


main()

"""Reaching into a session from the command line: ``sandloop session shell ID`` (an interactive
terminal inside) and ``sandloop session expose ID PORT`` (a local port forward to a server inside).

``shell``: keys go to a login bash on a terminal inside (``Session.terminal``), what it shows comes back
as it comes; the local terminal is raw while it runs and restored after, whatever happens; a
resize here (SIGWINCH) resizes the one inside. The exit code is the shell's. Without a local
terminal (a pipe), the input is sent as it is and the output printed.
"""

from __future__ import annotations

import contextlib
import ipaddress
import os
import select
import shutil
import signal
import sys
import termios
import threading
import tty
from typing import Annotated

import typer

from sandloop.cli.common import _fail, _fail_for, err, session_app
from sandloop.contract import SandboxError


def _size() -> os.terminal_size:
    """This terminal's size as it is now (not $COLUMNS, which says what it was at the start)."""
    try:
        return os.get_terminal_size(sys.stdout.fileno())
    except OSError:
        return shutil.get_terminal_size((80, 24))


@session_app.command("shell")
def session_shell(
    session_id: Annotated[str, typer.Argument(help="Session id (sandloop session ls).")],
    command: Annotated[
        list[str] | None, typer.Argument(help="A program to run instead of a login bash (after --).")
    ] = None,
) -> None:
    """An interactive terminal in a session's sandbox (its user, its /workspace). Exit the shell to leave."""
    from sandloop.cli.session import _session
    from sandloop.runtime.reach.mux import ReachError

    session = _session(session_id)
    interactive = sys.stdin.isatty() and sys.stdout.isatty()
    size = _size()
    try:
        term = session.terminal(size.columns, size.lines, cmd=command or None)
    except (ReachError, SandboxError) as exc:
        session.close()
        raise _fail_for(exc) from None
    saved = termios.tcgetattr(sys.stdin.fileno()) if interactive else None
    previous = None
    if interactive:
        err.print(f"[dim]a shell in session {session_id}: exit it to leave[/]")

        def resized(signum: int, frame: object) -> None:
            now = _size()
            with contextlib.suppress(ReachError):
                term.resize(now.columns, now.lines)

        previous = signal.signal(signal.SIGWINCH, resized)
    done = threading.Event()

    def keys() -> None:
        fd = sys.stdin.fileno()
        try:
            while not done.is_set():
                ready, _, _ = select.select([fd], [], [], 0.2)
                if not ready:
                    continue
                data = os.read(fd, 4096)
                if not data:
                    if not interactive:
                        term.end_input()  # a pipe's end: the shell reads its end (^D) and leaves
                    return
                term.send(data)
        except (OSError, ReachError):
            return

    try:
        if saved is not None:
            tty.setraw(sys.stdin.fileno())
        threading.Thread(target=keys, daemon=True).start()
        while data := term.recv():
            os.write(sys.stdout.fileno(), data)
        code = term.wait(30)
    except (ReachError, TimeoutError) as exc:
        raise _fail(f"the terminal ended: {exc}", 1) from None
    finally:
        done.set()
        if saved is not None:
            termios.tcsetattr(sys.stdin.fileno(), termios.TCSADRAIN, saved)
        if previous is not None:
            signal.signal(signal.SIGWINCH, previous)
        term.close()
        session.close()
    raise typer.Exit(code if code >= 0 else 128 - code)


@session_app.command("expose")
def session_expose(
    session_id: Annotated[str, typer.Argument(help="Session id (sandloop session ls).")],
    port: Annotated[int, typer.Argument(help="The port a server listens on inside the sandbox.")],
    local_port: Annotated[int, typer.Option("--local-port", help="The port here (0: a free one).")] = 0,
    host: Annotated[str, typer.Option("--host", help="The address here to listen on.")] = "127.0.0.1",
) -> None:
    """Serve a port of the session's sandbox here, as `kubectl port-forward` does, until Ctrl-C.

    Prints the local URL on stdout. Every connection to it is one to the port inside (the sandbox
    gets no network for it); nothing listening inside yet is fine, each connection is tried when
    it comes (502 with the reason while nothing listens)."""
    from sandloop.cli.session import _session
    from sandloop.runtime.reach.mux import ReachError

    if not 1 <= port <= 65535:
        raise _fail(f"PORT must be 1-65535, got {port}", 2)
    session = _session(session_id)
    try:
        exposed = session.expose(port, host=host, local_port=local_port)
    except OSError as exc:
        session.close()
        raise _fail(f"cannot listen on {host}:{local_port} (--host, --local-port): {exc.strerror or exc}", 2) from None
    except (ReachError, SandboxError) as exc:
        session.close()
        raise _fail_for(exc) from None
    stop = threading.Event()
    previous = {number: signal.signal(number, lambda *_: stop.set()) for number in (signal.SIGINT, signal.SIGTERM)}
    try:
        print(exposed.url, flush=True)
        err.print(f"[dim]port {port} of session {session_id} at {exposed.url}: Ctrl-C to stop[/]")
        if not ipaddress.ip_address(exposed.address[0]).is_loopback:
            err.print(f"[yellow]anyone who reaches {exposed.url} reaches that port: no token is asked for[/]")
        stop.wait()
    finally:
        for number, handler in previous.items():
            signal.signal(number, handler)
        exposed.close()
        session.close()

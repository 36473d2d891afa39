"""``sandloop session shell ID``: an interactive terminal inside a session's sandbox.

Keys go to a login bash on a terminal inside (``Session.terminal``), what it shows comes back
as it comes; the local terminal is raw while it runs and restored after, whatever happens; a
resize here (SIGWINCH) resizes the one inside. The exit code is the shell's. Without a local
terminal (a pipe), the input is sent as it is and the output printed.
"""

from __future__ import annotations

import contextlib
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

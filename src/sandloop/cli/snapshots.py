"""``sandloop session pause|resume|fork|snapshot|snapshots|snapshot-rm|from-snapshot`` (issue 25)."""

from __future__ import annotations

import datetime
from typing import TYPE_CHECKING, Annotated

import typer
from rich.table import Table

from sandloop.cli.common import _fail_for, out, session_app
from sandloop.cli.session import _one_call_settings, _session
from sandloop.contract import SandboxError
from sandloop.sessions.snapshots import validate_count

if TYPE_CHECKING:
    from sandloop.sessions import Session

KEPT = {
    "memory": "its memory (variables, processes, open files)",
    "state": "its picklable Python variables (runc keeps no memory here)",
    "files": "its files (no interpreter was running)",
}


def _attached(session_id: str) -> Session:
    """The session, attached without resuming it."""
    from sandloop.root import configure
    from sandloop.sessions import Session

    configure(_one_call_settings())
    try:
        return Session.attach(session_id, resume=False)
    except SandboxError as exc:
        raise _fail_for(exc) from None


def _pause_or_resume(session_id: str, verb: str) -> None:
    s = _attached(session_id)
    try:
        kind = s.pause() if verb == "pause" else s.resume()
    except SandboxError as exc:
        raise _fail_for(exc) from None
    out.print(
        f"paused {session_id}: kept {KEPT[kind]}" if verb == "pause" else f"resumed {session_id} with {KEPT[kind]}"
    )


@session_app.command("pause")
def session_pause(session_id: Annotated[str, typer.Argument(help="The session's id.")]) -> None:
    """Pause a session: nothing runs and no memory is held until it resumes (`session resume`,
    or any command that uses it). gVisor sessions keep their memory; runc sessions their
    picklable Python state."""
    _pause_or_resume(session_id, "pause")


@session_app.command("resume")
def session_resume(session_id: Annotated[str, typer.Argument(help="The session's id.")]) -> None:
    """Resume a paused session as it was."""
    _pause_or_resume(session_id, "resume")


@session_app.command("fork")
def session_fork(
    session_id: Annotated[str, typer.Argument(help="The session's id.")],
    count: Annotated[int, typer.Option("--count", "-n", help="How many forks (1-20).")] = 1,
    paused: Annotated[
        bool, typer.Option("--paused", help="Make them paused: each resumes at its first use (no memory held now).")
    ] = False,
) -> None:
    """New sessions, each starting as this one is now, with their own workspace and memory;
    prints their ids."""
    try:
        validate_count(count)  # before attaching: a bad count must not resume a paused session
    except SandboxError as exc:
        raise _fail_for(exc) from None
    s = _session(session_id)
    try:
        children = s.fork(count, paused=paused)
    except SandboxError as exc:
        raise _fail_for(exc) from None
    for child in children:
        child.close()
        out.print(child.id)


@session_app.command("snapshot")
def session_snapshot(
    session_id: Annotated[str, typer.Argument(help="The session's id.")],
    name: Annotated[str, typer.Option("--name", help="A name to find it by.")] = "",
) -> None:
    """Keep the session as it is now (it goes on running); prints the snapshot's id."""
    s = _session(session_id)
    try:
        snap = s.snapshot(name)
    except SandboxError as exc:
        raise _fail_for(exc) from None
    s.close()
    out.print(snap.id)


@session_app.command("snapshots")
def session_snapshots(
    session_id: Annotated[str | None, typer.Argument(help="Only this session's.")] = None,
) -> None:
    """List snapshots."""
    from sandloop.root import configure
    from sandloop.sessions import Session

    configure(_one_call_settings())
    table = Table("id", "session", "name", "kind", "size", "made", "not kept")
    for column in table.columns[:4]:  # ids and names are copied from here: never wrapped
        column.no_wrap = True
    for r in Session.snapshots(session_id):
        made = datetime.datetime.fromtimestamp(r.created).strftime("%Y-%m-%d %H:%M:%S")
        table.add_row(r.id, r.session_id, r.name, r.kind, f"{r.size_bytes >> 20}m", made, ", ".join(r.dropped))
    out.print(table)


@session_app.command("snapshot-rm")
def session_snapshot_rm(snapshot_ids: Annotated[list[str], typer.Argument(help="Snapshot ids.")]) -> None:
    """Delete snapshots."""
    from sandloop.root import configure
    from sandloop.sessions import Session

    configure(_one_call_settings())
    for snapshot_id in snapshot_ids:
        try:
            Session.delete_snapshot(snapshot_id)
        except SandboxError as exc:
            raise _fail_for(exc) from None
        out.print(f"deleted {snapshot_id}")


@session_app.command("from-snapshot")
def session_from_snapshot(
    snapshot_id: Annotated[str, typer.Argument(help="The snapshot's id.")],
    ttl: Annotated[float | None, typer.Option("--ttl", help="Idle seconds before it is removed.")] = None,
) -> None:
    """A new session started from a snapshot; prints its id."""
    from sandloop.root import configure
    from sandloop.sessions import Session

    configure(_one_call_settings())
    try:
        s = Session.from_snapshot(snapshot_id, ttl=ttl)
    except SandboxError as exc:
        raise _fail_for(exc) from None
    s.close()
    out.print(s.id)

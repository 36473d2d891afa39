"""Sandbox failures: the exception tree.

User code failing is never an exception (see ``ExecutionResult``). These are raised only when the
sandbox itself cannot do its job::

    SandboxError                    root: catch this to handle every sandbox failure
    ├── EngineUnavailable           no Docker engine answers, or it failed mid-run
    ├── ImageMissing                the runtime image is not built on this engine
    ├── RuntimeUnavailable          the OCI runtime (e.g. runsc) is not registered with the engine
    ├── UnknownLanguage             no language of that name is registered
    ├── InvalidArgument             a bad value given to the API (also a ValueError)
    │   ├── InvalidLimits           a SandboxLimits value out of range
    │   └── PathRefused             a workspace path that escapes the workspace, or names a directory
    │       └── TooLarge            data over a size cap (a file, an upload, an archive's expansion)
    ├── WorkspaceFileNotFound       no such file in the session's workspace (also FileNotFoundError)
    ├── WorkspaceFull               the session's workspace quota is used up
    ├── HostDiskFull                the host's disk cannot back a workspace or an image export
    ├── SessionNotFound             no live session with that id (deleted or expired)
    ├── SessionDamaged              the session's record cannot be read (deleting it still works)
    ├── SessionPaused               the session is paused: resume it first
    ├── SessionNotPaused            resume of a running session, pause of a paused one
    ├── SnapshotNotFound            no snapshot with that id
    ├── SnapshotIncompatible        a memory snapshot made by another runsc, image or CPU
    └── SandboxBusy                 admission control refused the run; retry later

Every message says what to do about it. Every class has a stable ``code`` that front ends map
(HTTP statuses, CLI JSON, MCP text) instead of reading messages.
"""

from __future__ import annotations

from typing import ClassVar


class SandboxError(Exception):
    """The sandbox itself failed (not the code it ran)."""

    #: Stable and machine-readable; front ends map it, never the message.
    code: ClassVar[str] = "sandbox_error"
    #: Whether retrying the same call later may succeed.
    retryable: bool = False


class EngineUnavailable(SandboxError):
    """No Docker engine answers, or it failed during the run."""

    code = "engine_unavailable"
    retryable = True


class ImageMissing(SandboxError):
    """The runtime image is not present on the engine."""

    code = "image_missing"


class RuntimeUnavailable(SandboxError):
    """The requested OCI runtime (runc, runsc) is not registered with the engine."""

    code = "runtime_unavailable"


class UnknownLanguage(SandboxError):
    """No language of that name is registered."""

    code = "unknown_language"


class InvalidArgument(SandboxError, ValueError):
    """A value passed to the API is invalid.

    ``problems`` names each bad value by its parameter (``("timeout_seconds", "must be ...")``),
    so a front end can say it in its own words (the CLI's ``--timeout``, the API's JSON field)
    without reading the message."""

    code = "invalid_argument"

    def __init__(self, message: str, problems: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.problems = problems


class InvalidLimits(InvalidArgument):
    """A ``SandboxLimits`` value is out of range (``problems``: each field and what is wrong)."""

    code = "invalid_limits"


class SandboxBusy(SandboxError):
    """Admission control refused the run because too many are in flight. Retry later."""

    code = "busy"
    retryable = True


class PathRefused(InvalidArgument):
    """A workspace path was refused: absolute, traversal, a symlink out, or a directory where a file
    was expected. Over a size cap is its subclass ``TooLarge``."""

    code = "path_refused"


class TooLarge(PathRefused):
    """Data over a size cap: a file written or read, an upload, an archive's expanded size."""

    code = "too_large"


class WorkspaceFull(SandboxError):
    """The session's workspace is full (its quota is used up); delete files or use a larger quota."""

    code = "workspace_full"


class HostDiskFull(SandboxError):
    """The host's disk has too little free space for what was asked (a session's workspace, the
    direct backend's image export): free space there, delete sessions, or ask for a smaller quota."""

    code = "host_disk_full"
    retryable = True


class WorkspaceFileNotFound(SandboxError, FileNotFoundError):
    """No such file or directory in the session's workspace."""

    code = "not_found"


class SessionNotFound(SandboxError):
    """No live session with that id: it was deleted, or its idle TTL expired."""

    code = "session_not_found"


class ContextNotFound(SandboxError):
    """No code context with that id in the session (it was removed, or the session's
    interpreter sandbox was replaced, which takes every context with it)."""

    code = "context_not_found"


class NodeLost(SandboxError):
    """A node of a cluster (the Ray backend) was lost, or stopped answering, during a call. The
    call may or may not have started its code; it is never retried (untrusted code runs at most
    once). New calls go to live nodes."""

    code = "node_lost"


class SessionDamaged(SandboxError):
    """The session's record cannot be read (kept as it is for a person to look at); deleting the
    session still removes it and everything it holds."""

    code = "session_damaged"


class SessionLost(SessionNotFound):
    """The session lived on a cluster node that is gone: its workspace and interpreter went with it."""

    code = "session_lost"


class TemplateNotFound(SandboxError):
    """No template with that name and tag on this host: build it (``sandloop templates build``)
    or list what there is (``sandloop templates ls``)."""

    code = "template_not_found"


class TemplateInUse(SandboxError):
    """The template cannot be removed while sessions or sandboxes run from it: delete them first."""

    code = "template_in_use"


class TemplateBuildFailed(SandboxError):
    """A template's build step failed: ``step`` (1-based) says which, ``log_tail`` its last lines.
    Nothing of the failed build is kept but the cached layers of the steps before it."""

    code = "template_build_failed"

    def __init__(self, message: str, step: int = 0, log_tail: list[str] | None = None) -> None:
        super().__init__(message)
        self.step = step
        self.log_tail = list(log_tail or [])


class SnapshotNotFound(SandboxError):
    """No snapshot with that id (it was deleted, or retention removed it)."""

    code = "snapshot_not_found"


class SnapshotIncompatible(SandboxError):
    """A memory snapshot this host cannot restore: made by another runsc, from another image, or
    on another CPU."""

    code = "snapshot_incompatible"


class SessionPaused(SandboxError):
    """The session is paused: resume it (``Session.attach`` or ``resume``) to run code in it."""

    code = "session_paused"


class SessionNotPaused(SandboxError):
    """Resume asked of a session that is running (or pause of one already paused)."""

    code = "session_conflict"

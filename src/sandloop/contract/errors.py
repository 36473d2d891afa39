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
    │   └── PathRefused             a workspace path that escapes the workspace, or too large
    ├── WorkspaceFileNotFound       no such file in the session's workspace (also FileNotFoundError)
    ├── SessionNotFound             no live session with that id (deleted or expired)
    └── SandboxBusy                 admission control refused the run; retry later

Every message says what to do about it.
"""

from __future__ import annotations


class SandboxError(Exception):
    """The sandbox itself failed (not the code it ran)."""

    #: Whether retrying the same call later may succeed.
    retryable: bool = False


class EngineUnavailable(SandboxError):
    """No Docker engine answers, or it failed during the run."""

    retryable = True


class ImageMissing(SandboxError):
    """The runtime image is not present on the engine."""


class RuntimeUnavailable(SandboxError):
    """The requested OCI runtime (runc, runsc) is not registered with the engine."""


class UnknownLanguage(SandboxError):
    """No language of that name is registered."""


class InvalidArgument(SandboxError, ValueError):
    """A value passed to the API is invalid."""


class InvalidLimits(InvalidArgument):
    """A ``SandboxLimits`` value is out of range."""


class SandboxBusy(SandboxError):
    """Admission control refused the run because too many are in flight. Retry later."""

    retryable = True


class PathRefused(InvalidArgument):
    """A workspace path was refused: absolute, traversal, a symlink out, or over a size cap."""


class WorkspaceFileNotFound(SandboxError, FileNotFoundError):
    """No such file or directory in the session's workspace."""


class SessionNotFound(SandboxError):
    """No live session with that id: it was deleted, or its idle TTL expired."""

"""Contract types. Imports nothing from backends, front ends or providers: dependencies point here."""

from sandloop.contract.egress import EgressAttempt
from sandloop.contract.errors import (
    EngineUnavailable,
    HostDiskFull,
    ImageMissing,
    InvalidArgument,
    InvalidLimits,
    NodeLost,
    PathRefused,
    RuntimeUnavailable,
    SandboxBusy,
    SandboxError,
    SessionLost,
    SessionNotFound,
    TooLarge,
    UnknownLanguage,
    WorkspaceFileNotFound,
    WorkspaceFull,
)
from sandloop.contract.limits import DEFAULT_LIMITS, SandboxLimits, format_size, parse_size
from sandloop.contract.result import Artifact, CellError, CellResult, ExecutionResult

__all__ = [
    "DEFAULT_LIMITS",
    "Artifact",
    "CellError",
    "CellResult",
    "EgressAttempt",
    "PathRefused",
    "SessionNotFound",
    "SessionLost",
    "NodeLost",
    "TooLarge",
    "WorkspaceFileNotFound",
    "HostDiskFull",
    "WorkspaceFull",
    "EngineUnavailable",
    "ExecutionResult",
    "ImageMissing",
    "InvalidArgument",
    "InvalidLimits",
    "RuntimeUnavailable",
    "SandboxBusy",
    "SandboxError",
    "SandboxLimits",
    "UnknownLanguage",
    "format_size",
    "parse_size",
]

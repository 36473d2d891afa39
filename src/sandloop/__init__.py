"""sandloop: run LLM-written code in throwaway, hardened containers.

>>> from sandloop import run_code
>>> run_code('print("hi")').stdout
'hi\\n'

``Sandloop`` is the composition root (backend, warm pool, sessions, settings); ``run_code`` and
``Session`` use a default one built on first use.
"""

from sandloop.contract import (
    CellResult,
    CodeContext,
    ContextNotFound,
    EgressAttempt,
    EngineUnavailable,
    ExecutionResult,
    HostDiskFull,
    ImageMissing,
    InvalidArgument,
    InvalidLimits,
    PathRefused,
    RuntimeUnavailable,
    SandboxBusy,
    SandboxError,
    SandboxLimits,
    SessionNotFound,
    TooLarge,
    UnknownLanguage,
    WorkspaceFileNotFound,
    WorkspaceFull,
)
from sandloop.contract.egress import Secret
from sandloop.languages import Language
from sandloop.root import Sandloop
from sandloop.runner import run_code
from sandloop.sessions import Session
from sandloop.settings import Settings

__version__ = "0.1.0"

__all__ = [
    "CellResult",
    "CodeContext",
    "EgressAttempt",
    "EngineUnavailable",
    "ExecutionResult",
    "ImageMissing",
    "InvalidArgument",
    "InvalidLimits",
    "Language",
    "PathRefused",
    "RuntimeUnavailable",
    "SandboxBusy",
    "SandboxError",
    "SandboxLimits",
    "Secret",
    "Sandloop",
    "Session",
    "ContextNotFound",
    "SessionNotFound",
    "Settings",
    "TooLarge",
    "UnknownLanguage",
    "WorkspaceFileNotFound",
    "HostDiskFull",
    "WorkspaceFull",
    "__version__",
    "run_code",
]

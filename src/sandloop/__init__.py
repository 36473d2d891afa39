"""sandloop: run LLM-written code in throwaway, hardened containers.

>>> from sandloop import run_code
>>> run_code('print("hi")').stdout
'hi\\n'
"""

from sandloop.contract import (
    EngineUnavailable,
    ExecutionResult,
    ImageMissing,
    InvalidArgument,
    InvalidLimits,
    RuntimeUnavailable,
    SandboxBusy,
    SandboxError,
    SandboxLimits,
    UnknownLanguage,
)
from sandloop.languages import Language
from sandloop.runner import run_code

__version__ = "0.1.0"

__all__ = [
    "EngineUnavailable",
    "ExecutionResult",
    "ImageMissing",
    "InvalidArgument",
    "InvalidLimits",
    "Language",
    "RuntimeUnavailable",
    "SandboxBusy",
    "SandboxError",
    "SandboxLimits",
    "UnknownLanguage",
    "__version__",
    "run_code",
]

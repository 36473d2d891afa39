"""What a runtime backend is asked to do, and the wire protocol to the in-sandbox launcher."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Protocol

from sandloop.contract import ExecutionResult, SandboxLimits
from sandloop.languages import Language

#: Where the launcher writes the program inside the sandbox (on the /tmp tmpfs).
STAGING_DIR = "/tmp/sandloop"


@dataclass(frozen=True)
class RunRequest:
    """One run of code in a fresh sandbox. Validated by the caller (sandloop.runner)."""

    code: bytes
    language: Language
    image: str
    timeout_seconds: float
    limits: SandboxLimits
    stdin: bytes = b""
    cwd: str = "/tmp"
    labels: dict[str, str] = field(default_factory=dict)

    def payload(self) -> bytes:
        """Preamble + JSON header + code + the user's stdin: what the launcher reads on its stdin.

        See images/recipe/launcher.py for the other side.
        """
        path = f"{STAGING_DIR}/{self.language.file_name}"
        header = json.dumps(
            {
                "argv": list(self.language.command),
                "file": path,
                "code": len(self.code),
                "cwd": self.cwd,
                "inproc": self.language.inproc and self.language.image is None,
            }
        ).encode()
        return b"SANDLOOP1 %08d\n" % len(header) + header + self.code + self.stdin


class Backend(Protocol):
    """Where code runs. One module per backend; the Docker engine is the first."""

    def run(self, request: RunRequest) -> ExecutionResult: ...

    def close(self) -> None: ...

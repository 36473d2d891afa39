"""What a runtime backend is asked to do, and the wire protocol to the in-sandbox launcher."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

from sandloop.contract import ExecutionResult, SandboxLimits
from sandloop.languages import Language

#: Where the launcher writes the program inside the sandbox (on the /tmp tmpfs).
STAGING_DIR = "/tmp/sandloop"
#: The launcher's end-of-run line on stderr: EXIT_MARKER + nonce + b":" + status + b"\n".
EXIT_MARKER = b"\0\x1esandloop-exit:"


@dataclass(frozen=True)
class SandboxSpec:
    """What makes two sandboxes interchangeable: a warm pool is keyed by this."""

    image: str
    limits: SandboxLimits
    cwd: str = "/tmp"
    labels: tuple[tuple[str, str], ...] = ()
    #: (volume name, mount point) pairs, e.g. a session's workspace at /workspace.
    volumes: tuple[tuple[str, str], ...] = ()
    #: Arguments for the launcher (``("--kernel",)`` starts a session's stateful interpreter).
    command: tuple[str, ...] = ()


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
    volumes: tuple[tuple[str, str], ...] = ()
    labels: tuple[tuple[str, str], ...] = ()
    #: Called with ("stdout" | "stderr", bytes) as output arrives (only the bytes kept under the
    #: cap), from the thread running the request; it must not block for long.
    on_output: Callable[[str, bytes], None] | None = field(default=None, compare=False)

    @property
    def spec(self) -> SandboxSpec:
        return SandboxSpec(self.image, self.limits.for_container(), self.cwd, self.labels, self.volumes)

    def payload(self, nonce: str = "") -> bytes:
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
                "nonce": nonce,
            }
        ).encode()
        return b"SANDLOOP1 %08d\n" % len(header) + header + self.code + self.stdin


class Backend(Protocol):
    """Where code runs. One module per backend; the Docker engine is the first.

    ``run`` is the cold path (launch, execute, destroy). The warm pool splits it: ``launch`` ahead
    of time, ``execute`` once per sandbox, ``destroy`` off the critical path.
    """

    def run(self, request: RunRequest) -> ExecutionResult: ...

    def launch(self, spec: SandboxSpec, *, purpose: str, lifetime_seconds: float) -> Any: ...

    def execute(self, sandbox: Any, request: RunRequest, *, started: float | None = None) -> ExecutionResult: ...

    def is_alive(self, sandbox: Any) -> bool: ...

    def destroy(self, sandbox: Any) -> None: ...

    def close(self) -> None: ...

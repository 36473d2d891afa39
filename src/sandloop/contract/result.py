"""``ExecutionResult``: what a run of user code produced. Code failing is data, not an exception."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, computed_field

from sandloop.contract.egress import EgressAttempt
from sandloop.contract.limits import SandboxLimits


class ExecutionResult(BaseModel):
    """The outcome of running code once.

    ``exit_code`` is the process's exit status, or -1 when the sandbox killed it for running past
    its timeout. Killed by a signal N reads as 128+N (137 for SIGKILL, e.g. an OOM kill).
    """

    model_config = ConfigDict(frozen=True)

    stdout: str = ""
    stderr: str = ""
    exit_code: int
    duration_seconds: float = Field(description="Wall clock from the call until the result was known.")
    timed_out: bool = False
    oom_killed: bool = False
    stdout_truncated: bool = False
    stderr_truncated: bool = False
    stdout_dropped_bytes: int = Field(0, description="Bytes of stdout read past the cap and dropped.")
    stderr_dropped_bytes: int = Field(0, description="Bytes of stderr read past the cap and dropped.")
    stdout_base64: str | None = Field(
        None, description="The kept stdout bytes, base64, when they are not UTF-8 (stdout shows them with U+FFFD)."
    )
    stderr_base64: str | None = Field(
        None, description="The kept stderr bytes, base64, when they are not UTF-8 (stderr shows them with U+FFFD)."
    )
    language: str = "python"
    timeout_seconds: float = 30.0
    limits: SandboxLimits = Field(default_factory=SandboxLimits)
    backend: str | None = Field(
        None, description="What started the sandbox: 'docker', 'oci' (runc started directly) or 'fake'."
    )
    egress: list[EgressAttempt] = Field(
        default_factory=list, description="Every outbound request through the egress proxy (limits.egress)."
    )
    host: str | None = Field(
        None, description="The cluster node that ran it (the Ray backend: its node id, hex); None on one host."
    )

    @computed_field  # type: ignore[prop-decorator]
    @property
    def ok(self) -> bool:
        """The code exited 0 and was not killed for time."""
        return self.exit_code == 0 and not self.timed_out


class Artifact(BaseModel):
    """A file a cell produced for the caller, e.g. a matplotlib figure as PNG."""

    model_config = ConfigDict(frozen=True)

    name: str
    mime_type: str
    data: bytes

    def __repr__(self) -> str:  # not the whole PNG
        return f"Artifact(name={self.name!r}, mime_type={self.mime_type!r}, {len(self.data):,} bytes)"

    __str__ = __repr__


class CellError(BaseModel):
    """The exception a cell raised, as a notebook shows it (its traceback also went to stderr)."""

    model_config = ConfigDict(frozen=True)

    name: str
    value: str
    traceback: str


class CellResult(ExecutionResult):
    """A cell run in a session's stateful interpreter."""

    #: ``repr`` of the cell's last expression, like a notebook's Out[n]; None when there is none.
    value: str | None = None
    #: The repr was longer than the kernel shows (20,000 characters) and was cut; this many were omitted.
    value_omitted_chars: int = 0
    artifacts: list[Artifact] = Field(default_factory=list)
    #: The exception the cell raised (None when it ran through, or its interpreter died).
    error: CellError | None = None
    #: The interpreter had to be killed (OOM, or it ignored the interrupt): its state is gone and
    #: the next cell starts a fresh one.
    interpreter_restarted: bool = False

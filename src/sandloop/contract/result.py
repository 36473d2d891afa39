"""``ExecutionResult``: what a run of user code produced. Code failing is data, not an exception."""

from __future__ import annotations

from typing import Any

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


class Output(BaseModel):
    """One thing a cell displayed, in order: a MIME bundle, as Jupyter's ``display_data`` and
    ``execute_result`` messages carry it. Binary formats (``image/png``, ``image/jpeg``,
    ``application/pdf``) are base64 text; ``application/json`` and E2B's ``e2b/data`` (a
    DataFrame's columns) and ``e2b/chart`` (a matplotlib figure's data) are JSON values."""

    model_config = ConfigDict(frozen=True)

    type: str = Field(description="'execute_result' (the last expression) or 'display_data'.")
    data: dict[str, Any] = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)

    @property
    def is_main_result(self) -> bool:
        return self.type == "execute_result"

    @property
    def text(self) -> str | None:
        value = self.data.get("text/plain")
        return value if isinstance(value, str) else None

    def __repr__(self) -> str:  # the formats, not a whole PNG
        return f"Output(type={self.type!r}, formats={sorted(self.data)!r})"

    __str__ = __repr__


class CodeContext(BaseModel):
    """One of a session's independent interpreters (``Session.create_context``)."""

    model_config = ConfigDict(frozen=True)

    id: str
    language: str = Field(description="python, javascript, typescript or bash.")
    cwd: str


#: Output formats that are files for the caller (``CellResult.artifacts``), and their suffixes.
ARTIFACT_FORMATS = {"image/png": "png", "image/jpeg": "jpg", "image/svg+xml": "svg", "application/pdf": "pdf"}


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
    #: What the cell displayed, in order (``display()``, figures, the last expression's bundle).
    outputs: list[Output] = Field(default_factory=list)
    #: The cell's number in its context, as a notebook's ``In [n]`` (None for bash).
    execution_count: int | None = None
    #: The context that ran the cell (``Session.create_context``); "default" for Python's.
    context: str | None = None
    #: The whole interpreter sandbox was replaced (it died, or did not answer): every context's
    #: state is gone, not only this one's.
    sandbox_replaced: bool = False
    #: The interpreter's own answer to an operation on contexts (``Session.create_context`` and
    #: the like), and ``refused`` for a cell it would not run; not part of the API's answers.
    reply: dict[str, Any] = Field(default_factory=dict, exclude=True, repr=False)


class HttpAnswer(BaseModel):
    """A server's answer to ``Session.request`` (a server the session's code started): ``headers``
    by lowercased name (repeated ones joined with ", "), ``body`` at most the bytes asked for
    (``truncated``: there was more)."""

    model_config = ConfigDict(frozen=True)

    status: int
    reason: str = ""
    headers: dict[str, str] = Field(default_factory=dict)
    body: bytes = b""
    truncated: bool = False

    @property
    def text(self) -> str:
        return self.body.decode(errors="replace")

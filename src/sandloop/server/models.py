"""The HTTP API's request bodies. Unknown fields are refused (a typo must not pass silently), and
every size and number is bounded here, before the core sees it."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from sandloop.contract.egress import Secret

#: Longest code or stdin in a JSON body, in characters.
MAX_CODE_CHARS = 1_000_000
#: Largest file body on PUT /v1/sessions/{id}/files/{path}.
MAX_FILE_BYTES = 16 * 1024 * 1024
#: Largest archive body on POST /v1/sessions/{id}/archive (the session's upload cap).
MAX_ARCHIVE_BYTES = 64 * 1024 * 1024
#: Largest JSON body: code and stdin at their caps, 4 bytes a character in UTF-8, plus 2 MiB.
MAX_JSON_BYTES = 2 * 4 * MAX_CODE_CHARS + 2 * 1024 * 1024

SIZE_PATTERN = r"^\s*\d+\s*[bkmgBKMG]?[bB]?\s*$"

# Policy caps of this API, tighter than the core's bounds (a run may take a day, a session idle
# for 30 days, in the Python API): a network service holds less for a caller. Tokens narrow them.
#: Longest run or cell timeout over the API (the core allows 24 h).
API_MAX_TIMEOUT_SECONDS = 3600
#: Longest per-run timeout inside an agent run (the agent's own tool allows 300 s).
API_MAX_AGENT_TIMEOUT_SECONDS = 300
#: A session's idle TTL over the API: 10 s to 7 days (the core allows 1 s to 30 days).
API_MIN_TTL_SECONDS, API_MAX_TTL_SECONDS = 10, 7 * 86400


class _In(BaseModel):
    model_config = ConfigDict(extra="forbid")


class LimitsIn(_In):
    """The limits a caller may ask for, within its token's ceilings. No open network over the API:
    at most the egress allowlist the token's policy permits.
    Left out, memory is 256m (or the token's ceiling, if lower)."""

    memory: str | None = Field(None, pattern=SIZE_PATTERN, max_length=20)
    cpus: float = Field(0.5, gt=0, le=2, allow_inf_nan=False)
    pids: int = Field(64, ge=8, le=1024)
    runtime: Literal["runc", "runsc"] = "runc"
    egress: list[str] = Field(
        default_factory=list,
        max_length=64,
        description="Hosts the run may reach over HTTP(S) through sandloop's egress proxy (within the token's "
        "egress policy), e.g. ['pypi.org', '*.example.com:443']; every attempt is returned in `egress`.",
    )


_TIMEOUT = Field(
    None,
    gt=0,
    le=API_MAX_TIMEOUT_SECONDS,
    allow_inf_nan=False,
    description="Seconds; left out, 30 (or the token's ceiling, if lower).",
)


class SecretIn(_In):
    """A value the run's code may use but never see (it gets a placeholder; the egress proxy puts
    the value in requests to ``hosts`` only)."""

    value: str = Field(min_length=1, max_length=8192)
    hosts: list[str] = Field(min_length=1, max_length=16)
    headers: list[str] = Field(
        ["Authorization"], min_length=1, max_length=8, description="The headers whose values may carry it."
    )
    plain_http: bool = Field(False, description="Also over plain HTTP (by default HTTPS only).")


_SECRETS: Any = Field(
    default_factory=dict,
    max_length=16,
    description="Variables whose values the code never sees, e.g. {'GITHUB_TOKEN': {'value': '...', "
    "'hosts': ['api.github.com']}}: their hosts must be on the egress allowlist. Never echoed back.",
)

_STREAM: Any = Field(
    False,
    description="Answer with server-sent events: `stdout` and `stderr` ({text}) as output arrives, then "
    "`result` (the same body as without streaming) or `error` ({code, message}).",
)


_TEMPLATE = Field(
    None,
    max_length=230,
    description="A template (name[:tag]) built by this token or the host's operator; left out, the runtime image.",
)


class RunIn(_In):
    code: str = Field(max_length=MAX_CODE_CHARS)
    language: str = "python"
    template: str | None = _TEMPLATE
    timeout_seconds: float | None = _TIMEOUT
    stdin: str | None = Field(None, max_length=MAX_CODE_CHARS)
    limits: LimitsIn = Field(default_factory=LimitsIn)
    secrets: dict[str, SecretIn] = _SECRETS
    stream: bool = _STREAM


class SessionRunIn(_In):
    """A run in a session uses the session's limits, fixed when it was created."""

    code: str = Field(max_length=MAX_CODE_CHARS)
    language: str = "python"
    timeout_seconds: float | None = _TIMEOUT
    stdin: str | None = Field(None, max_length=MAX_CODE_CHARS)
    secrets: dict[str, SecretIn] = _SECRETS
    stream: bool = _STREAM


class CellIn(_In):
    code: str = Field(max_length=MAX_CODE_CHARS)
    language: str | None = Field(
        None, max_length=20, description="python, javascript, typescript or bash: that language's default context."
    )
    context: str | None = Field(None, max_length=64, description="A context made by POST .../contexts.")
    timeout_seconds: float | None = _TIMEOUT
    secrets: dict[str, SecretIn] = _SECRETS
    stream: bool = _STREAM


def secrets_of(given: dict[str, SecretIn]) -> dict[str, Secret]:
    """Request secrets as the core's ``Secret``s (``InvalidArgument`` for a bad one)."""
    return {
        name: Secret(s.value, hosts=s.hosts, headers=s.headers, plain_http=s.plain_http) for name, s in given.items()
    }


class ContextIn(_In):
    language: str = Field("python", max_length=20)
    cwd: str | None = Field(None, max_length=4096, description="Absolute; default the workspace.")


class SessionIn(_In):
    template: str | None = _TEMPLATE
    ttl_seconds: float = Field(3600, ge=API_MIN_TTL_SECONDS, le=API_MAX_TTL_SECONDS, allow_inf_nan=False)
    quota: str = Field("256m", pattern=SIZE_PATTERN, max_length=20)
    limits: LimitsIn = Field(default_factory=LimitsIn)


class SnapshotIn(_In):
    name: str = Field("", max_length=128)


class ForkIn(_In):
    count: int = Field(1, ge=1, le=20)
    #: The children made paused for want of use (resumed at their first call): a copy each, no restore now.
    paused: bool = False


class FromSnapshotIn(_In):
    ttl_seconds: float | None = Field(None, ge=API_MIN_TTL_SECONDS, le=API_MAX_TTL_SECONDS, allow_inf_nan=False)


#: Files a template build may carry in its JSON body (base64), all together.
MAX_TEMPLATE_FILES_BYTES = 48 * 1024 * 1024


class TemplateIn(_In):
    """A template build: the steps of a steps file (``sandloop templates build -f``), with the
    files its COPY steps name sent along (relative path -> base64)."""

    name: str = Field(max_length=230, description="name[:tag]")
    steps: list[dict[str, Any]] = Field(default_factory=list, max_length=200)
    from_: str | None = Field(None, alias="from", max_length=230, description="runtime (default) or a template")
    start_cmd: str | None = Field(None, max_length=64 * 1024)
    ready_cmd: str | None = Field(None, max_length=64 * 1024)
    files: dict[str, str] = Field(default_factory=dict, max_length=10_000)
    force: bool = False
    runtime: Literal["runc", "runsc"] = "runc"


class AgentRunIn(_In):
    task: str = Field(min_length=1, max_length=100_000)
    provider: Literal["anthropic", "openai"] = "anthropic"
    model: str | None = Field(None, min_length=1, max_length=200, description="Left out: the provider's default.")
    #: One of the endpoints the operator listed for this provider (`serve --provider-url`);
    #: left out, the first listed. Any other URL is refused (403) and never contacted.
    base_url: str | None = Field(None, max_length=2000)
    max_iterations: int | None = Field(None, ge=1, le=50, description="Left out: 10 (or the token's ceiling).")
    timeout_seconds: float | None = Field(
        None,
        gt=0,
        le=API_MAX_AGENT_TIMEOUT_SECONDS,
        allow_inf_nan=False,
        description="Per sandbox run; left out, 30 (or the token's ceiling).",
    )
    limits: LimitsIn = Field(default_factory=LimitsIn)
    secrets: dict[str, SecretIn] = _SECRETS

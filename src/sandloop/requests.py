"""Validating ``run_code``'s arguments into a ``RunRequest``: every bound of a run in one place.
Invalid input raises ``InvalidArgument`` (or ``UnknownLanguage``) with what to do about it."""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Mapping

from sandloop import languages
from sandloop.contract import DEFAULT_LIMITS, InvalidArgument, SandboxLimits
from sandloop.contract.egress import Secret, covers
from sandloop.runtime.base import RunRequest
from sandloop.settings import runtime_image

#: Longest timeout a single run may ask for (a day). Anything longer is a mistake, not a job.
MAX_TIMEOUT_SECONDS = 24 * 3600
#: Largest program accepted; it is staged on the sandbox's /tmp tmpfs.
MAX_CODE_BYTES = 16 * 1024 * 1024
MAX_STDIN_BYTES = 64 * 1024 * 1024


def _as_bytes(value: str | bytes | None, what: str, limit: int) -> bytes:
    if value is None:
        return b""
    if isinstance(value, str):
        data = value.encode("utf-8", errors="surrogateescape")
    elif isinstance(value, bytes | bytearray | memoryview):
        data = bytes(value)
    else:
        raise InvalidArgument(f"{what} must be str or bytes, got {type(value).__name__}")
    if len(data) > limit:
        raise InvalidArgument(f"{what} is {len(data)} bytes; the most accepted is {limit}. Send less.")
    return data


def check_timeout(timeout_seconds: float) -> float:
    if isinstance(timeout_seconds, bool) or not isinstance(timeout_seconds, int | float):
        why = f"must be a number of seconds, got {type(timeout_seconds).__name__}"
        raise InvalidArgument(f"timeout_seconds {why}", (("timeout_seconds", why),))
    t = float(timeout_seconds)
    if not math.isfinite(t) or t <= 0 or t > MAX_TIMEOUT_SECONDS:
        why = f"must be more than 0 and at most {MAX_TIMEOUT_SECONDS} seconds, got {timeout_seconds!r}"
        raise InvalidArgument(f"timeout_seconds {why}", (("timeout_seconds", why),))
    return t


def build_request(
    code: str | bytes,
    language: str = "python",
    timeout_seconds: float = 30,
    *,
    limits: SandboxLimits | None = None,
    stdin: str | bytes | None = None,
    on_output: Callable[[str, bytes], None] | None = None,
    image: str | None = None,
    secrets: Mapping[str, Secret] | None = None,
) -> RunRequest:
    """Validate ``run_code``'s arguments into a ``RunRequest`` (raises ``SandboxError`` subclasses)."""
    if limits is None:
        limits = DEFAULT_LIMITS
    elif not isinstance(limits, SandboxLimits):
        raise InvalidArgument(f"limits must be a SandboxLimits, got {type(limits).__name__}")
    checked = check_secrets(secrets or {}, limits)
    lang = languages.get(language)
    return RunRequest(
        code=_as_bytes(code, "code", MAX_CODE_BYTES),
        language=lang,
        image=lang.image or image or runtime_image(),
        timeout_seconds=check_timeout(timeout_seconds),
        limits=limits,
        stdin=_as_bytes(stdin, "stdin", MAX_STDIN_BYTES),
        on_output=on_output,
        secrets=checked,
    )


_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,127}$")


def check_secrets(secrets: Mapping[str, Secret], limits: SandboxLimits) -> dict[str, Secret]:
    """Secrets checked against what the sandbox may reach (each host on ``limits.egress``)."""
    if not isinstance(secrets, Mapping):
        raise InvalidArgument("secrets must be a mapping of variable names to Secret(value, hosts=[...])")
    for name, secret in secrets.items():
        if not isinstance(name, str) or not _ENV_NAME.match(name):
            raise InvalidArgument(f"secret name {name!r} is not an environment variable name")
        if not isinstance(secret, Secret):
            raise InvalidArgument(f"secret {name} must be a sandloop Secret(value, hosts=[...]), not a plain value")
        unreachable = [h for h in secret.hosts if not covers(limits.egress, h)]
        if unreachable:
            raise InvalidArgument(
                f"secret {name} is for {', '.join(unreachable)}, which this sandbox's egress allowlist "
                f"({', '.join(limits.egress) or 'empty: no network'}) does not reach; add the host to egress"
            )
    return dict(secrets)

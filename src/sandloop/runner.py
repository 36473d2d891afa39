"""``run_code``: the one-shot entry point. Validates input, then hands a ``RunRequest`` to a backend."""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import TYPE_CHECKING

from sandloop import languages
from sandloop.contract import DEFAULT_LIMITS, ExecutionResult, InvalidArgument, SandboxLimits
from sandloop.pool.dispatcher import Dispatcher
from sandloop.runtime.base import FullBackend, RunRequest
from sandloop.settings import Settings

if TYPE_CHECKING:
    from sandloop.root import Sandloop

#: Longest timeout a single run may ask for (a day). Anything longer is a mistake, not a job.
MAX_TIMEOUT_SECONDS = 24 * 3600
#: Largest program accepted; it is staged on the sandbox's /tmp tmpfs.
MAX_CODE_BYTES = 16 * 1024 * 1024
MAX_STDIN_BYTES = 64 * 1024 * 1024

_lock = threading.Lock()
_root: Sandloop | None = None


def default_root() -> Sandloop:
    """The process-wide ``Sandloop``, built on first use from ``SANDLOOP_*`` settings
    (``SANDLOOP_POOL_SIZE=0`` disables the warm pool)."""
    global _root
    with _lock:
        if _root is None:
            from sandloop.root import Sandloop

            _root = Sandloop()
        return _root


def default_dispatcher() -> Dispatcher:
    return default_root().dispatcher


def use_root(root: Sandloop | None) -> Sandloop | None:
    """Make ``root`` the process-wide one without closing the previous, which is returned."""
    global _root
    with _lock:
        old, _root = _root, root
    return old


def shutdown() -> None:
    """Close the process-wide root, if any: its warm sandboxes are removed now rather than left
    for the reaper. A long-running front end calls this when it stops."""
    old = use_root(None)
    if old is not None:
        old.close()


def configure(settings: Settings | None = None, backend: FullBackend | None = None) -> Sandloop:
    """Replace the process-wide root (closing the old one): other settings or another backend."""
    from sandloop.root import Sandloop

    new = Sandloop(settings, backend=backend)
    old = use_root(new)
    if old is not None:
        old.close()
    return new


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
        raise InvalidArgument(f"timeout_seconds must be a number, got {type(timeout_seconds).__name__}")
    t = float(timeout_seconds)
    if not math.isfinite(t) or t <= 0 or t > MAX_TIMEOUT_SECONDS:
        raise InvalidArgument(f"timeout_seconds must be > 0 and <= {MAX_TIMEOUT_SECONDS}, got {timeout_seconds!r}")
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
) -> RunRequest:
    """Validate ``run_code``'s arguments into a ``RunRequest`` (raises ``SandboxError`` subclasses)."""
    if limits is None:
        limits = DEFAULT_LIMITS
    elif not isinstance(limits, SandboxLimits):
        raise InvalidArgument(f"limits must be a SandboxLimits, got {type(limits).__name__}")
    lang = languages.get(language)
    return RunRequest(
        code=_as_bytes(code, "code", MAX_CODE_BYTES),
        language=lang,
        image=lang.image or image or default_root().image,
        timeout_seconds=check_timeout(timeout_seconds),
        limits=limits,
        stdin=_as_bytes(stdin, "stdin", MAX_STDIN_BYTES),
        on_output=on_output,
    )


def run_code(
    code: str | bytes,
    language: str = "python",
    timeout_seconds: float = 30,
    *,
    limits: SandboxLimits | None = None,
    stdin: str | bytes | None = None,
    on_output: Callable[[str, bytes], None] | None = None,
) -> ExecutionResult:
    """Run ``code`` once in a fresh, hardened, throwaway sandbox and return what happened.

    Code failing (syntax error, non-zero exit, timeout, OOM kill) is a populated
    ``ExecutionResult``. Only the sandbox failing raises ``SandboxError``. Thread-safe.
    ``on_output("stdout" | "stderr", data)`` sees output as it arrives (what the result keeps).
    """
    return default_root().run_code(code, language, timeout_seconds, limits=limits, stdin=stdin, on_output=on_output)

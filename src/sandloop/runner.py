"""``run_code``: the one-shot entry point, over the process-wide ``Sandloop`` built on first use.

Also here, for callers of earlier versions: the default root's management (``default_root``,
``use_root``, ``configure``, ``shutdown``, which live in ``sandloop.root``) and the request
validation (``build_request``, ``check_timeout``, in ``sandloop.requests``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

from sandloop.contract import ExecutionResult, SandboxLimits
from sandloop.contract.egress import Secret
from sandloop.pool.dispatcher import Dispatcher
from sandloop.requests import MAX_CODE_BYTES, MAX_STDIN_BYTES, MAX_TIMEOUT_SECONDS, build_request, check_timeout
from sandloop.root import configure, default_root, shutdown, use_root

__all__ = [
    "MAX_CODE_BYTES",
    "MAX_STDIN_BYTES",
    "MAX_TIMEOUT_SECONDS",
    "build_request",
    "check_timeout",
    "configure",
    "default_dispatcher",
    "default_root",
    "run_code",
    "shutdown",
    "use_root",
]


def default_dispatcher() -> Dispatcher:
    return default_root().dispatcher


def run_code(
    code: str | bytes,
    language: str = "python",
    timeout_seconds: float = 30,
    *,
    limits: SandboxLimits | None = None,
    stdin: str | bytes | None = None,
    on_output: Callable[[str, bytes], None] | None = None,
    secrets: Mapping[str, Secret] | None = None,
    template: str | None = None,
) -> ExecutionResult:
    """Run ``code`` once in a fresh, hardened, throwaway sandbox and return what happened.

    Code failing (syntax error, non-zero exit, timeout, OOM kill) is a populated
    ``ExecutionResult``. Only the sandbox failing raises ``SandboxError``. Thread-safe.
    ``on_output("stdout" | "stderr", data)`` sees output as it arrives (what the result keeps).
    ``secrets`` ({"NAME": Secret(value, hosts=[...])}, hosts on ``limits.egress``): the code sees a
    placeholder in $NAME; the egress proxy sends the value in its place only to those hosts.
    ``template`` ("name[:tag]", built with ``sandloop templates build``) starts the sandbox from
    that template instead of the runtime image, with the same isolation.
    """
    return default_root().run_code(
        code,
        language,
        timeout_seconds,
        limits=limits,
        stdin=stdin,
        on_output=on_output,
        secrets=secrets,
        template=template,
    )

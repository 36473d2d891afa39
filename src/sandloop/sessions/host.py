"""What a session (and the agent's default tool) needs from the root it lives in, and the
process's default root.

Sessions and the agent stand below the composition root (``root.Sandloop``, which satisfies
``SessionHost``): a ``Session`` is handed its root (``root=``), or takes the process-wide one,
which the root's module registers here when it is imported (``provide_default``; ``import
sandloop`` does it); the agent's ``execute_code`` runs on it unless given a runner.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from sandloop.contract import ExecutionResult, SandboxLimits
    from sandloop.contract.egress import Secret
    from sandloop.images.templates import Templates
    from sandloop.pool.dispatcher import Dispatcher
    from sandloop.runtime.base import FullBackend
    from sandloop.sessions.reserve import Reserves
    from sandloop.sessions.snapshots import ClusterSnapshots, SnapshotStore
    from sandloop.sessions.store import SessionStore


class SessionHost(Protocol):
    """The parts of a root a session uses (``root.Sandloop``)."""

    backend: FullBackend
    dispatcher: Dispatcher
    sessions: SessionStore
    snapshots: SnapshotStore | ClusterSnapshots
    reserves: Reserves
    templates: Templates

    def image_for(self, template: str | None) -> str: ...

    def run_code(
        self,
        code: str | bytes,
        language: str = ...,
        timeout_seconds: float = ...,
        *,
        limits: SandboxLimits | None = ...,
        stdin: str | bytes | None = ...,
        on_output: Callable[[str, bytes], None] | None = ...,
        secrets: Mapping[str, Secret] | None = ...,
        template: str | None = ...,
    ) -> ExecutionResult: ...


_lock = threading.Lock()
_default: Callable[[], SessionHost] | None = None


def provide_default(factory: Callable[[], SessionHost]) -> None:
    """Register what builds (or returns) the process-wide root: ``root.default_root``."""
    global _default
    with _lock:
        _default = factory


def default_host() -> SessionHost:
    """The process-wide root (built on first use by the factory the root registered)."""
    factory = _default
    if factory is None:  # only if sandloop.root was never imported, which `import sandloop` does
        from sandloop.contract import SandboxError

        raise SandboxError("no default Sandloop: import sandloop (or pass root=Sandloop(...))")
    return factory()


__all__ = ["SessionHost", "default_host", "provide_default"]

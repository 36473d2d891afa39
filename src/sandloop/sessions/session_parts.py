"""What the parts of ``Session`` take from each other: ``SessionParts`` declares, for the type
checker only, what ``Session`` (session.py) holds and the parts use (``session_files.py``,
``session_snapshots.py``); at run time it is an empty base."""

from __future__ import annotations

import builtins
import threading
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from sandloop.contract import CellResult, ExecutionResult, SandboxLimits
    from sandloop.pool.dispatcher import Dispatcher
    from sandloop.runtime.base import SandboxSpec
    from sandloop.sessions.host import SessionHost
    from sandloop.sessions.kernel import Kernel
    from sandloop.sessions.store import SessionRecord, SessionStore
    from sandloop.sessions.watch import Watcher


class SessionParts:
    """The base of ``Session``'s parts."""

    if TYPE_CHECKING:  # held by Session (session.py)
        _root: SessionHost
        _record: SessionRecord
        _store: SessionStore
        _dispatcher: Dispatcher
        _kernel: Kernel
        _closed: bool
        _watchers: builtins.list[Watcher]
        _watch_lock: threading.Lock
        limits: SandboxLimits
        default_cwd: str | None

        @property
        def id(self) -> str: ...

        def _spec(self, kernel: bool = False) -> SandboxSpec: ...

        def _check_open(self) -> None: ...

        def _live(self) -> None: ...

        def close(self) -> None: ...

        def delete(self) -> None: ...

        def run_cell(self, code: str, *args: Any, **kwargs: Any) -> CellResult: ...

        def run(self, code: str, *args: Any, **kwargs: Any) -> ExecutionResult: ...

"""The reaper: removes what sandloop created and nobody will clean up.

A sandbox or workspace is reaped when it carries sandloop's labels and either its expiry has
passed, its owner process (on this host) is gone — e.g. SIGKILLed mid-run — or the backend already
failed to remove it (Docker's "dead"). Nothing without a ``sandloop.owner`` label is ever touched.
What the backend cannot remove is reported with what to do (``Reaped.error``), once per reap; it
is not retried in a loop.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from sandloop.runtime.base import Housekeeping
from sandloop.runtime.labels import LABEL_PREFIX, owner_alive


@dataclass(frozen=True)
class Reaped:
    kind: str  # "sandbox" or "workspace"
    id: str
    owner: str
    purpose: str
    reason: str
    #: Why the backend could not remove it (empty when it was removed, or on a dry run).
    error: str = ""


#: What an operator can do about a sandbox the engine refuses to remove.
STUCK_ADVICE = (
    "restart the engine (scripts/engine-up.sh, or systemctl restart docker) and run `sandloop reap` "
    "again; if it stays, its root file system is held or protected: `docker rm -f ID` shows why"
)


def _verdict(labels: dict[str, str], now: float) -> str | None:
    owner = labels.get(f"{LABEL_PREFIX}owner", "")
    try:
        expires = float(labels.get(f"{LABEL_PREFIX}expires", "inf"))
    except ValueError:
        expires = float("inf")
    if expires < now:
        return "expired"
    if owner_alive(owner) is False:
        return "owner gone"
    return None


def reap(backend: Housekeeping, *, dry_run: bool = False, now: float | None = None) -> list[Reaped]:
    """Remove stale sandloop sandboxes and workspaces; return what was (or would be) removed."""
    now = time.time() if now is None else now
    found: list[Reaped] = []
    for item in backend.owned():
        labels = item.labels
        reason = f"the engine failed to remove it ({item.stuck})" if item.stuck else _verdict(dict(labels), now)
        if reason is None:
            continue
        owner, purpose = labels.get(f"{LABEL_PREFIX}owner", ""), labels.get(f"{LABEL_PREFIX}purpose", "")
        error = "" if dry_run else (backend.remove(item) or "")
        found.append(Reaped(item.kind, item.id, owner, purpose, reason, error))
    return found

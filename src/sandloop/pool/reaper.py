"""The reaper: removes what sandloop created and nobody will clean up.

A sandbox or workspace is reaped when it carries sandloop's labels and either its expiry has
passed or its owner process (on this host) is gone — e.g. SIGKILLed mid-run. Nothing without a
``sandloop.owner`` label is ever touched.
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
        reason = _verdict(dict(labels), now)
        if reason is None:
            continue
        owner, purpose = labels.get(f"{LABEL_PREFIX}owner", ""), labels.get(f"{LABEL_PREFIX}purpose", "")
        found.append(Reaped(item.kind, item.id, owner, purpose, reason))
        if not dry_run:
            backend.remove(item)
    return found

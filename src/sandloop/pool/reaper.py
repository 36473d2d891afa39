"""The reaper: removes what sandloop created and nobody will clean up.

A container or volume is reaped when it carries sandloop's labels and either its expiry has
passed or its owner process (on this host) is gone — e.g. SIGKILLed mid-run. Nothing without a
``sandloop.owner`` label is ever touched.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

from sandloop.runtime.labels import LABEL_PREFIX, owner_alive


@dataclass(frozen=True)
class Reaped:
    kind: str  # "container" or "volume"
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


def reap(backend: Any, *, dry_run: bool = False, now: float | None = None) -> list[Reaped]:
    """Remove stale sandloop containers and volumes; return what was (or would be) removed."""
    now = time.time() if now is None else now
    found: list[Reaped] = []
    for kind, item_id, labels in backend.list_labelled(f"{LABEL_PREFIX}owner"):
        reason = _verdict(labels, now)
        if reason is None:
            continue
        found.append(
            Reaped(
                kind, item_id, labels.get(f"{LABEL_PREFIX}owner", ""), labels.get(f"{LABEL_PREFIX}purpose", ""), reason
            )
        )
        if not dry_run:
            backend.remove_labelled(kind, item_id)
    return found

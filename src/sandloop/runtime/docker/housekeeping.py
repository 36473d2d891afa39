"""The Docker backend's housekeeping (``DockerHousekeeping``, a part of ``DockerBackend``): what
this process and others left on the engine (``owned``), removing it with retries and the
graveyard of removals that failed, orphans of an outage, and what the engine refuses to remove."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import docker
import docker.errors
from sandloop.contract import (
    EngineUnavailable,
)
from sandloop.runtime.base import Owned
from sandloop.runtime.docker.errors import engine_errors
from sandloop.runtime.docker.hardening import TMPFS_LABEL
from sandloop.runtime.docker.health import EngineBreaker
from sandloop.runtime.egress import EgressProxy
from sandloop.runtime.labels import LABEL_PREFIX, owner_id

log = logging.getLogger(__name__)

#: A removal the engine refuses this many times while answering is given up on (and reported).
GIVE_UP_AFTER = 5


class DockerHousekeeping:
    """Owned containers and their removal, for ``DockerBackend`` (backend.py)."""

    if TYPE_CHECKING:  # held by DockerBackend (backend.py)
        _call_timeout: float
        _graveyard: dict[str, int]
        _graveyard_lock: threading.Lock
        _live: set[str]
        breaker: EngineBreaker
        unremovable: dict[str, str]

        @property
        def api(self) -> docker.APIClient: ...

        def _egress_dirs(self) -> EgressProxy: ...

    # -- housekeeping -------------------------------------------------------------------------
    def owned(self) -> list[Owned]:
        label = f"{LABEL_PREFIX}owner"
        with engine_errors():
            out = [
                Owned("sandbox", c["Id"], c.get("Labels") or {}, _stuck(c))
                for c in self.api.containers(all=True, filters={"label": label})
            ]
            volumes = self.api.volumes(filters={"label": label}).get("Volumes") or []
            out += [Owned("workspace", v["Name"], v.get("Labels") or {}) for v in volumes]
            # a runsc sandbox's /tmp volume that no container uses any more: garbage whoever made it
            dangling = self.api.volumes(filters={"label": TMPFS_LABEL, "dangling": True}).get("Volumes") or []
            gone = {f"{LABEL_PREFIX}owner": "", f"{LABEL_PREFIX}purpose": "tmpfs", f"{LABEL_PREFIX}expires": "0"}
            out += [Owned("tmpfs", v["Name"], gone) for v in dangling]
        # Egress proxy sockets a process left (killed before its sandbox's teardown).
        proxy = self._egress_dirs()
        for key, owner in proxy.leftovers():
            out.append(Owned("egress", key, {f"{LABEL_PREFIX}owner": owner, f"{LABEL_PREFIX}purpose": "egress"}))
        return out

    def remove(self, item: Owned) -> str | None:
        if item.kind == "egress":
            self._egress_dirs().remove(item.id)
            return None
        if item.kind == "sandbox":  # the reaper reports a failure: no retries behind its back
            error = self._remove(item.id, retry=False)
            if error and "already in progress" in error:  # its owner is removing it right now
                error = self._gone_within(item.id, 10.0, error)
            return error
        try:
            self.api.remove_volume(item.id, force=True)
        except docker.errors.NotFound:
            pass
        except Exception as exc:  # noqa: BLE001 - reaping is best effort
            log.warning("could not remove volume %s: %s", item.id, exc)
            return str(exc)
        return None

    def _gone_within(self, container_id: str, seconds: float, error: str) -> str | None:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                self.api.inspect_container(container_id)
            except docker.errors.NotFound:
                with self._graveyard_lock:
                    self._graveyard.pop(container_id, None)
                return None
            except Exception:  # noqa: BLE001 - the error we already have says enough
                break
            time.sleep(0.2)
        return error

    def remove_labelled(self, label: str, value: str) -> int:
        with engine_errors():
            found = self.api.containers(all=True, filters={"label": f"{label}={value}"})
        for c in found:
            self._remove(c["Id"])
        return len(found)

    @contextlib.contextmanager
    def _watch(self) -> Iterator[None]:
        """Open the breaker when an engine call inside fails for the engine's sake."""
        try:
            yield
        except EngineUnavailable as exc:
            self.breaker.failed(exc)
            raise

    def _remove(self, container_id: str, *, retry: bool = True) -> str | None:
        """Best effort: never raises, so it cannot mask the error that got us here. A removal that
        failed (engine down or overloaded) is remembered and retried by ``retry_removals`` (and as
        soon as the engine answers again); one the engine refuses ``GIVE_UP_AFTER`` times while
        answering (a dead container whose root is busy) is reported once and left to the operator.
        ``None`` when the container is gone, else the engine's reason."""
        if container_id in self.unremovable:
            return self.unremovable[container_id]
        try:
            self.api.remove_container(container_id, force=True, v=True)
        except docker.errors.NotFound:
            pass
        except Exception as exc:  # noqa: BLE001 - cleanup must not raise
            engine_away = not isinstance(exc, docker.errors.APIError)
            if not retry:
                if engine_away:
                    self.breaker.failed(exc)
                return _engine_message(exc)
            with self._graveyard_lock:
                failures = self._graveyard.get(container_id, 0) + (0 if engine_away else 1)
                self._graveyard[container_id] = failures
                give_up = failures >= GIVE_UP_AFTER
                if give_up:
                    self._graveyard.pop(container_id, None)
                    self._live.discard(container_id)
                    self.unremovable[container_id] = str(exc)
            if give_up:
                log.error(
                    "the engine refuses to remove container %s (%s): giving up; remove it by hand "
                    "(`docker rm -f %s`, after restarting the engine if its root file system is busy)",
                    container_id[:12],
                    exc,
                    container_id[:12],
                )
            else:
                log.warning("could not remove container %s: %s (will retry)", container_id[:12], exc)
            if engine_away:
                self.breaker.failed(exc)
            return str(exc)
        with self._graveyard_lock:
            self._graveyard.pop(container_id, None)
            self._live.discard(container_id)
        return None

    def retry_removals(self) -> int:
        with self._graveyard_lock:
            pending = list(self._graveyard)
        for container_id in pending:
            self._remove(container_id)
        with self._graveyard_lock:
            return len(self._graveyard)

    def sweep_orphans(self, min_age: float | None = None) -> int:
        """Remove containers this process owns that nothing here refers to: a create whose answer
        an outage swallowed, a start that failed while the engine went away. Only those older than
        ``min_age`` seconds (default: an engine call's timeout, so a launch in flight is never
        touched). Returns how many. Never raises."""
        min_age = self._call_timeout + 5 if min_age is None else min_age
        try:
            with engine_errors():
                found = self.api.containers(all=True, filters={"label": f"{LABEL_PREFIX}owner={owner_id()}"})
        except EngineUnavailable:
            return 0
        now, n = time.time(), 0
        for c in found:
            with self._graveyard_lock:
                known = c["Id"] in self._live or c["Id"] in self.unremovable
            created = float((c.get("Labels") or {}).get(f"{LABEL_PREFIX}created", "0") or 0)
            if known or now - created < min_age:
                continue
            log.warning("removing container %s: made by this process, but no run or pool has it", c["Id"][:12])
            self._remove(c["Id"])
            n += 1
        return n


def _stuck(container: dict[str, Any]) -> str:
    """Docker's word for a container whose removal already failed ("Dead", "Removal In Progress")."""
    if container.get("State") in ("dead", "removing"):
        return str(container.get("Status") or container["State"])
    return ""


def _engine_message(exc: Exception) -> str:
    """The engine's own explanation, without docker-py's HTTP preamble."""
    explanation = getattr(exc, "explanation", None)
    return str(explanation or exc)

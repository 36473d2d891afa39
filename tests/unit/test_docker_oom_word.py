"""The engine's word on an OOM kill, when it comes after the exit (seen under runsc in CI: the
container exited 137 with ``OOMKilled`` false, its memory cgroup already removed, and the engine
recorded the kill a moment later). A fake engine API orders the two deterministically."""

from __future__ import annotations

from typing import Any

import pytest

from sandloop.runtime.docker.backend import DockerBackend, _timestamp


class _Events:
    def __init__(self, items: list[dict[str, Any]]) -> None:
        self.items, self.closed = items, False

    def __iter__(self):
        return iter(self.items)

    def close(self) -> None:
        self.closed = True


class _Engine:
    """Exited with ``status``; ``OOMKilled`` as inspected; ``late`` events the log yields."""

    def __init__(self, status: int, oom_flag: bool, late: list[dict[str, Any]]) -> None:
        self.status, self.oom_flag, self.late = status, oom_flag, late
        self.asked: list[dict[str, Any]] = []
        self.streams: list[_Events] = []

    def wait(self, container_id: str, timeout: float | None = None) -> dict[str, Any]:
        return {"StatusCode": self.status}

    def inspect_container(self, container_id: str) -> dict[str, Any]:
        return {"Created": "2026-01-01T08:30:00.123456789Z", "State": {"OOMKilled": self.oom_flag}}

    def events(self, **kw: Any) -> _Events:
        self.asked.append(kw)
        self.streams.append(_Events(self.late))
        return self.streams[-1]


@pytest.fixture
def _backend(tmp_path):
    def make(engine: _Engine) -> DockerBackend:
        backend = DockerBackend(base_url=f"unix://{tmp_path}/no-such-docker.sock", home=tmp_path)
        backend._api = engine  # type: ignore[assignment]
        return backend

    return make


def test_a_late_oom_event_is_waited_for_when_the_sandbox_died_whole(_backend):
    engine = _Engine(137, False, [{"status": "oom", "id": "c1"}])
    assert _backend(engine)._exit_status("c1", None) == (137, True)
    (asked,) = engine.asked
    assert asked["filters"] == {"container": "c1", "event": "oom"}
    assert asked["since"] == int(_timestamp("2026-01-01T08:30:00Z") or 0) - 1
    assert asked["until"] > asked["since"]
    assert engine.streams[0].closed


def test_no_oom_event_means_no_oom(_backend):
    engine = _Engine(137, False, [])
    assert _backend(engine)._exit_status("c1", None) == (137, False)
    assert engine.streams[0].closed


@pytest.mark.parametrize(
    ("status", "reported", "flag", "expected"),
    [
        (137, None, True, (137, True)),  # the engine already says so: no log read
        (0, 137, False, (137, False)),  # the launcher reported its program's SIGKILL: no wait
        (1, None, False, (1, False)),  # not a SIGKILL: no wait
        (0, None, False, (0, False)),
    ],
)
def test_the_log_is_read_only_for_a_sandbox_killed_whole(_backend, status, reported, flag, expected):
    engine = _Engine(status, flag, [{"status": "oom"}])
    assert _backend(engine)._exit_status("c1", reported) == expected
    assert engine.asked == []


def test_engine_times():
    assert _timestamp("1970-01-01T00:00:10.5Z") == 10.0
    assert _timestamp("") is None and _timestamp("not a time") is None

"""The engine circuit breaker: fail fast while the engine is away, recover by itself."""

from __future__ import annotations

import threading
import time

import pytest

from sandloop.contract import EngineUnavailable
from sandloop.runtime.docker.health import EngineBreaker


def test_open_fails_fast_then_recovers_and_runs_recovery_once():
    up = threading.Event()
    recovered = []

    def ping():
        if not up.is_set():
            raise ConnectionError("refused")

    breaker = EngineBreaker(ping, lambda: recovered.append(time.monotonic()), probe_interval=0.05)
    breaker.check()  # closed: nothing happens
    breaker.failed(EngineUnavailable("the Docker engine did not answer (ConnectionError). Start it"))
    breaker.failed(EngineUnavailable("again"))  # already open: one prober, one opening
    with pytest.raises(EngineUnavailable, match="not answering .*resumes by itself"):
        breaker.check()  # no engine call, no wait: answered from the breaker's state
    time.sleep(0.2)
    assert breaker.is_open and not recovered  # still away: probing
    up.set()
    deadline = time.monotonic() + 5
    while breaker.is_open and time.monotonic() < deadline:
        time.sleep(0.01)
    time.sleep(0.1)
    assert not breaker.is_open and len(recovered) == 1 and breaker.openings == 1
    breaker.check()


def test_a_failing_recovery_does_not_reopen_or_raise():
    def boom():
        raise RuntimeError("retry failed")

    breaker = EngineBreaker(lambda: None, boom, probe_interval=0.01)
    breaker.failed(EngineUnavailable("x"))
    deadline = time.monotonic() + 5
    while breaker.is_open and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not breaker.is_open


def test_the_first_call_after_the_engine_is_back_goes_through():
    up = threading.Event()
    recovered = threading.Event()

    def ping():
        if not up.is_set():
            raise ConnectionError("refused")

    breaker = EngineBreaker(ping, recovered.set, probe_interval=60)  # the prober would be too late
    breaker.failed(EngineUnavailable("away"))
    time.sleep(0.25)
    with pytest.raises(EngineUnavailable):
        breaker.check()  # pings, still away
    up.set()
    time.sleep(0.25)  # past the inline probe gap
    breaker.check()  # pings, the engine answers: no error
    assert not breaker.is_open and recovered.wait(5)

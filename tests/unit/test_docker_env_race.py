"""The Docker backend's engine client reads no proxy settings from the environment: requests
would re-read them on every call by iterating ``os.environ``, which raises KeyError when another
thread changes the environment meanwhile (a warm pool's refill failed so in CI)."""

from __future__ import annotations

import os
import sys
import threading

import pytest

from sandloop.runtime.docker import DockerBackend


@pytest.mark.docker
def test_engine_calls_survive_another_thread_changing_the_environment():
    backend = DockerBackend()  # (no engine: the docker marker skips this, or fails it in CI)
    api = backend.api
    assert api.trust_env is False
    stop = threading.Event()
    old = sys.getswitchinterval()

    def churn() -> None:
        while not stop.is_set():
            os.environ["SANDLOOP_TEST_CHURN"] = "x"
            del os.environ["SANDLOOP_TEST_CHURN"]

    errors = []
    sys.setswitchinterval(1e-6)
    t = threading.Thread(target=churn, daemon=True)
    t.start()
    try:
        for _ in range(300):  # with trust_env, most of these failed (measured: 1,034 of 1,500)
            try:
                api.ping()
            except Exception as exc:  # noqa: BLE001 - counted: none may fail
                errors.append(repr(exc))
    finally:
        stop.set()
        t.join(10)
        sys.setswitchinterval(old)
        backend.close()
    assert errors == [], errors[:3]

"""Sandbox failures raise SandboxError with a fix, and still leave nothing behind."""

from __future__ import annotations

import pytest

from sandloop import EngineUnavailable, ImageMissing, SandboxLimits
from sandloop.runner import build_request
from sandloop.runtime.base import RunRequest
from sandloop.runtime.docker import DockerBackend
from tests.helpers import our_containers


def test_missing_image_names_the_build_command():
    req = build_request("print(1)")
    req = RunRequest(**{**req.__dict__, "image": "sandloop-runtime:does-not-exist"})
    with pytest.raises(ImageMissing, match="sandloop images build"):
        DockerBackend().run(req)
    assert our_containers() == []


class _EngineDiesAfterStart(DockerBackend):
    def launch(self, spec, *, purpose, lifetime_seconds):
        sandbox = super().launch(spec, purpose=purpose, lifetime_seconds=lifetime_seconds)

        def read(timeout):
            raise EngineUnavailable("simulated: the engine dropped the stream mid-run")

        sandbox.channel.read = read  # the transport fails after the container started
        return sandbox


def test_engine_error_mid_run_still_removes_the_container():
    with pytest.raises(EngineUnavailable, match="simulated"):
        _EngineDiesAfterStart().run(build_request("print(1)", limits=SandboxLimits()))
    assert our_containers() == []


def test_engine_refusing_limits_is_invalid_limits():
    from sandloop import InvalidLimits

    with pytest.raises(InvalidLimits, match="refused"):
        DockerBackend().run(build_request("print(1)", limits=SandboxLimits(cpus=200)))
    assert our_containers() == []

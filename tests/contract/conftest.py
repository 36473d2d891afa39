"""Every backend, one suite: ``backend`` runs each test on Docker with runc, Docker with runsc,
runc started directly (the OCI backend), and the test double. A new backend joins by adding a parameter here."""

from __future__ import annotations

import pytest

from sandloop.runtime.base import SandboxSpec
from tests.conftest import _missing, engine_state

PARAMS = [
    pytest.param("docker-runc", marks=pytest.mark.docker),
    pytest.param("docker-runsc", marks=[pytest.mark.docker, pytest.mark.runsc]),
    pytest.param("oci-runc", marks=pytest.mark.docker),
    pytest.param("oci-runsc", marks=[pytest.mark.docker, pytest.mark.runsc]),
    pytest.param("fake"),
    pytest.param("ray-runc", marks=[pytest.mark.docker, pytest.mark.ray]),
]


class Under:
    """A backend under test, with what a test needs to drive it."""

    def __init__(self, backend, runtime: str, image: str) -> None:
        self.backend, self.runtime, self.image = backend, runtime, image

    @property
    def isolated(self) -> bool:
        return self.backend.info().isolated

    def limits(self, **kw):
        from sandloop import SandboxLimits

        return SandboxLimits(runtime=self.runtime, **kw)

    def request(self, code, language="python", timeout=30, *, cwd="/tmp", volumes=(), **kw):
        from dataclasses import replace

        from sandloop.runner import build_request

        limits = kw.pop("limits", None) or self.limits()
        request = build_request(code, language, timeout, limits=limits, image=self.image, **kw)
        return replace(request, cwd=cwd, volumes=volumes)

    def spec(self, **kw) -> SandboxSpec:
        limits = kw.pop("limits", None) or self.limits()
        return SandboxSpec(self.image, limits.for_container(), **kw)


@pytest.fixture(params=PARAMS)
def under(request: pytest.FixtureRequest, tmp_path):
    name = request.param
    if name.startswith("ray-"):
        from sandloop.backends import build_backend
        from sandloop.root import node_root
        from sandloop.settings import runtime_image
        from tests.conftest import ray_settings

        backend = build_backend(ray_settings(request.getfixturevalue("ray_cluster")), node_root)
        yield Under(backend, "runc", runtime_image())
        backend.close()
        return
    if name == "fake":
        from sandloop.testing.fake import FakeBackend

        backend = FakeBackend(home=tmp_path)
        yield Under(backend, "runc", "sandloop-fake")
    else:
        from sandloop.runtime.docker import DockerBackend
        from sandloop.settings import runtime_image

        problem, runtimes = engine_state()
        runtime = name.split("-", 1)[1]
        if problem:
            _missing(problem)
        if runtime not in runtimes:
            _missing(f"the engine has no {runtime} runtime (scripts/engine-up.sh registers gVisor)")
        backend = DockerBackend(home=tmp_path)
        if name.startswith("oci-"):
            from sandloop.runtime.oci import OCIBackend

            backend = OCIBackend(backend)
            assert backend.host_problem() is None, backend.host_problem()
        yield Under(backend, runtime, runtime_image())
    backend.close()

"""Shared fixtures. Tests under integration/ and adversarial/ need a real Docker engine.

Without one they skip, unless SANDLOOP_REQUIRE_DOCKER=1 (CI), where they fail instead.
The ``runtime`` fixture runs a test on runc and on runsc (gVisor).
"""

from __future__ import annotations

import functools
import os
from pathlib import Path

import pytest

from sandloop import SandboxLimits

REQUIRE_DOCKER = os.environ.get("SANDLOOP_REQUIRE_DOCKER") == "1"
HERE = Path(__file__).parent
# Warm sessions (a Docker container with pandas imported, made in the background after the first
# session of each kind) are off in tests, and in the servers they start, unless a test asks for
# them: tests/integration/test_warm_sessions.py.
os.environ.setdefault("SANDLOOP_SESSION_POOL_SIZE", "0")


def _missing(reason: str) -> None:
    if REQUIRE_DOCKER:
        pytest.fail(f"{reason} (SANDLOOP_REQUIRE_DOCKER=1, so this fails instead of skipping)")
    pytest.skip(reason)


@functools.cache
def engine_state() -> tuple[str | None, set[str]]:
    """(problem or None, registered runtimes)."""
    from sandloop.runtime.docker import DockerBackend
    from sandloop.settings import runtime_image

    backend = DockerBackend()
    try:
        info = backend.info()
        if not backend.has_image(runtime_image()):
            return f"runtime image {runtime_image()} is not built (run `sandloop images build`)", set()
        return None, set(info.runtimes)
    except Exception as exc:  # noqa: BLE001 - any failure means "no usable engine"
        return f"no usable Docker engine: {exc}", set()
    finally:
        backend.close()


#: How the suite runs side by side (pytest-xdist, ``--dist loadgroup``; ``make test``). A file
#: whose tests share a module-scoped fixture (a server, a session, a built template) runs on one
#: worker, in order; everything on the (one) local Ray cluster (the contract suite's Ray backend,
#: test_ray.py) runs on one worker, where that cluster is. Files run alone after the parallel
#: pass (marker ``serial``): they stop, stall or restart the engine for everyone (chaos/, but for
#: a file marked ``parallel_ok``: it faults only what it started). Every other test counts only
#: what it made (its process's containers, its cluster's nodes' runs, the sessions its own calls
#: created), never what the whole host holds.


def _module_scoped(item: pytest.Item) -> bool:
    names = getattr(item, "fixturenames", ())
    defs = item.session._fixturemanager  # noqa: SLF001 - the fixtures this test uses, by scope
    for name in names:
        for fixture in defs.getfixturedefs(name, item) or ():
            if fixture.scope in ("module", "class", "package") and fixture.baseid:
                return True
    return False


# First: xdist's own hook (on a worker) reads the xdist_group marks to name each test's group.
#: SANDLOOP_TEST_TIMELINE=FILE: each test's worker, start and end appended to FILE as JSON lines
#: (where a parallel pass's time goes: which worker waited, which group ran last).
TIMELINE = os.environ.get("SANDLOOP_TEST_TIMELINE")


if TIMELINE:
    import json
    import time

    _started: dict[str, float] = {}

    def pytest_runtest_logstart(nodeid: str, location: object) -> None:
        _started[nodeid] = time.time()

    def pytest_runtest_logfinish(nodeid: str, location: object) -> None:
        line = {
            "worker": os.environ.get("PYTEST_XDIST_WORKER", "main"),
            "test": nodeid,
            "start": _started.pop(nodeid, time.time()),
            "end": time.time(),
        }
        with open(TIMELINE, "a") as f:
            f.write(json.dumps(line) + "\n")


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        parts = Path(str(item.fspath)).relative_to(HERE).parts
        where = "/".join(parts)
        if parts and parts[0] in ("integration", "adversarial", "chaos"):
            item.add_marker(pytest.mark.docker)
        if parts and parts[0] == "chaos" and not item.get_closest_marker("parallel_ok"):
            item.add_marker(pytest.mark.serial)
        if "[ray-" in item.nodeid or where == "integration/test_ray.py":
            group = "ray"
        elif _module_scoped(item):
            group = where
        else:
            continue
        item.add_marker(pytest.mark.xdist_group(group))


@pytest.hookimpl(trylast=True)
def pytest_collection_finish(session: pytest.Session) -> None:
    """On an xdist worker, after xdist named each grouped test's group (its node id ends in
    ``@group``): a grouped test without one would run on any worker beside its group's others,
    its module's fixtures set up twice (pytest 9.2 with pytest-xdist 3.8 did so, silently:
    pytest-xdist#1386)."""
    if not hasattr(session.config, "workerinput") or not session.config.getvalue("loadgroup"):
        return
    lost = [item.nodeid for item in session.items if item.get_closest_marker("xdist_group") and "@" not in item.nodeid]
    if lost:
        raise pytest.UsageError(
            f"pytest-xdist did not group {len(lost)} tests (first: {lost[0]}): this pytest and pytest-xdist "
            "do not work together (pytest-xdist#1386); install the versions pyproject.toml names"
        )


@pytest.fixture(autouse=True)
def _needs_docker(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("docker"):
        problem, _ = engine_state()
        if problem:
            _missing(problem)


@pytest.fixture(params=["runc", pytest.param("runsc", marks=pytest.mark.runsc)])
def runtime(request: pytest.FixtureRequest) -> str:
    name = request.param
    problem, runtimes = engine_state()
    if problem:
        _missing(problem)
    if name not in runtimes:
        _missing(f"the engine has no {name} runtime (scripts/engine-up.sh registers gVisor)")
    return name


@pytest.fixture(scope="session")
def roots():
    """One cold (no pool) and one warm ``Sandloop`` for the whole session."""
    from sandloop import Sandloop, Settings

    made = {"cold": Sandloop(Settings(pool_size=0)), "warm": Sandloop(Settings(pool_size=2))}
    yield made
    for root in made.values():
        root.close()


@pytest.fixture(params=["cold", "warm"])
def mode(request: pytest.FixtureRequest, roots) -> str:
    """Runs the test through a cold root and through a warm pool: results must not differ."""
    from sandloop import runner

    previous = runner.use_root(roots[request.param])
    yield request.param
    runner.use_root(previous)


@pytest.fixture
def limits(runtime: str, mode: str, roots) -> SandboxLimits:
    """The default limits on the runtime under test (pool pre-warmed in warm mode)."""
    lim = SandboxLimits(runtime=runtime)
    if mode == "warm":
        from sandloop.runtime.base import SandboxSpec

        warm = roots["warm"]
        assert warm.dispatcher.prewarm(SandboxSpec(warm.image, lim), timeout=120), "pool did not fill"
    return lim


@pytest.fixture(scope="session")
def _ray_clusters():
    """The local Ray clusters this session started (one at a time), stopped at its end."""
    started: list = []
    yield started
    import ray

    for cluster in started:
        if cluster.processes():
            if ray.is_initialized():
                from sandloop import Sandloop

                with Sandloop(ray_settings(cluster)) as sl:
                    sl.backend.shutdown_nodes()  # type: ignore[attr-defined]
                ray.shutdown()
            cluster.stop()


@pytest.fixture(scope="module")
def ray_cluster(_ray_clusters):
    """A real local Ray cluster (a head and two sandbox nodes), started on first use and shared by
    the session's tests; its nodes' actors run sandboxes through Docker with no warm pool, so every
    run is one container start (tests count them). Stopped by the pids it started. A module that
    comes after the one test that stops it (``test_nothing_is_left_when_the_nodes_stop``) gets a
    new one."""
    pytest.importorskip("ray") if not REQUIRE_DOCKER else None
    problem, _ = engine_state()
    if problem:
        _missing(problem)
    from sandloop.testing.ray_cluster import LocalCluster

    if not _ray_clusters or not _ray_clusters[-1].processes():
        _ray_clusters.append(LocalCluster(workers=2).start())
    return _ray_clusters[-1]


def ray_settings(cluster, **kw):
    from sandloop import Settings

    return Settings(backend={"type": "ray", "address": cluster.address, "node_backend": "docker"}, pool_size=0, **kw)

"""The backend a ``Settings`` names, built: the one place that imports backends (each lazily, so a
host without Ray or Docker's SDK never loads them). ``Settings.backend`` is plain data, a member of
``settings.BackendConfig`` chosen by its ``type``; a new backend adds a member there and a builder
here. Called by the composition root (``root.Sandloop``) only.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from sandloop.contract import InvalidArgument
from sandloop.settings import DockerConfig, FakeConfig, OCIConfig, RayConfig, Settings

if TYPE_CHECKING:
    from sandloop.runtime.base import FullBackend

#: Builds a cluster node's local root from the driver's overrides (``root.node_root``).
NodeRoot = Callable[[dict[str, Any]], Any]


def _docker(config: DockerConfig | OCIConfig, settings: Settings) -> Any:
    from sandloop.runtime.docker import DockerBackend

    return DockerBackend(
        config.base_url,
        call_timeout=settings.engine_timeout,
        home=settings.home,
        egress_hosts=settings.egress_hosts,
        egress_upstream_ca=settings.egress_upstream_ca,
    )


def _oci(config: OCIConfig, settings: Settings) -> FullBackend:
    from sandloop.runtime.oci import OCIBackend

    return OCIBackend(
        _docker(config, settings),
        store=config.store,
        state=config.state,
        fallback=config.fallback,
        runc_with=config.runc_with,
        engine=config.engine,
    )


def _fake(settings: Settings) -> FullBackend:
    from sandloop.testing.fake import FakeBackend

    return FakeBackend(home=settings.home)


def _ray(config: RayConfig, settings: Settings, node_root: NodeRoot | None) -> FullBackend:
    from sandloop.runtime.ray import RayBackend

    if node_root is None:
        raise InvalidArgument("the Ray backend is built by the composition root: use Sandloop(settings)")
    node: dict[str, Any] = {
        "image": settings.runtime_image(),
        "backend": config.node_backend,
        "pool_size": settings.pool_size,
        "max_running": settings.max_running,
        "max_creating": settings.max_creating,
        "queue_wait_seconds": min(settings.queue_wait_seconds, 0.5),  # the driver waits across nodes
        "engine_timeout": settings.engine_timeout,
        # each node expires the snapshots it keeps
        "snapshot_retention_seconds": settings.snapshot_retention_seconds,
    }
    return RayBackend(
        config.address,
        namespace=config.namespace,
        node_settings=node,
        node_root=node_root,
        queue_wait_seconds=settings.queue_wait_seconds,
    )


def build_backend(settings: Settings, node_root: NodeRoot | None = None) -> FullBackend:
    """The backend ``settings.backend`` names. ``node_root`` (from the composition root) builds a
    cluster node's local root: only the Ray backend uses it."""
    config = settings.backend
    if isinstance(config, DockerConfig):
        backend: FullBackend = _docker(config, settings)
        return backend
    if isinstance(config, OCIConfig):
        return _oci(config, settings)
    if isinstance(config, FakeConfig):
        return _fake(settings)
    if isinstance(config, RayConfig):
        return _ray(config, settings, node_root)
    raise InvalidArgument(f"unknown backend type {getattr(config, 'type', config)!r}")


__all__ = ["NodeRoot", "build_backend"]

"""The Ray backend: sandboxes across the nodes of a Ray cluster (``pip install 'sandloop[ray]'``)."""

from sandloop.runtime.ray.backend import RayBackend, RaySandbox

__all__ = ["RayBackend", "RaySandbox"]

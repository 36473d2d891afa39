"""Egress by allowlist: the host-side proxy that is a sandbox's only way out (see proxy.py)."""

from sandloop.runtime.egress.host import sandbox_env
from sandloop.runtime.egress.proxy import EgressProxy

__all__ = ["EgressProxy", "sandbox_env"]

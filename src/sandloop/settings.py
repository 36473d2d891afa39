"""Settings, from the environment (``SANDLOOP_*``) or set in code; read once, by the composition
root (``sandloop.Sandloop``), never at import time.

The backend is chosen by a discriminated union (``backend.type``), each member plain data that
``sandloop.backends.build_backend`` turns into a backend: ``SANDLOOP_BACKEND=oci`` (the default:
runs started by runc/runsc directly where the host passes the parity check, everything else
through Docker), ``docker`` (Docker only), ``ray`` (a Ray cluster) or ``fake`` (the test double),
or ``SANDLOOP_BACKEND='{"type": "docker", "base_url": "tcp://..."}'``. A new backend adds a member
here and its builder there; nothing here imports a backend.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from sandloop.paths import default_home
from sandloop.recipe_hash import default_runtime_image


class DockerConfig(BaseModel):
    """A Docker engine (dockerd), with runc or runsc (gVisor) as the OCI runtime."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["docker"] = "docker"
    base_url: str | None = Field(None, description="The engine's URL; default: DOCKER_HOST or the local socket.")


class OCIConfig(BaseModel):
    """Runs started by runc directly (no dockerd on their path), with Docker's own configuration;
    sessions, ``network=True`` and anything without parity go to the Docker engine (see
    docs/runtimes.md)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["oci"] = "oci"
    base_url: str | None = Field(None, description="The Docker engine's URL (images, templates, sessions).")
    store: Path = Field(Path("/var/lib/sandloop/oci"), description="Exported root file systems and config templates.")
    state: Path = Field(Path("/run/sandloop/oci"), description="Bundles and the runtime's state (a tmpfs).")
    fallback: bool = Field(True, description="Run through Docker what cannot run directly (else refuse).")
    runc_with: Literal["runc", "bwrap", "starter"] = Field(
        "starter",
        description="What starts runc-class sandboxes from Docker's config translated (runtime/oci/bwrap.py; "
        "runc where the translation has a gap): the C starter (runtime/oci/starter.c, the whole start in one "
        "program; bubblewrap where it cannot be compiled), bubblewrap, or runc itself.",
    )
    engine: bool = Field(
        True,
        description="Use a Docker engine (false: none on this host; single runs only, configs made here, "
        "images from the store: `sandloop images build --no-docker`).",
    )


class FakeConfig(BaseModel):
    """The test double: the launcher protocol against local subprocesses. No isolation at all."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["fake"] = "fake"


class RayConfig(BaseModel):
    """A Ray cluster: one actor per node started with the ``sandloop`` resource runs that node's
    sandboxes through its own local backend (``node_backend``). See runtime/ray/backend.py."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    type: Literal["ray"] = "ray"
    address: str | None = Field(None, description="The cluster (default: RAY_ADDRESS, else a local one: 'auto').")
    namespace: str = Field("sandloop", description="Ray namespace of sandloop's named actors.")
    node_backend: Literal["oci", "docker"] = Field("oci", description="The backend each node runs its sandboxes on.")


BackendConfig = Annotated[DockerConfig | OCIConfig | FakeConfig | RayConfig, Field(discriminator="type")]


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SANDLOOP_", extra="ignore")

    backend: BackendConfig = Field(
        default_factory=OCIConfig,
        description="Where sandboxes run: runs direct where Docker parity holds, the rest through Docker.",
    )
    home: Path = Field(default_factory=default_home, description="Sessions' records and workspaces, tokens.")
    image: str | None = Field(
        None, description="The runtime image; default: the one the recipe in this version builds."
    )
    engine_timeout: float = Field(30, gt=0, description="Seconds any single engine call may take.")
    egress_upstream_ca: Path | None = Field(
        None,
        description="CA bundle the egress proxy verifies destinations with when it reads a run's HTTPS to "
        "put secrets in (default: the system's).",
    )
    egress_hosts: dict[str, str] = Field(
        default_factory=dict,
        description="The egress proxy's own name map, trusted as given (an internal mirror): "
        "'name:port' -> 'ip:port', e.g. {'pypi.internal:443': '10.0.0.5:443'}.",
    )
    debian_mirror: str | None = Field(
        None, description="Debian mirror for the offline image build; default: the first in this machine's apt sources."
    )
    build_dir: Path = Field(Path("/var/tmp"), description="Where the image build unpacks its root filesystem.")
    pool_size: int = Field(2, ge=0, le=256, description="Warm sandboxes kept per pool key; 0 disables the pool.")
    pool_refill_concurrency: int = Field(2, ge=1, le=64, description="Sandboxes a pool creates at once.")
    pool_idle_seconds: float = Field(
        300, gt=0, description="A pool unused this long is emptied; a pooled sandbox this old is replaced."
    )
    pool_max_keys: int = Field(4, ge=1, le=64, description="Most distinct (image, limits) pools kept at once.")
    session_pool_size: int = Field(
        1,
        ge=0,
        le=16,
        description="Warm sessions kept per (limits, quota), their interpreter started with numpy, pandas and "
        "matplotlib imported; 0 disables them. Idle as long as pool_idle_seconds, like warm sandboxes.",
    )
    max_running: int = Field(32, ge=1, le=4096, description="Most sandboxes running code at once.")
    max_creating: int = Field(4, ge=1, le=256, description="Most container creations in flight at once.")
    queue_wait_seconds: float = Field(30, ge=0, description="Longest a run waits for a slot before SandboxBusy.")
    reap_interval_seconds: float = Field(60, gt=0, description="How often a long-running process reaps.")
    paused_retention_seconds: float = Field(
        30 * 86400,
        gt=0,
        description="The longest a paused session is kept after its last use (its idle TTL counts on while it is "
        "paused: it goes at whichever comes first); a paused E2B sandbox is kept this long, as E2B's are.",
    )
    session_idle_pause_seconds: float = Field(
        0,
        ge=0,
        description="A session whose interpreter has run no cell this long is paused to disk (its memory under "
        "gVisor, its picklable state under runc) and resumed by its next call, so a host holds more sessions than "
        "its memory; 0 (the default) never pauses one for idleness.",
    )
    snapshot_retention_seconds: float = Field(
        30 * 86400, gt=0, description="How long a snapshot is kept before the reaper removes it."
    )
    e2b_runtime: Literal["runc", "runsc"] = Field(
        "runc",
        description="OCI runtime of sandboxes made through the E2B-compatible API (E2B's SDKs cannot choose one).",
    )

    @field_validator("backend", mode="before")
    @classmethod
    def _backend_by_name(cls, value: Any) -> Any:
        return {"type": value} if isinstance(value, str) and not value.lstrip().startswith("{") else value

    def runtime_image(self) -> str:
        return self.image or default_runtime_image()


def load_settings() -> Settings:
    return Settings()


def runtime_image() -> str:
    """The runtime image the current settings name (``SANDLOOP_IMAGE``, else this recipe's)."""
    return Settings().runtime_image()


__all__ = ["BackendConfig", "DockerConfig", "FakeConfig", "OCIConfig", "Settings", "default_home", "runtime_image"]

"""Process-wide settings, from the environment (``SANDLOOP_*``) or set in code."""

from __future__ import annotations

from pydantic import Field
from pydantic_settings import BaseSettings, SettingsConfigDict


class Settings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="SANDLOOP_", extra="ignore")

    pool_size: int = Field(2, ge=0, le=256, description="Warm sandboxes kept per pool key; 0 disables the pool.")
    pool_refill_concurrency: int = Field(2, ge=1, le=64, description="Sandboxes a pool creates at once.")
    pool_idle_seconds: float = Field(
        300, gt=0, description="A pool unused this long is emptied; a pooled sandbox this old is replaced."
    )
    pool_max_keys: int = Field(4, ge=1, le=64, description="Most distinct (image, limits) pools kept at once.")
    max_running: int = Field(32, ge=1, le=4096, description="Most sandboxes running code at once.")
    max_creating: int = Field(4, ge=1, le=256, description="Most container creations in flight at once.")
    queue_wait_seconds: float = Field(30, ge=0, description="Longest a run waits for a slot before SandboxBusy.")
    reap_interval_seconds: float = Field(60, gt=0, description="How often a long-running process reaps.")


def load_settings() -> Settings:
    return Settings()

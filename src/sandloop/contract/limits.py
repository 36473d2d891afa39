"""``SandboxLimits``: every isolation control, secure by default, validated when made."""

from __future__ import annotations

import math
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from sandloop.contract.egress import normalize_rule
from sandloop.contract.errors import InvalidLimits

_SIZE = re.compile(r"^\s*(\d+)\s*([bkmg]?)b?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "b": 1, "k": 1024, "m": 1024**2, "g": 1024**3}
_USER = re.compile(r"^\d{1,10}(:\d{1,10})?$")

#: Most rules in one egress allowlist.
MAX_EGRESS_RULES = 64
#: Docker refuses memory limits below 6 MiB.
MIN_MEMORY_BYTES = 6 * 1024**2


def parse_size(value: str | int) -> int:
    """``"256m"`` -> 268435456. Accepts an int of bytes or a number with b/k/m/g."""
    if isinstance(value, bool):
        raise ValueError("a size must be a number of bytes or a string like '256m'")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"size must not be negative, got {value}")
        return value
    match = _SIZE.match(str(value))
    if not match:
        raise ValueError(f"invalid size {value!r}: use bytes or a number with k, m or g, e.g. '256m'")
    return int(match.group(1)) * _UNITS[match.group(2).lower()]


def format_size(n: int) -> str:
    """268435456 -> ``"256m"`` (the largest exact unit)."""
    for suffix, unit in (("g", 1024**3), ("m", 1024**2), ("k", 1024)):
        if n and n % unit == 0:
            return f"{n // unit}{suffix}"
    return f"{n}b"


def _problem(err: Any) -> tuple[str, str]:
    """One pydantic error as (field, what is wrong) in plain words: our validators' own sentence
    (without pydantic's "Value error, "), or pydantic's with the value that was given."""
    field = ".".join(str(p) for p in err["loc"]) or "limits"
    why = str(err["msg"]).removeprefix("Value error, ")
    if err.get("type") == "literal_error":
        why = f"{why.replace('Input should be', 'must be')}, got {err.get('input')!r}"
    elif err.get("type") == "extra_forbidden":
        why = "is not a limit (see SandboxLimits for the names)"
    elif err.get("type", "").endswith("_parsing") or err.get("type", "").endswith("_type"):
        why = f"{why.replace('Input should be', 'must be')}, got {err.get('input')!r}"
    # "cpus must be between ..." names the field itself: say it once
    why = why.removeprefix(f"{field} ")
    return field, why


class SandboxLimits(BaseModel):
    """Isolation controls applied to every sandbox.

    The defaults are the secure ones; weakening a control means naming it, e.g.
    ``SandboxLimits(network=True, memory="1g")``. Invalid values raise ``InvalidLimits``
    here, when the object is made, never halfway through a run.
    """

    model_config = ConfigDict(frozen=True, extra="forbid")

    network: bool = Field(
        False, description="Give the sandbox a network (bridge). Off: no sockets but loopback, no DNS."
    )
    egress: tuple[str, ...] = Field(
        (),
        description="Hosts the sandbox may reach over HTTP(S) through sandloop's egress proxy, e.g. "
        "('pypi.org', '*.githubusercontent.com:443'); its only way out. Empty: no network at all.",
    )
    memory: str = Field("256m", description="Memory ceiling; the kernel OOM-kills at it.")
    memory_swap: str | None = Field(
        None, description="Memory plus swap ceiling. None means equal to memory: no swap headroom."
    )
    cpus: float = Field(0.5, description="CPU share (CFS quota), e.g. 0.5 -> cpu.max 50000 100000.")
    pids: int = Field(64, description="Most processes and threads at once (fork-bomb ceiling).")
    read_only: bool = Field(True, description="Read-only root filesystem.")
    tmpfs_size: str = Field("64m", description="Size of the /tmp tmpfs (mode 1777, not persisted).")
    user: str = Field("65534:65534", description="uid:gid the code runs as (default nobody).")
    runtime: Literal["runc", "runsc"] = Field("runc", description="OCI runtime: runc, or runsc (gVisor).")
    open_files: int = Field(1024, description="RLIMIT_NOFILE (soft and hard).")
    tmpfs_inodes: int = Field(16384, description="Most files and directories in /tmp (inode exhaustion).")
    seccomp: Literal["sandloop", "docker-default"] = Field(
        "sandloop",
        description="Syscall filter: Docker's default minus ptrace, process_vm_*, io_uring, keyrings and "
        "userfaultfd ('sandloop'), or Docker's own default.",
    )
    output_limit: int = Field(
        64 * 1024, description="Bytes of stdout and of stderr kept per run; the rest is dropped while reading."
    )

    def __init__(self, **data: Any) -> None:
        try:
            super().__init__(**data)
        except ValidationError as exc:
            problems = tuple(_problem(err) for err in exc.errors())
            text = "; ".join(f"{name}: {why}" for name, why in problems)
            raise InvalidLimits(f"invalid limits: {text}", problems) from None

    @field_validator("egress", mode="before")
    @classmethod
    def _egress(cls, v: object) -> tuple[str, ...]:
        if isinstance(v, str):
            v = (v,)
        if not isinstance(v, list | tuple):
            raise ValueError("egress is a list of hostnames, e.g. ['pypi.org', '*.example.com:443']")
        rules = tuple(dict.fromkeys(normalize_rule(rule) for rule in v))
        if len(rules) > MAX_EGRESS_RULES:
            raise ValueError(f"egress has {len(rules)} rules; at most {MAX_EGRESS_RULES}")
        return rules

    @field_validator("memory", "tmpfs_size", mode="before")
    @classmethod
    def _size(cls, v: str | int) -> str:
        return format_size(parse_size(v))

    @field_validator("memory_swap", mode="before")
    @classmethod
    def _swap(cls, v: str | int | None) -> str | None:
        return None if v is None else format_size(parse_size(v))

    @field_validator("cpus")
    @classmethod
    def _cpus(cls, v: float) -> float:
        if not math.isfinite(v) or not (0.01 <= v <= 256):
            raise ValueError(f"cpus must be between 0.01 and 256, got {v}")
        return v

    @field_validator("pids")
    @classmethod
    def _pids(cls, v: int) -> int:
        # tini + the launcher + the interpreter need a few; a runaway needs a ceiling.
        if not 8 <= v <= 65536:
            raise ValueError(f"pids must be between 8 and 65536 (a limit is never optional), got {v}")
        return v

    @field_validator("user")
    @classmethod
    def _user(cls, v: str) -> str:
        if not _USER.match(v):
            raise ValueError(f"user must be numeric 'uid:gid' like '65534:65534', got {v!r}")
        return v

    @field_validator("open_files")
    @classmethod
    def _nofile(cls, v: int) -> int:
        if not 16 <= v <= 1048576:
            raise ValueError(f"open_files must be between 16 and 1048576, got {v}")
        return v

    @field_validator("tmpfs_inodes")
    @classmethod
    def _inodes(cls, v: int) -> int:
        if not 64 <= v <= 10_000_000:
            raise ValueError(f"tmpfs_inodes must be between 64 and 10000000, got {v}")
        return v

    @field_validator("output_limit")
    @classmethod
    def _output(cls, v: int) -> int:
        if not 0 < v <= 64 * 1024**2:
            raise ValueError(f"output_limit must be between 1 byte and 64m, got {v}")
        return v

    @model_validator(mode="after")
    def _consistent(self) -> SandboxLimits:
        if self.network and self.egress:
            raise ValueError(
                "network=True gives the whole network and egress an allowlist: choose one "
                "(an allowlist needs network=False)"
            )
        mem = parse_size(self.memory)
        if mem < MIN_MEMORY_BYTES:
            raise ValueError(f"memory must be at least 6m (the engine's minimum), got {self.memory}")
        if self.memory_swap is not None and parse_size(self.memory_swap) < mem:
            raise ValueError("memory_swap must be >= memory (it is memory plus swap)")
        tmp = parse_size(self.tmpfs_size)
        if tmp < 1024**2:
            raise ValueError(f"tmpfs_size must be at least 1m, got {self.tmpfs_size}")
        return self

    def for_container(self) -> SandboxLimits:
        """These limits minus the host-side-only ones: what makes two containers interchangeable."""
        return self if self.output_limit == 64 * 1024 else self.model_copy(update={"output_limit": 64 * 1024})

    @property
    def memory_bytes(self) -> int:
        return parse_size(self.memory)

    @property
    def memory_swap_bytes(self) -> int:
        return parse_size(self.memory_swap) if self.memory_swap else self.memory_bytes

    @property
    def tmpfs_bytes(self) -> int:
        return parse_size(self.tmpfs_size)


DEFAULT_LIMITS = SandboxLimits()

"""The backend seam: what the layers above (pool, sessions, front ends) may ask of a runtime
backend, and nothing more. One folder per backend implements it (``runtime/docker/``; the test
double ``sandloop.testing.FakeBackend``); ``tests/contract/`` states what every one must do.

Three roles, as typed Protocols:

- ``Backend``: sandbox lifecycle. ``launch`` a sandbox whose launcher waits for one program,
  ``execute`` one request in it, ``destroy`` it (never raises); ``run`` is launch + execute +
  destroy. A session's interpreter is a sandbox too: ``run_cell`` sends it a cell, interrupting
  after ``interrupt_after`` seconds and giving up ``grace`` seconds later; ``find_kernel`` finds a
  session's interpreter another process started; ``detach`` lets go without destroying it.
  ``info()`` says what the backend is and enforces.
- ``Workspaces``: a session's persistent /workspace, kept apart from any sandbox.
- ``ImageBuilder``: template build steps (``images/templates/`` holds the policy); a backend
  that cannot build returns None from ``image_builder()``.
- ``Reachable``: start a program inside a running session sandbox on a byte stream (ports and
  terminals ride on it: ``runtime/reach/``).
- ``Housekeeping``: everything the backend made carries sandloop's labels (``runtime/labels.py``);
  ``owned()`` lists it, ``remove`` removes one item, ``remove_labelled`` all of a session's
  sandboxes, ``retry_removals`` what an overloaded engine failed to remove, ``sweep_orphans``
  what this process made and lost track of.

Handles (``Sandbox``, ``WorkspaceRef``) are opaque above this line: only the backend that made
one looks inside.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar, runtime_checkable

from sandloop.contract import CellResult, ExecutionResult, SandboxError, SandboxLimits
from sandloop.contract.egress import Secret
from sandloop.languages import Language


@dataclass(frozen=True)
class SandboxSpec:
    """What makes two sandboxes interchangeable: a warm pool is keyed by this."""

    image: str
    limits: SandboxLimits
    cwd: str = "/tmp"
    labels: tuple[tuple[str, str], ...] = ()
    #: (workspace name, mount point) pairs, e.g. a session's workspace at /workspace.
    volumes: tuple[tuple[str, str], ...] = ()
    #: Arguments for the launcher (``("--kernel",)`` starts a session's stateful interpreter).
    command: tuple[str, ...] = ()


@dataclass(frozen=True)
class RunRequest:
    """One run of code in a fresh sandbox. Validated by the caller (sandloop.requests)."""

    code: bytes
    language: Language
    image: str
    timeout_seconds: float
    limits: SandboxLimits
    stdin: bytes = b""
    cwd: str = "/tmp"
    volumes: tuple[tuple[str, str], ...] = ()
    labels: tuple[tuple[str, str], ...] = ()
    #: Called with ("stdout" | "stderr", bytes) as output arrives (only the bytes kept under the
    #: cap), from the thread running the request; it must not block for long.
    on_output: Callable[[str, bytes], None] | None = field(default=None, compare=False)
    #: Values the code may use but never see (an egress allowlist names their hosts).
    secrets: Mapping[str, Secret] = field(default_factory=dict, compare=False)

    @property
    def spec(self) -> SandboxSpec:
        return SandboxSpec(self.image, self.limits.for_container(), self.cwd, self.labels, self.volumes)


@runtime_checkable
class Sandbox(Protocol):
    """A started sandbox, as the layers above see it."""

    @property
    def id(self) -> str: ...

    @property
    def started_at(self) -> float:
        """``time.monotonic()`` when it was started (a pool replaces sandboxes that waited too long)."""
        ...


@dataclass(frozen=True)
class WorkspaceRef:
    """A session's workspace: ``name`` goes into ``SandboxSpec.volumes``."""

    name: str
    #: The quota is a real size cap (code writing past it gets ENOSPC), not only a number.
    quota_enforced: bool


@dataclass(frozen=True)
class BackendInfo:
    """What ``sandloop doctor`` renders and tests consult."""

    name: str
    version: str
    runtimes: tuple[str, ...]
    #: Workspaces of this backend get a real size cap.
    quotas_enforced: bool
    #: Whether sandboxes are isolated at all (the test double's are plain local processes).
    isolated: bool = True
    #: Smallest memory limit the backend accepts, in bytes.
    min_memory_bytes: int = 0
    details: Mapping[str, str] = field(default_factory=dict)


#: The ``BackendInfo.details`` key saying what a backend without a Docker engine refuses.
NO_DOCKER = "refused without Docker"


@dataclass(frozen=True)
class Owned:
    """Something a backend made, found by its labels."""

    kind: str  # "sandbox", "workspace" or "egress" (a proxy socket left by a killed process)
    id: str
    labels: Mapping[str, str]
    #: Non-empty when the backend already failed to remove it (Docker's "dead" or "Removal In
    #: Progress"): the engine's own word for its state.
    stuck: str = ""


#: The handle type of one backend (each backend's ``launch`` returns its own).
S = TypeVar("S", bound=Sandbox)


class Backend(Protocol[S]):
    """Sandbox lifecycle, over the backend's own handle type ``S``."""

    name: str

    def run(self, request: RunRequest) -> ExecutionResult: ...

    def launch(self, spec: SandboxSpec, *, purpose: str, lifetime_seconds: float) -> S: ...

    def execute(self, sandbox: S, request: RunRequest, *, started: float | None = None) -> ExecutionResult: ...

    def run_cell(
        self,
        kernel: S,
        code: str,
        *,
        limits: SandboxLimits,
        interrupt_after: float,
        grace: float,
        secrets: Mapping[str, Secret] | None = None,
        on_output: Callable[[str, bytes], None] | None = None,
        cancel: threading.Event | None = None,
        options: Mapping[str, Any] | None = None,
    ) -> CellResult:
        """Run a cell in a session's interpreter. Past ``interrupt_after`` seconds the cell is
        interrupted (its state survives); if the interpreter has not answered ``grace`` seconds
        later, or it died, the result says ``interpreter_restarted`` and the caller destroys it.
        ``on_output("stdout" | "stderr", data)`` sees output as it arrives; setting ``cancel``
        interrupts the cell as its timeout would (its caller went away). ``options`` go into the
        frame's header (``protocol.encode_cell``): the context, the language, an operation on
        contexts, the caller's environment for this cell."""
        ...

    def find_kernel(self, session_id: str, spec: SandboxSpec) -> S | None:
        """A running interpreter of this session (maybe started by another process), connected."""
        ...

    def is_alive(self, sandbox: S) -> bool: ...

    def has_image(self, image: str) -> bool:
        """Whether sandboxes can start from ``image`` here."""
        ...

    def detach(self, sandbox: S) -> None:
        """Let go of a sandbox without destroying it (a session's interpreter outlives us)."""
        ...

    def destroy(self, sandbox: S) -> None:
        """Remove it. Best effort: never raises."""
        ...

    def info(self) -> BackendInfo: ...

    def image_builder(self) -> ImageBuilder | None:
        """What builds templates for this backend's sandboxes (None: this backend cannot)."""
        ...

    def close(self) -> None: ...


class Workspaces(Protocol):
    """Sessions' persistent workspaces."""

    def create_workspace(self, session_id: str, quota_bytes: int, owner_uid_gid: str) -> WorkspaceRef: ...

    def ensure_workspace(self, session_id: str, ref: WorkspaceRef) -> None:
        """Make an existing workspace usable again (e.g. remount it after a reboot)."""
        ...

    def delete_workspace(self, session_id: str) -> None:
        """Remove it and its data. Idempotent, best effort."""
        ...

    def workspace_on_host(self, session_id: str, ref: WorkspaceRef) -> Path | None:
        """Where this host sees the workspace's files (a file watch reads the kernel's events
        there), or None when they are not on this host (a Ray node keeps them)."""
        ...


class Housekeeping(Protocol):
    """What the reaper and shutdown need."""

    def owned(self) -> list[Owned]:
        """Everything of this backend that carries a ``sandloop.owner`` label."""
        ...

    def remove(self, item: Owned) -> str | None:
        """Remove it; ``None`` when it is gone, else why the backend could not. Never raises."""
        ...

    def remove_labelled(self, label: str, value: str) -> int:
        """Remove every sandbox labelled ``label=value``; how many there were."""
        ...

    def retry_removals(self) -> int:
        """Retry removals that failed earlier; how many are still pending."""
        ...

    def sweep_orphans(self, min_age: float | None = None) -> int:
        """Remove sandboxes this process made that nothing here refers to any more (e.g. a create
        whose answer an engine outage swallowed), older than ``min_age`` seconds (default: long
        enough that no launch in flight is touched). How many. Never raises."""
        ...


@dataclass(frozen=True)
class BuildLimits:
    """What one template build step may use."""

    memory_bytes: int = 2 * 1024**3
    cpus: float = 1.0
    pids: int = 1024
    timeout_seconds: float = 1800
    #: ``runc`` or ``runsc`` (gVisor) runs the step's commands.
    runtime: str = "runc"
    tmp_bytes: int = 1024**3
    #: What one step may add to the image (its layer): checked while it runs and exactly after.
    disk_bytes: int = 4 * 1024**3


#: Where a helper step's packages (fetched on the host) appear, read-only, in its build container.
PACKAGES_DIR = "/tmp/sandloop-packages"
#: Where a template build keeps its cached step results (``ImageBuilder.tag``): a tag there only
#: marks a step as done; a cluster does not send these images to its other nodes.
TEMPLATE_CACHE_REPO = "sandloop-template-cache"


class StepFailed(SandboxError):
    """A build step's command exited non-zero (or ran out of time): its exit code and log tail."""

    code = "template_build_failed"

    def __init__(self, message: str, exit_code: int, log_tail: list[str]) -> None:
        super().__init__(message)
        self.exit_code = exit_code
        self.log_tail = log_tail


class ImageBuilder(Protocol):
    """Template build steps, each committed to an image (``runtime/docker/builder.py``)."""

    def inspect(self, ref: str) -> dict[str, Any] | None: ...

    def images(self, label: str) -> list[dict[str, Any]]: ...

    def tag(self, image_id: str, repository: str, tag: str) -> None: ...

    def remove_image(self, ref: str) -> str | None: ...

    def containers_using(self, image_id: str) -> list[str]: ...

    def read_file(self, image: str, path: str, limit: int = ...) -> bytes | None: ...

    def has_entries(self, image: str, path: str) -> bool: ...

    def run_step(
        self,
        parent: str,
        command: str,
        *,
        user: str,
        workdir: str,
        limits: BuildLimits,
        packages_dir: str | None = None,
        on_line: Callable[[str], None] | None = None,
    ) -> str: ...

    def add_files(self, parent: str, archive: bytes) -> str: ...

    def change(
        self, parent: str, *, env: dict[str, str] | None = None, labels: dict[str, str] | None = None
    ) -> str: ...


@runtime_checkable
class ImageTransfer(Protocol):
    """An engine's images whole, to be sent to another host (the Ray backend's nodes)."""

    def save(self, ref: str) -> Iterator[bytes]:
        """The image as ``docker save`` writes it, in chunks."""
        ...

    def load(self, chunks: Iterable[bytes]) -> None:
        """An image ``save`` wrote (it keeps its id and its tags)."""
        ...


@runtime_checkable
class MemorySnapshots(Protocol):
    """A backend that can write a session interpreter's whole state (memory, processes, open files)
    to disk and start a new interpreter from it (``runtime/oci/kernels.py``: runsc's checkpoint)."""

    def checkpoint_problem(self, kernel: Any) -> str | None:
        """Why this interpreter's memory cannot be kept (None: it can)."""
        ...

    def checkpoint(self, kernel: Any, directory: Path) -> int:
        """Write its state into ``directory`` (made here); it stops and is removed. Bytes written."""
        ...

    def restore(self, spec: SandboxSpec, directory: Path, *, lifetime_seconds: float) -> Any:
        """A new interpreter of ``spec`` (its workspace) from a checkpoint's directory."""
        ...

    def checkpoint_whole(self, directory: Path) -> bool:
        """Whether a checkpoint's directory is complete (waits for one still being written by a
        process whose caller was killed)."""
        ...


class ExecStream(Protocol):
    """A program started inside a running sandbox: its stdin and stdout as one byte stream."""

    def read(self, n: int) -> bytes:
        """Up to ``n`` bytes it wrote (waits for some); ``b""`` once it ended. Raises OSError."""
        ...

    def write(self, data: bytes) -> None:
        """All of ``data`` to its stdin (waits while it does not read). Raises OSError."""
        ...

    def close(self) -> None:
        """Ends it (its stdin closes) and frees the stream; never raises."""
        ...


@runtime_checkable
class Reachable(Protocol):
    """A backend that can start a program inside a session's running interpreter sandbox, as
    one of the sandbox's own processes (its namespaces, cgroup, user, capabilities and system-call
    filter): the way in for ports and terminals (``runtime/reach/``)."""

    def exec_stream(self, kernel: Any, argv: list[str]) -> ExecStream:
        """Start ``argv`` in ``kernel``'s sandbox (cwd /workspace).

        Raises:
            SandboxError: the sandbox is not running, or this kind of sandbox cannot be entered.
        """
        ...


@runtime_checkable
class RemoteSessions(Protocol):
    """A backend whose sessions live on other hosts (the Ray backend: on the node holding the
    workspace): it pauses and resumes them there, where their memory and files are. ``record``
    is the session's record as a dict (``sessions/store.py``); a kind is "memory", "state" or
    "files" (``sessions/snapshots.py``)."""

    def pause_session(self, record: dict[str, Any], keep_memory: bool) -> str:
        """Pause the session where it lives; the kind kept."""
        ...

    def resume_session(self, record: dict[str, Any]) -> str:
        """Start a paused session again where it lives; the kind it was kept as."""
        ...

    def session_paused(self, session_id: str) -> str | None:
        """How the session is paused (None: it runs)."""
        ...

    def place_session(self, session_id: str, place: str) -> None:
        """Make a new session (before its workspace) live at ``place`` (a node's id, where a
        snapshot is kept: ``ClusterSnapshots.place``)."""
        ...

    def snapshot_session(self, record: dict[str, Any], name: str, owner: str, bring_back: bool) -> dict[str, Any]:
        """``Session.snapshot`` where the session lives (``bring_back=False``: a memory-kind
        session's interpreter stays down, for a fork to restore); the snapshot's record."""
        ...

    def start_from_snapshot(self, record: dict[str, Any], snapshot_id: str) -> None:
        """Start a new session (made at the snapshot's place) from the snapshot."""
        ...

    def restore_from_snapshot(self, record: dict[str, Any], snapshot_id: str) -> None:
        """Bring a session's interpreter back from its own memory snapshot (a fork's parent)."""
        ...

    def snapshot_record(self, snapshot_id: str) -> tuple[str, dict[str, Any]] | None:
        """Where the snapshot is kept and its record; None: nowhere."""
        ...

    def snapshot_records(self, session_id: str | None) -> list[dict[str, Any]]:
        """Every snapshot (of one session) wherever kept."""
        ...

    def delete_snapshot(self, snapshot_id: str) -> None: ...


class FullBackend(Backend[Any], Workspaces, Housekeeping, Protocol):
    """A backend that plays all three roles (every backend sandloop ships), whatever its handles."""

"""Template build steps on the Docker engine: each step is one short-lived, hardened container
(or none, for a change of configuration) committed to an image. The policy (what a step is, the
cache, the order, what may be fetched) is ``sandloop.images.templates``; this only runs steps.

A RUN step is untrusted code: no network at all, every capability dropped but the six a package
manager needs as root inside (chown, dac_override, fowner, fsetid, setuid, setgid), no new
privileges, sandloop's seccomp profile, memory+swap, CPU and pids limits, a wall-clock limit, and
a tmpfs /tmp that is never committed. Files come in as a tar archive written into the container's
own layer (never a bind of the host's tree); packages a helper step fetched on the host come in
as a read-only bind of one folder that holds only them.
"""

from __future__ import annotations

import contextlib
import io
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import docker.errors
from docker.types import LogConfig, Mount
from sandloop.contract import SandboxError
from sandloop.runtime.base import PACKAGES_DIR, BuildLimits, StepFailed
from sandloop.runtime.docker.errors import engine_errors
from sandloop.runtime.docker.hardening import seccomp_options
from sandloop.runtime.labels import LABEL_PREFIX, owner_labels
from sandloop.runtime.streams import ChunkReader

#: Capabilities a package manager needs as root in its own image layer; nothing that reaches the
#: host's kernel objects (no sys_admin, net_*, mknod, sys_ptrace, setpcap, audit, kill of others).
BUILD_CAPS = ("CHOWN", "DAC_OVERRIDE", "FOWNER", "FSETID", "SETUID", "SETGID")
#: Labels a committed image must not carry from its build container (they name a process).
_OWNER_KEYS = ("owner", "purpose", "created", "expires")


class _DiskWatch:
    """A build step's disk limit: Docker's overlay2 has no size option here (it needs XFS project
    quotas), so the step's layer (``SizeRw``, what it added) is read every ``interval`` seconds while
    it runs and the step killed past the limit; after it stops the size is read once more, exactly."""

    def __init__(self, api: Any, container: str, limit: int, interval: float = 1.0) -> None:
        self._api, self._container, self._limit, self._interval = api, container, limit, interval
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: What the step had written when it was stopped for it (0: never).
        self.over = 0

    def written(self) -> int:
        found = self._api.containers(all=True, size=True, filters={"id": self._container})
        return int(found[0].get("SizeRw") or 0) if found else 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._loop, name="sandloop-build-disk", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self._interval):
            try:
                written = self.written()
            except Exception:  # noqa: BLE001 - the container is gone or the engine is busy: the step's own end says
                continue
            if written > self._limit:
                self.over = written
                with contextlib.suppress(Exception):
                    self._api.kill(self._container)
                return


class DockerBuilder:
    """Runs template build steps on a Docker engine (``api`` is docker-py's low-level client)."""

    def __init__(self, api: Callable[[], Any]) -> None:
        self._api = api

    @property
    def api(self) -> Any:
        return self._api()

    # -- images -------------------------------------------------------------------------------
    def inspect(self, ref: str) -> dict[str, Any] | None:
        with engine_errors(ref):
            try:
                found: dict[str, Any] = self.api.inspect_image(ref)
            except docker.errors.ImageNotFound:
                return None
            return found

    def images(self, label: str) -> list[dict[str, Any]]:
        with engine_errors():
            found: list[dict[str, Any]] = self.api.images(filters={"label": label})
            return found

    def tag(self, image_id: str, repository: str, tag: str) -> None:
        with engine_errors(image_id):
            self.api.tag(image_id, repository, tag, force=True)

    def remove_image(self, ref: str) -> str | None:
        """Untag (and delete when nothing else holds it); None when done, else the engine's reason."""
        with engine_errors(ref):
            try:
                self.api.remove_image(ref, noprune=False)
            except docker.errors.ImageNotFound:
                return None
            except docker.errors.APIError as exc:
                return str(exc.explanation or exc)
        return None

    def save(self, ref: str) -> Iterator[bytes]:
        """The image as ``docker save`` writes it (layers, config, its tags), in chunks."""
        with engine_errors(ref):
            yield from self.api.get_image(ref, chunk_size=4 * 1024 * 1024)

    def load(self, chunks: Iterable[bytes]) -> None:
        """An image ``save`` wrote, into this engine: the same id, its tags with it."""
        with engine_errors():
            for _ in self.api.load_image(chunks):  # the engine's progress lines
                pass

    def containers_using(self, image_id: str) -> list[str]:
        """Running containers from ``image_id`` (a finished run's, still being removed, is not a user)."""
        with engine_errors(image_id):
            return [c["Id"] for c in self.api.containers(filters={"ancestor": image_id, "status": "running"})]

    def read_file(self, image: str, path: str, limit: int = 8 * 1024 * 1024) -> bytes | None:
        """One file of an image (its /etc/passwd, dpkg's status), from a container never started."""
        import tarfile

        container = self._create(image, command=["/bin/true"])
        try:
            with engine_errors(image):
                try:
                    stream, stat = self.api.get_archive(container, path)
                except docker.errors.NotFound:
                    return None
            if stat.get("size", 0) > limit:
                raise SandboxError(f"{path} in {image} is larger than {limit} bytes")
            data = b"".join(stream)
            with tarfile.open(fileobj=io.BytesIO(data)) as tar:
                member = tar.next()
                if member is None or not member.isfile():
                    return None
                handle = tar.extractfile(member)
                return handle.read() if handle else None
        finally:
            self._remove(container)

    def has_entries(self, image: str, path: str) -> bool:
        """Whether the folder ``path`` of an image holds anything (reads the archive's first entries only)."""
        import tarfile

        container = self._create(image, command=["/bin/true"])
        try:
            with engine_errors(image):
                try:
                    stream, _ = self.api.get_archive(container, path, chunk_size=64 * 1024)
                except docker.errors.NotFound:
                    return False
            reader = ChunkReader(iter(stream))
            with tarfile.open(fileobj=reader, mode="r|") as tar:
                for number, _member in enumerate(tar):
                    if number >= 1:  # the folder itself, then anything in it
                        return True
            return False
        finally:
            self._remove(container)

    # -- steps --------------------------------------------------------------------------------
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
    ) -> str:
        """Run ``command`` with ``/bin/sh -c`` in a container from ``parent`` and commit what it
        changed. Returns the new image's id; raises ``StepFailed`` with the log's tail."""
        mounts = [Mount(PACKAGES_DIR, packages_dir, type="bind", read_only=True)] if packages_dir else []
        host_config = self.api.create_host_config(
            network_mode="none",
            mem_limit=limits.memory_bytes,
            memswap_limit=limits.memory_bytes,
            nano_cpus=int(limits.cpus * 1e9),
            pids_limit=limits.pids,
            cap_drop=["ALL"],
            cap_add=list(BUILD_CAPS),
            security_opt=["no-new-privileges:true", *seccomp_options("sandloop")],
            ipc_mode="private",
            tmpfs={"/tmp": f"rw,nosuid,nodev,size={limits.tmp_bytes},mode=1777"},
            mounts=mounts,
            log_config=LogConfig(type="json-file", config={"max-size": "10m", "max-file": "1"}),
            runtime=limits.runtime,
        )
        container = self._create(
            parent,
            command=[command],
            entrypoint=["/bin/sh", "-c"],
            user=user,
            workdir=workdir,
            host_config=host_config,
            lifetime=limits.timeout_seconds,
        )
        tail: list[str] = []
        watch = _DiskWatch(self.api, container, limits.disk_bytes)
        try:
            with engine_errors(parent, limits.runtime):
                self.api.start(container)
            watch.start()
            deadline = time.monotonic() + limits.timeout_seconds
            pending, seen = b"", 0

            def take(data: bytes, final: bool) -> None:
                nonlocal pending, tail
                pending += data
                *lines, pending = pending.split(b"\n")
                if final and pending:  # a last line without its newline
                    lines, pending = [*lines, pending], b""
                for raw in lines:
                    line = raw.decode(errors="replace").rstrip("\r")
                    tail = (tail + [line])[-30:]
                    if on_line is not None:
                        on_line(line)

            with engine_errors(parent):
                for chunk in self.api.logs(container, stream=True, follow=True):
                    seen += len(chunk)
                    take(chunk, final=False)
                    if time.monotonic() > deadline:
                        break
                remaining = max(1.0, deadline - time.monotonic())
                try:
                    status = self.api.wait(container, timeout=remaining)
                except Exception:  # noqa: BLE001 - requests' read timeout: the step ran out of time
                    status = None
                # A follow stream opened as a quick step ends can miss its last output (seen here:
                # a one-line `cat`): what the log holds beyond what was streamed comes now.
                with contextlib.suppress(Exception):
                    whole = self.api.logs(container, stdout=True, stderr=True)
                    if len(whole) > seen:
                        take(whole[seen:], final=False)
                take(b"", final=True)
            if status is None or time.monotonic() > deadline:
                with contextlib.suppress(Exception):
                    self.api.kill(container)
                raise StepFailed(f"ran longer than its {limits.timeout_seconds:.0f} s limit and was stopped", -1, tail)
            watch.stop()
            code = int(status.get("StatusCode", -1))
            written = watch.written() if code == 0 else watch.over  # exact, now it has stopped
            if written > limits.disk_bytes:
                raise StepFailed(
                    f"wrote {written / 2**20:.0f} MiB to the image, more than its {limits.disk_bytes / 2**20:.0f} "
                    "MiB disk limit (it was stopped); write less, or raise the limit (--disk)",
                    code if code != 0 else -1,
                    tail,
                )
            if code != 0:
                oom = bool(self.api.inspect_container(container)["State"].get("OOMKilled"))
                why = f"ran out of its {limits.memory_bytes // 2**20} MiB memory limit" if oom else f"exited {code}"
                raise StepFailed(why, code, tail)
            return self._commit(container, parent)
        finally:
            watch.stop()
            self._remove(container)

    def add_files(self, parent: str, archive: bytes) -> str:
        """Unpack ``archive`` (a tar whose member paths are absolute-in-image, without the leading
        '/') at the image's root, in a container never started; commit it."""
        container = self._create(parent, command=["/bin/true"])
        try:
            with engine_errors(parent):
                if not self.api.put_archive(container, "/", archive):
                    raise SandboxError("the Docker engine refused the files of a COPY step")
            return self._commit(container, parent)
        finally:
            self._remove(container)

    def change(self, parent: str, *, env: dict[str, str] | None = None, labels: dict[str, str] | None = None) -> str:
        """A new image: ``parent`` with more environment variables and labels (no container runs)."""
        container = self._create(parent, command=["/bin/true"])
        try:
            return self._commit(container, parent, env=env, labels=labels)
        finally:
            self._remove(container)

    # -- helpers ------------------------------------------------------------------------------
    def _create(
        self,
        image: str,
        *,
        command: list[str],
        entrypoint: list[str] | None = None,
        user: str = "",
        workdir: str | None = None,
        host_config: Any = None,
        lifetime: float = 300,
    ) -> str:
        if host_config is None:
            host_config = self.api.create_host_config(network_mode="none", cap_drop=["ALL"])
        with engine_errors(image):
            created: dict[str, Any] = self.api.create_container(
                image,
                command=command,
                entrypoint=entrypoint,
                user=user or None,
                working_dir=workdir,
                network_disabled=True,
                labels=owner_labels("template-build", lifetime),
                host_config=host_config,
            )
        return str(created["Id"])

    def _commit(
        self, container: str, parent: str, *, env: dict[str, str] | None = None, labels: dict[str, str] | None = None
    ) -> str:
        """Commit ``container`` with ``parent``'s own entrypoint, command, user and working
        directory (a step's container overrides them to run), without the build's owner labels."""
        config = (self.inspect(parent) or {}).get("Config") or {}
        conf: dict[str, Any] = {
            "Entrypoint": config.get("Entrypoint"),
            "Cmd": config.get("Cmd"),
            "User": config.get("User") or "",
            "WorkingDir": config.get("WorkingDir") or "",
            "Labels": {
                **(config.get("Labels") or {}),
                **{f"{LABEL_PREFIX}{key}": "" for key in _OWNER_KEYS},
                **(labels or {}),
            },
        }
        if env:
            kept = [e for e in config.get("Env") or [] if e.split("=", 1)[0] not in env]
            conf["Env"] = kept + [f"{key}={value}" for key, value in env.items()]
        with engine_errors(parent):
            committed: dict[str, Any] = self.api.commit(container, conf=conf)
        return str(committed["Id"])

    def _remove(self, container: str) -> None:
        with contextlib.suppress(Exception):
            self.api.remove_container(container, force=True, v=True)


__all__ = ["BUILD_CAPS", "PACKAGES_DIR", "BuildLimits", "DockerBuilder", "StepFailed"]

"""The OCI ``config.json`` of a direct run: Docker's own, with only the per-run fields rewritten.

A template is captured from a real container that Docker started with the same ``SandboxSpec``
(the bundle Docker hands its runtime), kept on disk keyed by everything that shapes it (the spec,
the engine's version and runtime registration, sandloop's version and seccomp profile), and
rendered per run by rewriting only ``PER_RUN_FIELDS``. ``parity_problems`` says why a template
cannot be used as is (then the run goes to Docker); ``diff`` is what the parity test checks.
"""

from __future__ import annotations

import glob
import hashlib
import json
import threading
from collections.abc import Callable, Mapping
from dataclasses import asdict
from pathlib import Path
from typing import Any, TypeVar, cast

from sandloop.contract import SandboxError
from sandloop.paths import write_atomically
from sandloop.runtime.base import SandboxSpec

#: Fields a rendered config may differ from Docker's in: where the root and the hostname file
#: are, which cgroup, and the labels as annotations. Everything else is Docker's, byte for byte.
#: Under runsc ``/tmp`` is a host tmpfs bound in (runtime/tmpfs.py): Docker's is its volume's, ours
#: the bundle's own.
PER_RUN_FIELDS = (
    "root.path",
    "mounts[/etc/hostname].source",
    "mounts[/tmp].source",
    "linux.cgroupsPath",
    "annotations",
)

#: Destinations Docker's config may bind a host path to: the hostname file, and the host tmpfs
#: that stands for ``/tmp`` under gVisor.
PER_RUN_BINDS = ("/etc/hostname", "/tmp")

#: Where Docker's containerd keeps each running container's bundle.
BUNDLE_GLOBS = (
    "/run/docker/containerd/daemon/io.containerd.runtime.v2.task/moby/{id}/config.json",
    "/run/containerd/io.containerd.runtime.v2.task/moby/{id}/config.json",
)


def docker_bundle_config(container_id: str) -> dict[str, Any] | None:
    for pattern in BUNDLE_GLOBS:
        for path in glob.glob(pattern.format(id=container_id)):
            with open(path) as f:
                loaded: dict[str, Any] = json.load(f)
                return loaded
    return None


T = TypeVar("T")
#: What is derived from a template, by the template's identity and what: a template is never
#: changed once made (``Templates.get`` hands out one per spec), and is kept here so its id is
#: never another's.
_derived: dict[tuple[int, str], tuple[Mapping[str, Any], Any]] = {}


def derived(template: Mapping[str, Any], what: str, make: Callable[[Mapping[str, Any]], T]) -> T:
    """``make(template)``, computed once per template (e.g. its JSON text, its bwrap gaps)."""
    key = (id(template), what)
    found = _derived.get(key)
    if found is None or found[0] is not template:
        if len(_derived) >= 512:  # templates come and go with their specs: never more than this
            _derived.clear()
        found = _derived[key] = (template, make(template))
    return cast(T, found[1])


def _text(template: Mapping[str, Any]) -> str:
    """The template as JSON: a run's config is parsed from it, a quarter of the CPU of
    ``copy.deepcopy`` (most of it is the seccomp profile)."""
    return derived(template, "json", lambda t: json.dumps(dict(t)))


def render(
    template: Mapping[str, Any],
    *,
    rootfs: Path,
    hostname_file: Path,
    cgroups_path: str,
    annotations: Mapping[str, str],
    host_tmp: Path | None = None,
) -> dict[str, Any]:
    """The template with the per-run fields filled in (``host_tmp``: the host tmpfs that is this
    sandbox's ``/tmp``, when Docker's config binds one)."""
    config: dict[str, Any] = json.loads(_text(template))
    config["root"]["path"] = str(rootfs)
    for mount in config.get("mounts", []):
        if mount.get("destination") == "/etc/hostname":
            mount["source"] = str(hostname_file)
        elif mount.get("destination") == "/tmp" and mount.get("type") == "bind":
            if host_tmp is None:
                raise SandboxError("Docker's config binds a host tmpfs at /tmp, and none was made for this run")
            mount["source"] = str(host_tmp)
    config["linux"]["cgroupsPath"] = cgroups_path
    config["annotations"] = dict(annotations)
    return config


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        out: dict[str, Any] = {}
        for key, item in value.items():
            out.update(_flatten(item, f"{prefix}.{key}" if prefix else key))
        return out
    if isinstance(value, list) and prefix == "mounts":
        out = {}
        for item in value:
            out.update(_flatten(item, f"mounts[{item.get('destination')}]"))
        return out
    return {prefix: value}


def diff(ours: Mapping[str, Any], docker: Mapping[str, Any], ignore: tuple[str, ...] = PER_RUN_FIELDS) -> list[str]:
    """Paths at which two configs differ, outside ``ignore`` (a path or any path below it)."""
    a, b = _flatten(dict(ours)), _flatten(dict(docker))

    def ignored(path: str) -> bool:
        return any(path == i or path.startswith(i + ".") for i in ignore)

    return sorted(p for p in set(a) | set(b) if not ignored(p) and a.get(p) != b.get(p))


def parity_problems(template: Mapping[str, Any]) -> list[str]:
    """Why Docker's config cannot be replayed without Docker (each problem routes runs to Docker)."""
    problems = []
    if any(template.get("hooks", {}).values()):
        problems.append("Docker's config has hooks (networking) that only dockerd can serve")
    process = template.get("process", {})
    if process.get("apparmorProfile"):
        problems.append(f"Docker applies the AppArmor profile {process['apparmorProfile']!r}")
    if process.get("selinuxLabel") or template.get("linux", {}).get("mountLabel"):
        problems.append("Docker applies an SELinux label")
    if any(ns.get("path") for ns in template.get("linux", {}).get("namespaces", [])):
        problems.append("the config joins an existing namespace")
    if any(m.get("type") == "bind" and m.get("destination") not in PER_RUN_BINDS for m in template.get("mounts", [])):
        problems.append("the config binds host paths other than /etc/hostname and /tmp")
    return problems


class Templates:
    """Docker's config for each spec, captured once (``capture`` starts a container through Docker
    and returns its config) and cached on disk."""

    def __init__(self, directory: Path, capture: Callable[[SandboxSpec], dict[str, Any]], salt: Callable[[], str]):
        self.directory = directory
        self._capture = capture
        self._salt = salt
        self._lock = threading.Lock()
        self._memory: dict[SandboxSpec, dict[str, Any]] = {}

    def key(self, spec: SandboxSpec) -> str:
        shape = {**asdict(spec), "limits": spec.limits.model_dump(mode="json"), "labels": []}
        text = json.dumps(shape, sort_keys=True) + self._salt()
        return hashlib.sha256(text.encode()).hexdigest()[:32]

    def get(self, spec: SandboxSpec) -> dict[str, Any]:
        spec = SandboxSpec(spec.image, spec.limits, spec.cwd, (), spec.volumes, spec.command)
        found = self._memory.get(spec)
        if found is not None:
            return found
        with self._lock:
            found = self._memory.get(spec)
            if found is not None:
                return found
            path = self.directory / f"{self.key(spec)}.json"
            if path.is_file():
                found = json.loads(path.read_text())
            else:
                found = self._capture(spec)
                if not found:
                    raise SandboxError("could not read the configuration Docker gave its runtime")
                self.directory.mkdir(parents=True, exist_ok=True)
                write_atomically(path, json.dumps(found), 0o644)
            self._memory[spec] = found
            return found


def binds_host_tmp(template: Mapping[str, Any]) -> bool:
    """Whether ``/tmp`` in Docker's config is a host directory (a host tmpfs under gVisor)."""
    return any(m.get("destination") == "/tmp" and m.get("type") == "bind" for m in template.get("mounts", []))

"""Templates: named, versioned images built on the runtime image (or on another template) from
steps (``spec.py``), built step by step and cached (``build.py``), with packages fetched by the
host's own clients (``fetch.py``). Sandboxes from a template keep every isolation control: a
template adds software, never privileges.

    from sandloop import Sandloop
    from sandloop.images.templates import TemplateSpec, Step

    with Sandloop() as sl:
        sl.templates.build(parse_steps_file(Path("steps.yaml"), "data-tools:v1"))
        sl.run_code("import sklearn", template="data-tools:v1")
"""

from __future__ import annotations

import builtins
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sandloop.contract import SandboxError, TemplateInUse, TemplateNotFound
from sandloop.images.templates.build import (
    HOME_LABEL,
    NAME_LABEL,
    OWNER_LABEL,
    SPEC_LABEL,
    BuildEvent,
    BuildResult,
    build,
    image_name,
)
from sandloop.images.templates.spec import (
    RUNTIME,
    Step,
    TemplateSpec,
    from_mapping,
    parse_dockerfile,
    parse_steps_file,
    split_ref,
)
from sandloop.runtime.base import TEMPLATE_CACHE_REPO, BuildLimits, ImageBuilder

#: How long a name-to-image lookup is reused: a build or removal in this process is seen at once,
#: one in another process (the CLI beside a server) after this. An engine call per run would cost
#: a warm run ~15 % (measured: bench/templates.py).
RESOLVE_SECONDS = 30.0


@dataclass(frozen=True)
class TemplateInfo:
    ref: str
    image_id: str
    size_bytes: int
    created: str
    base: str
    steps: list[dict[str, Any]] = field(default_factory=list)
    start_cmd: str = ""
    ready_cmd: str = ""
    #: The API token that built it ('' for the host's own user).
    owner: str = ""

    @property
    def name(self) -> str:
        return self.ref.partition(":")[0]

    @property
    def tag(self) -> str:
        return self.ref.partition(":")[2]


class Templates:
    """A host's templates: build, list, show, resolve to an image, remove."""

    def __init__(
        self,
        builder: Callable[[], ImageBuilder | None],
        runtime_image: str,
        users: Callable[[str], list[str]] = lambda image_id: [],
        quiesce: Callable[[], object] = lambda: None,
    ) -> None:
        self._builder = builder
        self.runtime_image = runtime_image
        #: Who uses an image (sessions' ids), besides the engine's own containers.
        self._users = users
        #: Waits for this process's used sandboxes to be torn down (they are not users any more).
        self._quiesce = quiesce
        #: name:tag -> (when, image id, owner)
        self._resolved: dict[str, tuple[float, str, str]] = {}
        self._lock = threading.Lock()

    @property
    def builder(self) -> ImageBuilder:
        found = self._builder()
        if found is None:
            raise SandboxError(
                "this backend cannot build or run templates (the test double, and the oci backend without Docker, "
                "engine=false, run the runtime image only); use the docker, oci (with a Docker engine) or ray backend"
            )
        return found

    def build(
        self,
        spec: TemplateSpec,
        *,
        force: bool = False,
        limits: BuildLimits | None = None,
        on_event: Callable[[BuildEvent], None] | None = None,
        owner: str = "",
    ) -> BuildResult:
        """Build ``spec`` (``owner``: the API token building it; it alone sees the template)."""
        if any(t.name == spec.name and t.owner != owner for t in self._list()):
            raise TemplateInUse(f"the name {spec.name} is taken by another owner's template: choose another")
        result = build(
            spec, self.builder, self.runtime_image, force=force, limits=limits, on_event=on_event, owner=owner
        )
        with self._lock:
            self._resolved.pop(spec.ref, None)
        return result

    def image_for(self, ref: str, owner: str | None = None) -> str:
        """The image id sandboxes of template ``ref`` ("name[:tag]") start from; with ``owner``
        (an API token's id) only its own templates and the host user's are found."""
        name, tag = split_ref(ref)
        key = f"{name}:{tag}"
        now = time.monotonic()
        with self._lock:
            hit = self._resolved.get(key)
        if hit is None or now - hit[0] >= RESOLVE_SECONDS:
            found = self.builder.inspect(image_name(name, tag))
            labels = ((found or {}).get("Config") or {}).get("Labels") or {}
            # another tag of the same template (E2B's assign_tags) names the same image
            if found is None or str(labels.get(NAME_LABEL, "")).partition(":")[0] != name:
                raise TemplateNotFound(
                    f"no template {key} here: build it with `sandloop templates build {key} -f FILE`"
                )
            hit = (now, str(found["Id"]), labels.get(OWNER_LABEL) or "")
            with self._lock:
                self._resolved[key] = hit
        if owner is not None and hit[2] not in ("", owner):
            raise TemplateNotFound(f"no template {key} here (templates are their builder's own)")
        return hit[1]

    def seeds_home(self, image_id: str) -> bool:
        """Whether sessions from this template's image start with its /home/user files."""
        found = self.builder.inspect(image_id) or {}
        return ((found.get("Config") or {}).get("Labels") or {}).get(HOME_LABEL) == "1"

    def get(self, ref: str, owner: str | None = None) -> TemplateInfo:
        name, tag = split_ref(ref)
        found = self.builder.inspect(image_name(name, tag))
        info = _info(found, f"{name}:{tag}") if found is not None else None
        if info is None or (owner is not None and info.owner not in ("", owner)):
            raise TemplateNotFound(f"no template {name}:{tag} here (sandloop templates ls)")
        return info

    def list(self, owner: str | None = None) -> list[TemplateInfo]:
        """Every template here; with ``owner``, that token's own and the host user's."""
        return [t for t in self._list() if owner is None or t.owner in ("", owner)]

    def _list(self) -> builtins.list[TemplateInfo]:
        out = []
        for image in self.builder.images(NAME_LABEL):
            for repo_tag in image.get("RepoTags") or []:
                repository, _, tag = repo_tag.rpartition(":")
                if repository.startswith("sandloop-template-") and repository != TEMPLATE_CACHE_REPO:
                    ref = f"{repository.removeprefix('sandloop-template-')}:{tag}"
                    labels = image.get("Labels") or {}
                    out.append(
                        _info(
                            {
                                "Id": image["Id"],
                                "Size": image.get("Size"),
                                "Created": image.get("Created"),
                                "Config": {"Labels": labels},
                            },
                            ref,
                        )
                    )
        return sorted(out, key=lambda t: t.ref)

    def remove(self, ref: str, owner: str | None = None) -> None:
        """Remove the template (its tag; its layers when nothing else holds them). Refused while
        a session or sandbox runs from it; with ``owner``, only that token's own."""
        info = self.get(ref, owner)
        if owner is not None and info.owner != owner:
            raise TemplateInUse(f"template {info.ref} is the host's own: only its operator removes it")
        self._quiesce()
        users = self._users(info.image_id) + self.builder.containers_using(info.image_id)
        if users:
            raise TemplateInUse(
                f"template {info.ref} is in use by {len(users)} session(s) or sandbox(es) "
                f"({', '.join(u[:12] for u in users[:5])}): delete them first"
            )
        problem = self.builder.remove_image(image_name(info.name, info.tag))
        if problem:
            raise TemplateInUse(f"the engine would not remove template {info.ref}: {problem}")
        with self._lock:
            self._resolved.pop(info.ref, None)

    def prune(self) -> int:
        """Drop the build cache: the next build of any template runs every step again. Layers a
        template still uses stay (they are its). How many cache entries went."""
        removed = 0
        builder = self.builder
        for image in builder.images("sandloop.purpose"):
            for repo_tag in image.get("RepoTags") or []:
                if repo_tag.startswith(TEMPLATE_CACHE_REPO + ":") and builder.remove_image(repo_tag) is None:
                    removed += 1
        return removed


def _info(image: dict[str, Any], ref: str) -> TemplateInfo:
    labels = (image.get("Config") or {}).get("Labels") or {}
    try:
        recipe = json.loads(labels.get(SPEC_LABEL) or "{}")
    except ValueError:
        recipe = {}
    created = image.get("Created")
    if isinstance(created, int | float):
        created = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(created))
    return TemplateInfo(
        ref=ref,
        image_id=str(image["Id"]),
        size_bytes=int(image.get("Size") or 0),
        created=str(created or ""),
        base=str(recipe.get("from", RUNTIME)),
        steps=list(recipe.get("steps") or []),
        start_cmd=str(recipe.get("start_cmd") or ""),
        ready_cmd=str(recipe.get("ready_cmd") or ""),
        owner=str(labels.get(OWNER_LABEL) or ""),
    )


__all__ = [
    "BuildEvent",
    "BuildLimits",
    "BuildResult",
    "Step",
    "TemplateInfo",
    "TemplateSpec",
    "Templates",
    "from_mapping",
    "parse_dockerfile",
    "parse_steps_file",
    "split_ref",
]

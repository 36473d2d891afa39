"""Building a template: its steps in order on the image builder (``runtime/docker/builder.py``),
each step's result cached under a key made of its parent image, the step, the build's user and
working directory and the content of every file it reads: the same steps build once, ``force``
rebuilds. A failed step raises ``TemplateBuildFailed`` with its number and log tail; only the
cached results of the steps before it remain (``sandloop templates prune`` removes unused ones).
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import shlex
import shutil
import stat
import tarfile
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sandloop.contract import InvalidArgument, SandboxError, TemplateBuildFailed, TemplateNotFound
from sandloop.images.templates import fetch
from sandloop.images.templates.spec import RUNTIME, TEMPLATE_REPO_PREFIX, Step, TemplateSpec, split_ref
from sandloop.runtime.base import PACKAGES_DIR, TEMPLATE_CACHE_REPO, BuildLimits, ImageBuilder, StepFailed

#: Labels of a built template's image.
NAME_LABEL = "sandloop.template"
SPEC_LABEL = "sandloop.template.spec"
#: Set when the template has files in /home/user, which a session's workspace is mounted over:
#: a new session's workspace is seeded with them.
HOME_LABEL = "sandloop.template.home"
HOME = "/home/user"
#: Which API token built it ('' for the host's own user: the CLI, Python): only that token sees it.
OWNER_LABEL = "sandloop.template.owner"
#: Biggest COPY (all its files) and biggest single file it may hold.
MAX_COPY_BYTES = 1024**3
MAX_COPY_FILES = 100_000


@dataclass(frozen=True)
class BuildEvent:
    """What a build is doing, for a progress display: a step starting (``line`` empty) or a line
    of its log."""

    step: int
    steps: int
    description: str
    cached: bool = False
    line: str = ""


@dataclass(frozen=True)
class BuildResult:
    ref: str
    image_id: str
    seconds: float
    cached_steps: int
    built_steps: int


def image_name(name: str, tag: str) -> str:
    return f"{TEMPLATE_REPO_PREFIX}{name}:{tag}"


#: Scratch folders of builds: "sandloop-template-<pid>-...", so that one a killed build left is
#: known by its dead owner and removed by the next build (seen: a build SIGKILLed mid-step).
SCRATCH_PREFIX = "sandloop-template-"


def scratch(kind: str = "") -> Path:
    """A new scratch folder of this process (``kind`` names what it is for)."""
    return Path(tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{os.getpid()}-{kind}"))


def sweep_scratch() -> int:
    """Remove scratch folders whose process is gone; how many. Never raises."""
    removed = 0
    for path in Path(tempfile.gettempdir()).glob(f"{SCRATCH_PREFIX}*"):
        pid = path.name[len(SCRATCH_PREFIX) :].split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
    return removed


def _digest(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def build(
    spec: TemplateSpec,
    builder: ImageBuilder,
    runtime_image: str,
    *,
    force: bool = False,
    limits: BuildLimits | None = None,
    on_event: Callable[[BuildEvent], None] | None = None,
    owner: str = "",
) -> BuildResult:
    """Build ``spec`` (or find every step of it cached) and tag it; see the module's docstring."""
    limits = limits or BuildLimits()
    began = time.monotonic()
    sweep_scratch()
    emit = on_event or (lambda event: None)
    base_ref = runtime_image if spec.base == RUNTIME else image_name(*split_ref(spec.base, "from"))
    base = builder.inspect(base_ref)
    if base is None:
        if spec.base == RUNTIME:
            raise SandboxError(f"the runtime image {runtime_image} is not built yet: run `sandloop images build`")
        raise TemplateNotFound(
            f"FROM {spec.base}: no template of that name is built here, and sandloop pulls from no registry: "
            "start from the runtime image or a template (sandloop templates ls)"
        )
    parent: str = base["Id"]
    config = base.get("Config") or {}
    user, workdir = "root", config.get("WorkingDir") or "/"
    total = len(spec.steps) + 1
    cached = built = 0
    for number, step in enumerate(spec.steps, 1):
        if step.kind == "user":
            user = step.args[0]
        elif step.kind == "workdir":
            workdir = step.args[0]
        with _scratch_for_step() as tmp:
            files = _step_files(spec, step, Path(tmp)) if step.kind == "copy" else None
            key = _digest(
                parent, step.kind, step.args, user, workdir, files.digest if files else "", _local_digests(spec, step)
            )
            tag = key[:40]
            found = None if force else builder.inspect(f"{TEMPLATE_CACHE_REPO}:{tag}")
            emit(BuildEvent(number, total, step.describe(), cached=found is not None))
            if found is not None:
                parent = found["Id"]
                cached += 1
                continue
            try:
                parent = _run_step(
                    spec, step, number, total, parent, user, workdir, builder, limits, files, Path(tmp), emit
                )
            except StepFailed as exc:
                tail = "\n".join(exc.log_tail[-15:])
                raise TemplateBuildFailed(
                    f"template {spec.ref}: step {number} of {total - 1} "
                    f"({step.where or 'step'}: {step.describe()[:200]}) failed: {exc}"
                    + (f"\n--- its last lines ---\n{tail}" if tail else ""),
                    step=number,
                    log_tail=exc.log_tail,
                ) from None
            except (InvalidArgument, TemplateBuildFailed):
                raise
            except SandboxError as exc:
                raise TemplateBuildFailed(
                    f"template {spec.ref}: step {number} ({step.where}: {step.describe()[:200]}) failed: {exc}", number
                ) from None
            builder.tag(parent, TEMPLATE_CACHE_REPO, tag)
            built += 1
    # The last step: what the template is (its labels, the start command) on the image itself.
    recipe = {
        "name": spec.name,
        "tag": spec.tag,
        "from": spec.base,
        "steps": [{"kind": s.kind, "args": list(s.args)} for s in spec.steps],
        "start_cmd": spec.start_cmd,
        "ready_cmd": spec.ready_cmd,
        "workdir": workdir,
        "build_user": user,
    }
    labels = {NAME_LABEL: spec.ref, SPEC_LABEL: json.dumps(recipe, sort_keys=True), OWNER_LABEL: owner}
    if builder.has_entries(parent, HOME):  # a new session's workspace (mounted there) starts with them
        labels[HOME_LABEL] = "1"
    env = {"SANDLOOP_TEMPLATE": spec.ref}
    if spec.start_cmd:  # the launcher runs them (images/recipe/launcher.py)
        env["SANDLOOP_START_CMD"] = spec.start_cmd
        if spec.ready_cmd:
            env["SANDLOOP_READY_CMD"] = spec.ready_cmd
    if spec.start_cmd and spec.ready_cmd:  # as E2B does: the template's start is checked once here
        key = _digest(parent, "start-check", spec.start_cmd, spec.ready_cmd)[:40]
        if force or builder.inspect(f"{TEMPLATE_CACHE_REPO}:{key}") is None:
            emit(BuildEvent(total, total, "check the start and ready commands"))
            try:
                checked = builder.run_step(
                    parent,
                    _start_check(spec),
                    user=SANDBOX_USER,
                    workdir=workdir,
                    limits=limits,
                    on_line=lambda text: emit(BuildEvent(total, total, "start check", line=text)),
                )
            except StepFailed as exc:
                raise TemplateBuildFailed(
                    f"template {spec.ref}: the start command did not get ready ({exc}): "
                    + " | ".join(exc.log_tail[-10:]),
                    step=total,
                    log_tail=exc.log_tail,
                ) from None
            builder.tag(checked, TEMPLATE_CACHE_REPO, key)  # the check's result, kept only as a cache mark
    key = _digest(parent, "final", labels, env)[:40]
    found = None if force else builder.inspect(f"{TEMPLATE_CACHE_REPO}:{key}")
    emit(BuildEvent(total, total, f"tag {image_name(spec.name, spec.tag)}", cached=found is not None))
    final = found["Id"] if found is not None else builder.change(parent, env=env, labels=labels)
    if found is None:
        builder.tag(final, TEMPLATE_CACHE_REPO, key)
    repository, _, tag = image_name(spec.name, spec.tag).partition(":")
    builder.tag(final, repository, tag)
    return BuildResult(spec.ref, final, time.monotonic() - began, cached, built)


#: The user sandboxes run as (a template's start command runs as it).
SANDBOX_USER = "65534:65534"
START_CHECK_SECONDS = 60


def _start_check(spec: TemplateSpec) -> str:
    """A shell script: start the start command, poll the ready command for up to a minute."""
    tries = int(START_CHECK_SECONDS / 0.1)
    return (
        f"( {spec.start_cmd} ) >/tmp/.start.log 2>&1 </dev/null &\n"
        f"i=0; while [ $i -lt {tries} ]; do if ( {spec.ready_cmd} ) >/dev/null 2>&1; then echo ready; exit 0; fi; "
        "sleep 0.1; i=$((i+1)); done\n"
        'tail -n 20 /tmp/.start.log; echo "the ready command did not succeed within '
        f'{START_CHECK_SECONDS} s" >&2; exit 1\n'
    )


@contextlib.contextmanager
def _scratch_for_step() -> Iterator[str]:
    path = scratch("step-")
    try:
        yield str(path)
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _local_digests(spec: TemplateSpec, step: Step) -> list[str]:
    """The content of package files a helper step reads from the template's folder."""
    if step.kind not in ("pip_install", "npm_install"):
        return []
    out = []
    for item in step.args:
        if fetch.is_local(item):
            path = fetch.local_file(spec.context, item, step.where)
            out.append(hashlib.sha256(path.read_bytes()).hexdigest())
    return out


def _run_step(
    spec: TemplateSpec,
    step: Step,
    number: int,
    total: int,
    parent: str,
    user: str,
    workdir: str,
    builder: ImageBuilder,
    limits: BuildLimits,
    files: _Files | None,
    tmp: Path,
    emit: Callable[[BuildEvent], None],
) -> str:
    def line(text: str) -> None:
        emit(BuildEvent(number, total, step.describe(), line=text))

    if step.kind == "run":
        return builder.run_step(parent, step.args[0], user=user, workdir=workdir, limits=limits, on_line=line)
    if step.kind == "copy":
        assert files is not None
        with open(files.archive, "rb") as archive:
            return builder.add_files(parent, archive.read())
    if step.kind == "env":
        return builder.change(parent, env=dict(step.args))
    if step.kind in ("workdir", "user"):
        # Recorded for the next steps; a WORKDIR is also made (by root, as Docker's WORKDIR does).
        if step.kind == "workdir":
            return builder.run_step(
                parent, f"mkdir -p {shlex.quote(step.args[0])}", user="root", workdir="/", limits=limits
            )
        return parent
    packages = tmp / "packages"
    packages.mkdir(mode=0o755)
    os.chmod(tmp, 0o755)
    if step.kind == "pip_install":
        wanted = fetch.pip_packages(step.args, spec.context, packages, step.where, line)
        command = (
            f"python3 -m pip install --no-index --find-links {PACKAGES_DIR} --no-cache-dir "
            f"--root-user-action=ignore --break-system-packages --disable-pip-version-check --no-warn-script-location "
            + " ".join(shlex.quote(w) for w in wanted)
        )
    elif step.kind == "npm_install":
        modules = fetch.npm_packages(step.args, spec.context, packages, step.where, line)
        # Into NODE_PATH (the image's node finds them there), their commands into /usr/local/bin.
        command = (
            f"set -e; cd {PACKAGES_DIR}/node_modules; mkdir -p /usr/local/lib/node_modules; "
            "for p in $(ls -A | grep -v '^\\.bin$'); do rm -rf /usr/local/lib/node_modules/$p; "
            "cp -a $p /usr/local/lib/node_modules/; done; "
            "if [ -d .bin ]; then for b in .bin/*; do t=$(readlink -f $b); "
            'ln -sf "/usr/local/lib/node_modules/${t#' + PACKAGES_DIR + '/node_modules/}" '
            "/usr/local/bin/$(basename $b); done; fi"
        )
        if not modules.is_dir():
            raise TemplateBuildFailed(f"step {number}: npm installed nothing", number)
    else:  # apt_install
        status = builder.read_file(parent, "/var/lib/dpkg/status")
        if status is None:
            raise TemplateBuildFailed(f"step {number}: the image has no dpkg status (not a Debian image)", number)
        debs = fetch.apt_packages(step.args, status, packages, step.where, line)
        if not debs:
            return parent  # everything is installed already
        command = f"dpkg -i {PACKAGES_DIR}/*.deb"
    for path in packages.rglob("*"):  # the build's user (often not root) reads them
        with contextlib.suppress(OSError):
            path.chmod(path.stat().st_mode | stat.S_IROTH | (stat.S_IXOTH if path.is_dir() else 0))
    return builder.run_step(
        parent, command, user=user, workdir=workdir, limits=limits, packages_dir=str(packages), on_line=line
    )


@dataclass(frozen=True)
class _Files:
    archive: Path
    digest: str


def _step_files(spec: TemplateSpec, step: Step, tmp: Path) -> _Files:
    """A COPY step's files as one tar (paths as in the image), with modes and owners applied, and
    the digest of everything in it. The source must stay inside the template's folder: a symlink
    in it is copied as a link, never followed."""
    src, dest, mode, owner = step.args
    context = spec.context.resolve()
    source = (context / src).resolve()  # follows a link: where it really points must be inside too
    if not source.is_relative_to(context):
        raise InvalidArgument(f"{step.where}: copy's src {src} is outside the template's folder ({context})")
    if not source.exists():
        raise InvalidArgument(f"{step.where}: copy's src {src}: no such file or folder in {context}")
    uid, _, gid = (owner or "0:0").partition(":")
    uid_n, gid_n = int(uid), int(gid or uid)
    mode_n = int(mode, 8) if mode else None
    if source.is_dir():
        target = dest.rstrip("/") or "/"
        entries = sorted(source.rglob("*"))
        if len(entries) > MAX_COPY_FILES:
            raise InvalidArgument(f"{step.where}: {src} holds {len(entries)} files; at most {MAX_COPY_FILES}")
        pairs = [(p, f"{target}/{p.relative_to(source).as_posix()}") for p in entries]
    else:
        target = dest + source.name if dest.endswith("/") else dest
        pairs = [(source, target)]
    archive = tmp / "copy.tar"
    digest = hashlib.sha256()
    digest.update(json.dumps([dest, mode, owner]).encode())
    total = 0
    with tarfile.open(archive, "w", format=tarfile.PAX_FORMAT) as tar:
        for path, in_image in pairs:
            info = tar.gettarinfo(str(path), arcname=in_image.lstrip("/"))
            info.uid, info.gid, info.uname, info.gname = uid_n, gid_n, "", ""
            if mode_n is not None and info.isfile():  # folders keep theirs (they must stay enterable)
                info.mode = mode_n
            digest.update(f"{info.name}\0{info.mode}\0{info.type!r}\0{info.linkname}\0".encode())
            if info.isfile():
                total += info.size
                if total > MAX_COPY_BYTES:
                    raise InvalidArgument(f"{step.where}: {src} is over {MAX_COPY_BYTES >> 20} MiB; copy less")
                data = path.read_bytes()
                digest.update(hashlib.sha256(data).digest())
                tar.addfile(info, io.BytesIO(data))
            elif info.isdir() or info.issym():
                tar.addfile(info)
            # sockets, devices, fifos: not copied
    return _Files(archive, digest.hexdigest())

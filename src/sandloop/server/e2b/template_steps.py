"""E2B's build steps as sandloop's (``server/e2b/templates.py`` translates a build with these):
who a step runs as, paths against its working directory, package installs turned into the helper
steps that fetch on the host (pip, npm, apt), a COPY's files staged out of the uploaded archive
without leaving it, and E2B's own templates that cannot be had here."""

from __future__ import annotations

import re
import shlex
import shutil
import tarfile
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from sandloop.images.templates.spec import Step, make_step
from sandloop.server.e2b.service import E2BError

if TYPE_CHECKING:
    pass

#: Every /templates... and /v<N>/templates... path is E2B's template API.

#: E2B's own user in its images: here the sandbox's unprivileged user.
E2B_USER = "user"
SANDBOX_USER = "65534:65534"
E2B_HOME = "/home/user"


#: E2B's own templates that cannot be had here, and why.
NOT_HERE = {
    "mcp-gateway": "the MCP gateway template is not available: it runs its gateway as root inside the sandbox; "
    "sandloop serves MCP itself (`sandloop mcp`)",
    "devcontainer": "the devcontainer template is not available: building a dev container needs a container "
    "engine inside the sandbox, which sandloop never gives one",
}


def step_user(user: str) -> str:
    return SANDBOX_USER if user in (E2B_USER, "") else user


def absolute(path: str, workdir: str) -> str:
    if not path:
        return workdir
    if path.startswith("~"):
        path = E2B_HOME + path[1:]
    joined = PurePosixPath(path) if path.startswith("/") else PurePosixPath(workdir) / path
    parts: list[str] = []
    for part in joined.parts[1:]:
        if part == "..":
            if parts:
                parts.pop()
        elif part != ".":
            parts.append(part)
    return "/" + "/".join(parts)


_PIP = re.compile(r"^(?:sudo\s+)?(?:python3?\s+-m\s+)?pip3?\s+install(?:\s+(.*))?$")
_NPM = re.compile(r"^(?:sudo\s+)?npm\s+(?:install|i)(?:\s+(.*))?$")
_APT = re.compile(r"^(?:sudo\s+)?(?:[A-Z_]+=\S*\s+)*apt(?:-get)?\s+install(?:\s+(.*))?$")
_APT_UPDATE = re.compile(r"^(?:sudo\s+)?apt(?:-get)?\s+update(\s+-[a-z]+)*$")


def helper_step(part: str, where: str) -> Step | str | None:
    """A package install the SDK writes, as a helper step ("skip": nothing to do here)."""
    if _APT_UPDATE.match(part):
        return "skip"  # the host's package lists are used
    if re.match(r"^(?:sudo\s+)?git\s+clone\b", part):
        raise E2BError(
            400,
            f"{where}: {part!r}: a build step reaches no host, so git clone cannot run; check the repository "
            "out here and copy() it into the template",
        )
    for pattern, kind, flags in (
        (
            _PIP,
            "pip_install",
            {"--user", "--upgrade", "-U", "--no-cache-dir", "-q", "--quiet", "--break-system-packages"},
        ),
        (_NPM, "npm_install", {"-g", "--global", "--save-dev", "-D", "--save", "-q", "--silent"}),
        (_APT, "apt_install", {"-y", "--yes", "-q", "--no-install-recommends", "--fix-missing"}),
    ):
        match = pattern.match(part)
        if match is None:
            continue
        try:
            words = shlex.split(match.group(1) or "")
        except ValueError:
            return None
        packages = [w for w in words if w not in flags]
        if packages and all(p.startswith(("/", "./", "~")) for p in packages) and kind == "pip_install":
            return None  # wheels the template copied in: pip installs them as written, offline
        if not packages or any(p == "." or p.startswith("-") for p in packages):
            raise E2BError(
                400,
                f"{where}: {part!r}: sandloop installs named packages only (from this host's mirrors); a build "
                "from a project folder or with other options cannot run without network",
            )
        return make_step(kind, packages, where)
    return None


def inside_folder(member: tarfile.TarInfo, path: str) -> tarfile.TarInfo | None:
    """tarfile's "data" filter, skipping (not failing on) what it refuses: a link to an absolute
    path or out of the archive, a device. Nothing is written outside the folder."""
    try:
        return tarfile.data_filter(member, path)
    except tarfile.FilterError:
        return None


def stage_copy(unpacked: Path, pattern: str, stage: Path, where: str, *, into_folder: bool) -> str:
    """What E2B's COPY of ``pattern`` puts at its destination, laid out under ``stage``: a folder
    brings its contents, a file itself. Returns the copy step's source (relative to the context):
    one file copied to a destination not ending in '/' is that file, as Docker's COPY."""
    import glob

    stage.mkdir()
    pattern = pattern.removeprefix("./")
    matches = sorted(glob.glob(pattern, root_dir=unpacked, recursive=True, include_hidden=True))
    if not matches:
        raise E2BError(400, f"{where}: COPY {pattern} matched no uploaded file")
    for match in matches:
        source = unpacked / match
        if not source.resolve().is_relative_to(unpacked.resolve()):
            continue
        if source.is_dir() and not source.is_symlink():
            shutil.copytree(source, stage, symlinks=True, dirs_exist_ok=True)
        else:
            target = stage / source.name
            if source.is_symlink():
                target.symlink_to(source.readlink())
            else:
                shutil.copy2(source, target)
    entries = list(stage.iterdir())
    glob_pattern = any(c in pattern for c in "*?[")  # a pattern's matches go into a folder
    if len(matches) == 1 and len(entries) == 1 and not into_folder and not glob_pattern and not entries[0].is_dir():
        return f"{stage.name}/{entries[0].name}"
    return stage.name

"""What a template is: a name, a tag, what it starts from and its steps; parsed from a steps file
(YAML) or a Dockerfile, every problem said in the file's own words (the step, the line).

A template is an image built on the runtime image (or on another template). It adds software,
never privileges: every sandbox from it keeps every isolation control, and at run time code runs
as uid 65534 on a read-only root whatever ``USER`` said at build time.

Steps (YAML, one mapping per step)::

    from: runtime                 # or another template: "name" or "name:tag"
    steps:
      - pip_install: [scikit-learn, ./wheels/mine-1.0-py3-none-any.whl]
      - npm_install: [left-pad@1.3.0]
      - apt_install: [jq]
      - run: python3 -c "import sklearn"
      - copy: {src: data/, dest: /opt/data, mode: "0644", owner: "65534:65534"}
      - env: {MY_FLAG: "1"}
      - workdir: /opt/app
      - user: root
    start_cmd: python3 -m http.server 8000   # runs in the background when a sandbox starts
    ready_cmd: curl -sf localhost:8000         # polled until it succeeds
"""

from __future__ import annotations

import json
import re
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandloop.contract import InvalidArgument

#: What a template starts from when it names nothing else: the runtime image of this version.
RUNTIME = "runtime"
#: Template names as users type them: lowercase, digits, '.', '_', '-' (Docker's repository rules).
_NAME = re.compile(r"^[a-z0-9]+(?:[._-][a-z0-9]+)*$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
_OWNER = re.compile(r"^\d{1,10}(?::\d{1,10})?$")
_MODE = re.compile(r"^0?[0-7]{3,4}$")
MAX_STEPS = 200
MAX_COMMAND = 64 * 1024
#: Names of other templates' tags that mean "the newest".
DEFAULT_TAG = "latest"


@dataclass(frozen=True)
class Step:
    """One build step. ``kind`` is one of ``KINDS``; ``args`` its canonical arguments (what the
    step's cache key is made of, with the content of any file it reads)."""

    kind: str
    args: tuple[Any, ...]
    #: Where it came from, in the user's words ("step 3", "Dockerfile line 7").
    where: str = ""

    def describe(self) -> str:
        if self.kind == "run":
            return f"RUN {self.args[0]}"
        if self.kind in ("pip_install", "npm_install", "apt_install"):
            return f"{self.kind} {' '.join(self.args)}"
        if self.kind == "copy":
            src, dest, mode, owner = self.args
            extra = "".join(f" {k}={v}" for k, v in (("mode", mode), ("owner", owner)) if v)
            return f"COPY {src} {dest}{extra}"
        if self.kind == "env":
            return "ENV " + " ".join(f"{k}={v}" for k, v in self.args)
        return f"{self.kind.upper()} {self.args[0]}"


KINDS = ("run", "pip_install", "npm_install", "apt_install", "copy", "env", "workdir", "user")


@dataclass(frozen=True)
class TemplateSpec:
    name: str
    tag: str = DEFAULT_TAG
    #: ``RUNTIME`` or another template's "name[:tag]".
    base: str = RUNTIME
    steps: tuple[Step, ...] = ()
    start_cmd: str = ""
    ready_cmd: str = ""
    #: Where COPY sources are read from (the steps file's folder).
    context: Path = field(default_factory=Path.cwd)

    @property
    def ref(self) -> str:
        return f"{self.name}:{self.tag}"


def split_ref(ref: str, what: str = "template") -> tuple[str, str]:
    """ "name[:tag]" checked: (name, tag)."""
    if not isinstance(ref, str) or not ref:
        raise InvalidArgument(f"{what} must be a name such as 'my-template' or 'my-template:v1'")
    name, _, tag = ref.partition(":")
    tag = tag or DEFAULT_TAG
    if not _NAME.match(name) or len(name) > 96:
        raise InvalidArgument(
            f"{what} name {name!r} is not valid: use lowercase letters, digits and '.', '_', '-' between "
            "them (at most 96 characters), e.g. 'data-tools'"
        )
    if not _TAG.match(tag):
        raise InvalidArgument(f"{what} tag {tag!r} is not valid: letters, digits, '_', '.', '-' (at most 128)")
    return name, tag


def _text(value: Any, where: str, what: str) -> str:
    if not isinstance(value, str) or not value.strip():
        raise InvalidArgument(f"{where}: {what} must be a non-empty string")
    if len(value) > MAX_COMMAND or "\x00" in value:
        raise InvalidArgument(f"{where}: {what} is too long or holds a NUL byte")
    return value


def _packages(value: Any, where: str, kind: str) -> tuple[str, ...]:
    items = [value] if isinstance(value, str) else value
    if not isinstance(items, list) or not items or not all(isinstance(i, str) and i.strip() for i in items):
        raise InvalidArgument(f"{where}: {kind} takes a package name or a list of them, e.g. {kind}: [requests]")
    out = []
    for item in items:
        item = item.strip()
        # A package, never an option: '--index-url=...' would reach another host, '-e .' run code.
        url = "://" in item or " @ " in item or item.startswith(("git+", "file:"))
        if item.startswith("-") or url or any(c in item for c in "\n\r\x00;|&`$"):
            raise InvalidArgument(
                f"{where}: {kind} item {item!r} is not a package: options, URLs and shell syntax are refused "
                "(packages come from the mirrors this host is configured for, or a file in the template's folder)"
            )
        out.append(item)
    return tuple(out)


def check_path_in_image(value: Any, where: str, what: str) -> str:
    path = _text(value, where, what)
    if not path.startswith("/"):
        raise InvalidArgument(f"{where}: {what} must be an absolute path in the image, e.g. /opt/app")
    if any(part == ".." for part in path.split("/")):
        raise InvalidArgument(f"{where}: {what} {path!r} must not contain '..'")
    return path


def make_step(kind: str, raw: Any, where: str) -> Step:
    if kind == "run":
        return Step("run", (_text(raw, where, "run"),), where)
    if kind in ("pip_install", "npm_install", "apt_install"):
        return Step(kind, _packages(raw, where, kind), where)
    if kind == "copy":
        if not isinstance(raw, Mapping) or "src" not in raw or "dest" not in raw:
            raise InvalidArgument(
                f"{where}: copy takes {{src: local/path, dest: /path/in/image}} (mode, owner optional)"
            )
        unknown = set(raw) - {"src", "dest", "mode", "owner"}
        if unknown:
            raise InvalidArgument(f"{where}: copy has unknown keys {sorted(unknown)} (src, dest, mode, owner)")
        src = _text(raw["src"], where, "copy's src")
        dest = check_path_in_image(raw["dest"], where, "copy's dest")
        mode = str(raw.get("mode") or "")
        if isinstance(raw.get("mode"), int):  # YAML reads 0644 as an int (octal in YAML 1.1)
            mode = oct(raw["mode"])[2:]
        if mode and not _MODE.match(mode):
            raise InvalidArgument(f"{where}: copy's mode {mode!r} must be octal, e.g. '0644'")
        owner = str(raw.get("owner") or "")
        if owner and not _OWNER.match(owner):
            raise InvalidArgument(
                f"{where}: copy's owner {owner!r} must be numeric 'uid' or 'uid:gid', e.g. '65534:65534'"
            )
        return Step("copy", (src, dest, mode.lstrip("0").rjust(3, "0") if mode else "", owner), where)
    if kind == "env":
        if not isinstance(raw, Mapping) or not raw:
            raise InvalidArgument(f"{where}: env takes a mapping, e.g. env: {{MY_FLAG: '1'}}")
        pairs = []
        for key, value in raw.items():
            if not isinstance(key, str) or not _ENV_NAME.match(key):
                raise InvalidArgument(f"{where}: env name {key!r} is not a variable name")
            if not isinstance(value, str | int | float) or "\x00" in str(value) or "\n" in str(value):
                raise InvalidArgument(f"{where}: env {key} must be a one-line string")
            pairs.append((key, str(value)))
        return Step("env", tuple(pairs), where)
    if kind == "workdir":
        return Step("workdir", (check_path_in_image(raw, where, "workdir"),), where)
    if kind == "user":
        user = _text(raw, where, "user").strip()
        if not re.match(r"^[a-z_][a-z0-9_-]{0,31}$|^\d{1,10}$", user.split(":")[0]):
            raise InvalidArgument(f"{where}: user {user!r} is not a user name or uid")
        return Step("user", (user,), where)
    raise InvalidArgument(f"{where}: unknown step {kind!r}; steps are {', '.join(KINDS)}")


def from_mapping(data: Any, name: str, tag: str, context: Path, source: str = "steps file") -> TemplateSpec:
    """A template from the parsed steps file (``data``)."""
    if not isinstance(data, Mapping):
        raise InvalidArgument(
            f"{source}: expected a mapping with 'steps' (and optional 'from', 'start_cmd', 'ready_cmd')"
        )
    unknown = set(data) - {"from", "steps", "start_cmd", "ready_cmd"}
    if unknown:
        raise InvalidArgument(f"{source}: unknown keys {sorted(unknown)} (from, steps, start_cmd, ready_cmd)")
    base = data.get("from") or RUNTIME
    if base != RUNTIME:
        split_ref(str(base), "from")
    raw_steps = data.get("steps") or []
    if not isinstance(raw_steps, list):
        raise InvalidArgument(f"{source}: steps must be a list")
    if len(raw_steps) > MAX_STEPS:
        raise InvalidArgument(f"{source}: {len(raw_steps)} steps; at most {MAX_STEPS}")
    steps = []
    for i, raw in enumerate(raw_steps, 1):
        where = f"{source} step {i}"
        if not isinstance(raw, Mapping) or len(raw) != 1:
            raise InvalidArgument(
                f"{where}: each step is one mapping such as '- run: echo hi' (one of {', '.join(KINDS)})"
            )
        ((kind, value),) = raw.items()
        steps.append(make_step(str(kind), value, where))
    start = data.get("start_cmd") or ""
    ready = data.get("ready_cmd") or ""
    if start:
        _text(start, source, "start_cmd")
    if ready:
        _text(ready, source, "ready_cmd")
    if ready and not start:
        raise InvalidArgument(f"{source}: ready_cmd needs a start_cmd (it checks that the start command is ready)")
    return TemplateSpec(name, tag, str(base), tuple(steps), start, ready, context)


def parse_steps_file(path: Path, ref: str) -> TemplateSpec:
    """A template named ``ref`` from a steps file (YAML or JSON) or a Dockerfile."""
    name, tag = split_ref(ref)
    if not path.is_file():
        raise InvalidArgument(f"-f {path}: no such file")
    text = path.read_text(errors="replace")
    if (
        path.name.lower().startswith("dockerfile")
        or path.suffix.lower() == ".dockerfile"
        or _looks_like_dockerfile(text)
    ):
        return parse_dockerfile(text, name, tag, path.parent.resolve(), source=str(path))
    import yaml

    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise InvalidArgument(f"-f {path}: not valid YAML: {exc}") from None
    return from_mapping(data, name, tag, path.parent.resolve(), source=str(path))


def _looks_like_dockerfile(text: str) -> bool:
    for line in text.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            return line.upper().startswith("FROM ")
    return False


_ARG_IN_FROM = re.compile(r"\$\{?[A-Za-z_]")


def dockerfile_lines(text: str) -> list[tuple[int, str]]:
    """A Dockerfile's instructions, each with the number of its first line (continuations joined,
    comments and blank lines left out)."""
    lines: list[tuple[int, str]] = []
    pending, first = "", 0
    for number, raw in enumerate(text.splitlines(), 1):
        stripped = raw.strip()
        if not pending and (not stripped or stripped.startswith("#")):
            continue
        if not pending:
            first = number
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        lines.append((first, pending + stripped))
        pending = ""
    if pending:
        lines.append((first, pending))
    return lines


def parse_dockerfile(text: str, name: str, tag: str, context: Path, source: str = "Dockerfile") -> TemplateSpec:
    """The Dockerfile instructions a template can hold: FROM (the runtime image or a template),
    RUN, COPY/ADD of local files (``--chmod``, ``--chown`` numeric), ENV, WORKDIR, USER, CMD (the
    start command). What a template cannot have is refused with why."""
    lines = dockerfile_lines(text)
    base: str | None = None
    steps: list[Step] = []
    start = ""
    for number, line in lines:
        where = f"{source} line {number}"
        word, _, rest = line.partition(" ")
        word, rest = word.upper(), rest.strip()
        if base is None and word != "FROM":
            raise InvalidArgument(f"{where}: a Dockerfile starts with FROM (the runtime image or a template)")
        if word == "FROM":
            if base is not None:
                raise InvalidArgument(f"{where}: one FROM only (multi-stage builds are not supported)")
            base = _dockerfile_base(rest.split()[0] if rest else "", where)
        elif word == "RUN":
            if rest.startswith("["):
                rest = shlex.join(json_list(rest, where))
            steps.append(make_step("run", rest, where))
        elif word in ("COPY", "ADD"):
            steps.append(_dockerfile_copy(word, rest, where))
        elif word == "ENV":
            steps.append(make_step("env", dockerfile_env(rest, where), where))
        elif word == "WORKDIR":
            steps.append(make_step("workdir", rest, where))
        elif word == "USER":
            steps.append(make_step("user", rest, where))
        elif word in ("CMD", "ENTRYPOINT"):
            start = shlex.join(json_list(rest, where)) if rest.startswith("[") else rest
        elif word in (
            "LABEL",
            "EXPOSE",
            "ARG",
            "SHELL",
            "STOPSIGNAL",
            "VOLUME",
            "HEALTHCHECK",
            "ONBUILD",
            "MAINTAINER",
        ):
            raise InvalidArgument(
                f"{where}: {word} is not supported in a template (supported: FROM, RUN, COPY, ADD of local "
                "files, ENV, WORKDIR, USER, CMD)"
            )
        else:
            raise InvalidArgument(f"{where}: unknown instruction {word}")
    if base is None:
        raise InvalidArgument(f"{source}: empty Dockerfile (it needs FROM the runtime image or a template)")
    if len(steps) > MAX_STEPS:
        raise InvalidArgument(f"{source}: {len(steps)} steps; at most {MAX_STEPS}")
    return TemplateSpec(name, tag, base, tuple(steps), start, "", context)


def _dockerfile_base(image: str, where: str) -> str:
    from sandloop.settings import runtime_image

    if not image or _ARG_IN_FROM.search(image):
        raise InvalidArgument(f"{where}: FROM needs an image name (build arguments are not supported)")
    runtime = runtime_image()
    if image in (RUNTIME, runtime, "sandloop-runtime", "sandloop-runtime:latest") or image == runtime.split(":")[0]:
        return RUNTIME
    if image.startswith(TEMPLATE_REPO_PREFIX):
        image = image[len(TEMPLATE_REPO_PREFIX) :]
    if "/" in image or "@" in image:
        raise InvalidArgument(
            f"{where}: FROM {image}: sandloop builds offline and pulls from no registry; start FROM "
            f"{runtime} (the runtime image) or a template built here (sandloop templates ls)"
        )
    split_ref(image, "FROM")
    return image


#: Docker repository of template images: "sandloop-template-NAME:TAG".
TEMPLATE_REPO_PREFIX = "sandloop-template-"


def json_list(text: str, where: str) -> list[str]:
    try:
        value = json.loads(text)
    except ValueError:
        value = None
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise InvalidArgument(f"{where}: expected a JSON list of strings")
    return value


def _dockerfile_copy(word: str, rest: str, where: str) -> Step:
    parts = shlex.split(rest)
    mode = owner = ""
    while parts and parts[0].startswith("--"):
        flag, _, value = parts.pop(0).partition("=")
        if flag == "--chmod":
            mode = value
        elif flag == "--chown":
            owner = value
        else:
            raise InvalidArgument(f"{where}: {word} {flag} is not supported (--chmod, --chown)")
    if len(parts) != 2:
        raise InvalidArgument(f"{where}: {word} takes one local source and one destination")
    src, dest = parts
    if "://" in src:
        raise InvalidArgument(f"{where}: {word} from a URL is refused: a build reaches no host; copy local files")
    return make_step("copy", {"src": src, "dest": dest, "mode": mode, "owner": owner}, where)


def dockerfile_env(rest: str, where: str) -> dict[str, str]:
    parts = shlex.split(rest)
    if len(parts) >= 2 and "=" not in parts[0]:
        return {parts[0]: " ".join(parts[1:])}
    out = {}
    for part in parts:
        key, eq, value = part.partition("=")
        if not eq:
            raise InvalidArgument(f"{where}: ENV takes NAME=value pairs")
        out[key] = value
    return out

"""E2B's template build API on sandloop's templates (``images/templates/``): E2B's Template SDK
(``Template.build``, ``build_in_background``, ``get_build_status``, ``exists``, tags, delete)
drives it unchanged, and ``Sandbox.create("name:tag")`` starts from what it built.

    POST /v3/templates                               request a build: templateID (the name), buildID
    GET  /templates/{id}/files/{hash}                is a COPY's archive here? else a signed upload URL
    PUT  /templates/{id}/files/{hash}/upload?...     the archive (signed URL: no API key)
    POST /v2/templates/{id}/builds/{build}           the steps: translated and built in the background
    GET  /templates/{id}/builds/{build}/status       status, log entries from logsOffset, reason
    GET  /templates/aliases/{alias}                  exists?
    POST|DELETE /templates/tags, GET /templates/{id}/tags, DELETE /templates/{id}, GET /templates

Translation: E2B's steps are Dockerfile-like (RUN, COPY, ENV, WORKDIR, USER). A build reaches no
host, so the commands the SDK writes for ``pip_install``, ``npm_install`` and ``apt_install``
become sandloop's helper steps (the host fetches, the sandboxed step installs); any other RUN runs
as written, without network. E2B's "user" is the sandbox's user (uid 65534). What cannot be had is
refused in E2B's error shape: a registry pull (``from_image`` of anything but E2B's base, private
registry credentials), ``pip install .``/``npm install`` from a project file, MCP servers.
Builds and their logs live in this process (a restarted server answers 404 for an old build id);
templates themselves are images and survive.
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import json
import re
import shutil
import tarfile
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sandloop.contract import InvalidArgument, SandboxError, TemplateNotFound
from sandloop.images.templates import BuildEvent, TemplateSpec, split_ref
from sandloop.images.templates.build import scratch
from sandloop.images.templates.spec import RUNTIME, Step, make_step
from sandloop.paths import write_atomically
from sandloop.server.e2b.service import TEMPLATES, E2BError
from sandloop.server.e2b.template_steps import (
    E2B_HOME,
    E2B_USER,
    NOT_HERE,
    SANDBOX_USER,
    absolute,
    helper_step,
    inside_folder,
    stage_copy,
    step_user,
)
from sandloop.server.e2b.template_uploads import FILES_HASH, TemplateUploads, touch

if TYPE_CHECKING:
    from sandloop.server.e2b.service import E2B
    from sandloop.server.tokens import Token

#: Every /templates... and /v<N>/templates... path is E2B's template API.
TEMPLATE_PATH = re.compile(r"^/(v\d+/)?templates(/|$)")
#: Images E2B's SDK starts from that are sandloop's runtime image here.
E2B_BASE_IMAGES = ("e2bdev/base", "e2bdev/code-interpreter", "e2bdev/desktop")


def now_iso() -> str:
    return datetime.datetime.now(datetime.UTC).isoformat().replace("+00:00", "Z")


@dataclass
class Build:
    build_id: str
    template_id: str
    token_id: str
    name: str
    tag: str
    tags: list[str]
    status: str = "waiting"  # waiting -> building -> ready | error
    logs: list[dict[str, Any]] = field(default_factory=list)
    reason: dict[str, Any] | None = None
    image_id: str = ""
    created: float = field(default_factory=time.time)

    def log(self, message: str, level: str = "info") -> None:
        self.logs.append({"timestamp": now_iso(), "level": level, "message": message})
        del self.logs[:-10_000]  # bounded


#: Finished builds kept in memory; older ones are read back from their records (``records``).
IN_MEMORY = 64
#: Build records kept on disk per API key (the oldest finished ones go first).
KEPT_PER_KEY = 200
#: Log lines a build record keeps (the newest).
RECORD_LOG_LINES = 2_000
FINISHED = ("ready", "error")


class E2BTemplates:
    def __init__(self, e2b: E2B) -> None:
        self.e2b = e2b
        self.root = e2b.api.root
        #: Each key's uploaded COPY archives (template_uploads.py).
        self.uploads = TemplateUploads(e2b, self.root.settings.home / "e2b-template-files")
        #: One JSON record per build, so its status and log outlive the server (a restart).
        self.records = self.root.settings.home / "e2b-builds"
        self._builds: dict[str, Build] = {}
        self._lock = threading.Lock()
        self._running = threading.BoundedSemaphore(2)

    # -- build records ------------------------------------------------------------------------
    def _record_path(self, build_id: str) -> Path | None:
        try:
            return self.records / f"{uuid.UUID(build_id)}.json"
        except (ValueError, TypeError):
            return None  # not a build id (never a path: it comes from the URL)

    def _save(self, build: Build) -> None:
        """The build's record on disk (its log's newest lines); the oldest finished records of
        its key beyond ``KEPT_PER_KEY`` go, and finished builds beyond ``IN_MEMORY`` leave memory."""
        path = self._record_path(build.build_id)
        if path is None:
            return
        record = {**dataclasses.asdict(build), "logs": build.logs[-RECORD_LOG_LINES:]}
        self.records.mkdir(parents=True, exist_ok=True, mode=0o700)
        write_atomically(path, json.dumps(record))
        if build.status in FINISHED:
            self._prune(build.token_id)
            with self._lock:
                done = sorted((b for b in self._builds.values() if b.status in FINISHED), key=lambda b: b.created)
                for old in done[: max(0, len(done) - IN_MEMORY)]:
                    self._builds.pop(old.build_id, None)

    def _prune(self, token_id: str) -> None:
        mine = [(float(record["created"]), path) for record, path in self._finished(token_id)]
        for _, path in sorted(mine)[: max(0, len(mine) - KEPT_PER_KEY)]:
            path.unlink(missing_ok=True)

    def _finished(self, token_id: str) -> Iterator[tuple[dict[str, Any], Path]]:
        """This key's finished builds' records on disk, with their paths."""
        for path in self.records.glob("*.json") if self.records.is_dir() else ():
            try:
                record = json.loads(path.read_text())
                float(record["created"])  # a record without its time is not one of ours
                mine = record["token_id"] == token_id and record["status"] in FINISHED
            except (OSError, ValueError, KeyError, TypeError):
                continue
            if mine:
                yield record, path

    def _load(self, build_id: str) -> Build | None:
        """A build from its record; one a server stopped in the middle of is an error that says so."""
        path = self._record_path(build_id)
        if path is None:
            return None
        try:
            build = Build(**json.loads(path.read_text()))
        except (OSError, ValueError, TypeError):
            return None
        if build.status not in FINISHED:
            message = "the server stopped during this build: start a new build (its finished steps are cached)"
            build.log(message, "error")
            build.status, build.reason = "error", {"message": message}
        return build

    # -- names --------------------------------------------------------------------------------
    def _ref(self, name: str) -> tuple[str, str]:
        try:
            return split_ref(name.strip().lower() if isinstance(name, str) else name, "template")
        except InvalidArgument as exc:
            raise E2BError(400, str(exc)) from None

    def _build(self, token: Token, template_id: str, build_id: str) -> Build:
        with self._lock:
            build = self._builds.get(build_id)
        if build is None:
            build = self._load(build_id)
        if build is None or build.token_id != token.id or build.template_id != template_id:
            raise E2BError(404, f"build {build_id} of template {template_id} not found")
        return build

    # -- request, files, start ----------------------------------------------------------------
    def request(self, token: Token, body: dict[str, Any]) -> dict[str, Any]:
        raw = body.get("name") or body.get("alias")
        if not isinstance(raw, str):
            raise E2BError(400, "name is required, e.g. 'my-template' or 'my-template:v1'")
        name, tag = self._ref(raw)
        if name in TEMPLATES:
            raise E2BError(400, f"{name} is a built-in template here: choose another name")
        extra = body.get("tags") or []
        if not isinstance(extra, list) or not all(isinstance(t, str) for t in extra) or len(extra) > 32:
            raise E2BError(400, "tags must be a list of strings")
        tags = [tag, *[self._tag(t) for t in extra if t != tag]]
        build = Build(str(uuid.uuid4()), name, token.id, name, tag, tags)
        with self._lock:
            mine = [b for b in self._builds.values() if b.token_id == token.id and b.status in ("waiting", "building")]
            if len(mine) >= 4:
                raise E2BError(429, "this key has 4 template builds under way: wait for one to finish")
            self._builds[build.build_id] = build
        self._save(build)
        return {
            "templateID": name,
            "buildID": build.build_id,
            "public": False,
            "names": [name],
            "aliases": [name],
            "tags": tags,
        }

    def _tag(self, tag: str) -> str:
        if not re.match(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$", tag):
            raise E2BError(400, f"tag {tag!r} is not valid: letters, digits, '_', '.', '-'")
        return tag

    def start(self, token: Token, template_id: str, build_id: str, body: dict[str, Any]) -> None:
        build = self._build(token, template_id, build_id)
        if build.status != "waiting":
            raise E2BError(409, f"build {build_id} was already started")
        context = scratch("e2b-")
        try:
            spec, force = self.translate(token, build, body, context)
        except BaseException:
            shutil.rmtree(context, ignore_errors=True)
            with self._lock:
                self._builds.pop(build_id, None)
            path = self._record_path(build_id)
            if path is not None:
                path.unlink(missing_ok=True)
            raise
        build.status = "building"
        self._save(build)
        threading.Thread(
            target=self._run, args=(token, build, spec, force, context), name="sandloop-e2b-build", daemon=True
        ).start()

    def _run(self, token: Token, build: Build, spec: TemplateSpec, force: bool, context: Path) -> None:
        from sandloop.server.templates import build_limits

        def event(e: BuildEvent) -> None:
            if e.line:
                build.log(e.line)
            else:
                build.log(f"[{e.step}/{e.steps}] {e.description}" + (" (cached)" if e.cached else ""))

        try:
            with self._running:
                build.log(f"Building {spec.ref} (sandloop: steps run sandboxed, without network)")
                result = self.root.templates.build(
                    spec, force=force, limits=build_limits(token), on_event=event, owner=token.id
                )
                builder = self.root.templates.builder
                for tag in build.tags[1:]:
                    builder.tag(result.image_id, f"sandloop-template-{build.name}", tag)
            build.image_id = result.image_id
            build.log(f"Built {spec.ref} in {result.seconds:.1f} s")
            build.status = "ready"
        except SandboxError as exc:
            step = getattr(exc, "step", 0)
            build.log(str(exc), "error")
            build.reason = {
                "message": str(exc),
                **({"step": str(step)} if step else {}),
                "logEntries": build.logs[-20:],
            }
            build.status = "error"
        except Exception as exc:  # noqa: BLE001 - a build thread must record, not die
            build.log(f"internal error: {exc!r}", "error")
            build.reason = {"message": f"the build failed: {exc}"}
            build.status = "error"
        finally:
            shutil.rmtree(context, ignore_errors=True)
            self._save(build)

    def status(self, token: Token, template_id: str, build_id: str, offset: int) -> dict[str, Any]:
        build = self._build(token, template_id, build_id)
        entries = build.logs[max(0, offset) : max(0, offset) + 100]
        out: dict[str, Any] = {
            "templateID": template_id,
            "buildID": build_id,
            "status": build.status,
            "logEntries": entries,
            "logs": [e["message"] for e in entries],
        }
        if build.reason is not None:
            out["reason"] = build.reason
        return out

    # -- translation --------------------------------------------------------------------------
    def translate(self, token: Token, build: Build, body: dict[str, Any], context: Path) -> tuple[TemplateSpec, bool]:
        """E2B's build body as sandloop template steps (COPY archives unpacked under ``context``)."""
        if body.get("fromImageRegistry"):
            raise E2BError(400, "private registry credentials are not supported: sandloop pulls from no registry")
        base = RUNTIME
        if body.get("fromTemplate"):
            base = self._from_template(token, str(body["fromTemplate"]))
        elif body.get("fromImage"):
            image = str(body["fromImage"])
            if image.split(":")[0] not in E2B_BASE_IMAGES:
                raise E2BError(
                    400,
                    f"from_image({image!r}): sandloop builds offline and pulls from no registry, and runs only "
                    "images that hold its launcher: start from_base_image(), from_template('base') or one of "
                    "your templates",
                )
        steps_in = body.get("steps") or []
        if not isinstance(steps_in, list) or len(steps_in) > 200:
            raise E2BError(400, "steps must be a list of at most 200")
        steps: list[Step] = []
        user, workdir = E2B_USER, E2B_HOME
        steps.append(make_step("user", SANDBOX_USER, "base"))
        steps.append(make_step("workdir", E2B_HOME, "base"))
        force = bool(body.get("force"))
        for number, raw in enumerate(steps_in, 1):
            where = f"step {number}"
            if not isinstance(raw, dict):
                raise E2BError(400, f"{where}: expected an object")
            kind, args = str(raw.get("type", "")).upper(), raw.get("args") or []
            force = force or bool(raw.get("force"))
            if not isinstance(args, list) or not all(isinstance(a, str) for a in args):
                raise E2BError(400, f"{where}: args must be a list of strings")
            try:
                if kind == "RUN":
                    run_user = args[1] if len(args) > 1 and args[1] else user
                    steps += self._run_steps(args[0] if args else "", run_user, user, where)
                elif kind == "COPY":
                    steps.append(self._copy(token, raw, args, workdir, context, where))
                elif kind == "ENV":
                    if len(args) % 2:
                        raise E2BError(400, f"{where}: ENV takes name, value pairs")
                    steps.append(make_step("env", dict(zip(args[::2], args[1::2], strict=True)), where))
                elif kind == "WORKDIR":
                    workdir = absolute(args[0] if args else "", workdir)
                    steps.append(make_step("workdir", workdir, where))
                elif kind == "USER":
                    user = args[0] if args else E2B_USER
                    steps.append(make_step("user", step_user(user), where))
                else:
                    raise E2BError(400, f"{where}: {kind or 'a step without a type'} is not supported")
            except InvalidArgument as exc:
                raise E2BError(400, str(exc)) from None
        start, ready = str(body.get("startCmd") or ""), str(body.get("readyCmd") or "")
        if re.fullmatch(r"\s*sleep\s+[0-9.]+\s*", ready):
            ready = ""  # E2B waits once, at build time; here the command starts with each sandbox
        spec = TemplateSpec(build.name, build.tag, base, tuple(steps), start, ready if start else "", context)
        return spec, force

    def _from_template(self, token: Token, name: str) -> str:
        if name.split(":")[0] in TEMPLATES:
            return RUNTIME
        why = NOT_HERE.get(name.split(":")[0])
        if why:
            raise E2BError(400, f"from_template({name!r}): {why}")
        try:
            self.root.templates.image_for(name, owner=token.id)
        except InvalidArgument as exc:
            raise E2BError(400, str(exc)) from None
        except TemplateNotFound:
            raise E2BError(404, f"template {name} not found") from None
        return name

    def _run_steps(self, command: str, run_user: str, user: str, where: str) -> list[Step]:
        """One E2B RUN as steps: the package installs the SDK writes become helper steps."""
        out: list[Step] = []
        wrap = run_user != user
        if wrap:
            out.append(make_step("user", step_user(run_user), where))
        plain: list[str] = []

        def flush() -> None:
            if plain:
                out.append(make_step("run", " && ".join(plain), where))
                plain.clear()

        for part in (p.strip() for p in command.split("&&")):
            helper = helper_step(part, where)
            if isinstance(helper, str):  # "skip"
                continue
            if helper is not None:
                flush()
                out.append(helper)
            else:
                plain.append(part)
        flush()
        if wrap:
            out.append(make_step("user", step_user(user), where))
        return out

    def _copy(
        self, token: Token, raw: dict[str, Any], args: list[str], workdir: str, context: Path, where: str
    ) -> Step:
        if len(args) < 2:
            raise E2BError(400, f"{where}: COPY takes a source and a destination")
        files_hash = str(raw.get("filesHash") or "")
        archive = self.uploads.archive(token.id, files_hash) if FILES_HASH.match(files_hash) else None
        if archive is None or not touch(archive):
            raise E2BError(400, f"{where}: the files of COPY {args[0]} were not uploaded (hash {files_hash})")
        unpacked = context / files_hash
        if not unpacked.exists():
            unpacked.mkdir()
            try:
                with tarfile.open(archive) as tar:  # gzip or not
                    tar.extractall(unpacked, filter=inside_folder)
            except (tarfile.TarError, OSError) as exc:
                raise E2BError(400, f"{where}: the uploaded archive of {args[0]} is not a tar: {exc}") from None
        stage = context / f"stage-{where.replace(' ', '-')}"
        src = stage_copy(unpacked, args[0], stage, where, into_folder=args[1].endswith("/"))
        dest = absolute(args[1], workdir)
        owner = step_user(args[2]) if len(args) > 2 and args[2] else SANDBOX_USER
        if not re.fullmatch(r"\d+(:\d+)?", owner):
            owner = "0:0"
        mode = args[3] if len(args) > 3 and args[3] else ""
        return make_step("copy", {"src": src, "dest": dest, "owner": owner, "mode": mode}, where)

    # -- names, tags, delete ------------------------------------------------------------------
    def alias(self, token: Token, alias: str) -> dict[str, Any]:
        name = alias.split(":")[0]
        if name in TEMPLATES:
            return {"templateID": name, "public": True}
        try:
            self.root.templates.get(alias if ":" in alias else f"{alias}:latest", owner=token.id)
        except (TemplateNotFound, InvalidArgument):
            if not any(t.name == name for t in self.root.templates.list(owner=token.id)):
                raise E2BError(404, f"template {alias} not found") from None
        return {"templateID": name, "public": False}

    def _build_of(self, image_id: str) -> str:
        with self._lock:
            for build in self._builds.values():
                if build.image_id == image_id:
                    return build.build_id
        return str(uuid.UUID(hashlib.sha256(image_id.encode()).hexdigest()[:32]))  # stable for one image

    def assign_tags(self, token: Token, body: dict[str, Any]) -> dict[str, Any]:
        target, tags = body.get("target"), body.get("tags")
        if not isinstance(target, str) or not isinstance(tags, list) or not tags:
            raise E2BError(400, 'send {"target": "name:tag", "tags": ["production"]}')
        name, tag = self._ref(target)
        info = self._mine(token, f"{name}:{tag}")
        wanted = []
        for raw in tags:
            if not isinstance(raw, str):
                raise E2BError(400, "tags must be strings")
            tag_name, colon, tag_only = raw.rpartition(":")
            if colon and (not tag_name or not tag_only or tag_name != name):
                raise E2BError(400, f"tag {raw!r} is not valid: 'tag' or '{name}:tag'")
            wanted.append(self._tag(tag_only if colon else raw))
        for t in wanted:
            self.root.templates.builder.tag(info.image_id, f"sandloop-template-{name}", t)
        return {"buildID": self._build_of(info.image_id), "tags": wanted}

    def remove_tags(self, token: Token, body: dict[str, Any]) -> None:
        name, tags = body.get("name"), body.get("tags")
        if not isinstance(name, str) or not isinstance(tags, list):
            raise E2BError(400, 'send {"name": "my-template", "tags": ["production"]}')
        for tag in tags:
            self._remove(token, f"{self._ref(name)[0]}:{self._tag(str(tag))}")

    def tags(self, token: Token, template_id: str) -> list[dict[str, Any]]:
        name = self._ref(template_id)[0]
        found = [t for t in self.root.templates.list(owner=token.id) if t.name == name]
        if not found:
            raise E2BError(404, f"template {template_id} not found")
        return [{"tag": t.tag, "buildID": self._build_of(t.image_id), "createdAt": t.created} for t in found]

    def delete(self, token: Token, template_id: str) -> None:
        """The template (every tag) and its finished builds' records, as E2B deletes a template
        with its builds; one whose builds all failed has only records, and is deleted too."""
        name = self._ref(template_id)[0]
        found = [t for t in self.root.templates.list(owner=token.id) if t.name == name and t.owner == token.id]
        records = self._finished_records(token.id, name)
        if not found and not records:
            raise E2BError(404, f"template {template_id} not found")
        for info in found:
            self._remove(token, info.ref)
        with self._lock:
            for build_id in records:
                self._builds.pop(build_id, None)
        for path in records.values():
            path.unlink(missing_ok=True)

    def _finished_records(self, token_id: str, name: str) -> dict[str, Path]:
        """This key's finished builds of template ``name`` on disk: build id -> record."""
        return {str(r.get("build_id")): path for r, path in self._finished(token_id) if r.get("name") == name}

    def _mine(self, token: Token, ref: str) -> Any:
        try:
            info = self.root.templates.get(ref, owner=token.id)
        except TemplateNotFound:
            raise E2BError(404, f"template {ref} not found") from None
        if info.owner != token.id:
            raise E2BError(403, f"template {ref} is the host's own")
        return info

    def _remove(self, token: Token, ref: str) -> None:
        self._mine(token, ref)
        try:
            self.root.templates.remove(ref, owner=token.id)
        except SandboxError as exc:
            raise E2BError(409 if exc.code == "template_in_use" else 400, str(exc)) from None

    def list(self, token: Token) -> list[dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for t in self.root.templates.list(owner=token.id):
            entry = out.setdefault(
                t.name,
                {
                    "templateID": t.name,
                    "buildID": self._build_of(t.image_id),
                    "aliases": [t.name],
                    "names": [t.name],
                    "public": t.owner == "",
                    "createdAt": t.created,
                    "updatedAt": t.created,
                    "cpuCount": 1,
                    "memoryMB": 512,
                    "diskSizeMB": t.size_bytes >> 20,
                    "buildStatus": "ready",
                    "buildCount": 1,
                    "spawnCount": 0,
                    "tags": [],
                },
            )
            entry["tags"].append(t.tag)
        return list(out.values())

"""``Session``: one sandbox identity whose ``/workspace`` persists across runs, with a stateful
Python interpreter and a file API.

    with Session(ttl=3600) as s:
        s.write_file("data.csv", "x,y\\n1,2\\n")
        s.run_cell("import pandas as pd; df = pd.read_csv('data.csv')")
        print(s.run_cell("df.y.sum()").value)

Each ``run`` is a fresh single-use sandbox (warm-pooled) with the workspace mounted; ``run_cell``
goes to the session's long-lived interpreter. File operations run inside a sandbox too, so a
symlink made by code in the workspace can never reach a host file. ``with`` deletes the session
at the end; ``Session.create()`` + ``Session.attach(id)`` keep it across processes until
``delete()`` or until it has been idle for ``ttl`` seconds.
"""

from __future__ import annotations

import base64
import builtins
import concurrent.futures
import contextlib
import io
import json
import logging
import math
import os
import re
import shutil
import tarfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, replace
from importlib import resources
from pathlib import Path, PurePosixPath
from typing import Any

from sandloop.contract import (
    CellResult,
    CodeContext,
    ContextNotFound,
    ExecutionResult,
    InvalidArgument,
    Output,
    PathRefused,
    SandboxError,
    SandboxLimits,
    SessionNotPaused,
    SessionPaused,
    TooLarge,
    WorkspaceFileNotFound,
    WorkspaceFull,
    parse_size,
)
from sandloop.contract.egress import Secret
from sandloop.requests import build_request, check_secrets, check_timeout
from sandloop.runtime.base import Sandbox, SandboxSpec
from sandloop.sessions.host import SessionHost, default_host
from sandloop.sessions.kernel import Kernel, interpreter_spec, lock_file
from sandloop.sessions.snapshots import (
    LOAD_STATE,
    PAUSED,
    SAVE_STATE,
    STATE_FILE,
    ClusterSnapshots,
    SnapshotRecord,
    SnapshotStore,
    copy_files,
    memory_backend,
    new_snapshot_id,
    place_file,
    take_file,
    validate_count,
)
from sandloop.sessions.store import SESSION_LABEL, WORKSPACE, SessionRecord
from sandloop.sessions.watch import Watcher, check_watchable

MAX_TTL_SECONDS = 30 * 86400
#: What ``language=`` of a cell or a context may say, and the interpreter it names.
CONTEXT_LANGUAGES = {
    "python": "python",
    "python3": "python",
    "py": "python",
    "javascript": "javascript",
    "js": "javascript",
    "node": "javascript",
    "typescript": "typescript",
    "ts": "typescript",
    "bash": "bash",
    "sh": "bash",
    "shell": "bash",
}
MIN_QUOTA_BYTES, MAX_QUOTA_BYTES = 8 * 1024**2, 64 * 1024**3
MAX_READ_BYTES = 16 * 1024 * 1024
MAX_WRITE_BYTES = 64 * 1024 * 1024
MAX_UPLOAD_BYTES = 64 * 1024 * 1024
DEFAULT_QUOTA = "256m"
_HELPER = resources.files("sandloop.sessions").joinpath("files_helper.py").read_text()

log = logging.getLogger(__name__)


def check_path(path: str) -> str:
    """A workspace-relative POSIX path; refuses absolute paths outside /workspace and ``..``."""
    if not isinstance(path, str) or "\0" in path:
        raise PathRefused(f"invalid path {path!r}")
    p = path.strip()
    if p.startswith(WORKSPACE + "/") or p == WORKSPACE:
        p = p[len(WORKSPACE) :].lstrip("/")
    if p.startswith("/"):
        raise PathRefused(f"absolute path {path!r} is outside the workspace; use a path relative to {WORKSPACE}")
    parts = [x for x in PurePosixPath(p).parts if x != "."]
    if ".." in parts:
        raise PathRefused(f"path {path!r} climbs out of the workspace ('..' is not allowed)")
    return "/".join(parts) or "."


#: A metadata key: an HTTP header token (E2B's SDKs send each as an ``X-Metadata-<key>`` header).
_METADATA_KEY = re.compile(r"\A[A-Za-z0-9!#$%&'*+\-.^_`|~]+\Z")
_METADATA_VALUE = re.compile(r"\A[\x20-\x7e]*\Z")
#: ext4 keeps a file's extended attributes in at most one 4 KiB block beside its inode.
MAX_METADATA_BYTES = 2048


def check_metadata(metadata: Mapping[str, str]) -> dict[str, str]:
    """A file's metadata as it is kept: keys lowercased, each an HTTP token, values printable
    ASCII, 2 KiB in all. ``InvalidArgument`` says which entry is wrong."""
    if not isinstance(metadata, Mapping):
        raise InvalidArgument("metadata must be a mapping of strings to strings")
    out: dict[str, str] = {}
    for key, value in metadata.items():
        if not isinstance(key, str) or not _METADATA_KEY.match(key):
            raise InvalidArgument(
                f"invalid metadata key {key!r}: use letters, digits and !#$%&'*+-.^_`|~ (no spaces, not empty)"
            )
        if not isinstance(value, str) or not _METADATA_VALUE.match(value):
            raise InvalidArgument(f"invalid metadata value for {key!r}: values are printable ASCII, one line")
        out[key.lower()] = value
    if sum(len(k) + len(v) + 9 for k, v in out.items()) > MAX_METADATA_BYTES:
        raise InvalidArgument(f"metadata takes at most {MAX_METADATA_BYTES} bytes in all (keys and values)")
    return out


class Session:
    """A persistent workspace plus a stateful interpreter. See the module docstring."""

    def __init__(
        self,
        limits: SandboxLimits | None = None,
        ttl: float = 3600,
        quota: str | int = DEFAULT_QUOTA,
        *,
        root: SessionHost | None = None,
        template: str | None = None,
        _record: SessionRecord | None = None,
    ) -> None:
        created_here = _record is None
        warm: Sandbox | None = None
        self._root = root or default_host()
        self._dispatcher = self._root.dispatcher
        self._store = self._root.sessions
        if _record is None:
            limits = limits or SandboxLimits()
            if not isinstance(limits, SandboxLimits):
                raise InvalidArgument("limits must be a SandboxLimits")
            if (
                isinstance(ttl, bool)
                or not isinstance(ttl, int | float)
                or not math.isfinite(ttl)
                or not 1 <= ttl <= MAX_TTL_SECONDS
            ):
                raise InvalidArgument(f"ttl must be between 1 second and 30 days, got {ttl!r}")
            try:
                quota_bytes = parse_size(quota)
            except ValueError as exc:
                raise InvalidArgument(str(exc)) from None
            if not MIN_QUOTA_BYTES <= quota_bytes <= MAX_QUOTA_BYTES:
                raise InvalidArgument(f"quota must be between 8m and 64g, got {quota!r}")
            self._store.reap_expired()
            owner = limits.user if ":" in limits.user else f"{limits.user}:{limits.user}"
            image = self._root.image_for(template)  # TemplateNotFound before anything is made
            # Warm sessions run the runtime image: one from a template starts cold.
            reserve = self._root.reserves.take(limits, quota_bytes, owner) if template is None else None
            if reserve is not None:  # a warm one: its interpreter is started, pandas imported
                _record = self._store.claim(reserve.record, float(ttl))
                warm = reserve.sandbox
            else:
                _record = self._store.create(
                    ttl_seconds=float(ttl),
                    quota_bytes=quota_bytes,
                    image=image,
                    limits=limits.model_dump(),
                    owner_uid_gid=owner,
                )
        self._record = _record
        self.limits = SandboxLimits(**_record.limits)
        self._closed = False
        self._watchers: builtins.list[Watcher] = []
        self._watch_lock = threading.Lock()
        #: ``with`` releases what this call acquired: a session made here is deleted at the end
        #: of a ``with``; one attached to is only closed (it lives on for others).
        self._created_here = created_here
        #: Where the default contexts start when this handle starts them (None: the workspace);
        #: the E2B API sets /home/user, E2B's own default.
        self.default_cwd: str | None = None
        self._kernel = Kernel(
            self._root.backend,
            self._spec(kernel=True),
            self.id,
            lock_file(self._store.root / self.id),
            lifetime=_record.ttl_seconds,
        )
        if warm is not None:
            self._kernel.adopt(warm)
        if template is not None and created_here and self._root.templates.seeds_home(_record.image):
            try:
                self._seed_home()
            except BaseException:
                self.delete()
                raise

    # -- identity -------------------------------------------------------------------------------
    @classmethod
    def create(
        cls,
        limits: SandboxLimits | None = None,
        ttl: float = 3600,
        quota: str | int = DEFAULT_QUOTA,
        *,
        root: SessionHost | None = None,
        template: str | None = None,
    ) -> Session:
        """A new session; ``template`` ("name[:tag]") starts its sandboxes from a template."""
        return cls(limits, ttl, quota, root=root, template=template)

    @classmethod
    def attach(cls, session_id: str, *, root: SessionHost | None = None, resume: bool = True) -> Session:
        """Reattach to a live session by id (from any process on this host). A paused session
        resumes (unless ``resume=False``: then its calls raise ``SessionPaused`` until ``resume()``)."""
        root = root or default_host()
        record = root.sessions.load(session_id)
        root.sessions.ensure_workspace(record)
        root.sessions.touch(record)
        session = cls(root=root, _record=record)
        # Only a session paused (or one whose pause was cut short) needs the kernel's lock here:
        # taking it on every attach would wait for whatever cell another caller is running.
        if session.paused or (session._home / f".{PAUSED}").exists():
            with session._kernel.locked():
                session._recover()
                if resume and session.paused:  # attaching is using it: a paused session resumes
                    session.resume()
        return session

    @classmethod
    def list(cls, *, root: SessionHost | None = None) -> list[SessionRecord]:
        return (root or default_host()).sessions.list()

    @property
    def id(self) -> str:
        return self._record.id

    @property
    def record(self) -> SessionRecord:
        return self._record

    def _spec(self, kernel: bool = False) -> SandboxSpec:
        return interpreter_spec(self._record, kernel=kernel)

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError(
                f"session {self.id} is closed in this process; Session.attach({self.id!r}) to use it again"
            )

    def _live(self) -> None:
        self._check_open()
        # A session on another host (Ray): its node refuses a paused session's sandboxes, with no
        # call here for every cell to ask.
        if self._store.remote is None and self.paused:
            raise SessionPaused(f"session {self.id} is paused: resume it (resume(), or Session.attach) to use it")
        self._store.touch(self._record)

    # -- running --------------------------------------------------------------------------------
    def run(
        self,
        code: str | bytes,
        language: str = "python",
        timeout_seconds: float = 30,
        *,
        stdin: str | bytes | None = None,
        limits: SandboxLimits | None = None,
        secrets: Mapping[str, Secret] | None = None,
        on_output: Callable[[str, bytes], None] | None = None,
    ) -> ExecutionResult:
        """Run code in a fresh process with the workspace as its working directory
        (``on_output("stdout" | "stderr", data)`` sees output as it arrives)."""
        self._live()
        request = build_request(
            code,
            language,
            timeout_seconds,
            limits=limits or self.limits,
            stdin=stdin,
            image=self._record.image,
            secrets=secrets,
            on_output=on_output,
        )
        spec = self._spec()
        request = replace(request, image=spec.image, cwd=WORKSPACE, volumes=spec.volumes, labels=spec.labels)
        return self._dispatcher.run(request, pool_size=1)

    def run_cell(
        self,
        code: str,
        timeout_seconds: float = 30,
        *,
        secrets: Mapping[str, Secret] | None = None,
        on_output: Callable[[str, bytes], None] | None = None,
        cancel: threading.Event | None = None,
        output_limit: int | None = None,
        detach: bool = False,
        context: str | CodeContext | None = None,
        language: str | None = None,
        env: Mapping[str, str] | None = None,
        on_display: Callable[[Output], None] | None = None,
    ) -> CellResult:
        """Run a cell in one of the session's interpreters, with IPython's semantics for Python
        (``!cmd``, ``%magic``, ``display()``, rich outputs in ``result.outputs``): state persists
        between cells of a context. ``context`` (an id or a ``CodeContext``) picks one made by
        ``create_context``; else ``language`` (python, javascript, typescript, bash) picks that
        language's default context. ``env`` is set for this cell only. ``on_display(output)``
        sees each output as the cell displays it (``result.outputs`` has them all at the end).
        ``secrets`` as for ``run_code``: their placeholders are set for this cell only.
        ``on_output("stdout" | "stderr", data)`` sees output as it arrives; setting ``cancel``
        interrupts the cell (as its timeout would); ``output_limit`` replaces the session's
        (bytes of stdout and of stderr kept); ``detach`` lets go of the interpreter's stream after
        the cell (a long-lived holder of this Session, like a server, should: an idle stream would
        also receive other processes' cells)."""
        self._live()
        if not isinstance(code, str):
            raise InvalidArgument("a cell must be a string of code")
        options = self._cell_options(context, language, env)
        checked = check_secrets(secrets or {}, self.limits)
        relay = _relay(on_output, on_display)
        limits = self.limits
        if output_limit is not None:
            try:
                limits = SandboxLimits(**{**limits.model_dump(), "output_limit": output_limit})
            except SandboxError as exc:
                raise InvalidArgument(str(exc)) from None
        result = self._kernel.run(code, check_timeout(timeout_seconds), limits, checked, relay, cancel, detach, options)
        if result.error is not None and result.reply.get("refused"):
            self._op_reply(result, "a cell")
        return result

    def _cell_options(
        self, context: str | CodeContext | None, language: str | None, env: Mapping[str, str] | None
    ) -> dict[str, Any]:
        options: dict[str, Any] = {"default_cwd": self.default_cwd} if self.default_cwd else {}
        if context is not None:
            cid = context.id if isinstance(context, CodeContext) else context
            if not isinstance(cid, str) or not cid or len(cid) > 64:
                raise InvalidArgument(f"context must be a context id, got {context!r}")
            options["context"] = cid
        if language is not None:
            if not isinstance(language, str) or language.strip().lower() not in CONTEXT_LANGUAGES:
                known = ", ".join(sorted(set(CONTEXT_LANGUAGES.values())))
                raise InvalidArgument(f"language {language!r} has no interpreter; use one of: {known}")
            options["language"] = CONTEXT_LANGUAGES[language.strip().lower()]
        if env:
            if not all(isinstance(k, str) and isinstance(v, str) for k, v in env.items()):
                raise InvalidArgument("env must map names to strings")
            options["env"] = dict(env)
        return options

    # -- contexts -------------------------------------------------------------------------------
    def create_context(self, language: str = "python", cwd: str | None = None) -> CodeContext:
        """A new independent interpreter in this session's sandbox (``cwd`` defaults to the
        workspace). Its state is its own; files are shared."""
        if cwd is not None and (not isinstance(cwd, str) or not cwd.startswith("/")):
            raise InvalidArgument(f"cwd must be an absolute path inside the sandbox, got {cwd!r}")
        reply = self._context_op("create", "creating a context", language=language, cwd=cwd)
        return CodeContext(**reply["context"])

    def list_contexts(self) -> builtins.list[CodeContext]:
        """The session's contexts: the default Python and JavaScript ones, then those created."""
        return [CodeContext(**c) for c in self._context_op("list", "listing contexts")["contexts"]]

    def restart_context(self, context: str | CodeContext) -> CodeContext:
        """Replace a context's interpreter by a fresh one (its variables are gone)."""
        return CodeContext(**self._context_op("restart", "restarting a context", context=context)["context"])

    def remove_context(self, context: str | CodeContext) -> None:
        """End a context. A default one comes back, fresh, when next used."""
        self._context_op("remove", "removing a context", context=context)

    def _context_op(
        self,
        op: str,
        what: str,
        *,
        context: str | CodeContext | None = None,
        language: str | None = None,
        cwd: str | None = None,
    ) -> dict[str, Any]:
        """One operation on the interpreter's contexts (kernel.py's ``op`` frames): its reply."""
        self._live()
        options = {"op": op, "cwd": cwd, **self._cell_options(context, language, None)}
        return self._op_reply(self._kernel.run("", 30, self.limits, None, None, None, False, options), what)

    def _op_reply(self, result: CellResult, op: str) -> dict[str, Any]:
        if result.error is not None:
            if result.error.name == "ContextNotFound":
                raise ContextNotFound(f"{result.error.value}; list them with Session.list_contexts()")
            if result.error.name in ("InvalidArgument", "UnknownLanguage", "TooManyContexts"):
                raise InvalidArgument(result.error.value)
            raise SandboxError(f"{op} failed: {result.error.value}")
        if result.timed_out or result.sandbox_replaced:
            raise SandboxError(f"{op} failed: the session's interpreter did not answer")
        return result.reply

    def _seed_home(self) -> None:
        """The template's /home/user files into the new workspace, which is mounted over
        /home/user in every sandbox of the session: copied inside a sandbox that has the workspace
        at /workspace only (the template's own /home/user visible), as the session's user."""
        spec = self._spec()
        limits = self.limits.model_copy(update={"egress": (), "output_limit": 64 * 1024})
        copy = (  # each entry (not the folder itself: the workspace's root is not the sandbox user's to chmod)
            "find /home/user -mindepth 1 -maxdepth 1 -exec cp -R --preserve=mode,timestamps,links -t /workspace/ {} +"
        )
        request = build_request(copy, "bash", 300, limits=limits, image=self._record.image)
        volumes = tuple(v for v in spec.volumes if v[1] == WORKSPACE)
        request = replace(request, image=spec.image, cwd="/tmp", volumes=volumes, labels=spec.labels)
        result = self._dispatcher.run(request, pool_size=0)
        if result.exit_code != 0:
            raise SandboxError(
                f"could not copy the template's /home/user into the new session's workspace "
                f"(exit {result.exit_code}): {(result.stderr or result.stdout)[-500:]}; make its files readable "
                "by the sandbox's user (uid 65534), or fit them within the session's quota"
            )

    # -- files ----------------------------------------------------------------------------------
    def _files(self, op: str, args: dict[str, Any], data: bytes = b"", output: int = 1024 * 1024) -> dict[str, Any]:
        self._live()
        header = json.dumps({"op": op, **args}).encode() + b"\n"
        limits = self.limits.model_copy(update={"output_limit": output, "egress": ()})  # the helper needs none
        spec = self._spec()
        request = build_request(_HELPER, "python", 60, limits=limits, stdin=header + data, image=self._record.image)
        request = replace(request, image=spec.image, cwd=WORKSPACE, volumes=spec.volumes, labels=spec.labels)
        result = self._dispatcher.run(request, pool_size=1)
        if result.stdout_truncated or not result.stdout.startswith("{"):
            raise SandboxError(
                f"file operation {op} failed inside the sandbox: {result.stderr[-500:] or result.stdout[:200]}"
            )
        reply: dict[str, Any] = json.loads(result.stdout)
        if reply.get("ok"):
            return reply
        kind, message = reply.get("kind"), reply.get("error", "")
        if kind == "not_found":
            raise WorkspaceFileNotFound(message)
        if kind == "refused":
            raise PathRefused(message)
        if kind == "too_large":
            raise TooLarge(message)
        if kind == "is_directory":
            raise PathRefused(f"{message} (a directory where a file was expected; list a directory with list_files)")
        if kind == "no_space":
            raise WorkspaceFull(f"the workspace is full ({self._record.quota_bytes} byte quota): {message}")
        raise SandboxError(message)

    def write_file(self, path: str, content: bytes | str, *, metadata: Mapping[str, str] | None = None) -> int:
        """Write a file (replacing one there, and its metadata); its size. ``metadata``: strings
        kept with the file (its ``user.e2b.*`` extended attributes, as E2B keeps them), shown by
        ``stat``, ``list_files`` and ``move``; keys are lowercased (``check_metadata``)."""
        rel = check_path(path)
        data = content.encode() if isinstance(content, str) else bytes(content)
        if len(data) > MAX_WRITE_BYTES:
            raise TooLarge(f"{len(data)} bytes is over the {MAX_WRITE_BYTES}-byte cap for write_file; use upload")
        args: dict[str, Any] = {"path": rel}
        if metadata:
            args["metadata"] = check_metadata(metadata)
        return int(self._files("write", args, data)["size"])

    def read_file(self, path: str) -> bytes:
        rel = check_path(path)
        reply = self._files("read", {"path": rel, "max_bytes": MAX_READ_BYTES}, output=MAX_READ_BYTES * 4 // 3 + 4096)
        return base64.b64decode(reply["data"])

    def list_files(self, path: str = ".") -> builtins.list[dict[str, Any]]:
        return builtins.list(self._files("list", {"path": check_path(path)}, output=16 * 1024 * 1024)["entries"])

    def list_tree(self, path: str = ".", depth: int = 1) -> builtins.list[dict[str, Any]]:
        """Entries ``depth`` levels down, each with its ``path`` relative to the workspace."""
        if isinstance(depth, bool) or not isinstance(depth, int) or not 1 <= depth <= 64:
            raise InvalidArgument(f"depth must be between 1 and 64, got {depth!r}")
        reply = self._files("list", {"path": check_path(path), "depth": depth}, output=64 * 1024 * 1024)
        return builtins.list(reply["entries"])

    def stat(self, path: str) -> dict[str, Any]:
        """One entry (name, type, size, mode, mtime) of a file or directory; not followed if a link."""
        return dict(self._files("stat", {"path": check_path(path)})["entry"])

    def make_dir(self, path: str) -> bool:
        """Make a directory and its parents; False if something was already there."""
        return bool(self._files("mkdir", {"path": check_path(path)})["created"])

    def move(self, path: str, dest: str) -> dict[str, Any]:
        """Rename a file or directory within the workspace; its new entry."""
        return dict(self._files("move", {"path": check_path(path), "dest": check_path(dest)})["entry"])

    def delete_file(self, path: str) -> None:
        self._files("delete", {"path": check_path(path)})

    def watch(self, path: str = ".", *, recursive: bool = False, include_entry: bool = False) -> Watcher:
        """Watch a workspace directory for changes (by the session's code, its processes or the
        file API): ``events()`` returns what happened since the last call, ``wait(timeout)``
        waits for some; ``close()`` it. ``recursive`` covers the directories below too (up to
        ``watch.MAX_DIRS``); ``include_entry`` adds each changed path's ``stat``. See
        sessions/watch.py for what it costs and why it never follows the sandbox's symlinks."""
        self._live()
        rel = check_path(path)
        root = self._root.backend.workspace_on_host(self.id, self._record.workspace)
        watcher = Watcher(
            check_watchable(root, self.id),
            rel,
            recursive=bool(recursive),
            include_entry=bool(include_entry),
            session_id=self.id,
            shown=path,
        )
        with self._watch_lock:
            self._watchers = [w for w in self._watchers if not w.closed] + [watcher]
        return watcher

    def upload(self, source: str | os.PathLike[str] | bytes, dest: str = ".") -> dict[str, int]:
        """Upload a local directory, or a tar/tar.gz/zip archive (a path or its bytes)."""
        if isinstance(source, bytes):
            data = source
        else:
            src = Path(source)
            if src.is_dir():
                data = _tar_directory(src)
            elif src.is_file():
                if src.stat().st_size > MAX_UPLOAD_BYTES:
                    raise TooLarge(f"{src} is over the {MAX_UPLOAD_BYTES}-byte upload cap")
                data = src.read_bytes()
            else:
                raise InvalidArgument(f"{source} is neither a directory nor an archive file")
        if len(data) > MAX_UPLOAD_BYTES:
            raise TooLarge(f"upload of {len(data)} bytes is over the {MAX_UPLOAD_BYTES}-byte cap")
        limit = self._record.quota_bytes
        _check_archive(data, limit)
        reply = self._files("upload", {"dest": check_path(dest), "max_expanded": limit}, data)
        return {"files": reply["files"], "bytes": reply["bytes"]}

    def download(self, path: str = ".") -> bytes:
        """A tar.gz of a file or directory of the workspace (symlinks are left out)."""
        reply = self._files(
            "download", {"path": check_path(path), "max_bytes": MAX_READ_BYTES * 2}, output=64 * 1024 * 1024
        )
        return base64.b64decode(reply["data"])

    # -- pause, resume, snapshots, forks (snapshots.py) ---------------------------------------------
    @property
    def _home(self) -> Path:
        return self._store.root / self.id

    @property
    def paused(self) -> str | None:
        """How the session is paused ("memory", "state" or "files"), or None while it runs."""
        return self._store.paused(self.id)

    def pause(self, *, keep_memory: bool = True) -> str:
        """Stop the session's interpreter and keep what it had: its memory where the backend can
        (gVisor on the direct backend), else its picklable Python state; the workspace stays.
        ``keep_memory=False`` keeps the files only (E2B's filesystem-only pause: a cold start).
        Nothing runs and no memory is held until ``resume`` (or ``Session.attach``). A cell in
        flight finishes (or times out) first. Returns the kind kept ("memory", "state", "files").

        Raises:
            SessionNotPaused: it is paused already.
        """
        self._check_open()
        if self._store.remote is not None:  # where it lives (a Ray node), by the code below run there
            with self._kernel.locked():
                self._kernel.forget()  # that host lets go of the interpreter it checkpoints or stops
                return self._store.remote.pause_session(asdict(self._record), keep_memory)
        return self.pause_here(keep_memory=keep_memory)

    def pause_here(self, *, keep_memory: bool = True) -> str:
        """``pause`` on the host that holds the session's workspace and interpreter."""
        with self._kernel.locked():
            self._recover()
            if self.paused:
                raise SessionNotPaused(f"session {self.id} is already paused; resume it first")
            staged = self._home / f".{PAUSED}"
            shutil.rmtree(staged, ignore_errors=True)
            staged.mkdir(mode=0o700)
            try:
                kind, dropped = self._keep(staged, keep_running=False, files_only=not keep_memory)
                (staged / "dropped.json").write_text(json.dumps(dropped))
                (staged / "kind").write_text(kind)
                os.rename(staged, self._home / PAUSED)
            except BaseException:
                shutil.rmtree(staged, ignore_errors=True)
                raise
            self._dispatcher.drop_pools(lambda spec: (SESSION_LABEL, self.id) in spec.labels)
            return kind

    def resume(self) -> str:
        """Start the paused session again as it was (same id); the kind it was kept as.

        Raises:
            SessionNotPaused: it is running.
            SnapshotIncompatible: its memory was kept by another runsc, image or CPU.
        """
        self._check_open()
        with self._kernel.locked():
            if self._store.remote is not None:
                kind = self._store.remote.resume_session(asdict(self._record))
            else:
                kind = self.resume_here()
            self._store.touch(self._record)
            return kind

    def settle_here(self) -> str | None:
        """How the session is paused, on the host that holds it, once what a pause or resume cut
        short (a killed process) left is settled (see ``_recover``)."""
        if self.paused or (self._home / f".{PAUSED}").exists():
            with self._kernel.locked():
                self._recover()
        return self.paused

    def interpreter_id(self) -> str | None:
        """The id of the session's running interpreter on this host (None: none runs); starts none."""
        kernel = self._kernel.running()
        return None if kernel is None else str(kernel.id)

    def resume_here(self) -> str:
        """``resume`` on the host that holds the session's workspace and interpreter."""
        with self._kernel.locked():
            self._recover()
            kind = self.paused
            if kind is None:
                raise SessionNotPaused(f"session {self.id} is running: there is nothing to resume")
            self._bring_back(self._home / PAUSED, kind)
            shutil.rmtree(self._home / PAUSED)
            return kind

    def snapshot(self, name: str = "", *, owner: str = "") -> SnapshotRecord:
        """Keep the session as it is now (see ``pause`` for what each kind keeps, with a copy of
        the workspace's files); it goes on running. ``Session.from_snapshot`` starts new sessions
        from it. ``owner``: who it counts against (the HTTP API's token)."""
        with self._kernel.locked():
            return self._snapshot(name, owner=owner, bring_back=True)

    def _snapshot(self, name: str, *, owner: str = "", bring_back: bool) -> SnapshotRecord:
        """``snapshot`` under the kernel's lock; ``bring_back=False`` leaves a memory-kind
        session's interpreter down (``fork`` restores it beside its children)."""
        if not isinstance(name, str) or len(name) > 128:
            raise InvalidArgument("a snapshot's name is a string of at most 128 characters")
        if self._store.remote is not None:  # kept where the session lives (a Ray node), made there
            self._check_open()
            self._kernel.forget()  # a memory-kind interpreter comes back there as a new sandbox
            made = self._store.remote.snapshot_session(asdict(self._record), name, owner, bring_back)
            return SnapshotRecord(**made)
        return self.snapshot_here(name, owner=owner, bring_back=bring_back)

    def snapshot_here(self, name: str, *, owner: str = "", bring_back: bool = True) -> SnapshotRecord:
        """``snapshot`` on the host that holds the session's workspace and interpreter."""
        with self._kernel.locked():
            self._live()
            snapshots = self._local_snapshots()
            snapshot_id = new_snapshot_id()
            staged = snapshots.staging(snapshot_id)
            staged.mkdir(mode=0o700)
            return self._commit_snapshot(snapshots, staged, snapshot_id, name, owner, bring_back)

    def _commit_snapshot(
        self, snapshots: SnapshotStore, staged: Path, snapshot_id: str, name: str, owner: str, bring_back: bool
    ) -> SnapshotRecord:
        try:
            kind, dropped = self._keep(staged, keep_running=True, bring_back=bring_back)
            record = self._record
            return snapshots.commit(
                SnapshotRecord(
                    snapshot_id,
                    self.id,
                    name,
                    kind,
                    time.time(),
                    0,
                    record.image,
                    record.limits,
                    record.quota_bytes,
                    self._record_owner(),
                    record.ttl_seconds,
                    dropped,
                    owner,
                )
            )
        except BaseException:
            self._unstage(staged)
            raise

    def _unstage(self, staged: Path) -> None:
        """Remove a snapshot that failed; an interpreter it had checkpointed (and nothing brought
        back) is restored from it first: the session never loses its memory to a failed snapshot."""
        memory = memory_backend(self._root.backend)
        checkpointed = staged / "memory"
        whole = memory is not None and checkpointed.is_dir() and memory.checkpoint_whole(checkpointed)
        if whole and self._kernel.running() is None:
            try:
                self._bring_back(staged, "memory")
            except Exception as exc:  # noqa: BLE001 - the snapshot's own error is the one raised
                log.warning("session %s: its interpreter did not come back after a failed snapshot: %s", self.id, exc)
        shutil.rmtree(staged, ignore_errors=True)

    @classmethod
    def snapshots(
        cls, session_id: str | None = None, *, root: SessionHost | None = None
    ) -> builtins.list[SnapshotRecord]:
        """The snapshots on this host (of one session when ``session_id`` is given)."""
        return (root or default_host()).snapshots.list(session_id)

    @classmethod
    def delete_snapshot(cls, snapshot_id: str, *, root: SessionHost | None = None) -> None:
        store = (root or default_host()).snapshots
        store.get(snapshot_id)  # SnapshotNotFound
        store.delete(snapshot_id)

    def _local_snapshots(self) -> SnapshotStore:
        snapshots = self._root.snapshots
        if not isinstance(snapshots, SnapshotStore):
            raise SandboxError("this backend keeps snapshots on other hosts")
        return snapshots

    def fork(self, count: int = 1) -> builtins.list[Session]:
        """``count`` new sessions, each starting as this one is now, with its own copy of the
        workspace (and of the memory, where it is kept): what one changes, no other sees. Where
        the memory is kept, this session's own restore runs beside its children's (each is
        mostly waiting on runsc: one after the other took 4.9 s for a fork of one)."""
        validate_count(count)
        with self._kernel.locked():
            snap = self._snapshot(f"fork of {self.id}", bring_back=False)
            parent: BaseException | None = None
            try:
                with concurrent.futures.ThreadPoolExecutor(max_workers=min(count, 4)) as pool:
                    futures = [pool.submit(Session.from_snapshot, snap.id, root=self._root) for _ in range(count)]
                    parent = self._restore_from(snap)
                    concurrent.futures.wait(futures)
                made = [f.result() for f in futures if f.exception() is None]
                failed = [f.exception() for f in futures if f.exception() is not None]
                if parent is not None or failed:  # all or none: the ones that started go again
                    for child in made:
                        child.delete()
                    raise parent or failed[0]  # type: ignore[misc]
                return made
            finally:
                if parent is None:  # else the snapshot holds this session's memory: never removed with it
                    self._root.snapshots.delete(snap.id)

    def _restore_from(self, snap: SnapshotRecord) -> BaseException | None:
        """Bring this session's interpreter back from its fork's memory snapshot (nothing to do for
        another kind); what went wrong is returned, to be raised once the children are settled."""
        if snap.kind != "memory":
            return None
        try:
            if self._store.remote is not None:
                self._store.remote.restore_from_snapshot(asdict(self._record), snap.id)
            else:
                self.restore_here(snap.id)
        except Exception as exc:  # noqa: BLE001 - returned
            return SandboxError(
                f"the session's interpreter did not come back after the fork's snapshot ({exc}); "
                f"what it held is kept in snapshot {snap.id}: start it again with Session.from_snapshot({snap.id!r})"
            )
        except BaseException as exc:  # noqa: BLE001 - an interrupt: raised as it is, the snapshot kept
            return exc
        return None

    @classmethod
    def from_snapshot(
        cls, snapshot: str | SnapshotRecord, *, ttl: float | None = None, root: SessionHost | None = None
    ) -> Session:
        """A new session started from a snapshot (its workspace a copy of the snapshot's)."""
        root = root or default_host()
        snapshots = root.snapshots
        snapshot_id = snapshot.id if isinstance(snapshot, SnapshotRecord) else snapshot
        # on a cluster, where the snapshot is kept (its memory image and files), found with its record
        place, snap = (
            snapshots.locate(snapshot_id)
            if isinstance(snapshots, ClusterSnapshots)
            else (None, snapshots.get(snapshot_id))
        )
        record = root.sessions.create(
            ttl_seconds=float(ttl if ttl is not None else snap.ttl_seconds),
            quota_bytes=snap.quota_bytes,
            image=snap.image,
            limits=snap.limits,
            owner_uid_gid=snap.owner_uid_gid,
            place=place,
        )
        session = cls(root=root, _record=record)
        session._created_here = True
        try:
            if root.sessions.remote is not None:
                root.sessions.remote.start_from_snapshot(asdict(record), snap.id)
            else:
                session.start_here(snap.id)
        except BaseException:
            session.delete()
            raise
        return session

    def start_here(self, snapshot_id: str) -> None:
        """A new session's workspace and interpreter from a snapshot on the host holding both."""
        snapshots = self._local_snapshots()
        snap = snapshots.get(snapshot_id)
        on_host = self._root.backend.workspace_on_host(self.id, self._record.workspace)
        if on_host is None:
            raise SandboxError("this backend keeps workspaces on other hosts: start it where it lives")
        directory = snapshots.dir(snap.id)
        copy_files(directory / "files", on_host)
        with self._kernel.locked():
            self._bring_back(directory, snap.kind)

    def restore_here(self, snapshot_id: str) -> None:
        """This session's interpreter back from its own memory snapshot (a fork's parent), on the
        host holding it."""
        with self._kernel.locked():
            self._bring_back(self._local_snapshots().dir(snapshot_id), "memory")

    def _keep(
        self, directory: Path, *, keep_running: bool, files_only: bool = False, bring_back: bool = True
    ) -> tuple[str, builtins.list[str]]:
        """Write what the session has into ``directory``: its memory or state, and (for a
        snapshot, ``keep_running``) a copy of its workspace's files; a checkpointed interpreter
        is restored unless ``bring_back`` is False. Under the kernel's lock."""
        on_host = self._root.backend.workspace_on_host(self.id, self._record.workspace)
        if on_host is None:
            raise SandboxError("this backend keeps workspaces on other hosts: pause it where it lives")
        kernel = self._kernel.running()
        dropped: builtins.list[str] = []
        memory = memory_backend(self._root.backend)
        if kernel is None or files_only:
            kind = "files"
            if kernel is not None and not keep_running:
                self._kernel.shutdown()
        elif memory is not None and memory.checkpoint_problem(kernel) is None:
            memory.checkpoint(kernel, directory / "memory")
            self._kernel.forget()
            kind = "memory"
        else:
            dropped = self._save_state(directory / "state.pkl", on_host)
            kind = "state"
            if not keep_running:
                self._kernel.shutdown()
        if keep_running:
            copy_files(on_host, directory / "files")
            if kind == "memory" and bring_back:
                self._bring_back(directory, "memory")
        return kind, dropped

    def _save_state(self, dest: Path, on_host: Path) -> builtins.list[str]:
        result = self._kernel.run(SAVE_STATE % f"{WORKSPACE}/{STATE_FILE}", 120, self.limits)
        if result.error is not None:
            with contextlib.suppress(OSError):
                (on_host / STATE_FILE).unlink()
            raise SandboxError(f"could not save the session's Python state: {result.error}")
        take_file(on_host / STATE_FILE, dest)  # the sandbox's file: never a link followed on the host
        try:
            dropped = json.loads(result.stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            dropped = None
        if not isinstance(dropped, builtins.list) or not all(isinstance(n, str) for n in dropped):
            raise SandboxError("the interpreter did not say which names it could not keep (was print replaced?)")
        return dropped

    def _bring_back(self, directory: Path, kind: str) -> None:
        """Start this session's interpreter from what ``_keep`` wrote (under the kernel's lock)."""
        if kind == "memory":
            memory = memory_backend(self._root.backend)
            if memory is None:
                raise SandboxError("this backend cannot restore a memory snapshot")
            self._kernel.adopt(
                memory.restore(self._spec(kernel=True), directory / "memory", lifetime_seconds=self._record.ttl_seconds)
            )
        elif kind == "state":
            on_host = self._root.backend.workspace_on_host(self.id, self._record.workspace)
            if on_host is None:
                raise SandboxError("this backend keeps workspaces on other hosts")
            uid, gid = (int(x) for x in self._record_owner().split(":"))
            place_file(directory / "state.pkl", on_host / STATE_FILE, uid, gid)
        else:
            return
        cell = LOAD_STATE % f"{WORKSPACE}/{STATE_FILE}" if kind == "state" else "None"
        result = self._kernel.run(cell, 120, self.limits)  # the first cell: the interpreter is back
        if result.error is not None or result.interpreter_restarted:
            raise SandboxError(f"the session's interpreter did not come back: {result.error or result.stderr[-500:]}")

    def _record_owner(self) -> str:
        user = str(self.limits.user)
        return user if ":" in user else f"{user}:{user}"

    def _recover(self) -> None:
        """A pause cut short by a killed process: promote a whole memory checkpoint whose
        interpreter is gone (else the session would lose it), drop anything else half-made."""
        if self._store.remote is not None:
            return  # where it lives, as part of each call there
        staged = self._home / f".{PAUSED}"
        if staged.exists():
            memory = memory_backend(self._root.backend)
            whole = memory is not None and (staged / "memory").is_dir() and memory.checkpoint_whole(staged / "memory")
            if whole and self._kernel.running() is None:
                (staged / "kind").write_text("memory")
                os.rename(staged, self._home / PAUSED)
            else:
                shutil.rmtree(staged, ignore_errors=True)
        # A resume cut short after its interpreter started: a restored one (its holder restores on)
        # is the session, running; a fresh one whose state was not loaded yet goes, to be resumed again.
        kind = self.paused
        if kind and self._kernel.running() is not None:
            if kind == "memory":
                shutil.rmtree(self._home / PAUSED, ignore_errors=True)
            else:
                self._kernel.shutdown()

    # -- end ---------------------------------------------------------------------------------------
    def close(self) -> None:
        """Release this process's hold; the session lives on for ``attach``."""
        if not self._closed:
            with self._watch_lock:
                watchers, self._watchers = self._watchers, []
            for watcher in watchers:  # each holds the workspace open: before any unmount
                watcher.close()
            self._kernel.close()
            self._dispatcher.drop_pools(lambda spec: (SESSION_LABEL, self.id) in spec.labels)
            self._closed = True

    def let_go(self) -> None:
        """Release only this handle's hold on the interpreter (a node's handle for one call from
        a driver): the session's pooled sandboxes stay for its next runs."""
        self._kernel.close()
        self._closed = True

    def delete(self) -> None:
        """Remove the session: its interpreter, containers, workspace and record."""
        self.close()
        self._kernel.shutdown()
        self._store.delete(self.id)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._created_here:
            self.delete()
        else:
            self.close()

    def __repr__(self) -> str:
        return f"Session({self.id!r})"


def _relay(
    on_output: Callable[[str, bytes], None] | None, on_display: Callable[[Output], None] | None
) -> Callable[[str, bytes], None] | None:
    """The interpreter's stream of ``stdout``, ``stderr`` and ``display`` pieces (an output's
    JSON, runtime/protocol.py), split between the two callbacks."""
    if on_output is None and on_display is None:
        return None

    def relay(kind: str, data: bytes) -> None:
        if kind == "display":
            if on_display is not None:
                on_display(Output(**json.loads(data)))
        elif on_output is not None:
            on_output(kind, data)

    return relay


def _tar_directory(src: Path) -> bytes:
    buf = io.BytesIO()
    total = 0
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        for path in sorted(src.rglob("*")):
            if path.is_symlink():
                continue
            total += path.stat().st_size if path.is_file() else 0
            if total > MAX_UPLOAD_BYTES:
                raise TooLarge(f"{src} holds more than {MAX_UPLOAD_BYTES} bytes; upload less at a time")
            tar.add(path, arcname=str(path.relative_to(src)), recursive=False)
    return buf.getvalue()


def _check_archive(data: bytes, limit: int) -> None:
    """Refuse archive bombs before sending: sum the declared sizes, streaming, stop past the limit."""
    total = 0
    if data[:4] == b"PK\x03\x04":
        import zipfile

        try:
            with zipfile.ZipFile(io.BytesIO(data)) as z:
                for info in z.infolist():
                    total += info.file_size
                    if total > limit:
                        raise TooLarge(f"archive expands to more than the workspace quota ({limit} bytes): refused")
        except zipfile.BadZipFile as exc:
            raise InvalidArgument(f"not a valid zip archive: {exc}") from None
        return
    try:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r|*") as tar:
            for member in tar:
                total += member.size
                if total > limit:
                    raise TooLarge(f"archive expands to more than the workspace quota ({limit} bytes): refused")
    except tarfile.TarError as exc:
        raise InvalidArgument(f"not a tar, tar.gz or zip archive: {exc}") from None

"""A session's file API (``SessionFiles``, a part of ``Session``): reads, writes, listings,
watches, uploads and downloads of its workspace, each done inside a sandbox that has only the
workspace mounted, so a symlink made by code there can never reach a host file
(``files_helper.py`` is the program that runs there)."""

from __future__ import annotations

import base64
import builtins
import io
import json
import os
import re
import tarfile
from collections.abc import Mapping
from dataclasses import replace
from importlib import resources
from pathlib import Path, PurePosixPath
from typing import Any

from sandloop.contract import (
    InvalidArgument,
    PathRefused,
    SandboxError,
    TooLarge,
    WorkspaceFileNotFound,
    WorkspaceFull,
)
from sandloop.requests import build_request
from sandloop.sessions.session_parts import SessionParts
from sandloop.sessions.store import WORKSPACE
from sandloop.sessions.watch import Watcher, check_watchable

MAX_READ_BYTES = 16 * 1024 * 1024
MAX_WRITE_BYTES = 64 * 1024 * 1024
MAX_UPLOAD_BYTES = 64 * 1024 * 1024
_HELPER = resources.files("sandloop.sessions").joinpath("files_helper.py").read_text()


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


class SessionFiles(SessionParts):
    """The workspace's files, for ``Session``."""

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

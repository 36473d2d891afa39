"""envd's shapes on sandloop's: Connect errors from sandloop's, a file entry and a watch event as
envd reports them, a request's user, fields, metadata headers and gzip body, signal names.
The routes that use them are envd.py.
"""

from __future__ import annotations

import base64
import binascii
import datetime
import posixpath
import zlib
from typing import Any

from fastapi import Request

from sandloop.contract import InvalidArgument, SandboxError
from sandloop.server.e2b.connect import ConnectError
from sandloop.server.e2b.service import E2BError, sandbox_path
from sandloop.server.errors import error_for
from sandloop.server.quota import QuotaError
from sandloop.sessions.session_files import check_metadata
from sandloop.sessions.watch import Watcher, WatchEvent

#: An upload's file metadata travels in headers named this, then the key (lowercased by Starlette).
METADATA_HEADER = "x-metadata-"
SIGNALS = {"SIGNAL_SIGKILL": 9, "SIGNAL_SIGTERM": 15, 9: 9, 15: 15}
_CODES = {400: "invalid_argument", 401: "unauthenticated", 403: "permission_denied", 404: "not_found"}
_CODES |= {409: "already_exists", 413: "resource_exhausted", 429: "resource_exhausted", 501: "unimplemented"}
_CODES |= {503: "unavailable", 507: "resource_exhausted"}


def to_connect(exc: Exception) -> ConnectError:
    if isinstance(exc, ConnectError):
        return exc
    if isinstance(exc, E2BError):
        return ConnectError(_CODES.get(exc.status, "internal"), exc.message)
    if isinstance(exc, SandboxError):
        err = error_for(exc)
        return ConnectError(_CODES.get(err.status, "internal"), err.message)
    if isinstance(exc, QuotaError):  # the key's rate or ceilings: 429/403, not a server fault
        return ConnectError(_CODES.get(exc.status, "resource_exhausted"), exc.message)
    return ConnectError("internal", f"{type(exc).__name__}: {exc}")


def user_of(request: Request) -> None:
    """E2B names a user in ``Authorization: Basic base64(user:)``; sandloop has one, not root."""
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "basic":
        return
    try:
        user = base64.b64decode(value).decode().partition(":")[0]
    except (binascii.Error, UnicodeDecodeError):
        raise ConnectError("invalid_argument", "malformed Authorization header") from None
    if user == "root":
        raise ConnectError("permission_denied", "sandloop sandboxes never run anything as root; use the default user")
    if user not in ("", "user"):
        raise ConnectError("invalid_argument", f"no user {user!r} here: the only user is 'user'")


def entry_json(e: dict[str, Any], rel_dir: str | None = None) -> dict[str, Any]:
    rel = e.get("path") or (e["name"] if rel_dir in (None, ".", "") else f"{rel_dir}/{e['name']}")
    kind = {"dir": "FILE_TYPE_DIRECTORY"}.get(e["type"], "FILE_TYPE_FILE")
    mode = int(e.get("mode", 0o644))
    out: dict[str, Any] = {
        "name": e["name"] or "user",
        "type": kind,
        "path": sandbox_path(rel),
        "size": str(int(e.get("size", 0))),
        "mode": mode & 0o7777,  # as envd reports it: the permission bits (0o755), not the type's
        "permissions": _permissions(mode, kind == "FILE_TYPE_DIRECTORY"),
        "owner": "user",
        "group": "user",
        "modifiedTime": datetime.datetime.fromtimestamp(float(e.get("mtime", 0)), datetime.UTC)
        .isoformat()
        .replace("+00:00", "Z"),
    }
    if e.get("metadata"):
        out["metadata"] = dict(e["metadata"])
    if e["type"] == "symlink":
        # as envd reports it: an absolute path (a relative target is taken from the link's directory)
        target = str(e.get("target", ""))
        if target and not target.startswith("/"):
            target = posixpath.normpath(posixpath.join(posixpath.dirname(out["path"]), target))
        out["symlinkTarget"] = target
    return out


def _permissions(mode: int, is_dir: bool) -> str:
    bits = "".join(c if mode & (1 << (8 - i)) else "-" for i, c in enumerate("rwxrwxrwx"))
    return ("d" if is_dir else "-") + bits


def field(message: dict[str, Any], name: str) -> Any:
    """A request field by its proto name or its JSON (camelCase) name: protobuf's JSON accepts
    both."""
    head, *rest = name.split("_")
    camel = head + "".join(part.title() for part in rest)
    return message.get(camel, message.get(name))


_EVENT_TYPES = {
    "create": "EVENT_TYPE_CREATE",
    "write": "EVENT_TYPE_WRITE",
    "remove": "EVENT_TYPE_REMOVE",
    "rename": "EVENT_TYPE_RENAME",
    "chmod": "EVENT_TYPE_CHMOD",
}


def event_json(watcher: Watcher, event: WatchEvent) -> dict[str, Any]:
    """envd's FilesystemEvent: the name relative to the watched directory, the entry's path
    absolute."""
    out: dict[str, Any] = {"name": event.name, "type": _EVENT_TYPES[event.type]}
    if event.entry is not None:
        rel = event.name if watcher.rel in ("", ".") else f"{watcher.rel}/{event.name}"
        out["entry"] = entry_json({**event.entry, "path": rel})
    return out


def metadata_of(request: Request) -> dict[str, str]:
    """The upload's ``X-Metadata-<key>: value`` headers (envd 0.6.2's file metadata), checked
    before any file is written."""
    raw = {
        name[len(METADATA_HEADER) :]: value
        for name, value in request.headers.items()
        if name.lower().startswith(METADATA_HEADER)
    }
    try:
        return check_metadata(raw) if raw else {}
    except InvalidArgument as exc:
        raise E2BError(400, str(exc)) from None


def gunzip(data: bytes, limit: int) -> bytes:
    """A gzip body unpacked, at most ``limit`` bytes (a small body must not unpack to gigabytes)."""
    unpacker = zlib.decompressobj(16 + zlib.MAX_WBITS)
    try:
        out = unpacker.decompress(data, limit + 1)
    except zlib.error as exc:
        raise E2BError(400, f"the body is not valid gzip: {exc}") from None
    if len(out) > limit or unpacker.unconsumed_tail:
        raise E2BError(413, f"the file unpacks to more than {limit} bytes")
    return out


def signal_name(num: int) -> str:
    names = {9: "killed", 15: "terminated", 2: "interrupt", 6: "aborted", 11: "segmentation fault"}
    return names.get(num, f"signal {num}")

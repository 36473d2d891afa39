"""File operations on a session's workspace, run *inside* a sandbox with the workspace mounted.

Not imported by sandloop: its source is sent as the program of a run. Running inside the sandbox,
as the sandbox's user on its read-only root, means even a path check that failed could only ever
reach the sandbox's own files, never the host's. The host checks paths too.

stdin: one JSON line {"op": ..., "path": ..., ...}, then the data (write_file, upload).
stdout: one JSON line {"ok": true, ...} or {"ok": false, "kind": ..., "error": ...}.
"""

import base64
import errno
import io
import json
import os
import shutil
import stat
import sys
import tarfile
import zipfile

#: The workspace as the sandbox sees it (the test double's sandboxes see it elsewhere).
ROOT = os.environ.get("SANDLOOP_WORKSPACE", "/workspace")


class Refused(Exception):
    kind = "refused"


class TooBig(Refused):
    kind = "too_large"


class Missing(Exception):
    kind = "not_found"


def resolve(rel, must_exist=True):
    """Absolute path inside ROOT; no component may be a symlink leading out of it."""
    if rel in ("", "."):
        return ROOT
    if rel.startswith("/") or "\0" in rel or ".." in rel.split("/"):
        raise Refused("path %r is not inside the workspace" % rel)
    full = os.path.join(ROOT, rel)
    real = os.path.realpath(full)
    if real != ROOT and not real.startswith(ROOT + "/"):
        raise Refused("path %r leads out of the workspace (through a symlink)" % rel)
    if must_exist and not os.path.lexists(full):
        raise Missing("no such file or directory in the workspace: %s" % rel)
    return real


def describe(st: os.stat_result, name: str) -> dict:
    """A stat result as the file API reports it (the host's file watcher reports it the same)."""
    kind = (
        "dir"
        if stat.S_ISDIR(st.st_mode)
        else "file"
        if stat.S_ISREG(st.st_mode)
        else "symlink"
        if stat.S_ISLNK(st.st_mode)
        else "other"
    )
    return {"name": name, "size": st.st_size, "type": kind, "mtime": st.st_mtime, "mode": stat.S_IMODE(st.st_mode)}


def entry(path, name):
    info = describe(os.lstat(path), name)
    kind = info["type"]
    if kind == "symlink":
        info["target"] = os.readlink(path)
    else:
        metadata = read_metadata(path)
        if metadata:
            info["metadata"] = metadata
    return info


#: A file's metadata lives in its extended attributes under this prefix (as E2B's envd keeps it).
XATTR_PREFIX = "user.e2b."


def read_metadata(path):
    """The ``user.e2b.*`` attributes of a file, prefix stripped ({} where there are none, or the
    file system keeps no extended attributes)."""
    try:
        names = [n for n in os.listxattr(path, follow_symlinks=False) if n.startswith(XATTR_PREFIX)]
        return {
            n[len(XATTR_PREFIX) :]: os.getxattr(path, n, follow_symlinks=False)[:4096].decode("utf-8", "replace")
            for n in sorted(names)[:64]
        }
    except OSError:
        return {}


def write_metadata(path, metadata):
    for key, value in metadata.items():
        try:
            os.setxattr(path, XATTR_PREFIX + key, value.encode(), follow_symlinks=False)
        except OSError as exc:
            if exc.errno in (errno.ENOTSUP, errno.EOPNOTSUPP):
                raise Refused(
                    "this sandbox's file system keeps no extended attributes (gVisor's workspace mount does not): "
                    "file metadata needs a runc session"
                ) from None
            if exc.errno == errno.ENOSPC:
                raise Refused("the file's metadata does not fit in its extended attributes: send less") from None
            raise


def op_list(args, data):
    """Entries of a directory (``path`` relative to the workspace in each), ``depth`` levels down."""
    rel = args.get("path", ".")
    path = resolve(rel)
    if not os.path.isdir(path):
        return {"entries": [entry(path, os.path.basename(path))]}
    out = []

    def walk(directory, prefix, depth):
        for n in sorted(os.listdir(directory)):
            full = os.path.join(directory, n)
            e = entry(full, n)
            e["path"] = prefix + n
            out.append(e)
            if len(out) > 100000:
                raise TooBig("more than 100000 entries under %s; list less at a time" % rel)
            if depth > 1 and e["type"] == "dir":
                walk(full, prefix + n + "/", depth - 1)

    walk(path, "" if rel in ("", ".") else rel.rstrip("/") + "/", max(1, int(args.get("depth") or 1)))
    return {"entries": out}


def op_stat(args, data):
    rel = args["path"]
    path = os.path.join(resolve(os.path.dirname(rel) or "."), os.path.basename(rel)) if rel not in ("", ".") else ROOT
    if not os.path.lexists(path):
        raise Missing("no such file or directory in the workspace: %s" % rel)
    return {"entry": entry(path, os.path.basename(path) if rel not in ("", ".") else "")}


def op_mkdir(args, data):
    path = resolve(args["path"], must_exist=False)
    if os.path.lexists(path):
        return {"created": False}
    os.makedirs(path)
    resolve(args["path"])  # none of the new parents may lead out
    return {"created": True}


def op_move(args, data):
    src_rel, dst_rel = args["path"], args["dest"]
    if src_rel in ("", ".") or dst_rel in ("", "."):
        raise Refused("refusing to move the workspace itself")
    src = os.path.join(resolve(os.path.dirname(src_rel) or "."), os.path.basename(src_rel))
    if not os.path.lexists(src):
        raise Missing("no such file or directory in the workspace: %s" % src_rel)
    dst_dir = resolve(os.path.dirname(dst_rel) or ".", must_exist=False)
    os.makedirs(dst_dir, exist_ok=True)
    resolve(os.path.dirname(dst_rel) or ".")
    dst = os.path.join(dst_dir, os.path.basename(dst_rel))
    os.rename(src, dst)
    return {"entry": entry(dst, os.path.basename(dst))}


def op_read(args, data):
    path = resolve(args["path"])
    # O_NONBLOCK: opening a FIFO for reading would otherwise wait for a writer (60 s, then a 500)
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if stat.S_ISDIR(st.st_mode):
            raise Refused("%s is a directory; list it with list_files" % args["path"])
        if not stat.S_ISREG(st.st_mode):
            raise Refused("%s is not a regular file (a FIFO, socket or device): only files are read" % args["path"])
        if st.st_size > args["max_bytes"]:
            raise TooBig(
                "%s is %d bytes; the most read_file returns is %d" % (args["path"], st.st_size, args["max_bytes"])
            )
        content = f.read(args["max_bytes"] + 1)
    return {"data": base64.b64encode(content).decode()}


def op_write(args, data):
    path = resolve(args["path"], must_exist=False)
    if os.path.isdir(path):
        raise Refused("%s is a directory" % args["path"])
    os.makedirs(os.path.dirname(path), exist_ok=True)
    resolve(os.path.relpath(os.path.dirname(path), ROOT))  # parents must not lead out either
    metadata = args.get("metadata") or {}
    try:  # a new file is written where it goes, as envd writes it (a watch sees create, chmod, write)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    except FileExistsError:
        fd = -1
    if fd >= 0:
        try:
            os.fchmod(fd, 0o644)  # envd sets a new file's owner here; the sandbox's user already owns it
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            write_metadata(path, metadata)
        except BaseException:  # nothing half-written is left
            if os.path.lexists(path):
                os.unlink(path)
            raise
        return {"size": len(data)}
    # one already there is replaced whole: a reader never sees half of it (a watch sees one write);
    # each write its own temporary file, so two racing writes cannot interleave into one
    tmp = f"{path}.{os.urandom(6).hex()}.sandloop-tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        write_metadata(tmp, metadata)  # a new inode: no stale metadata on it
        os.replace(tmp, path)
    except BaseException:
        if os.path.lexists(tmp):
            os.unlink(tmp)
        raise
    return {"size": len(data)}


def op_delete(args, data):
    rel = args["path"]
    if rel in ("", "."):
        raise Refused("refusing to delete the workspace itself")
    path = os.path.join(resolve(os.path.dirname(rel) or "."), os.path.basename(rel))
    if not os.path.lexists(path):
        raise Missing("no such file or directory in the workspace: %s" % rel)
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)
    return {}


def check_member(name):
    if name.startswith("/") or ".." in name.split("/") or "\0" in name:
        raise Refused("archive member %r would land outside the workspace" % name)


def op_upload(args, data):
    """Checks every member first, then extracts; if extraction fails part way (a full workspace),
    what it created is removed again, so an upload lands whole or not at all."""
    dest = resolve(args.get("dest", "."), must_exist=False)
    created = []
    try:
        if not os.path.isdir(dest):
            created.append(dest)
        os.makedirs(dest, exist_ok=True)
        if data[:4] == b"PK\x03\x04":
            return _upload_zip(dest, data, args["max_expanded"], created)
        return _upload_tar(dest, data, args["max_expanded"], created)
    except BaseException:
        for path in reversed(created):
            try:
                if os.path.isdir(path) and not os.path.islink(path):
                    os.rmdir(path)
                else:
                    os.unlink(path)
            except OSError:
                pass
        raise


def _make_parents(path, created):
    missing = []
    d = os.path.dirname(path)
    while d and not os.path.isdir(d):
        missing.append(d)
        d = os.path.dirname(d)
    for d in reversed(missing):
        os.mkdir(d)
        created.append(d)


def _upload_zip(dest, data, limit, created):
    total = count = 0
    with zipfile.ZipFile(io.BytesIO(data)) as z:
        infos = z.infolist()
        for info in infos:
            check_member(info.filename)
            total += info.file_size
            if total > limit:
                raise TooBig("archive expands past %d bytes: refused" % limit)
        for info in infos:
            target = os.path.join(dest, info.filename)
            if info.is_dir():
                _make_parents(os.path.join(target, "x"), created)
                continue
            _make_parents(target, created)
            if not os.path.exists(target):
                created.append(target)
            with z.open(info) as src, open(target, "wb") as out:
                written = 0
                while True:
                    chunk = src.read(1 << 16)
                    if not chunk:
                        break
                    written += len(chunk)
                    if written > info.file_size:  # lying headers
                        raise TooBig("archive member %s expands past its declared size" % info.filename)
                    out.write(chunk)
            count += 1
    return {"files": count, "bytes": total}


def _upload_tar(dest, data, limit, created):
    total = count = 0
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:*") as tar:
        members = []
        for m in tar:
            check_member(m.name)
            if not (m.isfile() or m.isdir()):
                raise Refused(
                    "archive member %s is a %s; only files and directories are accepted"
                    % (m.name, "link" if m.issym() or m.islnk() else "special file")
                )
            total += m.size
            if total > limit:
                raise TooBig("archive expands past %d bytes: refused" % limit)
            members.append(m)
        for m in members:
            target = os.path.join(dest, m.name)
            if m.isdir():
                _make_parents(os.path.join(target, "x"), created)
                continue
            _make_parents(target, created)
            if not os.path.exists(target):
                created.append(target)
            src = tar.extractfile(m)
            with open(target, "wb") as out:
                shutil.copyfileobj(src, out)
            count += 1
    return {"files": count, "bytes": total}


def op_download(args, data):
    rel = args.get("path", ".")
    path = resolve(rel)
    buf = io.BytesIO()
    total = 0
    with tarfile.open(fileobj=buf, mode="w:gz") as tar:
        base = os.path.basename(path.rstrip("/")) if path != ROOT else "workspace"
        for dirpath, dirnames, filenames in (
            os.walk(path) if os.path.isdir(path) else [(os.path.dirname(path), [], [os.path.basename(path)])]
        ):
            for name in sorted(dirnames) + sorted(filenames):
                full = os.path.join(dirpath, name)
                if os.path.islink(full):
                    continue  # links are not followed or archived
                arc = os.path.join(base, os.path.relpath(full, path)) if os.path.isdir(path) else base
                if os.path.isfile(full):
                    total += os.path.getsize(full)
                    if total > args["max_bytes"]:
                        raise TooBig("%s holds more than %d bytes; download less at a time" % (rel, args["max_bytes"]))
                tar.add(full, arcname=arc, recursive=False)
    return {"data": base64.b64encode(buf.getvalue()).decode()}


OPS = {
    "list": op_list,
    "read": op_read,
    "write": op_write,
    "delete": op_delete,
    "stat": op_stat,
    "mkdir": op_mkdir,
    "move": op_move,
    "upload": op_upload,
    "download": op_download,
}


def main():
    header = json.loads(sys.stdin.buffer.readline())
    data = sys.stdin.buffer.read()
    try:
        result = OPS[header["op"]](header, data)
        result["ok"] = True
    except (Refused, Missing) as exc:
        result = {"ok": False, "kind": exc.kind, "error": str(exc)}
    except OSError as exc:
        kinds = {28: "no_space", 2: "not_found", 21: "is_directory", 20: "is_directory", 122: "no_space"}
        kind = kinds.get(exc.errno, "os_error")
        result = {"ok": False, "kind": kind, "error": "%s: %s" % (exc.strerror, header.get("path", ""))}
    sys.stdout.write(json.dumps(result))


if __name__ == "__main__":  # as the program of a run; the host imports describe()
    main()

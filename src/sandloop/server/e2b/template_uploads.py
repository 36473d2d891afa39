"""The archives of E2B template builds' COPY steps: the SDK asks whether one is here and, if not,
gets a signed upload URL (no API key on it: its signature says which key's folder it writes).
Each key's archives are apart and bounded together (``make_room``); they are a cache, so the least
recently used go first.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sandloop.server.e2b.service import E2BError

if TYPE_CHECKING:
    from sandloop.server.e2b.service import E2B
    from sandloop.server.tokens import Token

#: The signed upload URL (no API key: its signature says which key's folder it writes).
UPLOAD_PATH = re.compile(r"^/templates/[^/]+/files/[0-9A-Za-z_-]{1,128}/upload$")
#: Largest COPY archive one upload may carry.
MAX_UPLOAD_BYTES = 512 * 1024 * 1024
#: What one key's uploaded COPY archives may hold on disk together (finished and in flight). They
#: are a cache (E2B's SDK asks whether an archive is there and uploads it again when it is not), so
#: the least recently used go first to make room; uploads in flight can't be, and past the budget
#: a new one is refused.
MAX_UPLOADS_BYTES_PER_KEY = 2 * 1024 * 1024 * 1024
UPLOAD_URL_SECONDS = 3600
#: A COPY's files hash, as the SDK makes it (and nothing that could leave a folder).
FILES_HASH = re.compile(r"^[0-9A-Za-z_-]{1,128}$")


class TemplateUploads:
    def __init__(self, e2b: E2B, files: Path) -> None:
        self.e2b = e2b
        self.files = files
        self._lock = threading.Lock()
        #: Bytes each key's uploads in flight may still write, by the key's folder (``make_room``).
        self._reserved: dict[Path, int] = {}

    def _signature(self, token_id: str, template_id: str, files_hash: str, expires: int) -> str:
        text = f"template-upload:{token_id}:{template_id}:{files_hash}:{expires}"
        return self.e2b.registry.sign(text)

    def archive(self, token_id: str, files_hash: str) -> Path:
        # each key's uploads apart: another key's archive under the same hash is never used
        return self.files / hashlib.sha256(token_id.encode()).hexdigest()[:32] / f"{files_hash}.tar"

    def upload_link(self, token: Token, template_id: str, files_hash: str, base_url: str) -> dict[str, Any]:
        if not FILES_HASH.match(files_hash):
            raise E2BError(400, "the files hash must be letters and digits")
        present = touch(self.archive(token.id, files_hash))
        expires = int(time.time()) + UPLOAD_URL_SECONDS
        signature = self._signature(token.id, template_id, files_hash, expires)
        url = (
            f"{base_url.rstrip('/')}/templates/{template_id}/files/{files_hash}/upload"
            f"?key={token.id}&expires={expires}&signature={signature}"
        )
        return {"present": present, "url": url}

    def reserve_upload(self, target: Path) -> int:
        """Room for one upload into ``target``'s key folder (``make_room``): the bytes it may write,
        held for it until ``release_upload``."""
        with self._lock:
            held = self._reserved.get(target.parent, 0)
            room = make_room(target.parent, MAX_UPLOADS_BYTES_PER_KEY, keep=target, reserved=held)
            self._reserved[target.parent] = held + room
        return room

    def release_upload(self, target: Path, room: int) -> None:
        with self._lock:
            left = self._reserved.get(target.parent, 0) - room
            if left > 0:
                self._reserved[target.parent] = left
            else:
                self._reserved.pop(target.parent, None)

    def check_upload(self, template_id: str, files_hash: str, query: dict[str, str]) -> Path:
        """Where a signed upload goes, or 403 (a changed, expired or foreign URL)."""
        try:
            expires = int(query.get("expires", ""))
        except ValueError:
            raise E2BError(403, "this upload URL is not one this server signed") from None
        key, signature = query.get("key", ""), query.get("signature", "")
        expected = self._signature(key, template_id, files_hash, expires)
        if not hmac.compare_digest(expected, signature):
            raise E2BError(403, "this upload URL is not one this server signed")
        if expires < time.time():
            raise E2BError(403, "this upload URL has expired: ask for a new one")
        if self.e2b.api.tokens.get(key) is None:
            raise E2BError(403, "the key this upload URL was made for was revoked")
        return self.archive(key, files_hash)


def touch(archive: Path) -> bool:
    """Whether a key's archive is there; if so it is marked as just used (``make_room`` keeps it)."""
    try:
        os.utime(archive)
    except OSError:
        return False
    return archive.is_file()


def make_room(folder: Path, budget: int, *, keep: Path, reserved: int) -> int:
    """Make room in a key's upload ``folder`` for one more upload: the least recently used finished
    archives (not ``keep``, which this upload replaces) go until ``MAX_UPLOAD_BYTES`` fits in
    ``budget`` beside what stays and what uploads in flight have ``reserved``. A partial file no
    upload is writing (``.NAME.*`` a day old: its server died mid-upload) goes too. Returns how
    many bytes this upload may write (its reservation).

    Raises:
        E2BError: 429 when uploads in flight leave no room (wait for them to finish).
    """
    finished: list[tuple[float, int, Path]] = []
    for path in folder.iterdir():
        try:
            st = path.stat()
        except OSError:
            continue  # went meanwhile
        if path.name.startswith("."):
            if st.st_mtime < time.time() - 86400:
                path.unlink(missing_ok=True)
        elif path != keep:
            finished.append((st.st_mtime, st.st_size, path))
    finished.sort()
    held = reserved + sum(size for _, size, _ in finished)
    while finished and held + MAX_UPLOAD_BYTES > budget:
        _, size, path = finished.pop(0)
        path.unlink(missing_ok=True)
        held -= size
    room = min(MAX_UPLOAD_BYTES, budget - held)
    if room <= 0:
        raise E2BError(429, "this key's uploads in flight fill its upload space: wait for them to finish and retry")
    return room


def too_large(limit: int) -> str:
    if limit >= MAX_UPLOAD_BYTES:
        return f"a COPY's files may be at most {MAX_UPLOAD_BYTES >> 20} MiB"
    return f"a COPY's files may be at most {limit >> 20} MiB now: this key's other uploads in flight hold the rest"

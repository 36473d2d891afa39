"""What the E2B-compatible API knows about its sandboxes beyond their sessions: the key that owns
each, its template, metadata, default environment and absolute end time.

One row per E2B sandbox, keyed by the session id (an E2B sandbox *is* a session). A sandbox's two
access tokens (envd's and the traffic token) are not stored: each is an HMAC of its id under a
per-install secret (``e2b-secret``, mode 0600), so ``connect`` can hand them out again and a
leaked database holds none.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS e2b_sandboxes (
    sandbox_id TEXT PRIMARY KEY,
    token_id TEXT NOT NULL,
    template TEXT NOT NULL,
    metadata TEXT NOT NULL,
    envs TEXT NOT NULL,
    started REAL NOT NULL,
    end_at REAL NOT NULL,
    cpus REAL NOT NULL,
    memory_mb INTEGER NOT NULL,
    disk_mb INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS e2b_lifecycle (
    sandbox_id TEXT PRIMARY KEY,
    on_timeout TEXT NOT NULL,
    auto_resume INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS e2b_private (
    sandbox_id TEXT PRIMARY KEY
);
CREATE TABLE IF NOT EXISTS e2b_private_snapshots (
    snapshot_id TEXT PRIMARY KEY
);
"""


@dataclass
class E2BSandbox:
    sandbox_id: str
    token_id: str
    template: str
    started: float
    end_at: float
    cpus: float
    memory_mb: int
    disk_mb: int
    metadata: dict[str, str] = field(default_factory=dict)
    envs: dict[str, str] = field(default_factory=dict)


class Registry:
    def __init__(self, path: Path, secret_path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self._secret = _load_secret(secret_path)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False)
        self._db.row_factory = sqlite3.Row
        self._db.executescript(SCHEMA)
        self._db.commit()

    def add(
        self,
        sandbox_id: str,
        token_id: str,
        *,
        template: str,
        timeout: float,
        metadata: dict[str, str],
        envs: dict[str, str],
        cpus: float,
        memory_mb: int,
        disk_mb: int,
    ) -> E2BSandbox:
        now = time.time()
        box = E2BSandbox(
            sandbox_id,
            token_id,
            template,
            now,
            now + timeout,
            cpus,
            memory_mb,
            disk_mb,
            metadata,
            envs,
        )
        with self._lock:
            self._db.execute(
                "INSERT INTO e2b_sandboxes VALUES (?,?,?,?,?,?,?,?,?,?)",
                (
                    sandbox_id,
                    token_id,
                    template,
                    json.dumps(metadata),
                    json.dumps(envs),
                    box.started,
                    box.end_at,
                    cpus,
                    memory_mb,
                    disk_mb,
                ),
            )
            self._db.commit()
        return box

    # -- access tokens ---------------------------------------------------------------------------
    def access_token(self, sandbox_id: str, kind: str) -> str:
        """``kind`` is "envd" or "traffic"."""
        return hmac.new(self._secret, f"{kind}:{sandbox_id}".encode(), hashlib.sha256).hexdigest()

    def sign(self, text: str) -> str:
        """An HMAC of ``text`` under this install's secret (signed URLs)."""
        return hmac.new(self._secret, f"sign:{text}".encode(), hashlib.sha256).hexdigest()

    def check_access(self, sandbox_id: str, envd_token: str | None, traffic_token: str | None) -> bool:
        """Every token sent must be this sandbox's, and at least one must be sent."""
        sent = [(kind, t) for kind, t in (("envd", envd_token), ("traffic", traffic_token)) if t]
        return bool(sent) and all(hmac.compare_digest(self.access_token(sandbox_id, kind), t) for kind, t in sent)

    @staticmethod
    def _row(row: sqlite3.Row) -> E2BSandbox:
        values: dict[str, Any] = dict(row)
        values["metadata"] = json.loads(values["metadata"])
        values["envs"] = json.loads(values["envs"])
        return E2BSandbox(**values)

    def get(self, sandbox_id: str) -> E2BSandbox | None:
        with self._lock:
            row = self._db.execute("SELECT * FROM e2b_sandboxes WHERE sandbox_id = ?", (sandbox_id,)).fetchone()
        return None if row is None else self._row(row)

    def of_token(self, token_id: str) -> list[E2BSandbox]:
        with self._lock:
            rows = self._db.execute(
                "SELECT * FROM e2b_sandboxes WHERE token_id = ? ORDER BY started, sandbox_id", (token_id,)
            ).fetchall()
        return [self._row(r) for r in rows]

    def ids(self) -> list[str]:
        """Every sandbox's id (live ones: a killed one's row is removed)."""
        with self._lock:
            rows = self._db.execute("SELECT sandbox_id FROM e2b_sandboxes").fetchall()
        return [r["sandbox_id"] for r in rows]

    def expired(self, now: float | None = None) -> list[str]:
        with self._lock:
            rows = self._db.execute(
                "SELECT sandbox_id FROM e2b_sandboxes WHERE end_at < ?", (now or time.time(),)
            ).fetchall()
        return [r["sandbox_id"] for r in rows]

    # -- lifecycle (E2B's ``lifecycle`` / ``autoPause``: pause at the timeout, resume on traffic) -----
    def set_lifecycle(self, sandbox_id: str, on_timeout: str, auto_resume: bool) -> None:
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO e2b_lifecycle VALUES (?,?,?)", (sandbox_id, on_timeout, int(auto_resume))
            )
            self._db.commit()

    def lifecycle(self, sandbox_id: str) -> tuple[str, bool]:
        """(on_timeout: "kill", "pause" or "pause-files" (memory not kept), auto_resume)."""
        with self._lock:
            row = self._db.execute("SELECT * FROM e2b_lifecycle WHERE sandbox_id = ?", (sandbox_id,)).fetchone()
        return ("kill", False) if row is None else (row["on_timeout"], bool(row["auto_resume"]))

    # -- traffic (E2B's ``network.allowPublicTraffic``: true unless said) -------------------------
    def set_public_traffic(self, sandbox_id: str, public: bool) -> None:
        with self._lock:
            if public:
                self._db.execute("DELETE FROM e2b_private WHERE sandbox_id = ?", (sandbox_id,))
            else:
                self._db.execute("INSERT OR REPLACE INTO e2b_private VALUES (?)", (sandbox_id,))
            self._db.commit()

    def public_traffic(self, sandbox_id: str) -> bool:
        """Whether its preview URLs take traffic without its traffic access token."""
        with self._lock:
            row = self._db.execute("SELECT 1 FROM e2b_private WHERE sandbox_id = ?", (sandbox_id,)).fetchone()
        return row is None

    def keep_snapshot_private(self, snapshot_id: str) -> None:
        """A snapshot of a sandbox that takes no public traffic: a sandbox made from it takes none
        either (unless its create says otherwise), even once the source is killed. Rows are not
        removed with the snapshot: one short row each, and a snapshot id is never reused."""
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO e2b_private_snapshots VALUES (?)", (snapshot_id,))
            self._db.commit()

    def snapshot_private(self, snapshot_id: str) -> bool:
        with self._lock:
            row = self._db.execute(
                "SELECT 1 FROM e2b_private_snapshots WHERE snapshot_id = ?", (snapshot_id,)
            ).fetchone()
        return row is not None

    def set_end(self, sandbox_id: str, end_at: float) -> None:
        with self._lock:
            self._db.execute("UPDATE e2b_sandboxes SET end_at = ? WHERE sandbox_id = ?", (end_at, sandbox_id))
            self._db.commit()

    def remove(self, sandbox_id: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM e2b_sandboxes WHERE sandbox_id = ?", (sandbox_id,))
            self._db.execute("DELETE FROM e2b_lifecycle WHERE sandbox_id = ?", (sandbox_id,))
            self._db.execute("DELETE FROM e2b_private WHERE sandbox_id = ?", (sandbox_id,))
            self._db.commit()


def _load_secret(path: Path) -> bytes:
    try:
        return bytes.fromhex(path.read_text().strip())
    except (FileNotFoundError, ValueError):
        pass
    path.parent.mkdir(parents=True, exist_ok=True)
    value = secrets.token_bytes(32)
    tmp = path.with_name(f".{path.name}.{secrets.token_hex(6)}.tmp")  # each writer its own
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(value.hex())
    try:
        os.link(tmp, path)  # first writer wins; a racing process reads the winner's secret
    except FileExistsError:
        tmp.unlink(missing_ok=True)
        return bytes.fromhex(path.read_text().strip())
    tmp.unlink(missing_ok=True)
    return value

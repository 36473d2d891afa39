"""Bearer tokens for the HTTP API: stored hashed in SQLite, each with its own limits.

A token is 32 random bytes (``sl_`` + urlsafe base64); only its SHA-256 is stored, so a leaked
database grants nothing. Lookups go by hash and are confirmed with a constant-time comparison.
"""

from __future__ import annotations

import hashlib
import hmac
import secrets
import sqlite3
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from sandloop.sessions.store import sandloop_home

SCHEMA = """
CREATE TABLE IF NOT EXISTS tokens (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    hash TEXT NOT NULL UNIQUE,
    created REAL NOT NULL,
    revoked REAL,
    max_concurrent INTEGER NOT NULL,
    runs_per_minute INTEGER NOT NULL,
    max_memory TEXT NOT NULL,
    max_timeout REAL NOT NULL
);
CREATE TABLE IF NOT EXISTS session_owners (
    session_id TEXT PRIMARY KEY,
    token_id TEXT NOT NULL
)
"""


@dataclass(frozen=True)
class Token:
    id: str
    name: str
    created: float
    revoked: float | None
    max_concurrent: int
    runs_per_minute: int
    max_memory: str
    max_timeout: float


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


class TokenStore:
    def __init__(self, path: Path | None = None) -> None:
        self.path = path or sandloop_home() / "tokens.sqlite"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False)
        self._db.executescript(SCHEMA)
        self._db.commit()

    def create(
        self,
        name: str,
        *,
        max_concurrent: int = 4,
        runs_per_minute: int = 120,
        max_memory: str = "1g",
        max_timeout: float = 300,
    ) -> tuple[str, Token]:
        """Returns (the secret, shown once; the token's record)."""
        secret = "sl_" + secrets.token_urlsafe(32)
        token = Token(
            "tok_" + secrets.token_hex(6),
            name,
            time.time(),
            None,
            max_concurrent,
            runs_per_minute,
            max_memory,
            max_timeout,
        )
        with self._lock:
            self._db.execute(
                "INSERT INTO tokens VALUES (?,?,?,?,?,?,?,?,?)",
                (
                    token.id,
                    name,
                    _hash(secret),
                    token.created,
                    None,
                    max_concurrent,
                    runs_per_minute,
                    max_memory,
                    max_timeout,
                ),
            )
            self._db.commit()
        return secret, token

    def verify(self, secret: str) -> Token | None:
        digest = _hash(secret)
        with self._lock:
            row = self._db.execute("SELECT * FROM tokens WHERE hash = ?", (digest,)).fetchone()
        if row is None or not hmac.compare_digest(row[2], digest) or row[4] is not None:
            return None
        return Token(row[0], row[1], row[3], row[4], row[5], row[6], row[7], row[8])

    def list(self) -> list[Token]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM tokens ORDER BY created").fetchall()
        return [Token(r[0], r[1], r[3], r[4], r[5], r[6], r[7], r[8]) for r in rows]

    def revoke(self, token_id: str) -> bool:
        with self._lock:
            cur = self._db.execute(
                "UPDATE tokens SET revoked = ? WHERE id = ? AND revoked IS NULL", (time.time(), token_id)
            )
            self._db.commit()
        return cur.rowcount == 1

    # -- which token owns which session -------------------------------------------------------
    def own(self, session_id: str, token_id: str) -> None:
        with self._lock:
            self._db.execute("INSERT OR REPLACE INTO session_owners VALUES (?, ?)", (session_id, token_id))
            self._db.commit()

    def owner_of(self, session_id: str) -> str | None:
        with self._lock:
            row = self._db.execute("SELECT token_id FROM session_owners WHERE session_id = ?", (session_id,)).fetchone()
        return row[0] if row else None

    def sessions_of(self, token_id: str) -> set[str]:
        with self._lock:
            rows = self._db.execute("SELECT session_id FROM session_owners WHERE token_id = ?", (token_id,)).fetchall()
        return {r[0] for r in rows}

    def disown(self, session_id: str) -> None:
        with self._lock:
            self._db.execute("DELETE FROM session_owners WHERE session_id = ?", (session_id,))
            self._db.commit()

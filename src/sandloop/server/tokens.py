"""Bearer tokens for the HTTP API and MCP over HTTP: stored hashed in SQLite, each with its ceilings.

A token is 32 random bytes (``sl_`` + urlsafe base64); only its SHA-256 is stored, so a leaked
database grants nothing. Lookups go by hash and are confirmed with a constant-time comparison.

Each token carries what it may cost: runs per minute and at once, the largest memory and timeout a
run may ask for, how many live sessions and how much workspace quota it may hold, and what its
agent runs may spend per UTC day (runs, model tokens) with the most iterations per run. Agent
usage is recorded per token and day (``usage``).
"""

from __future__ import annotations

import dataclasses
import datetime
import hashlib
import hmac
import json
import logging
import secrets
import sqlite3
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sandloop.contract import parse_size
from sandloop.contract.egress import ANY, normalize_rule
from sandloop.paths import default_home

log = logging.getLogger("sandloop.server")

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
);
CREATE TABLE IF NOT EXISTS usage (
    token_id TEXT NOT NULL,
    day TEXT NOT NULL,
    agent_runs INTEGER NOT NULL DEFAULT 0,
    agent_iterations INTEGER NOT NULL DEFAULT 0,
    input_tokens INTEGER NOT NULL DEFAULT 0,
    output_tokens INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (token_id, day)
)
"""

#: Columns added after the first release, with their defaults for tokens made before them.
_ADDED_COLUMNS = {
    "max_sessions": "INTEGER NOT NULL DEFAULT 10",
    "max_workspace": "TEXT NOT NULL DEFAULT '10g'",
    "agent_runs_per_day": "INTEGER NOT NULL DEFAULT 100",
    "agent_tokens_per_day": "INTEGER NOT NULL DEFAULT 1000000",
    "agent_max_iterations": "INTEGER NOT NULL DEFAULT 20",
    "provider_urls": "TEXT NOT NULL DEFAULT '[]'",
    "egress": "TEXT NOT NULL DEFAULT '[]'",
}


#: Seconds between looks for a revocation by another process (``sandloop tokens revoke`` writes
#: the database this server reads), while anything listens (``TokenStore.on_revoke``). A look is
#: one ``PRAGMA data_version``, and a query only when another connection committed.
REVOKE_POLL = 1.0


class TokenError(ValueError):
    """A token operation the store refuses (a duplicate name, an unknown token)."""


@dataclass(frozen=True)
class Token:
    id: str
    name: str
    created: float
    revoked: float | None
    #: 4 at once bounds what one token holds (4 sandboxes of at most max_memory each, 4 bodies in
    #: the server's memory). 600 operations a minute (10 a second, sustained): E2B's SDK suites
    #: and an agent doing files and commands in a loop spend a few a second in bursts (120 a
    #: minute was hit within seconds by a files.write loop); a flood of thousands is still 429.
    max_concurrent: int = 4
    runs_per_minute: int = 600
    max_memory: str = "1g"
    max_timeout: float = 300
    max_sessions: int = 10
    max_workspace: str = "10g"
    agent_runs_per_day: int = 100
    agent_tokens_per_day: int = 1_000_000
    agent_max_iterations: int = 20
    #: Provider endpoints this token's agent runs may use (a subset of the server's); () = all listed.
    provider_urls: tuple[str, ...] = field(default=())
    #: Egress rules this token's runs may ask for (``any`` for all); () = no egress at all.
    egress: tuple[str, ...] = field(default=())


@dataclass(frozen=True)
class Usage:
    """What a token's agent runs spent on one UTC day."""

    day: str
    agent_runs: int = 0
    agent_iterations: int = 0
    input_tokens: int = 0
    output_tokens: int = 0

    @property
    def model_tokens(self) -> int:
        return self.input_tokens + self.output_tokens


_LIMIT_FIELDS = [f.name for f in dataclasses.fields(Token)][4:]


def _hash(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def today() -> str:
    return datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d")


def _validate(limits: dict[str, Any]) -> None:
    for name in ("max_concurrent", "runs_per_minute", "max_sessions", "agent_runs_per_day", "agent_max_iterations"):
        if int(limits[name]) < 1:
            raise TokenError(f"{name} must be at least 1")
    if int(limits["agent_tokens_per_day"]) < 0 or float(limits["max_timeout"]) <= 0:
        raise TokenError("agent_tokens_per_day must be >= 0 and max_timeout > 0")
    for name in ("max_memory", "max_workspace"):
        try:
            parse_size(limits[name])
        except ValueError as exc:
            raise TokenError(f"{name}: {exc}") from None


class TokenStore:
    def __init__(self, path: Path | None = None) -> None:
        self.path = path or default_home() / "tokens.sqlite"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(self.path, check_same_thread=False)
        self._db.row_factory = sqlite3.Row
        self._db.executescript(SCHEMA)
        have = {row["name"] for row in self._db.execute("PRAGMA table_info(tokens)")}
        for column, decl in _ADDED_COLUMNS.items():
            if column not in have:
                self._db.execute(f"ALTER TABLE tokens ADD COLUMN {column} {decl}")
        self._db.commit()
        self._listeners: dict[object, Callable[[str], None]] = {}
        self._listeners_lock = threading.Lock()
        self._poller: threading.Thread | None = None
        self._seen_revoked: set[str] = set()
        self._seen_version = 0

    @staticmethod
    def _token(row: sqlite3.Row) -> Token:
        values = {name: row[name] for name in _LIMIT_FIELDS}
        values["provider_urls"] = tuple(json.loads(values["provider_urls"]))
        values["egress"] = tuple(json.loads(values["egress"]))
        return Token(row["id"], row["name"], row["created"], row["revoked"], **values)

    def create(self, name: str, **limits: object) -> tuple[str, Token]:
        """Returns (the secret, shown once; the token's record). ``limits`` are Token's fields."""
        unknown = set(limits) - set(_LIMIT_FIELDS)
        if unknown:
            raise TokenError(f"unknown token limits: {', '.join(sorted(unknown))}")
        try:
            limits["egress"] = tuple(
                dict.fromkeys(r if r == ANY else normalize_rule(str(r)) for r in limits.get("egress") or ())  # type: ignore[attr-defined]
            )
        except ValueError as exc:
            raise TokenError(str(exc)) from None
        name = name.strip()
        if not name or name.startswith("tok_"):
            raise TokenError("a token needs a name that does not start with 'tok_'")
        token = Token("tok_" + secrets.token_hex(6), name, time.time(), None, **limits)  # type: ignore[arg-type]
        row = dataclasses.asdict(token)
        _validate(row)
        row["provider_urls"] = json.dumps(list(token.provider_urls))
        row["egress"] = json.dumps(list(token.egress))
        secret = "e2b_" + secrets.token_hex(32)  # the shape E2B's SDKs accept as an API key
        row["hash"] = _hash(secret)
        with self._lock:
            if self._db.execute("SELECT 1 FROM tokens WHERE name = ? AND revoked IS NULL", (name,)).fetchone():
                raise TokenError(f"an active token is already named {name!r}; revoke it or choose another name")
            columns = ", ".join(row)
            self._db.execute(f"INSERT INTO tokens ({columns}) VALUES ({', '.join('?' * len(row))})", list(row.values()))
            self._db.commit()
        return secret, token

    def verify(self, secret: str) -> Token | None:
        digest = _hash(secret)
        with self._lock:
            row = self._db.execute("SELECT * FROM tokens WHERE hash = ?", (digest,)).fetchone()
        if row is None or not hmac.compare_digest(row["hash"], digest) or row["revoked"] is not None:
            return None
        return self._token(row)

    def get(self, token_id: str) -> Token | None:
        """The active token with this id (None if unknown or revoked)."""
        with self._lock:
            row = self._db.execute("SELECT * FROM tokens WHERE id = ? AND revoked IS NULL", (token_id,)).fetchone()
        return None if row is None else self._token(row)

    def list(self) -> list[Token]:
        with self._lock:
            rows = self._db.execute("SELECT * FROM tokens ORDER BY created").fetchall()
        return [self._token(r) for r in rows]

    def revoke(self, id_or_name: str) -> Token | None:
        """Revoke the active token with this id or name; the revoked token, or None if none."""
        with self._lock:
            row = self._db.execute(
                "SELECT * FROM tokens WHERE (id = ? OR name = ?) AND revoked IS NULL", (id_or_name, id_or_name)
            ).fetchone()
            if row is None:
                return None
            self._db.execute("UPDATE tokens SET revoked = ? WHERE id = ?", (time.time(), row["id"]))
            self._db.commit()
            self._seen_revoked.add(row["id"])
        self._revoked(row["id"])
        return self._token(row)

    # -- who hears of a revocation -------------------------------------------------------------
    def on_revoke(self, callback: Callable[[str], None]) -> Callable[[], None]:
        """Calls ``callback(token_id)`` when a token is revoked: at once (on the revoking thread)
        by this store's ``revoke``, within ``REVOKE_POLL`` seconds (on a poller thread) by another
        process's. What a revoked token holds open (a terminal's stream, a preview's connection)
        ends there: the token was checked when it opened, and never again. Keep ``callback``
        short; it may be called twice for one token. Returns what stops the calls; the poller runs
        only while someone listens."""
        key = object()
        with self._listeners_lock:
            self._listeners[key] = callback
            if self._poller is None:
                self._look()  # what was revoked until now, before this returns: none later is missed
                self._poller = threading.Thread(target=self._poll, name="sandloop-revocations", daemon=True)
                self._poller.start()

        def off() -> None:
            with self._listeners_lock:
                self._listeners.pop(key, None)

        return off

    def _look(self) -> set[str]:
        """Tokens revoked since the last look (by another connection: this one's own ``revoke``
        notes its own)."""
        with self._lock:
            version = self._db.execute("PRAGMA data_version").fetchone()[0]
            if version == self._seen_version:
                return set()
            self._seen_version = version
            revoked = {r[0] for r in self._db.execute("SELECT id FROM tokens WHERE revoked IS NOT NULL")}
            new = revoked - self._seen_revoked
            self._seen_revoked |= revoked
        return new

    def _poll(self) -> None:
        stop = threading.Event()
        while not stop.wait(REVOKE_POLL):
            with self._listeners_lock:
                if not self._listeners:
                    self._poller = None
                    return
            try:
                new = self._look()
            except sqlite3.Error:  # a busy or locked database: looked at again next time
                continue
            for token_id in new:
                self._revoked(token_id)

    def _revoked(self, token_id: str) -> None:
        with self._listeners_lock:
            listeners = list(self._listeners.values())
        for callback in listeners:
            try:
                callback(token_id)
            except Exception:  # noqa: BLE001 - one listener's failure must not keep the others from hearing
                log.warning("a revocation listener failed for %s", token_id, exc_info=True)

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

    # -- agent usage per token and UTC day ---------------------------------------------------
    def usage(self, token_id: str, day: str | None = None) -> Usage:
        day = day or today()
        with self._lock:
            row = self._db.execute("SELECT * FROM usage WHERE token_id = ? AND day = ?", (token_id, day)).fetchone()
        if row is None:
            return Usage(day)
        return Usage(day, row["agent_runs"], row["agent_iterations"], row["input_tokens"], row["output_tokens"])

    def record_usage(
        self, token_id: str, *, agent_runs: int = 0, iterations: int = 0, input_tokens: int = 0, output_tokens: int = 0
    ) -> Usage:
        """Add to today's usage and return the new total."""
        day = today()
        with self._lock:
            self._db.execute(
                "INSERT INTO usage VALUES (?, ?, ?, ?, ?, ?) ON CONFLICT (token_id, day) DO UPDATE SET "
                "agent_runs = agent_runs + excluded.agent_runs, "
                "agent_iterations = agent_iterations + excluded.agent_iterations, "
                "input_tokens = input_tokens + excluded.input_tokens, "
                "output_tokens = output_tokens + excluded.output_tokens",
                (token_id, day, agent_runs, iterations, input_tokens, output_tokens),
            )
            self._db.commit()
        return self.usage(token_id, day)

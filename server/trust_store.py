"""The root of trust's stored state: the chain of roots (``roots``: version → the
``root.<N>.json`` bytes) and the current signed timestamp (``timestamps``: only the newest row is
kept). Both are written with a conditional insert on the version (the primary key), so two
replicas racing to store one version cannot both win: the loser reads the winner's."""

from __future__ import annotations

from dataclasses import dataclass

from .database import Database

TRUST_SCHEMA = """
CREATE TABLE IF NOT EXISTS roots (
    version INTEGER PRIMARY KEY,
    root BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS timestamps (
    version INTEGER PRIMARY KEY,
    timestamp BLOB NOT NULL
);
"""

TRUST_COLUMNS = (
    ("versions", "co_signatures", "BLOB NOT NULL DEFAULT ''"),
    ("devices", "root_version", "INTEGER NOT NULL DEFAULT 0"),
    ("devices", "trust_stale", "INTEGER NOT NULL DEFAULT 0"),
    ("devices", "seconds_since_fresh", "INTEGER NOT NULL DEFAULT 0"),
)
"""Columns schema 8 adds to tables of schema 7 (a new database gets them in its CREATE TABLE)."""


@dataclass(frozen=True)
class StoredTimestamp:
    version: int
    data: bytes


_NO_LIMIT = 1 << 62  # PostgreSQL refuses LIMIT -1


class TrustStore:
    """Roots and the current timestamp on the metadata database."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def roots(self, after_version: int = 0, limit: int | None = None) -> list[tuple[int, bytes]]:
        """The stored roots above ``after_version``, by increasing version."""
        rows = self._db.execute(
            "SELECT version, root FROM roots WHERE version > ? ORDER BY version LIMIT ?",
            (after_version, _NO_LIMIT if limit is None else limit),
        )
        return [(int(v), bytes(r)) for v, r in rows]

    def latest_root(self) -> tuple[int, bytes] | None:
        row = self._db.execute("SELECT version, root FROM roots ORDER BY version DESC LIMIT 1").fetchone()
        return None if row is None else (int(row[0]), bytes(row[1]))

    def add_root(self, version: int, data: bytes) -> bool:
        """Store root ``version`` unless one is stored already (then False: another replica won).
        It must follow the latest stored version, which the caller checked against the root rules."""
        with self._db.transaction("roots"):
            latest = self._db.execute("SELECT COALESCE(MAX(version), 0) FROM roots").fetchone()[0]
            if int(latest) != version - 1:
                return False
            self._db.execute("INSERT INTO roots (version, root) VALUES (?, ?)", (version, data))
            self._db.notify(f"root:{version}")
        return True

    def timestamp(self) -> StoredTimestamp | None:
        row = self._db.execute("SELECT version, timestamp FROM timestamps ORDER BY version DESC LIMIT 1").fetchone()
        return None if row is None else StoredTimestamp(int(row[0]), bytes(row[1]))

    def put_timestamp(self, version: int, data: bytes) -> bool:
        """Make ``version`` the current timestamp if it is the next one (False when another
        replica stored that version or a later one first); older rows go."""
        with self._db.transaction("timestamps"):
            current = self._db.execute("SELECT COALESCE(MAX(version), 0) FROM timestamps").fetchone()[0]
            if int(current) != version - 1:
                return False
            self._db.execute("INSERT INTO timestamps (version, timestamp) VALUES (?, ?)", (version, data))
            self._db.execute("DELETE FROM timestamps WHERE version < ?", (version,))
        return True

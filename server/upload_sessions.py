"""Vault uploads in progress, as rows of the server's database (schema 5).

Each upload reserves its announced size against its owner's quota when it starts, so the
quota counts every byte the owner holds, unfinished uploads included, and stays exact however
many uploads run at once. An upload belongs to the owner, not to the device that began it: the
owner's devices share one vault, a blob is stored once per owner, and any of its devices may
resume it. A reservation ends when the blob is stored (in the same transaction), when the
upload is deleted or fails its hash, when it was idle longer than the server's TTL, or when the
device that began it is revoked; the sweep then removes its partial file.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from .database import Database

UPLOADS_SCHEMA = """
CREATE TABLE IF NOT EXISTS uploads (
    owner_id TEXT NOT NULL,
    sha256 TEXT NOT NULL,
    device_id TEXT NOT NULL,
    size INTEGER NOT NULL,
    touched_at REAL NOT NULL,
    PRIMARY KEY (owner_id, sha256)
);
CREATE UNIQUE INDEX IF NOT EXISTS blobs_one_per_owner ON blobs (owner_id, sha256);
"""


@dataclass(frozen=True)
class Reservation:
    """Whether an upload of ``size`` fits: ``stored`` bytes of blobs plus ``reserved`` bytes of
    the owner's other unfinished uploads plus ``size`` within ``quota``."""

    fits: bool
    stored: int
    reserved: int


def reserve(db: Database, owner_id: str, device_id: str, sha256: str, size: int, now: float,
            quota: int) -> Reservation:
    """Inside the caller's transaction: reserve (or renew) the upload when it fits the quota."""
    stored = db.execute("SELECT COALESCE(SUM(size), 0) FROM blobs WHERE owner_id=?", (owner_id,)).fetchone()[0]
    reserved = db.execute("SELECT COALESCE(SUM(size), 0) FROM uploads WHERE owner_id=? AND sha256<>?",
                          (owner_id, sha256)).fetchone()[0]
    fits = stored + reserved + size <= quota
    if fits:
        db.execute("INSERT INTO uploads VALUES (?, ?, ?, ?, ?) ON CONFLICT (owner_id, sha256) DO UPDATE SET "
                   "device_id=excluded.device_id, size=excluded.size, touched_at=excluded.touched_at",
                   (owner_id, sha256, device_id, size, now))
    return Reservation(fits, int(stored), int(reserved))


def release(db: Database, owner_id: str, sha256: str) -> None:
    db.execute("DELETE FROM uploads WHERE owner_id=? AND sha256=?", (owner_id, sha256))


def release_device(db: Database, device_id: str) -> None:
    """End every reservation the device began (it is being revoked)."""
    db.execute("DELETE FROM uploads WHERE device_id=?", (device_id,))


def touch(db: Database, owner_id: str, sha256: str, now: float) -> None:
    db.execute("UPDATE uploads SET touched_at=? WHERE owner_id=? AND sha256=?", (now, owner_id, sha256))


def expire(db: Database, idle_since: float, in_progress: Collection[tuple[str, str]]) -> list[tuple[str, str]]:
    """Inside the caller's transaction: end the reservations idle since before ``idle_since``
    (not those ``in_progress``); returns their (owner id, SHA-256)."""
    stale = [key for key in db.execute("SELECT owner_id, sha256 FROM uploads WHERE touched_at < ?", (idle_since,))
             if key not in in_progress]
    db.executemany("DELETE FROM uploads WHERE owner_id=? AND sha256=? AND touched_at < ?",
                   [(*key, idle_since) for key in stale])  # not one a replica renewed meanwhile
    return stale


def reserved_keys(db: Database) -> set[tuple[str, str]]:
    return set(db.execute("SELECT owner_id, sha256 FROM uploads"))

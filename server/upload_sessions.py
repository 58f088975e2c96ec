"""Vault uploads in progress, as rows of the server's database (schema 5; leases since schema 7).

Each upload reserves its announced size against its owner's quota when it starts, so the
quota counts every byte the owner holds, unfinished uploads included, and stays exact however
many uploads run at once. An upload belongs to the owner, not to the device that began it: the
owner's devices share one vault, a blob is stored once per owner, and any of its devices may
resume it. A reservation ends when the blob is stored (in the same transaction), when the
upload is deleted or fails its hash, when it was idle longer than the server's TTL, or when the
device that began it is revoked; the sweep then removes its partial file.

A row also carries the *lease* of the one call (on any replica) allowed to change the upload's
bytes now: a token and the time it was last renewed. A call takes it in a transaction before it
touches the bytes and renews it while it runs; a lease not renewed for :data:`LEASE_STALE_S`
belongs to a replica that died and may be taken over. ``touched_at`` moves only when bytes
arrive (a header alone does not keep an upload from expiring).
"""

from __future__ import annotations

from dataclasses import dataclass

from .database import Database

UPLOADS_SCHEMA = """
CREATE TABLE IF NOT EXISTS uploads (
    owner_id TEXT NOT NULL,
    sha256 TEXT NOT NULL,
    device_id TEXT NOT NULL,
    size INTEGER NOT NULL,
    touched_at REAL NOT NULL,
    lease_token TEXT NOT NULL DEFAULT '',
    lease_at REAL NOT NULL DEFAULT 0,
    PRIMARY KEY (owner_id, sha256)
);
CREATE UNIQUE INDEX IF NOT EXISTS blobs_one_per_owner ON blobs (owner_id, sha256);
"""
ADD_LEASES = """
ALTER TABLE uploads ADD COLUMN lease_token TEXT NOT NULL DEFAULT '';
ALTER TABLE uploads ADD COLUMN lease_at REAL NOT NULL DEFAULT 0
"""
LEASE_STALE_S = 2.5  # a lease not renewed for this long is a dead replica's: another call may take it over


@dataclass(frozen=True)
class Reservation:
    """Whether an upload of ``size`` fits: ``stored`` bytes of blobs plus ``reserved`` bytes of
    the owner's other unfinished uploads plus ``size`` within ``quota``."""

    fits: bool
    stored: int
    reserved: int


def reserve(db: Database, owner_id: str, device_id: str, sha256: str, size: int, now: float, quota: int) -> Reservation:
    """Inside the caller's transaction: reserve the upload's ``size`` when it fits the quota (its
    idle clock, ``touched_at``, is left as it was: only arriving bytes move it)."""
    stored = db.execute("SELECT COALESCE(SUM(size), 0) FROM blobs WHERE owner_id=?", (owner_id,)).fetchone()[0]
    reserved = db.execute(
        "SELECT COALESCE(SUM(size), 0) FROM uploads WHERE owner_id=? AND sha256<>?", (owner_id, sha256)
    ).fetchone()[0]
    fits = stored + reserved + size <= quota
    if fits:
        db.execute(
            "INSERT INTO uploads (owner_id, sha256, device_id, size, touched_at) VALUES (?, ?, ?, ?, ?) "
            "ON CONFLICT (owner_id, sha256) DO UPDATE SET device_id=excluded.device_id, size=excluded.size",
            (owner_id, sha256, device_id, size, now),
        )
    return Reservation(fits, int(stored), int(reserved))


def take_lease(db: Database, owner_id: str, sha256: str, device_id: str, token: str, now: float) -> bool | None:
    """Inside the caller's transaction (the owner's lock): give the upload's lease to ``token``.
    None when another call holds a live lease; otherwise whether the upload had a reservation
    (a new upload gets a row of size 0 until it reserves, its idle clock starting now)."""
    row = db.execute(
        "SELECT size, lease_token, lease_at FROM uploads WHERE owner_id=? AND sha256=?", (owner_id, sha256)
    ).fetchone()
    if row is not None and row[1] and row[2] >= now - LEASE_STALE_S:
        return None
    db.execute(
        "INSERT INTO uploads (owner_id, sha256, device_id, size, touched_at, lease_token, lease_at) "
        "VALUES (?, ?, ?, 0, ?, ?, ?) ON CONFLICT (owner_id, sha256) DO UPDATE SET "
        "lease_token=excluded.lease_token, lease_at=excluded.lease_at",
        (owner_id, sha256, device_id, now, token, now),
    )
    return row is not None and row[0] > 0


_TOUCHED = "touched_at=CASE WHEN ?=1 THEN ? ELSE touched_at END"  # bytes arrived: the idle clock restarts


def renew_lease(db: Database, owner_id: str, sha256: str, token: str, now: float, bytes_arrived: bool) -> bool:
    """Renew ``token``'s lease (and the idle clock when bytes arrived since the last renewal);
    False when the lease is no longer ``token``'s."""
    return (
        db.execute(
            f"UPDATE uploads SET lease_at=?, {_TOUCHED} WHERE owner_id=? AND sha256=? AND lease_token=?",
            (now, int(bytes_arrived), now, owner_id, sha256, token),
        ).rowcount
        > 0
    )


def end_lease(db: Database, owner_id: str, sha256: str, token: str, now: float, bytes_arrived: bool) -> None:
    """``token``'s call ends: its lease goes, and so does a row that never reserved anything."""
    db.execute(
        "DELETE FROM uploads WHERE owner_id=? AND sha256=? AND lease_token=? AND size=0", (owner_id, sha256, token)
    )
    db.execute(
        f"UPDATE uploads SET lease_token='', lease_at=0, {_TOUCHED} WHERE owner_id=? AND sha256=? AND lease_token=?",
        (int(bytes_arrived), now, owner_id, sha256, token),
    )


def release(db: Database, owner_id: str, sha256: str, token: str | None = None) -> bool:
    """End the upload's reservation (only while ``token`` holds its lease, when given); whether it ended."""
    if token is None:
        return db.execute("DELETE FROM uploads WHERE owner_id=? AND sha256=?", (owner_id, sha256)).rowcount > 0
    return (
        db.execute(
            "DELETE FROM uploads WHERE owner_id=? AND sha256=? AND lease_token=?", (owner_id, sha256, token)
        ).rowcount
        > 0
    )


def release_device(db: Database, device_id: str) -> None:
    """End every reservation the device began (it is being revoked)."""
    db.execute("DELETE FROM uploads WHERE device_id=?", (device_id,))


def expire(db: Database, idle_since: float, leased_since: float) -> int:
    """End the reservations idle since before ``idle_since`` whose lease, if any, was last renewed
    before ``leased_since`` (no call is receiving them); returns how many."""
    return db.execute(
        "DELETE FROM uploads WHERE touched_at < ? AND (lease_token = '' OR lease_at < ?)", (idle_since, leased_since)
    ).rowcount


def reserved_keys(db: Database) -> set[tuple[str, str]]:
    return set(db.execute("SELECT owner_id, sha256 FROM uploads"))

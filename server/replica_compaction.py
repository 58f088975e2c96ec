"""Which replica records are superseded, and dropping their sealed bytes (replica compaction).

A record that loses to another live record of its item on every device that could still pull it
is *superseded*: its sealed bytes are dropped (and leave the owner's quota), its row stays for the
idempotency check of a retried push, and pulls skip it. Every function here runs inside the
caller's transaction.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence

# A live record is superseded when another live record of the same item wins over it on every
# device that could still pull it (the devices' merge order, fctkit.edge_runtime.records.beats):
# a tombstone (the earliest one of an item stays); at the same version a higher-ranked via
# ('native'/'backward' over 'forward'), then the smaller SHA-256 of the sealed bytes (the earlier
# of two identical ones); or a record at a higher version when every device of the owner is at
# exactly that version (:common_version; a device further on may have skipped it and so could not
# place the record, only the older one).
_SUPERSEDED = """
SELECT r.sequence, length(r.sealed) FROM replica_records r
WHERE r.owner_id = :owner AND r.superseded = 0 {items} AND EXISTS (
    SELECT 1 FROM replica_records w
    WHERE w.owner_id = r.owner_id AND w.item_id = r.item_id AND w.superseded = 0 AND w.sequence != r.sequence AND (
        (w.tombstone = 1 AND (r.tombstone = 0 OR w.sequence < r.sequence))
        OR (w.tombstone = 0 AND r.tombstone = 0 AND (
            w.version > r.version AND w.version = :common_version
            OR w.version = r.version AND ((w.via != 'forward') > (r.via != 'forward')
                OR (w.via != 'forward') = (r.via != 'forward') AND (w.sealed_sha256, w.sequence) < (r.sealed_sha256, r.sequence))))))
"""


def unique_chunks(values: Sequence, size: int = 500) -> list[list]:
    """``values`` without repeats, in order, cut into lists of at most ``size`` (SQLite's limit
    on the ``?`` of one ``IN (...)`` is what keeps them short)."""
    unique = list(dict.fromkeys(values))
    return [unique[start:start + size] for start in range(0, len(unique), size)]


def common_version(db: sqlite3.Connection, owner_id: str | None) -> int:
    """The version every (unrevoked) device of the owner reports, or 0 while they differ."""
    lowest, highest = db.execute("SELECT MIN(version), MAX(version) FROM devices WHERE owner_id=? AND revoked_at IS NULL",
                                 (owner_id,)).fetchone()
    return lowest if lowest == highest and lowest else 0


def compact_replica(db: sqlite3.Connection, owner_id: str, items: Sequence[str] | None = None) -> int:
    """Mark the owner's superseded records (all of them, or those of ``items``) and drop their
    sealed bytes; returns how many. Their rows stay (empty), so a retried push of one is still
    answered with the sequence number it got. Runs inside the caller's transaction."""
    params = {"owner": owner_id, "common_version": common_version(db, owner_id)}
    found: list[tuple[int, int]] = []
    if items is None:
        found = db.execute(_SUPERSEDED.format(items=""), params).fetchall()
    else:
        for chunk in unique_chunks(items):
            marks = ",".join(f":i{k}" for k in range(len(chunk)))
            found += db.execute(_SUPERSEDED.format(items=f"AND r.item_id IN ({marks})"),
                                {**params, **{f"i{k}": item for k, item in enumerate(chunk)}}).fetchall()
    if found:
        db.executemany("UPDATE replica_records SET superseded = 1, sealed = X'' WHERE owner_id=? AND sequence=?",
                       [(owner_id, sequence) for sequence, _ in found])
        db.execute("UPDATE replica_owners SET sealed_bytes = sealed_bytes - ? WHERE owner_id=?",
                   (sum(size for _, size in found), owner_id))
    return len(found)

"""The replica's tables, which of its rows are superseded, and dropping sealed bytes no device
needs any more (replica compaction).

A record is a block of rows (a single-row record is a block of one): ``replica_blocks`` keeps each
one's plaintext header and sealed bytes, ``replica_items`` each row's item id and whether it is
superseded. A row that loses to another live row of its item on every device that could still
pull it is *superseded*: pulls tell devices to skip it, and once every row of a block is, the
block's sealed bytes are dropped (and leave the owner's quota). The block's entry stays for the
idempotency check of a retried push. Every function here runs inside the caller's transaction.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence

from .database import Database

REPLICA_SCHEMA = """
CREATE TABLE IF NOT EXISTS replica_blocks (
    owner_id TEXT NOT NULL,
    sequence INTEGER NOT NULL,
    device_id TEXT NOT NULL,
    change_id INTEGER NOT NULL,
    block INTEGER NOT NULL,
    version INTEGER NOT NULL,
    origin_version INTEGER NOT NULL,
    via TEXT NOT NULL,
    tombstone INTEGER NOT NULL,
    sealed_sha256 TEXT NOT NULL,
    created_at TEXT NOT NULL,
    rows INTEGER NOT NULL,
    live_rows INTEGER NOT NULL,
    sealed BLOB NOT NULL,
    PRIMARY KEY (owner_id, sequence),
    UNIQUE (device_id, change_id)
);
CREATE INDEX IF NOT EXISTS replica_live_blocks ON replica_blocks (owner_id, sequence) WHERE live_rows > 0;
CREATE TABLE IF NOT EXISTS replica_items (
    owner_id TEXT NOT NULL,
    sequence INTEGER NOT NULL,
    position INTEGER NOT NULL,
    item_id TEXT NOT NULL,
    superseded INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (owner_id, sequence, position)
);
CREATE INDEX IF NOT EXISTS replica_live_by_item ON replica_items (owner_id, item_id) WHERE superseded = 0;
"""
"""``block`` 1: a block of rows, 0: a record in the single-row format; ``rows`` its rows,
``live_rows`` those not superseded (0: the sealed bytes are dropped); ``sealed`` comes last, so reading the other columns
never walks a large record's overflow pages. A row's entry is small (the block holds its header):
pushing a block writes one short index entry per row."""

# A live row is superseded when another live record of the same item wins over it on every
# device that could still pull it (the devices' merge order, fctkit.edge_runtime.records.beats):
# a tombstone (the earliest one of an item stays); at the same version a higher-ranked via
# ('native'/'backward' over 'forward'), then the smaller SHA-256 of the sealed bytes (the earlier
# of two identical ones); or a record at a higher version when every device of the owner is at
# exactly that version (:common_version; a device further on may have skipped it and so could not
# place the record, only the older one).
SUPERSEDED = """
SELECT r.sequence, r.position FROM replica_items r JOIN replica_blocks rb USING (owner_id, sequence)
WHERE r.owner_id = :owner AND r.superseded = 0 {items} AND EXISTS (
    SELECT 1 FROM replica_items w JOIN replica_blocks wb USING (owner_id, sequence)
    WHERE w.owner_id = r.owner_id AND w.item_id = r.item_id AND w.superseded = 0 AND w.sequence != r.sequence AND (
        (wb.tombstone = 1 AND (rb.tombstone = 0 OR w.sequence < r.sequence))
        OR (wb.tombstone = 0 AND rb.tombstone = 0 AND (
            wb.version > rb.version AND wb.version = :common_version
            OR wb.version = rb.version AND ((wb.via != 'forward') > (rb.via != 'forward')
                OR (wb.via != 'forward') = (rb.via != 'forward')
                   AND (wb.sealed_sha256, w.sequence) < (rb.sealed_sha256, r.sequence))))))
"""


CONTESTED = """
SELECT c.item_id FROM compacting c WHERE (SELECT COUNT(*) FROM (
    SELECT 1 FROM replica_items r WHERE r.owner_id = ? AND r.item_id = c.item_id AND r.superseded = 0 LIMIT 2) AS live) > 1
"""
"""The items (of the temporary table ``compacting``) with more than one live row: one probe of the item index each."""


def unique_chunks(values: Sequence, size: int = 500) -> list[list]:
    """``values`` without repeats, in order, cut into lists of at most ``size`` (SQLite's limit
    on the ``?`` of one ``IN (...)`` is what keeps them short)."""
    unique = list(dict.fromkeys(values))
    return [unique[start : start + size] for start in range(0, len(unique), size)]


COMMON_VERSION = """
SELECT (SELECT MIN(version) FROM devices WHERE owner_id = :owner AND revoked_at IS NULL),
       (SELECT MAX(version) FROM devices WHERE owner_id = :owner AND revoked_at IS NULL)
"""
"""The lowest and highest version of the owner's unrevoked devices: two probes of ``devices_by_owner``
(:data:`~.device_store.DEVICE_INDEXES`), each one descent of the index, whatever the fleet's or
the owner's size (one query with both aggregates would read every entry of the owner instead)."""


def common_version(db: Database, owner_id: str | None) -> int:
    """The version every (unrevoked) device of the owner reports, or 0 while they differ."""
    lowest, highest = db.execute(COMMON_VERSION, {"owner": owner_id}).fetchone()
    return lowest if lowest == highest and lowest else 0


def compact_replica(
    db: Database, owner_id: str, items: Sequence[str] | None = None, *, blocks: Sequence[int] | None = None
) -> int:
    """Mark the owner's superseded rows (all of them when neither ``items`` nor ``blocks`` is given;
    else those of ``items`` and of the items of ``blocks``, just stored; none for empty ones) and drop the sealed bytes of blocks left without a
    live row; returns how many rows. The blocks' entries stay (empty), so a retried push of one
    is still answered with the sequence number it got."""
    params = {"owner": owner_id, "common_version": common_version(db, owner_id)}
    found: list[tuple[int, int]] = []
    if items is None and blocks is None:
        found = db.execute(SUPERSEDED.format(items=""), params).fetchall()
    else:
        for chunk in unique_chunks(_contested(db, owner_id, items or (), blocks or ())):
            marks = ",".join(f":i{k}" for k in range(len(chunk)))
            found += db.execute(
                SUPERSEDED.format(items=f"AND r.item_id IN ({marks})"),
                {**params, **{f"i{k}": item for k, item in enumerate(chunk)}},
            ).fetchall()
    if found:
        db.executemany(
            "UPDATE replica_items SET superseded = 1 WHERE owner_id=? AND sequence=? AND position=?",
            [(owner_id, sequence, position) for sequence, position in found],
        )
        per_block = Counter(sequence for sequence, _ in found)
        db.executemany(
            "UPDATE replica_blocks SET live_rows = live_rows - ? WHERE owner_id=? AND sequence=?",
            [(count, owner_id, sequence) for sequence, count in per_block.items()],
        )
        _drop_dead_blocks(db, owner_id, list(per_block))
    return len(found)


def _contested(db: Database, owner_id: str, items: Sequence[str], blocks: Sequence[int]) -> list[str]:
    """Those of ``items`` (or of the items of ``blocks``) with more than one live row: only they
    can have a superseded one (a push of new items then costs one index probe per row)."""
    db.execute("CREATE TEMP TABLE IF NOT EXISTS compacting (item_id TEXT PRIMARY KEY)")
    db.execute("DELETE FROM compacting")
    db.executemany("INSERT INTO compacting VALUES (?) ON CONFLICT DO NOTHING", [(i,) for i in dict.fromkeys(items)])
    for chunk in unique_chunks(blocks):
        db.execute(
            f"INSERT INTO compacting SELECT item_id FROM replica_items WHERE owner_id = ? "
            f"AND sequence IN ({','.join('?' * len(chunk))}) ON CONFLICT DO NOTHING",
            (owner_id, *chunk),
        )
    return [row[0] for row in db.execute(CONTESTED, (owner_id,))]


def _drop_dead_blocks(db: Database, owner_id: str, sequences: Sequence[int]) -> None:
    """Drop the sealed bytes of those blocks that have no live row left, and give them back to the quota."""
    dead: list[tuple[int, int]] = []
    for chunk in unique_chunks(sequences):
        dead += db.execute(
            f"SELECT sequence, length(sealed) FROM replica_blocks WHERE owner_id=? AND live_rows=0 "
            f"AND length(sealed) > 0 AND sequence IN ({','.join('?' * len(chunk))})",
            (owner_id, *chunk),
        ).fetchall()
    if dead:
        db.executemany(
            "UPDATE replica_blocks SET sealed = ? WHERE owner_id=? AND sequence=?",
            [(b"", owner_id, sequence) for sequence, _ in dead],
        )
        db.execute(
            "UPDATE replica_owners SET sealed_bytes = sealed_bytes - ? WHERE owner_id=?",
            (sum(size for _, size in dead), owner_id),
        )

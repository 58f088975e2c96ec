"""The owners' replicated gallery records (``replica_blocks``, ``replica_items``,
``replica_owners``), sealed: the server stores ciphertext only.

A record is a block of rows sealed together (a single-row record is a block of one). Records get
a per-owner sequence number, assigned in the transaction that stores them; ``(device_id,
change_id)`` is unique, so a retried push finds its records already stored and never duplicates
them. Superseded rows are compacted away (:mod:`.replica_compaction`): pulls name them, and skip
blocks left without a live row.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

from .database import Database
from .device_store import owner_lock
from .replica_compaction import compact_replica, unique_chunks


@dataclass(frozen=True)
class ReplicaRecord:
    """One sealed record of an owner's replica: a block of rows of one version tag (or of
    tombstones), or a single-row record (``block`` False, one item id). See the Vault
    service's SealedRecord."""

    change_id: int
    item_ids: tuple[str, ...]
    version: int
    origin_version: int
    via: str
    tombstone: bool
    sealed: bytes
    block: bool = True
    sequence: int = 0  # assigned by the server
    superseded: tuple[int, ...] = ()  # on pull: positions of rows compacted away


class ReplicaQuotaExceeded(Exception):
    """A push refused whole: its new records' sealed bytes would take the owner past the quota."""

    def __init__(self, used: int, extra: int, quota: int) -> None:
        super().__init__(f"{used} sealed bytes stored + {extra} new > {quota}")
        self.used, self.extra, self.quota = used, extra, quota


@dataclass(frozen=True)
class PushOutcome:
    stored: int
    already_stored: int
    last_sequence: int
    sequences: tuple[int, ...] = ()  # each record's, in push order
    stored_rows: int = 0
    already_stored_rows: int = 0


class ReplicaStore:
    """The owners' replicas on the metadata database."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def push_records(
        self, owner_id: str, device_id: str, records: Sequence[ReplicaRecord], now: str, quota: int
    ) -> PushOutcome:
        """Store ``records`` in one transaction, each new one under the owner's next sequence
        number; a record whose (device, change id) is already stored is left as it is (and not
        counted against ``quota``: a retried push is answered even at a full quota).
        :class:`ReplicaQuotaExceeded` (nothing stored) when the new ones do not fit."""
        with self._db.transaction(owner_lock(owner_id)):
            used, last = self.replica_usage(owner_id)
            size = used
            assigned = self._stored_sequences(device_id, [r.change_id for r in records])
            blocks, rows, sequences = [], [], []
            for record in records:
                if record.change_id not in assigned:
                    last += 1
                    assigned[record.change_id] = last
                    size += len(record.sealed)
                    sha = hashlib.sha256(record.sealed).hexdigest()
                    blocks.append(
                        (
                            owner_id,
                            last,
                            device_id,
                            record.change_id,
                            int(record.block),
                            record.version,
                            record.origin_version,
                            record.via,
                            int(record.tombstone),
                            sha,
                            now,
                            len(record.item_ids),
                            len(record.item_ids),
                            record.sealed,
                        )
                    )
                    rows += [(owner_id, last, position, item_id) for position, item_id in enumerate(record.item_ids)]
                sequences.append(assigned[record.change_id])
            if size > quota:
                raise ReplicaQuotaExceeded(used, size - used, quota)
            self._db.executemany("INSERT INTO replica_blocks VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", blocks)
            self._db.executemany(
                "INSERT INTO replica_items (owner_id, sequence, position, item_id) VALUES (?, ?, ?, ?)", rows
            )
            self._db.execute(
                "INSERT INTO replica_owners VALUES (?, ?, ?) ON CONFLICT (owner_id) DO UPDATE SET "
                "last_sequence=excluded.last_sequence, sealed_bytes=excluded.sealed_bytes",
                (owner_id, last, size),
            )
            compact_replica(self._db, owner_id, blocks=[block[1] for block in blocks])
        rows_stored = len(rows)
        self._db.grew(("replica_items", "replica_blocks"), rows_stored)
        return PushOutcome(
            len(blocks),
            len(records) - len(blocks),
            last,
            tuple(sequences),
            rows_stored,
            sum(len(r.item_ids) for r in records) - rows_stored,
        )

    def _stored_sequences(self, device_id: str, change_ids: Sequence[int]) -> dict[int, int]:
        """change id -> sequence of the device's records already stored among ``change_ids``."""
        found: dict[int, int] = {}
        for chunk in unique_chunks(change_ids):
            found.update(
                self._db.execute(
                    f"SELECT change_id, sequence FROM replica_blocks WHERE device_id=? AND change_id IN ({','.join('?' * len(chunk))})",
                    (device_id, *chunk),
                )
            )
        return found

    def pull_records(
        self, owner_id: str, after_sequence: int, max_rows: int, max_sealed_bytes: int
    ) -> list[ReplicaRecord]:
        """The owner's next records with a live row after ``after_sequence``, in sequence order:
        at most ``max_rows`` rows and ``max_sealed_bytes`` (at least one record), each with its
        superseded positions."""
        picked: list[int] = []
        rows = size = 0
        for sequence, count, length in self._db.execute(
            "SELECT sequence, rows, length(sealed) FROM replica_blocks WHERE owner_id=? AND sequence>? AND live_rows>0 "
            "ORDER BY sequence LIMIT ?",
            (owner_id, after_sequence, max_rows),
        ).fetchall():
            if picked and (rows + count > max_rows or size + length > max_sealed_bytes):
                break
            picked.append(sequence)
            rows, size = rows + count, size + length
        return [self._record(owner_id, sequence) for sequence in picked]

    def _record(self, owner_id: str, sequence: int) -> ReplicaRecord:
        change_id, block, version, origin, via, tombstone, sealed = self._db.execute(
            "SELECT change_id, block, version, origin_version, via, tombstone, sealed FROM replica_blocks "
            "WHERE owner_id=? AND sequence=?",
            (owner_id, sequence),
        ).fetchone()
        entries = self._db.execute(
            "SELECT item_id, superseded FROM replica_items WHERE owner_id=? AND sequence=? ORDER BY position",
            (owner_id, sequence),
        ).fetchall()
        return ReplicaRecord(
            change_id,
            tuple(item for item, _ in entries),
            version,
            origin,
            via,
            bool(tombstone),
            bytes(sealed),
            bool(block),
            sequence,
            tuple(k for k, (_, dead) in enumerate(entries) if dead),
        )

    def replica_usage(self, owner_id: str) -> tuple[int, int]:
        """(sealed bytes, highest sequence number) of the owner's replica."""
        row = self._db.execute(
            "SELECT sealed_bytes, last_sequence FROM replica_owners WHERE owner_id=?", (owner_id,)
        ).fetchone()
        return (int(row[0]), int(row[1])) if row else (0, 0)

    def compact_replica_page(self, owner_id: str, after_item: str, limit: int) -> str | None:
        """Compact the records of the owner's next ``limit`` item ids after ``after_item`` (in
        one transaction); the last item id done, or None when there were none left."""
        with self._db.transaction(owner_lock(owner_id)):
            items = [
                row[0]
                for row in self._db.execute(
                    "SELECT DISTINCT item_id FROM replica_items WHERE owner_id=? AND superseded=0 AND item_id>? "
                    "ORDER BY item_id LIMIT ?",
                    (owner_id, after_item, limit),
                )
            ]
            if items:
                compact_replica(self._db, owner_id, items)
        return items[-1] if items else None

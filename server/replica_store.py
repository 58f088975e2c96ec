"""The owners' replicated gallery records (``replica_records``, ``replica_owners``), sealed:
the server stores ciphertext only.

Records get a per-owner sequence number, assigned in the transaction that stores them;
``(device_id, change_id)`` is unique, so a retried push finds its records already stored and
never duplicates them. Superseded records are compacted away (:mod:`.replica_compaction`):
pulls skip them.
"""

from __future__ import annotations

import hashlib
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass

from .replica_compaction import compact_replica, unique_chunks
from .sqlite_transaction import Transaction


@dataclass(frozen=True)
class ReplicaRecord:
    """One sealed gallery record of an owner's replica (see the Vault service's SealedRecord)."""

    change_id: int
    item_id: str
    version: int
    origin_version: int
    via: str
    tombstone: bool
    sealed: bytes
    sequence: int = 0  # assigned by the server


@dataclass(frozen=True)
class PushOutcome:
    stored: int
    already_stored: int
    last_sequence: int
    sequences: tuple[int, ...] = ()  # each record's, in push order


class ReplicaStore:
    """The owners' replicas on the metadata database."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def push_records(self, owner_id: str, device_id: str, records: Sequence[ReplicaRecord], now: str) -> PushOutcome:
        """Store ``records`` in one transaction, each new one under the owner's next sequence
        number; a record whose (device, change id) is already stored is left as it is."""
        with Transaction(self._db):
            size, last = self.replica_usage(owner_id)
            assigned = self._stored_sequences(device_id, [r.change_id for r in records])
            new_rows, sequences = [], []
            for record in records:
                if record.change_id not in assigned:
                    last += 1
                    assigned[record.change_id] = last
                    size += len(record.sealed)
                    new_rows.append((owner_id, last, device_id, record.change_id, record.item_id, record.version,
                                     record.origin_version, record.via, int(record.tombstone), record.sealed, now,
                                     hashlib.sha256(record.sealed).hexdigest()))
                sequences.append(assigned[record.change_id])
            self._db.executemany(
                "INSERT INTO replica_records (owner_id, sequence, device_id, change_id, item_id, version, origin_version, "
                "via, tombstone, sealed, created_at, sealed_sha256) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)", new_rows)
            self._db.execute("INSERT OR REPLACE INTO replica_owners VALUES (?, ?, ?)", (owner_id, last, size))
            compact_replica(self._db, owner_id, [row[4] for row in new_rows])
        stored = len(new_rows)
        return PushOutcome(stored, len(records) - stored, last, tuple(sequences))

    def _stored_sequences(self, device_id: str, change_ids: Sequence[int]) -> dict[int, int]:
        """change id -> sequence of the device's records already stored among ``change_ids``."""
        found: dict[int, int] = {}
        for chunk in unique_chunks(change_ids):
            found.update(self._db.execute(
                f"SELECT change_id, sequence FROM replica_records WHERE device_id=? AND change_id IN ({','.join('?' * len(chunk))})",
                (device_id, *chunk)))
        return found

    def pull_records(self, owner_id: str, after_sequence: int, limit: int) -> list[ReplicaRecord]:
        rows = self._db.execute(
            "SELECT change_id, item_id, version, origin_version, via, tombstone, sealed, sequence FROM replica_records "
            "WHERE owner_id=? AND sequence>? AND superseded=0 ORDER BY sequence LIMIT ?",
            (owner_id, after_sequence, limit),
        )
        return [ReplicaRecord(c, i, v, o, via, bool(t), bytes(s), seq) for c, i, v, o, via, t, s, seq in rows]

    def replica_usage(self, owner_id: str) -> tuple[int, int]:
        """(sealed bytes, highest sequence number) of the owner's replica."""
        row = self._db.execute("SELECT sealed_bytes, last_sequence FROM replica_owners WHERE owner_id=?", (owner_id,)).fetchone()
        return (int(row[0]), int(row[1])) if row else (0, 0)

    def compact_replica_page(self, owner_id: str, after_item: str, limit: int) -> str | None:
        """Compact the records of the owner's next ``limit`` item ids after ``after_item`` (in
        one transaction); the last item id done, or None when there were none left."""
        with Transaction(self._db):
            items = [row[0] for row in self._db.execute(
                "SELECT DISTINCT item_id FROM replica_records WHERE owner_id=? AND superseded=0 AND item_id>? "
                "ORDER BY item_id LIMIT ?", (owner_id, after_item, limit))]
            if items:
                compact_replica(self._db, owner_id, items)
        return items[-1] if items else None

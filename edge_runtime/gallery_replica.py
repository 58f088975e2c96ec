"""The gallery's side of replication and the vault (:mod:`.replication`, :mod:`.backfill`): the
outbox of sealed originals to upload, the log of changes to seal and push, pulled records
merged in, and removed items whose originals are to be deleted. Tables: :mod:`.gallery_schema`.

A :class:`ReplicaLog` belongs to one :class:`~fctkit.edge_runtime.gallery.Gallery`
(``gallery.replica_log``) and shares its connection; the rows it writes go through the gallery
(:class:`GalleryRows`), so they are sealed and counted as every other row is.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from fctkit.errors import GalleryError, InputError

from .gallery_rows import LoadedRows, NewRow, VersionTag
from .gallery_vectors import LabelOpener, VectorBlocks
from .sqlite_file import id_chunks, read_snapshot, transaction


@dataclass(frozen=True)
class ItemState:
    """An item's replication state: its live tag (None: no row), the record its content is
    (None: an unsealed local change) and whether it was removed."""

    tag: VersionTag | None
    record_sha256: str | None
    tombstoned: bool


@dataclass(frozen=True)
class ReplicaWrite:
    """What merging one record does (see :meth:`ReplicaLog.merge_replica`): ``kind`` 'row' (replace
    the item's row; ``record_sha256`` None logs it as a local change to push), 'tombstone',
    'pending' (keep ``sealed`` for a version not installed yet) or 'ignore'."""

    kind: str
    item_id: str
    tag: VersionTag | None = None
    embedding: np.ndarray | None = None
    side_info: np.ndarray | None = None
    label: str | None = None
    vault_sha256: str | None = None
    record_sha256: str | None = None
    sequence: int = 0
    sealed: bytes = b""


@dataclass(frozen=True)
class InsertedRow:
    """A replicated row to insert under a free row id (a merge inserts its rows together, in blocks)."""

    row_id: int
    row: NewRow
    tag: VersionTag
    vault_sha256: str | None
    record_sha256: str | None


@dataclass(frozen=True)
class SealedChange:
    """A change sealed for pushing: ``tag`` is the row state it was sealed from (None: tombstone)."""

    change_id: int
    item_id: str
    tag: VersionTag | None
    sealed: bytes
    sha256: str


class GalleryRows(Protocol):
    """What a replica log uses of its gallery, inside the log's transactions (a protocol because
    the gallery module imports this one)."""

    def meta(self, key: str, default: str | None = None) -> str | None: ...

    def _set_meta(self, values: dict[str, str | None]) -> None: ...

    def _tables(self) -> tuple[str, str]: ...

    def _tombstoned(self, item_ids: Sequence[str]) -> list[str]: ...

    def _insert_rows(self, live: str, rows: Sequence[InsertedRow]) -> None: ...

    def _remove_item(self, item_id: str, *, tombstone: bool = True) -> bool: ...

    def _log_changes(self, item_ids: Sequence[str] = ()) -> None: ...


class ReplicaLog:
    """The outbox, change log, tombstones and pending records of one gallery connection."""

    def __init__(self, gallery: GalleryRows, connection: sqlite3.Connection, vectors: VectorBlocks, open_label: LabelOpener) -> None:
        self._gallery = gallery
        self._db = connection
        self._vectors = vectors
        self._open_label = open_label

    # -- outbox ----------------------------------------------------------------------------

    def outbox(self) -> list[tuple[str, bytes]]:
        return list(self._db.execute("SELECT item_id, blob FROM outbox ORDER BY item_id"))

    def outbox_size(self) -> int:
        return self._db.execute("SELECT COUNT(*) FROM outbox").fetchone()[0]

    def mark_uploaded(self, item_id: str, sha256: str) -> None:
        with transaction(self._db):
            self._db.execute("UPDATE items SET vault_sha256 = ? WHERE item_id = ?", (sha256, item_id))
            self._db.execute("DELETE FROM outbox WHERE item_id = ?", (item_id,))

    def vault_sha256(self, item_id: str) -> str | None:
        row = self._db.execute("SELECT vault_sha256 FROM items WHERE item_id = ?", (item_id,)).fetchone()
        if row is None:
            raise InputError(f"item {item_id!r} is not in the gallery")
        return row[0]

    # -- replication -----------------------------------------------------------------------

    @property
    def replica_cursor(self) -> int:
        """The owner's last sequence number merged into this gallery."""
        return int(self._gallery.meta("replica_cursor", "0"))

    def replication_counts(self) -> dict[str, int]:
        """Changes not yet acknowledged by the server (unsealed + sealed) and pending records."""
        one = lambda sql: self._db.execute(sql).fetchone()[0]  # noqa: E731
        return {"cursor": self.replica_cursor, "unpushed": one("SELECT COUNT(*) FROM changes"),
                "pending": one("SELECT COUNT(*) FROM pending_records"), "tombstones": one("SELECT COUNT(*) FROM tombstones")}

    def unsealed_changes(self, limit: int) -> list[tuple[int, str, bool]]:
        """(change id, item id, tombstone) of changes to seal, oldest first; an item whose
        original still waits in the outbox is not pushed before the original is uploaded."""
        return [(c, i, bool(t)) for c, i, t in self._db.execute(
            "SELECT change_id, item_id, tombstone FROM changes c WHERE sealed IS NULL AND NOT EXISTS "
            "(SELECT 1 FROM outbox o WHERE o.item_id = c.item_id) ORDER BY change_id LIMIT ?", (limit,))]

    def load_items(self, item_ids: Sequence[str]) -> tuple[LoadedRows, dict[str, str | None]]:
        """The live rows of ``item_ids`` (decrypted, with labels) and each one's vault SHA-256."""
        found, shas = [], {}
        with read_snapshot(self._db):
            live, _ = self._gallery._tables()
            for chunk, marks in id_chunks(item_ids):
                found += self._db.execute(
                    f"SELECT row_id, i.item_id, i.origin_version, v.version, v.via, v.block_id, i.label "
                    f"FROM items i JOIN {live} v USING (row_id) WHERE i.item_id IN ({marks}) ORDER BY row_id", chunk).fetchall()
                shas.update(self._db.execute(f"SELECT item_id, vault_sha256 FROM items WHERE item_id IN ({marks})", chunk))
            return self._vectors.open_pointers(found, self._open_label), shas

    def store_sealed(self, changes: Sequence[SealedChange]) -> int:
        """Keep the sealed records of changes (one transaction); a change whose row moved on
        or is gone since it was read is dropped (a newer change stands for it). Returns the
        changes stored."""
        rows = [c for c in changes if c.tag is not None]
        with transaction(self._db):
            live, _ = self._gallery._tables()
            stored = self._db.executemany("UPDATE changes SET sealed = ? WHERE change_id = ? AND sealed IS NULL",
                                          [(c.sealed, c.change_id) for c in changes if c.tag is None]).rowcount
            stored += self._db.executemany(  # guarded: the row still has the tag it was sealed from
                f"UPDATE changes SET sealed = ?, version = ?, origin_version = ?, via = ? WHERE change_id = ? AND sealed IS NULL "
                f"AND EXISTS (SELECT 1 FROM items i JOIN {live} v USING (row_id) WHERE i.item_id = ? AND i.origin_version = ? "
                f"AND v.version = ? AND v.via = ?)",
                [(c.sealed, c.tag.version, c.tag.origin_version, c.tag.via, c.change_id, c.item_id, c.tag.origin_version,
                  c.tag.version, c.tag.via) for c in rows]).rowcount
            self._db.executemany("UPDATE items SET record_sha256 = ? WHERE item_id = ? AND EXISTS "
                                 "(SELECT 1 FROM changes WHERE change_id = ? AND sealed = ?)",
                                 [(c.sha256, c.item_id, c.change_id, c.sealed) for c in rows])
            # still unsealed: the row moved on or is gone since it was read; a newer change (or none) stands for it
            self._db.executemany("DELETE FROM changes WHERE change_id = ? AND sealed IS NULL", [(c.change_id,) for c in changes])
        return stored

    def sealed_changes(self, limit: int) -> list[tuple[int, str, int, int, str, bool, bytes]]:
        """(change id, item id, version, origin version, via, tombstone, sealed) to push, oldest first."""
        return [(c, i, v or 0, o or 0, via or "", bool(t), s) for c, i, v, o, via, t, s in self._db.execute(
            "SELECT change_id, item_id, version, origin_version, via, tombstone, sealed FROM changes "
            "WHERE sealed IS NOT NULL ORDER BY change_id LIMIT ?", (limit,))]

    def mark_pushed(self, change_ids: Sequence[int]) -> None:
        """The server acknowledged these changes: forget them (one transaction)."""
        with transaction(self._db):
            self._db.executemany("DELETE FROM changes WHERE change_id = ?", [(c,) for c in change_ids])

    def originals_to_delete(self) -> list[tuple[str, str]]:
        """(item id, vault SHA-256) of items removed here whose tombstone the server has acknowledged."""
        return list(self._db.execute("SELECT item_id, vault_sha256 FROM tombstones t WHERE vault_sha256 IS NOT NULL "
                                     "AND NOT EXISTS (SELECT 1 FROM changes c WHERE c.item_id = t.item_id)"))

    def forget_original(self, item_id: str) -> None:
        """The removed item's original is gone from the vault."""
        with transaction(self._db):
            self._db.execute("UPDATE tombstones SET vault_sha256 = NULL WHERE item_id = ?", (item_id,))

    def pending_records(self, up_to_version: int) -> list[tuple[int, str, int, int, str, bytes]]:
        """(sequence, item id, version, origin version, via, sealed) of kept records whose version is at most ``up_to_version``."""
        return list(self._db.execute("SELECT sequence, item_id, version, origin_version, via, sealed FROM pending_records "
                                     "WHERE version <= ? ORDER BY sequence", (up_to_version,)))

    def merge_replica(self, records: Sequence[Any], decide: Callable[[Any, ItemState], ReplicaWrite], *,
                      cursor: int | None = None, done_pending: Sequence[int] = ()) -> dict[str, int]:
        """Merge records in one transaction: ``decide(record, state)`` (state read inside the
        transaction, and updated as the batch goes) says what each does; then the cursor is
        set and the ``done_pending`` sequence numbers are dropped, so a crash leaves either
        all of it or none. Returns how many writes of each kind were made."""
        counts: dict[str, int] = {}
        with transaction(self._db):
            if self._gallery.meta("upgrade") is not None:
                raise GalleryError("an upgrade is in progress: finish it before merging replicated records")
            live, _ = self._gallery._tables()
            states = self._item_states(live, [r.item_id for r in records])
            next_row_id = self._db.execute("SELECT COALESCE(MAX(row_id), 0) + 1 FROM items").fetchone()[0]
            inserts: dict[str, InsertedRow] = {}  # written together at the end, sealed in blocks
            for record in records:
                state = states[record.item_id]
                write = decide(record, state)
                if write.kind == "row":
                    self._apply(write, has_row=state.tag is not None, inserts=inserts, row_id=next_row_id)
                    next_row_id += 1
                    states[record.item_id] = ItemState(write.tag, write.record_sha256, False)
                else:
                    self._apply(write, has_row=state.tag is not None, inserts=inserts)
                    if write.kind == "tombstone":
                        states[record.item_id] = ItemState(None, None, True)
                counts[write.kind] = counts.get(write.kind, 0) + 1
            self._gallery._insert_rows(live, list(inserts.values()))
            self._db.executemany("DELETE FROM pending_records WHERE sequence = ?", [(s,) for s in done_pending])
            if cursor is not None and cursor > self.replica_cursor:  # another process may have merged further
                self._gallery._set_meta({"replica_cursor": str(cursor)})
        return counts

    def _item_states(self, live: str, item_ids: Sequence[str]) -> dict[str, ItemState]:
        """Each item's state (inside the caller's transaction)."""
        unique = list(dict.fromkeys(item_ids))
        removed = set(self._gallery._tombstoned(unique))
        states = {i: ItemState(None, None, i in removed) for i in unique}
        for chunk, marks in id_chunks(unique):
            query = (f"SELECT i.item_id, i.origin_version, v.version, v.via, i.record_sha256 FROM items i "
                     f"JOIN {live} v USING (row_id) WHERE i.item_id IN ({marks})")
            for item_id, origin, version, via, sha in self._db.execute(query, chunk):
                states[item_id] = ItemState(VersionTag(origin, version, via), sha, item_id in removed)
        return states

    def _apply(self, write: ReplicaWrite, *, has_row: bool, inserts: dict[str, InsertedRow], row_id: int = 0) -> None:
        """One write of a merge; rows to insert wait in ``inserts`` (an item inserted earlier in
        the same merge is replaced or removed there, not in the file)."""
        if write.kind == "tombstone":
            inserts.pop(write.item_id, None)
            self._gallery._remove_item(write.item_id)
        elif write.kind == "pending":
            tag = write.tag
            self._db.execute("INSERT OR IGNORE INTO pending_records VALUES (?, ?, ?, ?, ?, ?)",
                             (write.sequence, write.item_id, tag.version, tag.origin_version, tag.via, write.sealed))
        elif write.kind == "row":
            if inserts.pop(write.item_id, None) is None and has_row:  # an item without a row has no upload or unsealed change either
                self._gallery._remove_item(write.item_id, tombstone=False)
            row = NewRow(write.item_id, write.embedding, write.side_info, write.label)
            inserts[write.item_id] = InsertedRow(row_id, row, write.tag, write.vault_sha256, write.record_sha256)
            if write.record_sha256 is None:
                self._gallery._log_changes([write.item_id])
        elif write.kind != "ignore":
            raise GalleryError(f"unknown replica write {write.kind!r}")

    def reset_replication(self) -> None:
        """Start replicating afresh (the device joined another owner): cursor 0, no pending or
        sealed records, every row a change to push again."""
        with transaction(self._db):
            self._db.execute("DELETE FROM pending_records")
            self._db.execute("DELETE FROM changes WHERE tombstone = 0")
            self._db.execute("UPDATE changes SET sealed = NULL, version = NULL, origin_version = NULL, via = NULL")
            self._gallery._log_changes([r[0] for r in self._db.execute("SELECT item_id FROM items")])
            self._gallery._set_meta({"replica_cursor": "0"})

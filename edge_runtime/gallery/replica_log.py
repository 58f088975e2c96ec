"""The gallery's side of replication and the vault (:mod:`..replication`, :mod:`..backfill`): the
outbox of sealed originals to upload, the log of changes sealed in blocks and pushed, pulled
blocks merged in (set-based: one pass per block), pulled blocks kept for a version not installed
yet, and removed items whose originals are to be deleted. Tables: :mod:`.schema`.

A :class:`ReplicaLog` belongs to one :class:`~fctkit.edge_runtime.gallery.Gallery`
(``gallery.replica_log``) and shares its connection; the rows it writes go through the gallery
(:class:`GalleryRows`), so they are sealed and counted as every other row is.
"""

from __future__ import annotations

import hashlib
import sqlite3
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol, TypeVar, overload

import numpy as np

from fctkit.errors import GalleryError, InputError

from ..sqlite_file import id_chunks, read_snapshot, transaction
from .blocks import decode_item_ids, encode_item_ids
from .rows import LoadedRows, VersionTag, rows_by_tag, take_rows
from .schema import VECTOR_TABLES
from .vectors import LabelOpener, VectorBlocks


class _OpenedRecord(Protocol):
    @property
    def item_ids(self) -> Sequence[str]: ...


_Record = TypeVar("_Record", bound=_OpenedRecord)  # a pulled record as the caller opened it


@dataclass(frozen=True)
class ItemState:
    """An item's replication state: its live tag (None: no row), the record its content is
    (None: an unsealed local change) and whether it was removed."""

    tag: VersionTag | None
    record_sha256: str | None
    tombstoned: bool


@dataclass(frozen=True)
class ReplicaRows:
    """Rows as a replica block holds them: row k is ``item_ids[k]`` (no vectors for tombstones)."""

    item_ids: tuple[str, ...]
    embeddings: np.ndarray
    side_infos: np.ndarray
    labels: list[str | None]
    vault_sha256s: list[str | None]

    def __len__(self) -> int:
        return len(self.item_ids)

    def take(self, positions: Sequence[int]) -> ReplicaRows:
        return ReplicaRows(
            tuple(self.item_ids[k] for k in positions),
            self.embeddings[list(positions)],
            self.side_infos[list(positions)],
            [self.labels[k] for k in positions],
            [self.vault_sha256s[k] for k in positions],
        )

    @classmethod
    def tombstones(cls, item_ids: Sequence[str]) -> ReplicaRows:
        return cls(
            tuple(item_ids),
            np.zeros((len(item_ids), 0), np.float32),
            np.zeros((len(item_ids), 0), np.float32),
            [None] * len(item_ids),
            [None] * len(item_ids),
        )


BlockSealer = Callable[[VersionTag | None, ReplicaRows], list[tuple[tuple[str, ...], bytes]]]
"""Seals rows of one tag (None: tombstones) as one or more blocks: [(item ids, sealed bytes)]."""


@dataclass(frozen=True)
class OutgoingBlock:
    """Changes sealed for pushing, as one record; ``key`` (its first change id) is the push's
    idempotency key. ``block`` False: a single-row record sealed before blocks (kept as it was)."""

    key: int
    block: bool
    tag: VersionTag | None
    item_ids: tuple[str, ...]
    sealed: bytes


@dataclass(frozen=True)
class PendingBlock:
    """A pulled record this device cannot place yet (its version is not installed), kept sealed."""

    sequence: int
    block: bool
    tag: VersionTag | None  # None: tombstones (merged at once, never kept)
    item_ids: tuple[str, ...]
    skipped: tuple[int, ...]  # positions the server superseded
    sealed: bytes


@dataclass(frozen=True)
class BlockMerge:
    """What merging one pulled record does, decided against its items' states: ``rows`` (positions
    into ``content``) replace or add those items' rows, in space ``tag``; ``tombstones`` removes
    items for good; ``pending`` keeps the record for later. ``record_sha256`` None: the rows were
    moved to this device's version and are logged as local changes to push."""

    content: ReplicaRows | None = None
    rows: Sequence[int] = ()
    tag: VersionTag | None = None
    record_sha256: str | None = None
    tombstones: Sequence[str] = ()
    pending: PendingBlock | None = None
    pending_rows: int = 0  # of the kept record's rows, those that would win now
    ignored: int = 0


@dataclass(frozen=True)
class InsertedRows:
    """Replicated rows of one tag to insert under free row ids from ``first_row_id`` (a merge
    inserts a record's rows together, in blocks)."""

    first_row_id: int
    tag: VersionTag
    rows: ReplicaRows
    record_sha256: str | None


class GalleryRows(Protocol):
    """What a replica log uses of its gallery, inside the log's transactions (a protocol because
    the gallery module imports this one)."""

    @overload
    def meta(self, key: str, default: str) -> str: ...
    @overload
    def meta(self, key: str, default: None = None) -> str | None: ...

    def _set_meta(self, values: dict[str, str | None]) -> None: ...

    def _tables(self) -> tuple[str, str]: ...

    def _tombstoned(self, item_ids: Sequence[str]) -> list[str]: ...

    def _insert_rows(self, live: str, inserted: InsertedRows) -> None: ...

    def _next_row_id(self) -> int: ...

    def _remove_item(
        self,
        item_id: str,
        *,
        tombstone: bool = True,
        delete_original: bool = False,
        keep_queued: bool = False,
        retired: bool = False,
    ) -> bool: ...

    def _log_changes(self, item_ids: Sequence[str] = (), *, tombstone: bool = False) -> None: ...


class ReplicaLog:
    """The outbox, change log, tombstones and pending records of one gallery connection."""

    def __init__(
        self, gallery: GalleryRows, connection: sqlite3.Connection, vectors: VectorBlocks, open_label: LabelOpener
    ) -> None:
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
        """Changes not yet acknowledged by the server (unsealed + sealed), rows of pending records, tombstones."""
        one = lambda sql: self._db.execute(sql).fetchone()[0]  # noqa: E731
        return {
            "cursor": self.replica_cursor,
            "unpushed": one(
                "SELECT (SELECT COUNT(*) FROM changes) + (SELECT COALESCE(SUM(rows), 0) FROM outgoing_blocks)"
            ),
            "pending": one("SELECT COALESCE(SUM(rows), 0) FROM pending_blocks"),
            "tombstones": one("SELECT COUNT(*) FROM tombstones"),
        }

    def load_items(self, item_ids: Sequence[str]) -> tuple[LoadedRows, dict[str, str | None]]:
        """The live rows of ``item_ids`` (decrypted, with labels) and each one's vault SHA-256."""
        with read_snapshot(self._db):
            return self._load_items(item_ids)

    def _load_items(self, item_ids: Sequence[str]) -> tuple[LoadedRows, dict[str, str | None]]:
        found = []
        live, _ = self._gallery._tables()
        for chunk, marks in id_chunks(item_ids):
            found += self._db.execute(
                f"SELECT row_id, i.item_id, i.origin_version, v.version, v.via, v.block_id, i.label, i.vault_sha256 "
                f"FROM items i JOIN {live} v USING (row_id) WHERE i.item_id IN ({marks})",
                chunk,
            ).fetchall()
        found.sort()
        return self._vectors.open_pointers(found, self._open_label), {row[1]: row[7] for row in found}

    def seal_changes(self, limit: int, seal: BlockSealer) -> int:
        """Seal up to ``limit`` logged changes, oldest first, as blocks (one per tag, and one of
        tombstones, cut by ``seal``), in one transaction: rows read, sealed and kept together, so
        a block is what its rows are. An item whose original still waits in the outbox waits
        too; a change whose row is gone (removed without tombstone) is dropped. Returns the
        changes looked at."""
        with transaction(self._db):
            changes = self._db.execute(
                "SELECT change_id, item_id, tombstone FROM changes c WHERE NOT EXISTS "
                "(SELECT 1 FROM outbox o WHERE o.item_id = c.item_id) ORDER BY change_id LIMIT ?",
                (limit,),
            ).fetchall()
            if not changes:
                return 0
            change_of = {item_id: change_id for change_id, item_id, _ in changes}
            removed = [item_id for _, item_id, tombstone in changes if tombstone]
            rows, vault_shas = self._load_items([item_id for _, item_id, tombstone in changes if not tombstone])
            if rows.corrupt:
                row_id, item_id, reason = rows.corrupt[0]
                raise GalleryError(
                    f"row {row_id} ({item_id!r}) cannot be read to replicate it: {reason}; remove it and sync again"
                )
            groups: list[tuple[VersionTag | None, ReplicaRows]] = (
                [(None, ReplicaRows.tombstones(removed))] if removed else []
            )
            for tag, picked in rows_by_tag(rows.tags).items():
                item_ids = tuple(rows.item_ids[k] for k in picked)
                groups.append(
                    (
                        tag,
                        ReplicaRows(
                            item_ids,
                            take_rows(rows.embeddings, picked),
                            take_rows(rows.side_infos, picked),
                            [rows.labels[k] for k in picked],
                            [vault_shas[i] for i in item_ids],
                        ),
                    )
                )
            for group_tag, group in groups:
                for item_ids, sealed in seal(group_tag, group):
                    self._keep_outgoing(group_tag, item_ids, sealed, min(change_of[i] for i in item_ids))
            # all of them: sealed now, or their rows are gone with no tombstone standing for them
            for chunk, marks in id_chunks([c for c, _, _ in changes]):
                self._db.execute(f"DELETE FROM changes WHERE change_id IN ({marks})", chunk)
        return len(changes)

    def _keep_outgoing(self, tag: VersionTag | None, item_ids: tuple[str, ...], sealed: bytes, key: int) -> None:
        self._db.execute(
            "INSERT INTO outgoing_blocks VALUES (?, 1, ?, ?, ?, ?, ?, ?, ?)",
            (key, *(_tag_columns(tag)), int(tag is None), len(item_ids), encode_item_ids(item_ids), sealed),
        )
        if tag is not None:
            sha = hashlib.sha256(sealed).hexdigest()
            for chunk, marks in id_chunks(item_ids):
                self._db.execute(f"UPDATE items SET record_sha256 = ? WHERE item_id IN ({marks})", (sha, *chunk))

    def outgoing(self, max_rows: int) -> list[OutgoingBlock]:
        """Sealed records to push, oldest first, holding at most ``max_rows`` rows (at least one record)."""
        found: list[OutgoingBlock] = []
        rows = 0
        for key, block, version, origin, via, tombstone, item_ids, sealed in self._db.execute(
            "SELECT block_key, block, version, origin_version, via, tombstone, item_ids, sealed FROM outgoing_blocks "
            "ORDER BY block_key"
        ):
            ids = tuple(decode_item_ids(item_ids))
            if found and rows + len(ids) > max_rows:
                break
            found.append(
                OutgoingBlock(key, bool(block), None if tombstone else VersionTag(origin, version, via), ids, sealed)
            )
            rows += len(ids)
        return found

    def _drop_misplaced_origins(self) -> list[str]:
        """Inside a transaction: drop the sealed records whose tag has its origin version above its
        version (the server refuses them; :meth:`~.upgrades.GalleryUpgrades.heal_origins`); returns
        those of their item ids that still have a row (to be logged again)."""
        dropped = self._db.execute(
            "SELECT block_key, item_ids FROM outgoing_blocks WHERE tombstone = 0 AND origin_version > version"
        ).fetchall()
        self._db.executemany("DELETE FROM outgoing_blocks WHERE block_key = ?", [(k,) for k, _ in dropped])
        item_ids = [i for _, ids in dropped for i in decode_item_ids(ids)]
        return [
            i
            for chunk, marks in id_chunks(item_ids)
            for (i,) in self._db.execute(f"SELECT item_id FROM items WHERE item_id IN ({marks})", chunk)
        ]

    def mark_pushed(self, keys: Sequence[int]) -> None:
        """The server acknowledged these records: forget them (one transaction)."""
        with transaction(self._db):
            self._db.executemany("DELETE FROM outgoing_blocks WHERE block_key = ?", [(k,) for k in keys])

    def originals_to_delete(self) -> list[tuple[str, str]]:
        """(item id, vault SHA-256) of items removed here whose tombstone the server has acknowledged
        (none while any tombstone waits, unsealed or sealed: the owner's other devices learn first)."""
        return list(
            self._db.execute(
                "SELECT item_id, vault_sha256 FROM tombstones t WHERE vault_sha256 IS NOT NULL "
                "AND NOT EXISTS (SELECT 1 FROM changes c WHERE c.item_id = t.item_id) "
                "AND NOT EXISTS (SELECT 1 FROM outgoing_blocks WHERE tombstone = 1)"
            )
        )

    def forget_original(self, item_id: str) -> None:
        """The removed item's original is gone from the vault."""
        with transaction(self._db):
            self._db.execute("UPDATE tombstones SET vault_sha256 = NULL WHERE item_id = ?", (item_id,))

    def pending_blocks(self, up_to_version: int) -> list[PendingBlock]:
        """Kept records whose version is at most ``up_to_version``, in sequence order."""
        return [
            PendingBlock(
                seq,
                bool(block),
                VersionTag(origin, version, via),
                tuple(decode_item_ids(ids)),
                tuple(int(k) for k in skipped.split(",") if k),
                sealed,
            )
            for seq, block, version, origin, via, ids, skipped, sealed in self._db.execute(
                "SELECT sequence, block, version, origin_version, via, item_ids, skipped, sealed FROM pending_blocks "
                "WHERE version <= ? ORDER BY sequence",
                (up_to_version,),
            )
        ]

    def merge_blocks(
        self,
        records: Sequence[_Record],
        decide: Callable[[_Record, dict[str, ItemState]], BlockMerge],
        *,
        cursor: int | None = None,
        done_pending: Sequence[int] = (),
    ) -> dict[str, int]:
        """Merge pulled records in one transaction, one pass per record: ``decide(record, states)``
        (the states of its items, read inside the transaction) says what it does; then the cursor
        is set and the ``done_pending`` sequence numbers are dropped, so a crash leaves either all
        of it or none. Returns how many rows of each kind were written."""
        counts = {"row": 0, "tombstone": 0, "pending": 0, "ignore": 0}
        with transaction(self._db):
            if self._gallery.meta("upgrade") is not None:
                raise GalleryError("an upgrade is in progress: finish it before merging replicated records")
            live, _ = self._gallery._tables()
            for record in records:
                states = self._item_states(live, record.item_ids)
                merge = decide(record, states)
                self._apply(live, merge, states)
                counts["row"] += len(merge.rows)
                counts["tombstone"] += len(merge.tombstones)
                counts["pending"] += merge.pending_rows
                counts["ignore"] += merge.ignored
            self._db.executemany("DELETE FROM pending_blocks WHERE sequence = ?", [(s,) for s in done_pending])
            if cursor is not None and cursor > self.replica_cursor:  # another process may have merged further
                self._gallery._set_meta({"replica_cursor": str(cursor)})
        return counts

    def _item_states(self, live: str, item_ids: Sequence[str]) -> dict[str, ItemState]:
        """The states of those items that have a row or a tombstone (inside the caller's transaction)."""
        states = {i: ItemState(None, None, True) for i in self._gallery._tombstoned(item_ids)}
        for chunk, marks in id_chunks(item_ids):
            query = (
                f"SELECT i.item_id, i.origin_version, v.version, v.via, i.record_sha256 FROM items i "
                f"JOIN {live} v USING (row_id) WHERE i.item_id IN ({marks})"
            )
            for item_id, origin, version, via, sha in self._db.execute(query, chunk):
                states[item_id] = ItemState(VersionTag(origin, version, via), sha, item_id in states)
        return states

    def _apply(self, live: str, merge: BlockMerge, states: dict[str, ItemState]) -> None:
        """The writes of one merged record, set-based: replaced rows' vectors retired together,
        new rows sealed together in blocks."""
        for item_id in merge.tombstones:
            self._gallery._remove_item(item_id)
        if merge.pending is not None:
            kept = merge.pending
            self._db.execute(
                "INSERT OR IGNORE INTO pending_blocks VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?)",
                (
                    kept.sequence,
                    int(kept.block),
                    *_tag_columns(kept.tag),
                    encode_item_ids(kept.item_ids),
                    ",".join(map(str, kept.skipped)),
                    len(kept.item_ids) - len(kept.skipped),
                    kept.sealed,
                ),
            )
        if not merge.rows:
            return
        assert merge.content is not None and merge.tag is not None  # a merge with rows has both
        rows = merge.content.take(merge.rows)
        replaced = [i for i in rows.item_ids if i in states and states[i].tag is not None]
        if replaced:
            row_ids = [
                r
                for chunk, marks in id_chunks(replaced)
                for (r,) in self._db.execute(f"SELECT row_id FROM items WHERE item_id IN ({marks})", chunk)
            ]
            for table in VECTOR_TABLES:
                self._vectors.retire(table, row_ids)
            for item_id in replaced:
                self._gallery._remove_item(item_id, tombstone=False, retired=True)
        self._gallery._insert_rows(
            live, InsertedRows(self._gallery._next_row_id(), merge.tag, rows, merge.record_sha256)
        )
        if merge.record_sha256 is None:
            self._gallery._log_changes(rows.item_ids)

    def reset_replication(self) -> None:
        """Start replicating afresh (the device joined another owner): cursor 0, no pending or
        sealed records, every row a change to push again."""
        with transaction(self._db):
            removed = [
                i
                for (ids,) in self._db.execute("SELECT item_ids FROM outgoing_blocks WHERE tombstone = 1")
                for i in decode_item_ids(ids)
            ]
            self._db.execute("DELETE FROM pending_blocks")
            self._db.execute("DELETE FROM outgoing_blocks")
            self._db.execute("DELETE FROM changes WHERE tombstone = 0")
            self._gallery._log_changes(removed, tombstone=True)  # removals not yet acknowledged go to the new owner too
            self._gallery._log_changes([r[0] for r in self._db.execute("SELECT item_id FROM items")])
            self._gallery._set_meta({"replica_cursor": "0"})


def _tag_columns(tag: VersionTag | None) -> tuple[int, int, str]:
    """(version, origin version, via) as the tables store them (zeros for tombstones)."""
    return (0, 0, "") if tag is None else (tag.version, tag.origin_version, tag.via)

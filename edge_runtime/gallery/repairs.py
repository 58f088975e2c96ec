"""The gallery's repair reads and writes (:class:`GalleryRepairs`, a base of
:class:`~fctkit.edge_runtime.gallery.Gallery`; :mod:`..repair` uses them): rows opened one by one
through their pointers, the side-info widths a re-seal needs, and per-row entries set back from
their authenticated block (their row id too, when a damaged one left the entry beside its row)."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Sequence

from fctkit.errors import CorruptRecordError

from ..sqlite_file import id_chunks, read_snapshot, transaction
from .rows import LoadedRows
from .sealing import RowSealer
from .settings import stored_name
from .vectors import VectorBlocks


class GalleryRepairs:
    """The repair part of a gallery; :class:`~fctkit.edge_runtime.gallery.Gallery` provides the
    connection, the blocks, the per-row sealing and the live vector table."""

    _db: sqlite3.Connection
    _vectors: VectorBlocks
    _sealing: RowSealer
    _tables: Callable[[], tuple[str, str]]  # (live, staged) vector tables

    def open_rows(self, row_ids: Sequence[int]) -> LoadedRows:
        """These live rows opened one by one through their pointers, labels too (repair: rows a
        whole-set load cannot take, e.g. of a block whose list of removed rows fails authentication,
        which the pointers make redundant); a row that still fails is ``corrupt``."""
        with read_snapshot(self._db):
            live, _ = self._tables()
            found: list[tuple] = []
            for chunk, marks in id_chunks([int(r) for r in row_ids]):
                found += self._db.execute(
                    f"SELECT row_id, i.item_id, i.origin_version, v.version, v.via, v.block_id, i.label "
                    f"FROM items i JOIN {live} v USING (row_id) WHERE row_id IN ({marks})",
                    chunk,
                ).fetchall()
            return self._vectors.open_pointers(sorted(found), self._sealing.open_label)

    def side_info_widths(self, row_ids: Sequence[int]) -> dict[int, int]:
        """Each live row's side-info width as its block records it (repair re-seals rows whose side-info was lost)."""
        live, _ = self._tables()
        found: dict[int, int] = {}
        for chunk, marks in id_chunks([int(r) for r in row_ids]):
            found.update(
                self._db.execute(
                    f"SELECT v.row_id, b.side_info_width FROM {live} v JOIN vector_blocks b USING (block_id) "
                    f"WHERE v.row_id IN ({marks})",
                    chunk,
                ).fetchall()
            )
        return found

    def restore_entries(self, rows: LoadedRows) -> list[str]:
        """One repair transaction: each row's per-row entry (item id, origin, version tag) set back
        to what its authenticated block says, and a label that still fails to open dropped (the
        row is kept without it). Nothing is logged: the rows are what they were. Returns the
        item ids whose label was dropped."""
        dropped: list[str] = []
        with transaction(self._db):
            live, _ = self._tables()
            for row_id, item_id, tag in zip(rows.row_ids.tolist(), rows.item_ids, rows.tags, strict=True):
                try:
                    self._db.execute(
                        "UPDATE items SET item_id = ?, origin_version = ? WHERE row_id = ?",
                        (item_id, tag.origin_version, row_id),
                    )
                except sqlite3.IntegrityError:  # another row holds that item id: this one stays damaged
                    continue
                self._db.execute(
                    f"UPDATE {live} SET version = ?, via = ? WHERE row_id = ?", (tag.version, tag.via, row_id)
                )
                label = self._db.execute("SELECT label FROM items WHERE row_id = ?", (row_id,)).fetchone()
                try:
                    if label is not None and label[0] is not None:
                        self._sealing.open_label(row_id, item_id, tag.origin_version, label[0])
                except CorruptRecordError:
                    self._db.execute("UPDATE items SET label = NULL WHERE row_id = ?", (row_id,))
                    dropped.append(item_id)
        return dropped

    def restore_row_ids(self, rows: LoadedRows) -> list[str]:
        """One repair transaction: a per-row entry whose row id was damaged (no live row has that id) is
        moved back to the row of ``rows`` that holds its item id and has no entry of its own. ``rows``
        come from blocks that opened, whose authenticated data binds each row id to its item id, so
        the pair is vouched for; an item id two such rows hold is left alone. Nothing is logged: the
        row is what it was. Returns the item ids whose entry was moved back."""
        held: dict[str, list[int]] = {}
        for row_id, item_id in zip(rows.row_ids.tolist(), rows.item_ids, strict=True):
            held.setdefault(item_id, []).append(row_id)
        moved: list[str] = []
        with transaction(self._db):
            live, _ = self._tables()
            stray = self._db.execute(
                f"SELECT i.row_id, i.item_id FROM items i LEFT JOIN {live} v USING (row_id) WHERE v.row_id IS NULL"
            ).fetchall()
            for row_id, item_id in stray:
                free = [r for r in held.get(stored_name(item_id), ()) if not self._has_entry(r)]
                if len(free) == 1:
                    self._db.execute("UPDATE items SET row_id = ? WHERE row_id = ?", (free[0], row_id))
                    moved.append(stored_name(item_id))
        return moved

    def _has_entry(self, row_id: int) -> bool:
        return self._db.execute("SELECT 1 FROM items WHERE row_id = ?", (row_id,)).fetchone() is not None

"""The gallery's repair reads and writes (:class:`GalleryRepairs`, a base of
:class:`~fctkit.edge_runtime.gallery.Gallery`; :mod:`..repair` uses them): rows opened one by one
through their pointers, the side-info widths a re-seal needs, and per-row entries set back from
their authenticated block."""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Sequence

from fctkit.errors import CorruptRecordError

from ..sqlite_file import id_chunks, read_snapshot, transaction
from .rows import LoadedRows
from .sealing import RowSealer
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

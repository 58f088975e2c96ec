"""Per-row extras of the gallery (schema 3, table ``row_extras``): values sealed beside a row and
bound to one of its version tags, kept only while they belong to the row's live vectors.
A :class:`RowExtras` belongs to one :class:`~fctkit.edge_runtime.gallery.Gallery` (``gallery.extras``)."""

from __future__ import annotations

import sqlite3
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..sqlite_file import read_snapshot, transaction
from .rows import LoadedRows, VersionTag, rows_by_tag
from .schema import vector_tables
from .sealing import RowSealer
from .settings import GallerySettings
from .vectors import VectorBlocks

#: the row's embedding in the previous version's space while a transition lasts (sealed as that
#: tag's "embedding", so it is the very record the row had), and the row's hubness offset in its
#: current space; each field's name in the records' authenticated data
EXTRA_FIELDS = {
    "previous_embedding": "embedding",
    "hubness_offset": "hubness_offset",
    "rollback_embedding": "embedding",
    "rollback_side_info": "side_info",
}
#: during a rollback window (:mod:`..revert`): each row's embedding and side-info as they were before
#: the last upgrade, sealed as that tag's own records (an SQL tuple)
ROLLBACK_FIELDS = "('rollback_embedding', 'rollback_side_info')"


class RowExtras:
    """The extras of one gallery connection."""

    def __init__(
        self,
        connection: sqlite3.Connection,
        settings: GallerySettings,
        sealing: RowSealer,
        vectors: VectorBlocks,
        path: Path,
    ) -> None:
        self._db = connection
        self._settings = settings
        self._sealing = sealing
        self._vectors = vectors
        self._path = path

    def put(self, field_name: str, rows: LoadedRows, values: np.ndarray) -> int:
        """Store one extra per row of ``rows`` (one transaction), each bound to the row's tag
        and kept only while the row still has that live tag; returns how many were stored."""
        with transaction(self._db):
            live, _ = vector_tables(self._settings, self._path)
            written = 0
            for tag, picked in rows_by_tag(rows.tags).items():
                written += self.insert(
                    field_name,
                    [int(rows.row_ids[i]) for i in picked],
                    [rows.item_ids[i] for i in picked],
                    tag,
                    np.asarray(values)[picked],
                    live=live,
                )
        return written

    def insert(
        self,
        field_name: str,
        row_ids: Sequence[int],
        item_ids: Sequence[str],
        tag: VersionTag,
        values: np.ndarray,
        *,
        live: str | None = None,
    ) -> int:
        """Inside a transaction: seal and store extras; with ``live``, only for rows whose live vectors have ``tag``."""
        sealed = self._sealing.seal_values(row_ids, item_ids, tag, EXTRA_FIELDS[field_name], values)
        guard = (
            ""
            if live is None
            else f" AND EXISTS (SELECT 1 FROM {live} v WHERE v.row_id = ? AND v.version = ? AND v.via = ?)"
        )
        params = [
            (r, field_name, tag.origin_version, tag.version, tag.via, blob, r)
            + (() if live is None else (r, tag.version, tag.via))
            for r, blob in zip(row_ids, sealed, strict=True)
        ]
        return self._db.executemany(
            f"INSERT OR REPLACE INTO row_extras SELECT ?, ?, ?, ?, ?, ? "
            f"WHERE EXISTS (SELECT 1 FROM items WHERE row_id = ?){guard}",
            params,
        ).rowcount

    def load(self, field_name: str) -> LoadedRows:
        """The stored extras of ``field_name``, decrypted: ``embeddings`` holds the values and
        ``tags`` the tag each was bound to; extras that fail to open are in ``corrupt``."""
        with read_snapshot(self._db):
            cursor = self._db.execute(
                "SELECT row_id, i.item_id, e.origin_version, e.version, e.via, e.sealed, NULL, NULL "
                "FROM row_extras e JOIN items i USING (row_id) WHERE e.field = ? ORDER BY row_id",
                (field_name,),
            )
            return self._sealing.open_rows(cursor, with_labels=False, fields=(EXTRA_FIELDS[field_name], None))

    def rows_missing(self, field_name: str, version: int) -> LoadedRows:
        """The live rows in ``version``'s space without a ``field_name`` extra for their current tag, decrypted."""
        with read_snapshot(self._db):
            live, _ = vector_tables(self._settings, self._path)
            rows = self._db.execute(
                f"SELECT v.row_id, i.item_id, i.origin_version, v.version, v.via, v.block_id, NULL "
                f"FROM {live} v JOIN items i USING (row_id) LEFT JOIN row_extras e ON e.row_id = v.row_id AND e.field = ? "
                f"WHERE v.version = ? AND (e.row_id IS NULL OR e.origin_version != i.origin_version OR e.version != v.version "
                f"OR e.via != v.via) ORDER BY v.row_id",
                (field_name, version),
            ).fetchall()
            return self._vectors.open_pointers(rows)

    def drop(self, field_name: str, meta: dict[str, str | None] | None = None) -> int:
        """Delete every ``field_name`` extra and set ``meta``, in one transaction; returns the extras deleted."""
        with transaction(self._db):
            dropped = self._db.execute("DELETE FROM row_extras WHERE field = ?", (field_name,)).rowcount
            self._settings.put(meta or {})
        return dropped

    def count(self, field_name: str) -> int:
        return self._db.execute("SELECT COUNT(*) FROM row_extras WHERE field = ?", (field_name,)).fetchone()[0]

"""Galleries as older fctkit versions wrote them, for the migration tests: a gallery rewritten in
place to schema 5 (replication tables before blocks) or schema 4 (also every vector its own
sealed record in the vector tables, the record format :mod:`fctkit.edge_runtime.gallery.sealing`
still opens)."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import numpy as np

from fctkit.edge_runtime.crypto import Sealer
from fctkit.edge_runtime.gallery import Gallery
from fctkit.edge_runtime.gallery.sealing import RowSealer
from fctkit.edge_runtime.gallery.settings import setting_mac


def downgrade_to_schema_5(path: Path, key: bytes) -> None:
    """Rewrite the (closed) gallery at ``path`` as schema 5: changes and pulled records kept for
    later as single-row records (``changes.sealed``, ``pending_records``); no change may be sealed
    yet and no record pending."""
    with sqlite3.connect(path) as db:
        assert db.execute("SELECT COUNT(*) FROM outgoing_blocks").fetchone()[0] == 0
        assert db.execute("SELECT COUNT(*) FROM pending_blocks").fetchone()[0] == 0
        for column in ("version INTEGER", "origin_version INTEGER", "via TEXT", "sealed BLOB"):
            db.execute(f"ALTER TABLE changes ADD COLUMN {column}")
        db.execute("DROP TABLE outgoing_blocks")
        db.execute("DROP TABLE pending_blocks")
        db.execute(
            "CREATE TABLE pending_records (sequence INTEGER PRIMARY KEY, item_id TEXT NOT NULL, version INTEGER NOT NULL, "
            "origin_version INTEGER NOT NULL, via TEXT NOT NULL, sealed BLOB NOT NULL)"
        )
        db.execute(
            "UPDATE meta SET value = '5', mac = ? WHERE key = 'schema_version'",
            (setting_mac(Sealer(key), "schema_version", "5"),),
        )


def downgrade_to_schema_4(path: Path, key: bytes) -> None:
    """Rewrite the (closed) gallery at ``path`` as schema 4: both vector tables hold per-row
    sealed ``embedding`` and ``side_info`` BLOBs, and there are no blocks."""
    with Gallery.open(path, key) as gallery:
        sets = {}
        for table in ("vectors_0", "vectors_1"):
            pointers = gallery._db.execute(
                f"SELECT row_id, i.item_id, i.origin_version, v.version, v.via, v.block_id, NULL "
                f"FROM {table} v JOIN items i USING (row_id) ORDER BY row_id"
            ).fetchall()
            sets[table] = gallery._vectors.open_pointers(pointers)
        gallery_id = gallery.gallery_id
    sealing = RowSealer(Sealer(key), gallery_id)
    downgrade_to_schema_5(path, key)
    with sqlite3.connect(path) as db:
        for table, rows in sets.items():
            db.execute(f"DROP TABLE {table}")
            db.execute(
                f"CREATE TABLE {table} (row_id INTEGER PRIMARY KEY, version INTEGER NOT NULL, via TEXT NOT NULL, "
                f"embedding BLOB NOT NULL, side_info BLOB NOT NULL)"
            )
            for i, (row_id, item_id, tag) in enumerate(
                zip(rows.row_ids.tolist(), rows.item_ids, rows.tags, strict=True)
            ):
                (embedding,) = sealing.seal_values(
                    [row_id], [item_id], tag, "embedding", np.asarray(rows.embeddings[i])[None]
                )
                (side_info,) = sealing.seal_values(
                    [row_id], [item_id], tag, "side_info", np.asarray(rows.side_infos[i])[None]
                )
                db.execute(
                    f"INSERT INTO {table} VALUES (?, ?, ?, ?, ?)", (row_id, tag.version, tag.via, embedding, side_info)
                )
        db.execute("DROP TABLE vector_blocks")
        db.execute(
            "UPDATE meta SET value = '4', mac = ? WHERE key = 'schema_version'",
            (setting_mac(Sealer(key), "schema_version", "4"),),
        )

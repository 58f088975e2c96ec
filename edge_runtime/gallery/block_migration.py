"""Schema 4 -> 5: the row-sealed vectors of an older gallery re-sealed as blocks (:mod:`.vectors`).

Runs when a schema-4 gallery is opened, in steps that each commit on their own, so it is
crash-safe and resumable: a step takes the next :data:`~.vectors.BLOCK_ROWS` rows of a
vector table not yet in a block (by row id), opens their per-row records, seals them as
blocks and points the rows to them, emptying their old BLOBs, in one transaction. A row
whose record fails to open points to block 0 (no such block): it stays listed as a damaged
row (``fctkit device check``) for ``fctkit device repair`` to restore from the replica. The
last step rebuilds the vector tables without the old BLOB columns and sets schema 5.
"""

from __future__ import annotations

import sqlite3

from tqdm import tqdm

from ..sqlite_file import transaction
from .rows import rows_by_tag, take_rows
from .schema import VECTOR_TABLES, execute_script, still_at
from .sealing import RowSealer
from .settings import GallerySettings
from .vectors import BLOCK_ROWS, BLOCKS_SCHEMA, VectorBlocks

DAMAGED_BLOCK = 0  # the block id of rows whose old records failed to open (no block has it)


def migrate_to_blocks(
    db: sqlite3.Connection,
    settings: GallerySettings,
    sealing: RowSealer,
    vectors: VectorBlocks,
    *,
    progress: bool | None = None,
) -> int:
    """Bring a schema-4 gallery to schema 5 (nothing for one already there); returns the rows
    re-sealed now. ``progress``: a progress bar (None: when writing to a terminal)."""
    with transaction(db):
        if not still_at(db, "4"):
            return 0
        columns = {row[1] for row in db.execute("PRAGMA table_info(vectors_0)")}
        if "block_id" not in columns:  # first step (a resumed migration finds it done)
            execute_script(db, BLOCKS_SCHEMA)
            for table in VECTOR_TABLES:
                db.execute(f"ALTER TABLE {table} ADD COLUMN block_id INTEGER")
        left = sum(db.execute(f"SELECT COUNT(*) FROM {t} WHERE block_id IS NULL").fetchone()[0] for t in VECTOR_TABLES)
    done = 0
    with tqdm(
        total=left,
        desc="re-sealing the gallery in blocks",
        unit="row",
        disable=None if progress is None else not progress,
    ) as bar:
        for table in VECTOR_TABLES:
            while moved := _reseal_next(db, table, sealing, vectors):
                done += moved
                bar.update(moved)
    with transaction(db):
        if still_at(db, "4"):
            _drop_row_blobs(db)
            settings.put({"schema_version": "5"})
    return done


def _reseal_next(db: sqlite3.Connection, table: str, sealing: RowSealer, vectors: VectorBlocks) -> int:
    """One step: the next rows of ``table`` without a block, re-sealed as blocks; returns how many."""
    with transaction(db):
        rows = db.execute(
            f"SELECT row_id, i.item_id, i.origin_version, v.version, v.via, v.embedding, v.side_info, NULL "
            f"FROM {table} v JOIN items i USING (row_id) WHERE v.block_id IS NULL ORDER BY row_id LIMIT ?",
            (BLOCK_ROWS,),
        ).fetchall()
        orphans = db.execute(
            f"DELETE FROM {table} WHERE block_id IS NULL AND row_id NOT IN (SELECT row_id FROM items)"
        ).rowcount
        if not rows:
            return orphans
        opened = sealing.open_rows(rows, with_labels=False)
        for tag, picked in rows_by_tag(opened.tags).items():
            row_ids = opened.row_ids[picked].tolist()
            block_of = vectors.write(
                table,
                tag,
                row_ids,
                [opened.item_ids[i] for i in picked],
                take_rows(opened.embeddings, picked),
                take_rows(opened.side_infos, picked),
            )
            db.executemany(
                f"UPDATE {table} SET block_id = ?, embedding = x'', side_info = x'' WHERE row_id = ?",
                [(int(b), r) for r, b in zip(row_ids, block_of, strict=True)],
            )
        db.executemany(
            f"UPDATE {table} SET block_id = ?, embedding = x'', side_info = x'' WHERE row_id = ?",
            [(DAMAGED_BLOCK, r) for r, _, _ in opened.corrupt],
        )
        return len(rows) + orphans


def _drop_row_blobs(db: sqlite3.Connection) -> None:
    """The vector tables rebuilt without the per-row BLOB columns."""
    for table in VECTOR_TABLES:
        db.execute(
            f"CREATE TABLE {table}_blocks (row_id INTEGER PRIMARY KEY, version INTEGER NOT NULL, via TEXT NOT NULL, "
            f"block_id INTEGER NOT NULL)"
        )
        db.execute(f"INSERT INTO {table}_blocks SELECT row_id, version, via, block_id FROM {table}")
        db.execute(f"DROP TABLE {table}")
        db.execute(f"ALTER TABLE {table}_blocks RENAME TO {table}")

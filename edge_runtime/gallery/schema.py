"""The gallery file's tables (:mod:`.store`), the migrations from older schemas and the check
of the settings needed to open it at all.

Row format::

    items       row_id INTEGER PRIMARY KEY  stable for the row's life; part of every record's AAD
                item_id TEXT UNIQUE         the app's id for the item (plaintext: use opaque ids)
                origin_version INTEGER      the model version that embedded the item's image
                label BLOB NULL             sealed UTF-8 label
                vault_sha256 TEXT NULL      the encrypted original in the server's vault, once uploaded
                                            (a replicated row: the original another device uploaded)
                record_sha256 TEXT NULL     the replica record this row's content is (pulled, or sealed
                                            for pushing); NULL: a local change not sealed yet
    vectors_0 / row_id INTEGER PRIMARY KEY
    vectors_1   version INTEGER             the version whose query space the vectors live in
                via TEXT                    how they got there: 'native' (embedded by that version's
                                            model), 'forward' (adapted by h/F from origin_version),
                                            'backward' (B(φ_new), unified mode)
                block_id INTEGER            the sealed block holding the row's vectors (schema 5,
                                            :mod:`.vectors`; up to schema 4 each row held its
                                            own sealed embedding and side_info BLOBs)
    vector_blocks                           the blocks (:mod:`.vectors`)

Replication (schema 2, :mod:`fctkit.edge_runtime.replication`; blocks since schema 6)::

    changes          change_id INTEGER PRIMARY KEY AUTOINCREMENT   the changes not sealed yet (one
                     item_id, tombstone                              per item); ids are never reused
    outgoing_blocks  block_key (its first change id: the push's idempotency key), block (0: a
                     single-row record sealed before schema 6), version, origin_version, via,
                     tombstone, rows, item_ids (NUL-separated), sealed (the owner-key record):
                     changes sealed, not yet acknowledged by the server
    tombstones       item_id, vault_sha256       removed items (their ids are never used again); for a
                                                 removal made here, the original to delete from the
                                                 vault once the tombstone is pushed
    pending_blocks   sequence, block, version, origin_version, via, item_ids, skipped (positions the
                     server superseded), rows, sealed: pulled records of a version not installed yet
    meta.replica_cursor                          the owner's last sequence number merged

Schema 1 galleries are migrated when opened: every row gets a change, so the whole gallery is
pushed once. Schema 3 adds ``row_extras`` (:mod:`.extras`), schema 4 the settings' MACs
(:mod:`.settings`), schema 5 the vector blocks (:mod:`.block_migration`), schema 6
the replica's blocks (changes already sealed and pulled records kept stay single-row records).
"""

from __future__ import annotations

import base64
import sqlite3
from pathlib import Path

from fctkit.errors import CorruptRecordError, DeviceKeyError, GalleryDamagedError, GalleryError

from ..crypto import Sealer
from ..sqlite_file import transaction
from .settings import (
    ESSENTIAL,
    RESTORE_OR_REBUILD,
    GallerySettings,
    add_macs,
    authentic,
    setting_mac,
    stored_name,
)
from .vectors import BLOCKS_SCHEMA

SCHEMA_VERSION = 6
VECTOR_TABLES = ("vectors_0", "vectors_1")

_SCHEMA = """
CREATE TABLE meta (key TEXT PRIMARY KEY, value TEXT NOT NULL, mac BLOB);
CREATE TABLE items (
    row_id INTEGER PRIMARY KEY,
    item_id TEXT NOT NULL UNIQUE,
    origin_version INTEGER NOT NULL,
    label BLOB,
    vault_sha256 TEXT,
    record_sha256 TEXT
);
CREATE TABLE vectors_0 (row_id INTEGER PRIMARY KEY, version INTEGER NOT NULL, via TEXT NOT NULL, block_id INTEGER NOT NULL);
CREATE TABLE vectors_1 (row_id INTEGER PRIMARY KEY, version INTEGER NOT NULL, via TEXT NOT NULL, block_id INTEGER NOT NULL);
CREATE TABLE outbox (item_id TEXT PRIMARY KEY, blob BLOB NOT NULL);
"""
_REPLICATION_SCHEMA = """
CREATE TABLE changes (change_id INTEGER PRIMARY KEY AUTOINCREMENT, item_id TEXT NOT NULL, tombstone INTEGER NOT NULL,
                      version INTEGER, origin_version INTEGER, via TEXT, sealed BLOB);
CREATE INDEX changes_by_item ON changes (item_id);
CREATE TABLE tombstones (item_id TEXT PRIMARY KEY, vault_sha256 TEXT);
CREATE TABLE pending_records (sequence INTEGER PRIMARY KEY, item_id TEXT NOT NULL, version INTEGER NOT NULL,
                              origin_version INTEGER NOT NULL, via TEXT NOT NULL, sealed BLOB NOT NULL);
"""
_REPLICA_BLOCKS_SCHEMA = """
CREATE TABLE IF NOT EXISTS outgoing_blocks (block_key INTEGER PRIMARY KEY, block INTEGER NOT NULL, version INTEGER NOT NULL,
    origin_version INTEGER NOT NULL, via TEXT NOT NULL, tombstone INTEGER NOT NULL, rows INTEGER NOT NULL, item_ids BLOB NOT NULL,
    sealed BLOB NOT NULL);
CREATE TABLE IF NOT EXISTS pending_blocks (sequence INTEGER PRIMARY KEY, block INTEGER NOT NULL, version INTEGER NOT NULL,
    origin_version INTEGER NOT NULL, via TEXT NOT NULL, item_ids BLOB NOT NULL, skipped TEXT NOT NULL, rows INTEGER NOT NULL,
    sealed BLOB NOT NULL)
"""
_EXTRAS_SCHEMA = """
CREATE TABLE IF NOT EXISTS row_extras (row_id INTEGER NOT NULL, field TEXT NOT NULL, origin_version INTEGER NOT NULL,
                         version INTEGER NOT NULL, via TEXT NOT NULL, sealed BLOB NOT NULL, PRIMARY KEY (row_id, field));
"""
_SCHEMA += _REPLICATION_SCHEMA + _EXTRAS_SCHEMA + ";" + BLOCKS_SCHEMA


def create_tables(db: sqlite3.Connection) -> None:
    """Inside the creating transaction: every table of the current schema (settings not set yet)."""
    execute_script(db, _SCHEMA)
    _move_replica_to_blocks(db)


def migrate(db: sqlite3.Connection, sealer: Sealer) -> None:
    """Bring a gallery of an older schema to schema 4, one transaction per step (4 -> 5, which
    re-seals every row, is :mod:`.block_migration`)."""
    for step in (_add_replication, _add_row_extras, _add_macs):
        step(db, sealer)


def check_essential(path: Path, db: sqlite3.Connection, sealer: Sealer, meta: dict[str, tuple]) -> str:
    """Authenticate the settings needed to open the gallery at all; returns its schema version as
    authenticated (a damaged record the file's own tables vouch for: the current one). When no
    setting at all authenticates, the key is not the gallery's; when only some fail, the file is
    damaged."""
    bad = [k for k in ESSENTIAL if k not in meta or not authentic(sealer, k, *meta[k])]
    if not bad:
        return str(meta["schema_version"][0])
    if not any(authentic(sealer, k, v, m) for k, (v, m) in meta.items()):
        raise DeviceKeyError(
            f"{path} was not sealed with this device key: use the gallery's own key file (nothing was changed)"
        )
    settings = GallerySettings(db, sealer, path)
    recovered = settings.recovered()  # a damaged name or byte the MAC still vouches for: used now, rewritten by repair
    meta.update({k: (recovered[k], setting_mac(sealer, k, recovered[k])) for k in bad if k in recovered})
    left = [k for k in bad if k not in recovered]
    if _key_check_holds(meta, sealer):  # gallery id and key check vouch for each other: only their MACs are damaged
        left = [k for k in left if k not in ("gallery_id", "key_check")]
    if "schema_version" in left and _tables_at_current_schema(db):  # its tables say which schema the file is at
        meta["schema_version"] = (str(SCHEMA_VERSION), None)
        left.remove("schema_version")
    if left == ["schema_version"]:
        raise GalleryDamagedError(
            f"{path}: the gallery's schema version record is damaged (it reads {_stored(meta, 'schema_version')!r} "
            f"and fails authentication) and its tables are not those of schema {SCHEMA_VERSION}, so which migrations "
            f"it needs cannot be told (nothing was changed); {RESTORE_OR_REBUILD}",
            ("schema_version",),
        )
    if left:
        raise settings.error(left)
    return str(meta["schema_version"][0])


def _stored(meta: dict[str, tuple], key: str) -> str | None:
    value = meta.get(key, (None, None))[0]
    return None if value is None else stored_name(value)


def _tables_at_current_schema(db: sqlite3.Connection) -> bool:
    """Whether the file's tables are exactly those of :data:`SCHEMA_VERSION` (blocks and replica blocks, no
    per-row vector columns, no single-row replica tables)."""
    tables = {name for (name,) in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    columns = {row[1] for row in db.execute("PRAGMA table_info(vectors_0)")}
    current = {"meta", "items", *VECTOR_TABLES, "outbox", "changes", "tombstones", "row_extras", "vector_blocks"}
    return (
        current | {"outgoing_blocks", "pending_blocks"} <= tables
        and "pending_records" not in tables
        and columns == {"row_id", "version", "via", "block_id"}
    )


def reseal_schema_record(db: sqlite3.Connection, sealer: Sealer, path: Path, schema: str) -> None:
    """Before an older gallery migrates: its schema version record sealed again at ``schema`` (as
    authenticated) when the stored one is damaged, since each migration step reads the stored record."""
    row = db.execute("SELECT value, mac FROM meta WHERE key = 'schema_version'").fetchone()
    if row is None or not authentic(sealer, "schema_version", *row):
        with transaction(db):
            GallerySettings(db, sealer, path).put({"schema_version": schema})


def _key_check_holds(meta: dict[str, tuple], sealer: Sealer) -> bool:
    try:
        gallery_id = bytes.fromhex(meta["gallery_id"][0])
        sealer.open(base64.b64decode(meta["key_check"][0]), b"key-check|" + gallery_id, "key check")
    except (CorruptRecordError, ValueError, KeyError, TypeError):
        return False
    return True


def vector_tables(settings: GallerySettings, path: Path) -> tuple[str, str]:
    """(live, staged) vector tables (``meta.live_vectors``); read inside the caller's transaction."""
    live = settings.get("live_vectors")
    if live not in VECTOR_TABLES:
        raise GalleryError(f"{path}: meta.live_vectors is {live!r}; the gallery is damaged")
    return live, VECTOR_TABLES[1 - VECTOR_TABLES.index(live)]


def execute_script(db: sqlite3.Connection, script: str) -> None:
    for statement in filter(str.strip, script.split(";")):
        db.execute(statement)


def still_at(db: sqlite3.Connection, from_schema: str) -> bool:
    """Whether the gallery is (still) at ``from_schema``; inside a transaction, another process
    cannot migrate it meanwhile."""
    row = db.execute("SELECT value FROM meta WHERE key = 'schema_version'").fetchone()
    return (
        row is not None and row[0] == from_schema
    )  # None: its name was damaged (its value recovered by check_essential)


def _add_replication(db: sqlite3.Connection, sealer: Sealer) -> None:
    """Schema 1 -> 2 in one transaction: the replication tables, and a change for every row."""
    with transaction(db):
        if not still_at(db, "1"):
            return
        db.execute("ALTER TABLE items ADD COLUMN record_sha256 TEXT")
        execute_script(db, _REPLICATION_SCHEMA)
        db.execute("INSERT INTO changes (item_id, tombstone) SELECT item_id, 0 FROM items ORDER BY row_id")
        db.executemany(
            "INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", [("schema_version", "2"), ("replica_cursor", "0")]
        )


def _add_row_extras(db: sqlite3.Connection, sealer: Sealer) -> None:
    """Schema 2 -> 3 in one transaction: the (empty) per-row extras table."""
    with transaction(db):
        if not still_at(db, "2"):
            return
        db.execute(_EXTRAS_SCHEMA)
        db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('schema_version', '3')")


def _add_macs(db: sqlite3.Connection, sealer: Sealer) -> None:
    """Schema 3 -> 4 in one transaction: authenticated settings and row count (:func:`add_macs`)."""
    with transaction(db):
        if not still_at(db, "3"):
            return
        db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES ('schema_version', '4')")
        add_macs(db, sealer)


def migrate_replica_to_blocks(db: sqlite3.Connection, settings: GallerySettings) -> None:
    """Schema 5 -> 6 in one transaction: changes sealed already become outgoing single-row
    records (pushed as they are: their change ids may be stored at the server), pulled records
    kept for later become pending single-row records."""
    if not still_at(db, "5"):  # the common case, read without taking the write lock
        return
    with transaction(db):
        if still_at(db, "5"):
            _move_replica_to_blocks(db)
            settings.put({"schema_version": str(SCHEMA_VERSION)})


def _move_replica_to_blocks(db: sqlite3.Connection) -> None:
    """The schema-6 replication tables from the schema-2 ones (a new gallery is created this way too)."""
    execute_script(db, _REPLICA_BLOCKS_SCHEMA)
    db.execute(
        "INSERT INTO outgoing_blocks SELECT change_id, 0, COALESCE(version, 0), COALESCE(origin_version, 0), "
        "COALESCE(via, ''), tombstone, 1, CAST(item_id AS BLOB), sealed FROM changes WHERE sealed IS NOT NULL"
    )
    db.execute("DELETE FROM changes WHERE sealed IS NOT NULL")
    for column in ("version", "origin_version", "via", "sealed"):  # DROP COLUMN keeps the AUTOINCREMENT counter
        db.execute(f"ALTER TABLE changes DROP COLUMN {column}")
    db.execute(
        "INSERT INTO pending_blocks SELECT sequence, 0, version, origin_version, via, CAST(item_id AS BLOB), '', 1, sealed "
        "FROM pending_records"
    )
    db.execute("DROP TABLE pending_records")

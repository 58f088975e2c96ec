"""The schema of the server's metadata database (``DATA/meta.sqlite3``, or a PostgreSQL
database), its migrations from older schemas, and opening it.

Schema 1 databases (before owners) are migrated in place: each device becomes the only device of
an owner of its own. Schema 2 databases get the replica's compaction columns; schema 3 gets device
revocation; schema 4 keeps one blob record per owner and SHA-256; schema 5 stores the replica as
blocks of rows, each old record a block of one, and compacts it (:mod:`.replica_compaction`);
schema 6 gets the leases of uploads in progress (:mod:`.upload_sessions`); schema 7 gets the root
of trust (:mod:`.trust_store`: roots, the current timestamp, each release's co-signatures, each
device's reported trust state; existing releases get no co-signatures and stay valid); schema 8
gets staged rollouts and the devices' upgrade health (:mod:`.rollout_store`; existing releases
have no rollout: every device is offered them); schema 10 gets withdrawals and the devices' reverts
(:mod:`.withdrawal_store`; nothing is withdrawn); schema 11 gets the confirmed versions
(:mod:`.rollout_store`; none is confirmed); schema 12 gets the devices' report counts of the last
minute (:mod:`.device_store`; none yet); schema 13 gets the indexes per-device calls need
and schema 14 those of filtered device listings (:data:`.device_store.DEVICE_INDEXES`); schema 15 gets
the guard's running tally of owners' votes (:mod:`.guard_votes`, counted from the health rows when
first read). A database of a schema this server does not know is refused.

PostgreSQL databases start at schema 6 or later: the same tables in PostgreSQL's types, created
once under an advisory lock however many replicas start at once, the version kept in
``fctkit_schema``; a schema-6 database gets the upload leases the same way, and a schema-6 or 7
one the trust tables and columns, a schema 6 to 8 one the rollout tables, a schema 6 to 9 one
the withdrawal tables, a schema 6 to 10 one the confirmations table, a schema 6 to 11 one
the report counts table, a schema 6 to 13 one the devices' indexes, and a schema 6 to 14 one the
guard's tally.
"""

from __future__ import annotations

import hashlib
import re
import sqlite3
from pathlib import Path

from fctkit.errors import ConfigError

from . import upload_sessions
from .database import PostgresDatabase, SqliteDatabase, add_columns
from .device_store import DEVICE_INDEXES, REPORT_COUNTS_SCHEMA
from .guard_failures import FAILURE_SCHEMA
from .guard_votes import GUARD_VOTES_SCHEMA
from .replica_compaction import REPLICA_SCHEMA, compact_replica
from .rollout_store import CONFIRMATION_SCHEMA, HEALTH_GUARD_COLUMNS, ROLLOUT_SCHEMA
from .trust_store import TRUST_COLUMNS, TRUST_SCHEMA
from .withdrawal_store import WITHDRAWAL_SCHEMA

SCHEMA_VERSION = 16
_SCHEMA = (
    """
CREATE TABLE IF NOT EXISTS versions (
    version INTEGER PRIMARY KEY,
    manifest BLOB NOT NULL,
    signature BLOB NOT NULL,
    published_at TEXT NOT NULL,
    co_signatures BLOB NOT NULL DEFAULT ''
);
CREATE TABLE IF NOT EXISTS version_artifacts (
    version INTEGER NOT NULL REFERENCES versions(version),
    sha256 TEXT NOT NULL,
    PRIMARY KEY (version, sha256)
);
CREATE TABLE IF NOT EXISTS enrolment_codes (
    code_hash TEXT PRIMARY KEY,
    label TEXT NOT NULL,
    created_at TEXT NOT NULL,
    expires_at TEXT NOT NULL,
    used_at TEXT,
    device_id TEXT,
    owner_id TEXT
);
CREATE TABLE IF NOT EXISTS devices (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    device_id TEXT NOT NULL UNIQUE,
    token_hash TEXT NOT NULL UNIQUE,
    name TEXT NOT NULL,
    label TEXT NOT NULL,
    enrolled_at TEXT NOT NULL,
    owner_id TEXT,
    last_report_at TEXT,
    version INTEGER NOT NULL DEFAULT 0,
    gallery_size INTEGER NOT NULL DEFAULT 0,
    upgrade_state INTEGER NOT NULL DEFAULT 0,
    target_version INTEGER NOT NULL DEFAULT 0,
    progress REAL NOT NULL DEFAULT 0,
    detail TEXT NOT NULL DEFAULT '',
    revoked_at TEXT,
    root_version INTEGER NOT NULL DEFAULT 0,
    trust_stale INTEGER NOT NULL DEFAULT 0,
    seconds_since_fresh INTEGER NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS blobs (
    device_id TEXT NOT NULL REFERENCES devices(device_id),
    sha256 TEXT NOT NULL,
    size INTEGER NOT NULL,
    item_id TEXT NOT NULL,
    created_at TEXT NOT NULL,
    owner_id TEXT,
    PRIMARY KEY (device_id, sha256)
);
CREATE INDEX IF NOT EXISTS blobs_by_sha256 ON blobs (sha256);
CREATE INDEX IF NOT EXISTS blobs_by_owner ON blobs (owner_id, sha256);
CREATE TABLE IF NOT EXISTS owner_keys (
    owner_id TEXT PRIMARY KEY,
    key_id TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS replica_owners (
    owner_id TEXT PRIMARY KEY,
    last_sequence INTEGER NOT NULL,
    sealed_bytes INTEGER NOT NULL
);
"""
    + REPLICA_SCHEMA
    + TRUST_SCHEMA
    + ";"
    + ROLLOUT_SCHEMA
    + ";"
    + WITHDRAWAL_SCHEMA
    + ";"
    + CONFIRMATION_SCHEMA
    + ";"
    + REPORT_COUNTS_SCHEMA
    + ";"
    + GUARD_VOTES_SCHEMA
    + FAILURE_SCHEMA
)


def execute_script(db: sqlite3.Connection | PostgresDatabase, script: str) -> None:
    for statement in filter(str.strip, script.split(";")):
        db.execute(statement)


def _add_owners(db: sqlite3.Connection) -> None:
    """Schema 1 -> 2: owners. Each existing device becomes the only device of an owner of its own."""
    if "owner_id" not in {row[1] for row in db.execute("PRAGMA table_info(enrolment_codes)")}:
        db.execute("ALTER TABLE enrolment_codes ADD COLUMN owner_id TEXT")
    db.execute("UPDATE devices SET owner_id = 'own-' || device_id WHERE owner_id IS NULL")
    db.execute(
        "UPDATE blobs SET owner_id = (SELECT d.owner_id FROM devices d WHERE d.device_id = blobs.device_id) "
        "WHERE owner_id IS NULL"
    )


def _add_replica_compaction(db: sqlite3.Connection) -> None:
    """Schema 2 -> 3: replica records know their sealed bytes' SHA-256 and whether they are
    superseded; every owner's replica is compacted once."""
    columns = {row[1] for row in db.execute("PRAGMA table_info(replica_records)")}
    if not columns:
        return  # schema 1 had no replica: the table is created as it is now
    if "sealed_sha256" not in columns:
        db.execute("ALTER TABLE replica_records ADD COLUMN sealed_sha256 TEXT NOT NULL DEFAULT ''")
    if "superseded" not in columns:
        db.execute("ALTER TABLE replica_records ADD COLUMN superseded INTEGER NOT NULL DEFAULT 0")
    db.create_function("fctkit_sha256", 1, lambda sealed: hashlib.sha256(sealed).hexdigest(), deterministic=True)
    db.execute("UPDATE replica_records SET sealed_sha256 = fctkit_sha256(sealed) WHERE sealed_sha256 = ''")
    # compacted by the step to schema 6, once the records are in the tables of today


def _add_revocation(db: sqlite3.Connection) -> None:
    """Schema 3 -> 4: devices can be revoked."""
    if "revoked_at" not in {row[1] for row in db.execute("PRAGMA table_info(devices)")}:
        db.execute("ALTER TABLE devices ADD COLUMN revoked_at TEXT")


def _one_blob_per_owner(db: sqlite3.Connection) -> None:
    """Schema 4 -> 5: one blob record per owner and SHA-256 (two devices of one owner that
    uploaded the same blob had two records, charged twice); the uploads table comes with
    the schema (:mod:`.upload_sessions`)."""
    db.execute("DELETE FROM blobs WHERE rowid NOT IN (SELECT MIN(rowid) FROM blobs GROUP BY owner_id, sha256)")


def _replica_blocks(db: sqlite3.Connection) -> None:
    """Schema 5 -> 6: replica records become blocks (``replica_blocks``) of rows (``replica_items``);
    each record stored so far is a block of one row in the single-row format. Every owner's
    replica is compacted once."""
    execute_script(db, REPLICA_SCHEMA)
    if not db.execute("SELECT 1 FROM sqlite_master WHERE name = 'replica_records'").fetchone():
        return  # a database from before replication (schema 1)
    db.execute(
        "INSERT INTO replica_blocks SELECT owner_id, sequence, device_id, change_id, 0, version, origin_version, via, "
        "tombstone, sealed_sha256, created_at, 1, 1 - superseded, sealed FROM replica_records"
    )
    db.execute("INSERT INTO replica_items SELECT owner_id, sequence, 0, item_id, superseded FROM replica_records")
    db.execute("DROP TABLE replica_records")
    for (owner_id,) in db.execute("SELECT owner_id FROM replica_owners").fetchall():
        compact_replica(SqliteDatabase(db), owner_id)


def _upload_leases(db: sqlite3.Connection) -> None:
    """Schema 6 -> 7: an upload in progress holds a lease in its row (one call per owner and blob,
    on any replica); older schemas get the uploads table whole, with the schema."""
    columns = {row[1] for row in db.execute("PRAGMA table_info(uploads)")}
    if columns and "lease_token" not in columns:
        execute_script(db, upload_sessions.ADD_LEASES)


def _trust(db: sqlite3.Connection) -> None:
    """Schema 7 -> 8: the root of trust's columns (its tables come with the schema)."""
    tables = {table for table, _, _ in TRUST_COLUMNS}
    execute_script(db, add_columns(TRUST_COLUMNS, _columns(db, tables)))


def _rollouts(db: sqlite3.Connection) -> None:
    """Schema 8 -> 9: nothing to alter (the rollout tables come with the schema; no version has a rollout)."""


def _withdrawals(db: sqlite3.Connection) -> None:
    """Schema 9 -> 10: nothing to alter (the withdrawal tables come with the schema; nothing is withdrawn)."""


def _confirmations(db: sqlite3.Connection) -> None:
    """Schema 10 -> 11: nothing to alter (the confirmations table comes with the schema; nothing is confirmed)."""


def _report_counts(db: sqlite3.Connection) -> None:
    """Schema 11 -> 12: nothing to alter (the report counts table comes with the schema; no device reported yet)."""


def _device_indexes(db: sqlite3.Connection) -> None:
    """Schema 12 -> 13 and 13 -> 14: nothing to alter (the devices' indexes come with the schema)."""


def _guard_votes(db: sqlite3.Connection) -> None:
    """Schema 14 -> 15: nothing to alter (the guard's tables come with the schema; a version's votes
    are counted from its health rows the first time its guard reads them)."""


def _health_measures(db: sqlite3.Connection) -> None:
    """Schema 15 -> 16: device_health gains median_rank and gallery_rows, rollouts guard_measure
    (existing guards keep comparing the mean cosine) and max_failure_rate (0: existing guards do not
    bound it); the failure tables come with the schema."""
    present = _columns(db, {t for t, _, _ in HEALTH_GUARD_COLUMNS})
    # a table not there yet (a database from before schema 9) comes whole with the schema
    execute_script(db, add_columns([c for c in HEALTH_GUARD_COLUMNS if present[c[0]]], present))


def _columns(db: sqlite3.Connection, tables: set[str]) -> dict[str, set[str]]:
    """Each of ``tables``' columns, as SQLite lists them."""
    return {t: {row[1] for row in db.execute(f"PRAGMA table_info({t})")} for t in tables}


_MIGRATIONS = {
    1: _add_owners,
    2: _add_replica_compaction,
    3: _add_revocation,
    4: _one_blob_per_owner,
    5: _replica_blocks,
    6: _upload_leases,
    7: _trust,
    8: _rollouts,
    9: _withdrawals,
    10: _confirmations,
    11: _report_counts,
    12: _device_indexes,
    13: _device_indexes,
    14: _guard_votes,
    15: _health_measures,
}  # schema found -> the step to the next one


def open_database(path: Path) -> SqliteDatabase:
    """Open (creating or migrating it to :data:`SCHEMA_VERSION`) the metadata database at ``path``."""
    try:
        db = sqlite3.connect(path, isolation_level=None)
        db.execute("PRAGMA journal_mode=WAL")
        db.execute("PRAGMA synchronous=NORMAL")
        db.execute("PRAGMA foreign_keys=ON")
        found = db.execute("PRAGMA user_version").fetchone()[0]
        if found not in (0, SCHEMA_VERSION, *_MIGRATIONS):
            db.close()
            raise ConfigError(
                f"{path.parent}: metadata schema {found} is not the {SCHEMA_VERSION} this server "
                "understands; run the fctkit version that wrote it"
            )
        database = SqliteDatabase(db)
        with database.transaction():
            for step in range(found, SCHEMA_VERSION) if found else ():
                _MIGRATIONS[step](db)
            execute_script(db, _SCHEMA + upload_sessions.UPLOADS_SCHEMA + DEVICE_INDEXES)
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
    except sqlite3.DatabaseError as exc:
        raise ConfigError(f"{path}: not a usable fctkit database: {exc}") from exc
    return database


def open_reader(path: Path) -> SqliteDatabase:
    """A read-only connection to the metadata database at ``path`` (opened and migrated by
    :func:`open_database` first), for the one thread that opens it."""
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA query_only=ON")
    return SqliteDatabase(db)


_MIGRATION_LOCK = 0x66637463  # "fctc": the advisory lock replicas take to create or check the schema


def postgres_schema(script: str) -> str:
    """The schema in PostgreSQL's types (64-bit integers: sizes and sequence numbers outgrow 32 bits)."""
    script = script.replace("INTEGER PRIMARY KEY AUTOINCREMENT", "BIGSERIAL PRIMARY KEY")
    for sqlite_type, postgres_type in (("INTEGER", "BIGINT"), ("BLOB", "BYTEA"), ("REAL", "DOUBLE PRECISION")):
        script = re.sub(rf"\b{sqlite_type}\b", postgres_type, script)
    return script


def open_postgres(dsn: str, *, max_connections: int = 20) -> PostgresDatabase:
    """Connect to the PostgreSQL database at ``dsn``, creating the schema the first time (under
    an advisory lock: replicas starting together create it once); refuses another schema."""
    import psycopg

    try:
        psycopg.connect(dsn, connect_timeout=10).close()  # a wrong address, database or password fails here, at once
        db = PostgresDatabase(dsn, max_connections=max_connections)
    except Exception as exc:  # psycopg.Error, or psycopg_pool's PoolTimeout when the server never answers
        raise ConfigError(f"cannot connect to the database {redacted_dsn(dsn)}: {exc}") from exc
    try:
        with db.transaction():
            db.execute("SELECT pg_advisory_xact_lock(?)", (_MIGRATION_LOCK,))
            db.execute("CREATE TABLE IF NOT EXISTS fctkit_schema (version INTEGER NOT NULL)")
            found = db.execute("SELECT MAX(version) FROM fctkit_schema").fetchone()[0] or 0
            if found not in (0, *range(6, SCHEMA_VERSION + 1)):
                raise ConfigError(
                    f"{redacted_dsn(dsn)}: metadata schema {found} is not the {SCHEMA_VERSION} this "
                    "server understands; run the fctkit version that wrote it"
                )
            if found != SCHEMA_VERSION:
                script = _SCHEMA + upload_sessions.UPLOADS_SCHEMA + DEVICE_INDEXES
                if found:  # the tables of today come with the schema; columns are added to older ones
                    script = (
                        (upload_sessions.ADD_LEASES + ";" if found == 6 else "")
                        + add_columns(TRUST_COLUMNS)
                        + ";"
                        + TRUST_SCHEMA
                    )
                    script += ";" + ROLLOUT_SCHEMA + ";" + WITHDRAWAL_SCHEMA + ";" + CONFIRMATION_SCHEMA
                    script += ";" + REPORT_COUNTS_SCHEMA + ";" + DEVICE_INDEXES + ";" + GUARD_VOTES_SCHEMA
                    script += ";" + FAILURE_SCHEMA + ";" + add_columns(HEALTH_GUARD_COLUMNS)
                execute_script(db, postgres_schema(script))
                db.execute("INSERT INTO fctkit_schema VALUES (?)", (SCHEMA_VERSION,))
    except BaseException:
        db.close()
        raise
    return db


def redacted_dsn(dsn: str) -> str:
    """``dsn`` without a password, for messages and logs."""
    return re.sub(r"(://[^:/@]*:)[^@]*@", r"\1***@", dsn)

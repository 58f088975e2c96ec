"""The server's persistent state behind one small interface, :class:`Storage`.

The default, :class:`SqliteStorage`, keeps everything in one data directory:

```
DATA/meta.sqlite3      metadata (SQLite in WAL mode): versions, devices, enrolment codes, blob index,
                       owners' replicated gallery records (sealed: ciphertext only)
DATA/artifacts/aa/...  bundle artifacts, content-addressed by SHA-256
DATA/blobs/aa/...      vault blobs (device ciphertext), content-addressed by SHA-256
DATA/tmp/              uploads in progress and publish staging (never listed)
DATA/server.lock       held (flock) by the one server using the directory
```

A content file is fsynced and renamed into place *before* the metadata row that makes it
visible is committed; files that no row references (a crash in between) are removed by
:meth:`SqliteStorage.collect_garbage` at start-up.

Owners: every enrolment code names an owner (a fresh one unless the admin gives one) and the
device it enrols belongs to that owner. Vault blobs and replica records belong to the owner
(the uploading / pushing device is kept for audit); a device reaches everything of its owner
and nothing of another. Schema 1 databases (before owners) are migrated in place: each device
becomes the only device of an owner of its own.

Replica records (``replica_records``) get a per-owner sequence number, assigned in the
transaction that stores them; ``(device_id, change_id)`` is unique, so a retried push finds
its records already stored and never duplicates them. A record that loses to another live
record of its item on every device that could still pull it is *superseded*: its sealed bytes
are dropped (and leave the owner's quota), its row stays for that idempotency check, and pulls
skip it (:func:`compact_replica`; schema 2 databases are migrated and compacted in place).
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import sqlite3
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from fctkit.errors import ConfigError

from . import upload_sessions
from .content_store import ContentStore
from .upload_sessions import Reservation

SCHEMA_VERSION = 5
_REPLICA_LIVE_INDEX = ("CREATE INDEX IF NOT EXISTS replica_live_by_item ON replica_records (owner_id, item_id, version) "
                       "WHERE superseded = 0")
_SCHEMA = """
CREATE TABLE IF NOT EXISTS versions (
    version INTEGER PRIMARY KEY,
    manifest BLOB NOT NULL,
    signature BLOB NOT NULL,
    published_at TEXT NOT NULL
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
    revoked_at TEXT
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
CREATE TABLE IF NOT EXISTS replica_records (
    owner_id TEXT NOT NULL,
    sequence INTEGER NOT NULL,
    device_id TEXT NOT NULL,
    change_id INTEGER NOT NULL,
    item_id TEXT NOT NULL,
    version INTEGER NOT NULL,
    origin_version INTEGER NOT NULL,
    via TEXT NOT NULL,
    tombstone INTEGER NOT NULL,
    sealed BLOB NOT NULL,
    created_at TEXT NOT NULL,
    sealed_sha256 TEXT NOT NULL DEFAULT '',
    superseded INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (owner_id, sequence),
    UNIQUE (device_id, change_id)
);
CREATE TABLE IF NOT EXISTS owner_keys (
    owner_id TEXT PRIMARY KEY,
    key_id TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS replica_owners (
    owner_id TEXT PRIMARY KEY,
    last_sequence INTEGER NOT NULL,
    sealed_bytes INTEGER NOT NULL
);
""" + _REPLICA_LIVE_INDEX + ";\n"


@dataclass(frozen=True)
class VersionRecord:
    version: int
    manifest: bytes
    signature: bytes
    published_at: str


def _add_owners(db: sqlite3.Connection) -> None:
    """Schema 1 -> 2: owners. Each existing device becomes the only device of an owner of its own."""
    if "owner_id" not in {row[1] for row in db.execute("PRAGMA table_info(enrolment_codes)")}:
        db.execute("ALTER TABLE enrolment_codes ADD COLUMN owner_id TEXT")
    db.execute("UPDATE devices SET owner_id = 'own-' || device_id WHERE owner_id IS NULL")
    db.execute("UPDATE blobs SET owner_id = (SELECT d.owner_id FROM devices d WHERE d.device_id = blobs.device_id) "
               "WHERE owner_id IS NULL")


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
    db.execute(_REPLICA_LIVE_INDEX)  # before the compaction below, which looks records up by item
    for (owner_id,) in db.execute("SELECT owner_id FROM replica_owners").fetchall():
        compact_replica(db, owner_id)


def _add_revocation(db: sqlite3.Connection) -> None:
    """Schema 3 -> 4: devices can be revoked."""
    if "revoked_at" not in {row[1] for row in db.execute("PRAGMA table_info(devices)")}:
        db.execute("ALTER TABLE devices ADD COLUMN revoked_at TEXT")


def _one_blob_per_owner(db: sqlite3.Connection) -> None:
    """Schema 4 -> 5: one blob record per owner and SHA-256 (two devices of one owner that
    uploaded the same blob had two records, charged twice); the uploads table comes with
    the schema (:mod:`.upload_sessions`)."""
    db.execute("DELETE FROM blobs WHERE rowid NOT IN (SELECT MIN(rowid) FROM blobs GROUP BY owner_id, sha256)")


_MIGRATIONS = {1: _add_owners, 2: _add_replica_compaction, 3: _add_revocation, 4: _one_blob_per_owner}  # schema found -> the step to the next one


# A live record is superseded when another live record of the same item wins over it on every
# device that could still pull it (the devices' merge order, fctkit.edge_runtime.records.beats):
# a tombstone (the earliest one of an item stays); at the same version a higher-ranked via
# ('native'/'backward' over 'forward'), then the smaller SHA-256 of the sealed bytes (the earlier
# of two identical ones); or a record at a higher version when every device of the owner is at
# exactly that version (:common_version; a device further on may have skipped it and so could not
# place the record, only the older one).
_SUPERSEDED = """
SELECT r.sequence, length(r.sealed) FROM replica_records r
WHERE r.owner_id = :owner AND r.superseded = 0 {items} AND EXISTS (
    SELECT 1 FROM replica_records w
    WHERE w.owner_id = r.owner_id AND w.item_id = r.item_id AND w.superseded = 0 AND w.sequence != r.sequence AND (
        (w.tombstone = 1 AND (r.tombstone = 0 OR w.sequence < r.sequence))
        OR (w.tombstone = 0 AND r.tombstone = 0 AND (
            w.version > r.version AND w.version = :common_version
            OR w.version = r.version AND ((w.via != 'forward') > (r.via != 'forward')
                OR (w.via != 'forward') = (r.via != 'forward') AND (w.sealed_sha256, w.sequence) < (r.sealed_sha256, r.sequence))))))
"""


def _unique_chunks(values: Sequence, size: int = 500) -> list[list]:
    """``values`` without repeats, in order, cut into lists of at most ``size`` (SQLite's limit
    on the ``?`` of one ``IN (...)`` is what keeps them short)."""
    unique = list(dict.fromkeys(values))
    return [unique[start:start + size] for start in range(0, len(unique), size)]


def common_version(db: sqlite3.Connection, owner_id: str | None) -> int:
    """The version every (unrevoked) device of the owner reports, or 0 while they differ."""
    lowest, highest = db.execute("SELECT MIN(version), MAX(version) FROM devices WHERE owner_id=? AND revoked_at IS NULL",
                                 (owner_id,)).fetchone()
    return lowest if lowest == highest and lowest else 0


def compact_replica(db: sqlite3.Connection, owner_id: str, items: Sequence[str] | None = None) -> int:
    """Mark the owner's superseded records (all of them, or those of ``items``) and drop their
    sealed bytes; returns how many. Their rows stay (empty), so a retried push of one is still
    answered with the sequence number it got. Runs inside the caller's transaction."""
    params = {"owner": owner_id, "common_version": common_version(db, owner_id)}
    found: list[tuple[int, int]] = []
    if items is None:
        found = db.execute(_SUPERSEDED.format(items=""), params).fetchall()
    else:
        for chunk in _unique_chunks(items):
            marks = ",".join(f":i{k}" for k in range(len(chunk)))
            found += db.execute(_SUPERSEDED.format(items=f"AND r.item_id IN ({marks})"),
                                {**params, **{f"i{k}": item for k, item in enumerate(chunk)}}).fetchall()
    if found:
        db.executemany("UPDATE replica_records SET superseded = 1, sealed = X'' WHERE owner_id=? AND sequence=?",
                       [(owner_id, sequence) for sequence, _ in found])
        db.execute("UPDATE replica_owners SET sealed_bytes = sealed_bytes - ? WHERE owner_id=?",
                   (sum(size for _, size in found), owner_id))
    return len(found)


@dataclass(frozen=True)
class BlobRecord:
    device_id: str
    sha256: str
    size: int
    item_id: str
    created_at: str
    owner_id: str | None = None  # None: the uploading device's owner


class OwnerKeyMismatch(Exception):
    """Enrolment refused: the device's owner key id differs from the owner's (the code stays unused)."""


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


@dataclass(frozen=True)
class DeviceReport:
    version: int
    gallery_size: int
    upgrade_state: int
    target_version: int
    progress: float
    detail: str


@dataclass(frozen=True)
class DeviceRecord:
    seq: int
    device_id: str
    name: str
    label: str
    enrolled_at: str
    last_report_at: str | None
    report: DeviceReport
    vault_bytes: int
    vault_blobs: int
    owner_id: str = ""
    revoked_at: str | None = None


class Storage(Protocol):
    """What the services need from persistence. Every method is synchronous and short;
    file contents go through the two content stores."""

    artifacts: ContentStore
    blobs: ContentStore
    tmp_dir: Path

    def versions(self) -> list[VersionRecord]: ...
    def add_version(self, record: VersionRecord, artifact_sha256s: Sequence[str]) -> None: ...

    def blob(self, device_id: str, sha256: str) -> BlobRecord | None: ...
    def blob_held_by_other_device(self, device_id: str, sha256: str) -> bool: ...
    def add_blob(self, record: BlobRecord, source: Path) -> None: ...
    def list_blobs(self, device_id: str, after_sha256: str, limit: int) -> list[BlobRecord]: ...
    def delete_blob(self, device_id: str, sha256: str) -> bool: ...
    def vault_usage(self, device_id: str) -> tuple[int, int]: ...
    def owner_blob(self, owner_id: str, sha256: str) -> BlobRecord | None: ...
    def blob_held_by_other_owner(self, owner_id: str, sha256: str) -> bool: ...
    def list_owner_blobs(self, owner_id: str, after_sha256: str, limit: int) -> list[BlobRecord]: ...
    def delete_owner_blob(self, owner_id: str, sha256: str) -> bool: ...
    def owner_vault_usage(self, owner_id: str) -> tuple[int, int]: ...
    def reserve_upload(self, owner_id: str, device_id: str, sha256: str, size: int, now: float, quota: int) -> Reservation: ...
    def finish_upload(self, record: BlobRecord, source: Path) -> None: ...
    def release_upload(self, owner_id: str, sha256: str) -> None: ...
    def touch_upload(self, owner_id: str, sha256: str, now: float) -> None: ...
    def expire_uploads(self, idle_since: float, in_progress: Collection[tuple[str, str]]) -> list[tuple[str, str]]: ...
    def reserved_uploads(self) -> set[tuple[str, str]]: ...

    def push_records(self, owner_id: str, device_id: str, records: Sequence[ReplicaRecord], now: str) -> PushOutcome: ...
    def pull_records(self, owner_id: str, after_sequence: int, limit: int) -> list[ReplicaRecord]: ...
    def replica_usage(self, owner_id: str) -> tuple[int, int]: ...

    def add_enrolment_code(self, code_hash: str, label: str, created_at: str, expires_at: str,
                           owner_id: str | None = None) -> None: ...
    def enrol(self, code_hash: str, now: str, device_id: str, name: str, token_hash: str,
              owner_key_id: str = "") -> DeviceRecord | None: ...
    def device_for_token(self, token_hash: str) -> str | None: ...
    def device_owner(self, device_id: str) -> str | None: ...
    def record_report(self, device_id: str, report: DeviceReport, now: str) -> str | None: ...
    def revoke_device(self, device_id: str, now: str) -> tuple[str, str | None] | None: ...
    def compact_replica_page(self, owner_id: str, after_item: str, limit: int) -> str | None: ...
    def list_devices(self, after_seq: int, limit: int) -> list[DeviceRecord]: ...

    def counts(self) -> dict[str, int]: ...
    def collect_garbage(self) -> dict[str, int]: ...
    def close(self) -> None: ...


class SqliteStorage:
    """:class:`Storage` on SQLite (WAL) plus two content-addressed file stores in ``data_dir``."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = _lock_exclusively(self.data_dir / "server.lock")
        self.artifacts = ContentStore(self.data_dir / "artifacts")
        self.blobs = ContentStore(self.data_dir / "blobs")
        self.tmp_dir = self.data_dir / "tmp"
        self.tmp_dir.mkdir(exist_ok=True)
        try:
            self._db = _open_database(self.data_dir / "meta.sqlite3")
        except BaseException:
            os.close(self._lock_fd)
            raise

    # -- registry ---------------------------------------------------------------------------

    def versions(self) -> list[VersionRecord]:
        rows = self._db.execute("SELECT version, manifest, signature, published_at FROM versions ORDER BY version")
        return [VersionRecord(v, bytes(m), bytes(s), p) for v, m, s, p in rows]

    def add_version(self, record: VersionRecord, artifact_sha256s: Sequence[str]) -> None:
        """Make a version visible, in one transaction. Its artifacts must already be in
        :attr:`artifacts` (put them first, e.g. from a worker thread)."""
        missing = [s for s in artifact_sha256s if not self.artifacts.has(s)]
        if missing:
            raise FileNotFoundError(f"artifacts not in the store: {', '.join(missing)}")
        with self._transaction():
            self._db.execute(
                "INSERT INTO versions (version, manifest, signature, published_at) VALUES (?, ?, ?, ?)",
                (record.version, record.manifest, record.signature, record.published_at),
            )
            self._db.executemany(
                "INSERT INTO version_artifacts (version, sha256) VALUES (?, ?)",
                [(record.version, sha256) for sha256 in sorted(set(artifact_sha256s))],
            )

    # -- vault ------------------------------------------------------------------------------
    # Blobs are looked up per device (its uploads) or per owner (what its devices may reach).

    def blob(self, device_id: str, sha256: str) -> BlobRecord | None:
        return next(iter(self._blobs("device_id", device_id, "sha256=?", (sha256,), 1)), None)

    def owner_blob(self, owner_id: str, sha256: str) -> BlobRecord | None:
        return next(iter(self._blobs("owner_id", owner_id, "sha256=?", (sha256,), 1)), None)

    def blob_held_by_other_device(self, device_id: str, sha256: str) -> bool:
        return self._held_by_other("device_id", device_id, sha256)

    def blob_held_by_other_owner(self, owner_id: str, sha256: str) -> bool:
        return self._held_by_other("owner_id", owner_id, sha256)

    def add_blob(self, record: BlobRecord, source: Path) -> None:
        self.blobs.put(source, record.sha256)
        owner_id = record.owner_id or self.device_owner(record.device_id)
        self._db.execute(
            "INSERT OR IGNORE INTO blobs (device_id, sha256, size, item_id, created_at, owner_id) VALUES (?, ?, ?, ?, ?, ?)",
            (record.device_id, record.sha256, record.size, record.item_id, record.created_at, owner_id),
        )

    # -- uploads in progress (fctkit.server.upload_sessions) ----------------------------------

    def reserve_upload(self, owner_id: str, device_id: str, sha256: str, size: int, now: float, quota: int) -> Reservation:
        with self._transaction():
            return upload_sessions.reserve(self._db, owner_id, device_id, sha256, size, now, quota)

    def finish_upload(self, record: BlobRecord, source: Path) -> None:
        """Store the finished upload's blob and end its reservation, in one transaction."""
        with self._transaction():
            self.add_blob(record, source)
            upload_sessions.release(self._db, record.owner_id, record.sha256)

    def release_upload(self, owner_id: str, sha256: str) -> None:
        upload_sessions.release(self._db, owner_id, sha256)

    def touch_upload(self, owner_id: str, sha256: str, now: float) -> None:
        upload_sessions.touch(self._db, owner_id, sha256, now)

    def expire_uploads(self, idle_since: float, in_progress: Collection[tuple[str, str]]) -> list[tuple[str, str]]:
        with self._transaction():
            return upload_sessions.expire(self._db, idle_since, in_progress)

    def reserved_uploads(self) -> set[tuple[str, str]]:
        return upload_sessions.reserved_keys(self._db)

    def list_blobs(self, device_id: str, after_sha256: str, limit: int) -> list[BlobRecord]:
        return self._blobs("device_id", device_id, "sha256>?", (after_sha256,), limit)

    def list_owner_blobs(self, owner_id: str, after_sha256: str, limit: int) -> list[BlobRecord]:
        return self._blobs("owner_id", owner_id, "sha256>?", (after_sha256,), limit)

    def delete_blob(self, device_id: str, sha256: str) -> bool:
        """Forget the device's blob; the file goes when no device holds it any more."""
        return self._delete_blob("device_id", device_id, sha256)

    def delete_owner_blob(self, owner_id: str, sha256: str) -> bool:
        """Forget the owner's blob (whichever of its devices uploaded it)."""
        return self._delete_blob("owner_id", owner_id, sha256)

    def vault_usage(self, device_id: str) -> tuple[int, int]:
        return self._usage("device_id", device_id)

    def owner_vault_usage(self, owner_id: str) -> tuple[int, int]:
        return self._usage("owner_id", owner_id)

    def _blobs(self, column: str, value: str, condition: str, params: tuple, limit: int) -> list[BlobRecord]:
        rows = self._db.execute(
            f"SELECT device_id, sha256, size, item_id, created_at, owner_id FROM blobs "
            f"WHERE {column}=? AND {condition} ORDER BY sha256 LIMIT ?",
            (value, *params, limit),
        )
        return [BlobRecord(*row) for row in rows]

    def _held_by_other(self, column: str, value: str, sha256: str) -> bool:
        query = f"SELECT 1 FROM blobs WHERE sha256=? AND ({column} IS NULL OR {column}<>?) LIMIT 1"
        return self._db.execute(query, (sha256, value)).fetchone() is not None

    def _delete_blob(self, column: str, value: str, sha256: str) -> bool:
        deleted = self._db.execute(f"DELETE FROM blobs WHERE {column}=? AND sha256=?", (value, sha256)).rowcount
        if deleted and not self._db.execute("SELECT 1 FROM blobs WHERE sha256=? LIMIT 1", (sha256,)).fetchone():
            self.blobs.delete(sha256)
        return bool(deleted)

    def _usage(self, column: str, value: str) -> tuple[int, int]:
        size, count = self._db.execute(
            f"SELECT COALESCE(SUM(size), 0), COUNT(*) FROM blobs WHERE {column}=?", (value,)
        ).fetchone()
        return int(size), int(count)

    # -- replica ----------------------------------------------------------------------------

    def push_records(self, owner_id: str, device_id: str, records: Sequence[ReplicaRecord], now: str) -> PushOutcome:
        """Store ``records`` in one transaction, each new one under the owner's next sequence
        number; a record whose (device, change id) is already stored is left as it is."""
        with self._transaction():
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
        for chunk in _unique_chunks(change_ids):
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

    # -- fleet ------------------------------------------------------------------------------

    def add_enrolment_code(self, code_hash: str, label: str, created_at: str, expires_at: str,
                           owner_id: str | None = None) -> None:
        """A one-time code; the device it enrols joins ``owner_id`` (None: an owner of its own)."""
        self._db.execute(
            "INSERT INTO enrolment_codes (code_hash, label, created_at, expires_at, owner_id) VALUES (?, ?, ?, ?, ?)",
            (code_hash, label, created_at, expires_at, owner_id),
        )

    def enrol(self, code_hash: str, now: str, device_id: str, name: str, token_hash: str,
              owner_key_id: str = "") -> DeviceRecord | None:
        """Use up an unused, unexpired code and add the device, in one transaction; None when
        the code is unknown, used or expired. ``owner_key_id`` (when given) must be the one the
        owner's first device brought (:class:`OwnerKeyMismatch` otherwise, nothing changed)."""
        with self._transaction():
            row = self._db.execute(
                "SELECT label, owner_id FROM enrolment_codes WHERE code_hash=? AND used_at IS NULL AND expires_at>?",
                (code_hash, now),
            ).fetchone()
            if row is None:
                return None
            owner_id = row[1] or "own-" + device_id
            if owner_key_id:
                known = self._db.execute("SELECT key_id FROM owner_keys WHERE owner_id=?", (owner_id,)).fetchone()
                if known is not None and known[0] != owner_key_id:
                    raise OwnerKeyMismatch(owner_id)
                self._db.execute("INSERT OR IGNORE INTO owner_keys VALUES (?, ?)", (owner_id, owner_key_id))
            self._db.execute(
                "UPDATE enrolment_codes SET used_at=?, device_id=? WHERE code_hash=?", (now, device_id, code_hash)
            )
            self._db.execute(
                "INSERT INTO devices (device_id, token_hash, name, label, enrolled_at, owner_id) VALUES (?, ?, ?, ?, ?, ?)",
                (device_id, token_hash, name, row[0], now, owner_id),
            )
        return self._devices("WHERE d.device_id=?", (device_id,))[0]

    def device_for_token(self, token_hash: str) -> str | None:
        row = self._db.execute("SELECT device_id FROM devices WHERE token_hash=? AND revoked_at IS NULL", (token_hash,)).fetchone()
        return row[0] if row else None

    def device_owner(self, device_id: str) -> str | None:
        row = self._db.execute("SELECT owner_id FROM devices WHERE device_id=?", (device_id,)).fetchone()
        return row[0] if row else None

    def record_report(self, device_id: str, report: DeviceReport, now: str) -> str | None:
        """Store the device's report. Returns its owner when every device of the owner has now
        reached the same version: records at older versions may have become superseded
        (:meth:`compact_replica_page`); None otherwise."""
        with self._transaction():
            return self._update_device(
                self.device_owner(device_id),
                "UPDATE devices SET last_report_at=?, version=?, gallery_size=?, upgrade_state=?, target_version=?, "
                "progress=?, detail=? WHERE device_id=?",
                (now, report.version, report.gallery_size, report.upgrade_state, report.target_version,
                 report.progress, report.detail, device_id),
            )

    def revoke_device(self, device_id: str, now: str) -> tuple[str, str | None] | None:
        """Revoke the device (its token stops working); None for an unknown device. Returns when
        it was revoked (the first time) and its owner if the owner's remaining devices now share
        a version (a replica compaction is due), else None."""
        with self._transaction():
            row = self._db.execute("SELECT owner_id, revoked_at FROM devices WHERE device_id=?", (device_id,)).fetchone()
            if row is None:
                return None
            owner_id, revoked_at = row
            if revoked_at is not None:
                return revoked_at, None
            self._db.execute("DELETE FROM uploads WHERE device_id=?", (device_id,))  # its partial files go at the next sweep
            return now, self._update_device(owner_id, "UPDATE devices SET revoked_at=? WHERE device_id=?", (now, device_id))

    def _update_device(self, owner_id: str | None, statement: str, params: tuple) -> str | None:
        """Run ``statement`` on a device of ``owner_id``; the owner if its devices now share a
        version they did not share before (a replica compaction is due), else None."""
        before = common_version(self._db, owner_id)
        self._db.execute(statement, params)
        return owner_id if owner_id is not None and common_version(self._db, owner_id) not in (0, before) else None

    def compact_replica_page(self, owner_id: str, after_item: str, limit: int) -> str | None:
        """Compact the records of the owner's next ``limit`` item ids after ``after_item`` (in
        one transaction); the last item id done, or None when there were none left."""
        with self._transaction():
            items = [row[0] for row in self._db.execute(
                "SELECT DISTINCT item_id FROM replica_records WHERE owner_id=? AND superseded=0 AND item_id>? "
                "ORDER BY item_id LIMIT ?", (owner_id, after_item, limit))]
            if items:
                compact_replica(self._db, owner_id, items)
        return items[-1] if items else None

    def list_devices(self, after_seq: int, limit: int) -> list[DeviceRecord]:
        return self._devices("WHERE d.seq>? ORDER BY d.seq LIMIT ?", (after_seq, limit))

    def _devices(self, where: str, params: tuple) -> list[DeviceRecord]:
        rows = self._db.execute(
            "SELECT d.seq, d.device_id, d.name, d.label, d.enrolled_at, d.last_report_at, d.version, d.gallery_size, "
            "d.upgrade_state, d.target_version, d.progress, d.detail, "
            "(SELECT COALESCE(SUM(size), 0) FROM blobs b WHERE b.device_id=d.device_id), "
            "(SELECT COUNT(*) FROM blobs b WHERE b.device_id=d.device_id), d.owner_id, d.revoked_at "
            f"FROM devices d {where}",
            params,
        )
        return [
            DeviceRecord(seq, dev, name, label, enrolled, last, DeviceReport(*report), int(vb), int(vn), owner or "", revoked)
            for seq, dev, name, label, enrolled, last, *report, vb, vn, owner, revoked in rows
        ]

    # -- housekeeping -----------------------------------------------------------------------

    def counts(self) -> dict[str, int]:
        """Row counts per table, for checks and the start-up log."""
        tables = ("versions", "devices", "blobs", "enrolment_codes")
        return {t: self._db.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in tables}

    def collect_garbage(self) -> dict[str, int]:
        """Remove what no row references: leftovers of uploads and publishes cut short by a crash.

        Partial vault uploads (``tmp/uploads``) are kept: they can still be resumed.
        """
        wanted_artifacts = {row[0] for row in self._db.execute("SELECT DISTINCT sha256 FROM version_artifacts")}
        wanted_blobs = {row[0] for row in self._db.execute("SELECT DISTINCT sha256 FROM blobs")}
        removed = {"artifacts": 0, "blobs": 0, "staging": 0}
        for store, wanted, key in ((self.artifacts, wanted_artifacts, "artifacts"), (self.blobs, wanted_blobs, "blobs")):
            for sha256 in list(store):
                if sha256 not in wanted:
                    store.delete(sha256)
                    removed[key] += 1
        for staging in self.tmp_dir.glob("publish-*"):
            shutil.rmtree(staging, ignore_errors=True)
            removed["staging"] += 1
        return removed

    def close(self) -> None:
        self._db.close()
        os.close(self._lock_fd)  # releases the lock

    def _transaction(self):
        return _Transaction(self._db)


def _open_database(path: Path) -> sqlite3.Connection:
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
        with _Transaction(db):
            for step in range(found, SCHEMA_VERSION) if found else ():
                _MIGRATIONS[step](db)
            for statement in filter(str.strip, (_SCHEMA + upload_sessions.UPLOADS_SCHEMA).split(";")):
                db.execute(statement)
            db.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
    except sqlite3.DatabaseError as exc:
        raise ConfigError(f"{path}: not a usable fctkit database: {exc}") from exc
    return db


def _lock_exclusively(path: Path) -> int:
    """Hold an exclusive lock on ``path`` for as long as the returned descriptor stays open:
    two servers on one data directory would race each other's uploads and publishes."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(f"{path.parent} is in use by another fctkit server; stop it or choose another --data") from None
    return fd


class _Transaction:
    """BEGIN IMMEDIATE ... COMMIT, rolled back on any exception."""

    def __init__(self, db: sqlite3.Connection) -> None:
        self._db = db

    def __enter__(self) -> None:
        self._db.execute("BEGIN IMMEDIATE")

    def __exit__(self, exc_type, exc, tb) -> None:
        self._db.execute("COMMIT" if exc_type is None else "ROLLBACK")

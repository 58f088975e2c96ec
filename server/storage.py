"""The server's persistent state behind one small interface, :class:`Storage`.

The default, :class:`SqliteStorage`, keeps everything in one data directory:

```
DATA/meta.sqlite3      metadata (SQLite in WAL mode): versions, devices, enrolment codes, blob index
DATA/artifacts/aa/...  bundle artifacts, content-addressed by SHA-256
DATA/blobs/aa/...      vault blobs (device ciphertext), content-addressed by SHA-256
DATA/tmp/              uploads in progress and publish staging (never listed)
DATA/server.lock       held (flock) by the one server using the directory
```

A content file is fsynced and renamed into place *before* the metadata row that makes it
visible is committed; files that no row references (a crash in between) are removed by
:meth:`SqliteStorage.collect_garbage` at start-up.

The tables carry an ``owner_id`` column (devices and blobs) for the multi-device owners of a
later release; nothing sets it yet.
"""

from __future__ import annotations

import fcntl
import os
import shutil
import sqlite3
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

from fctkit.errors import ConfigError

from .content_store import ContentStore

SCHEMA_VERSION = 1
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
    device_id TEXT
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
    detail TEXT NOT NULL DEFAULT ''
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
"""


@dataclass(frozen=True)
class VersionRecord:
    version: int
    manifest: bytes
    signature: bytes
    published_at: str


@dataclass(frozen=True)
class BlobRecord:
    device_id: str
    sha256: str
    size: int
    item_id: str
    created_at: str


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

    def add_enrolment_code(self, code_hash: str, label: str, created_at: str, expires_at: str) -> None: ...
    def enrol(self, code_hash: str, now: str, device_id: str, name: str, token_hash: str) -> DeviceRecord | None: ...
    def device_for_token(self, token_hash: str) -> str | None: ...
    def record_report(self, device_id: str, report: DeviceReport, now: str) -> None: ...
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

    def blob(self, device_id: str, sha256: str) -> BlobRecord | None:
        row = self._db.execute(
            "SELECT device_id, sha256, size, item_id, created_at FROM blobs WHERE device_id=? AND sha256=?",
            (device_id, sha256),
        ).fetchone()
        return BlobRecord(*row) if row else None

    def blob_held_by_other_device(self, device_id: str, sha256: str) -> bool:
        row = self._db.execute(
            "SELECT 1 FROM blobs WHERE sha256=? AND device_id<>? LIMIT 1", (sha256, device_id)
        ).fetchone()
        return row is not None

    def add_blob(self, record: BlobRecord, source: Path) -> None:
        self.blobs.put(source, record.sha256)
        self._db.execute(
            "INSERT OR IGNORE INTO blobs (device_id, sha256, size, item_id, created_at) VALUES (?, ?, ?, ?, ?)",
            (record.device_id, record.sha256, record.size, record.item_id, record.created_at),
        )

    def list_blobs(self, device_id: str, after_sha256: str, limit: int) -> list[BlobRecord]:
        rows = self._db.execute(
            "SELECT device_id, sha256, size, item_id, created_at FROM blobs "
            "WHERE device_id=? AND sha256>? ORDER BY sha256 LIMIT ?",
            (device_id, after_sha256, limit),
        )
        return [BlobRecord(*row) for row in rows]

    def delete_blob(self, device_id: str, sha256: str) -> bool:
        """Forget the device's blob; the file goes when no device holds it any more."""
        deleted = self._db.execute("DELETE FROM blobs WHERE device_id=? AND sha256=?", (device_id, sha256)).rowcount
        if deleted and not self._db.execute("SELECT 1 FROM blobs WHERE sha256=? LIMIT 1", (sha256,)).fetchone():
            self.blobs.delete(sha256)
        return bool(deleted)

    def vault_usage(self, device_id: str) -> tuple[int, int]:
        size, count = self._db.execute(
            "SELECT COALESCE(SUM(size), 0), COUNT(*) FROM blobs WHERE device_id=?", (device_id,)
        ).fetchone()
        return int(size), int(count)

    # -- fleet ------------------------------------------------------------------------------

    def add_enrolment_code(self, code_hash: str, label: str, created_at: str, expires_at: str) -> None:
        self._db.execute(
            "INSERT INTO enrolment_codes (code_hash, label, created_at, expires_at) VALUES (?, ?, ?, ?)",
            (code_hash, label, created_at, expires_at),
        )

    def enrol(self, code_hash: str, now: str, device_id: str, name: str, token_hash: str) -> DeviceRecord | None:
        """Use up an unused, unexpired code and add the device, in one transaction; None when
        the code is unknown, used or expired."""
        with self._transaction():
            row = self._db.execute(
                "SELECT label FROM enrolment_codes WHERE code_hash=? AND used_at IS NULL AND expires_at>?",
                (code_hash, now),
            ).fetchone()
            if row is None:
                return None
            self._db.execute(
                "UPDATE enrolment_codes SET used_at=?, device_id=? WHERE code_hash=?", (now, device_id, code_hash)
            )
            self._db.execute(
                "INSERT INTO devices (device_id, token_hash, name, label, enrolled_at) VALUES (?, ?, ?, ?, ?)",
                (device_id, token_hash, name, row[0], now),
            )
        return self._devices("WHERE d.device_id=?", (device_id,))[0]

    def device_for_token(self, token_hash: str) -> str | None:
        row = self._db.execute("SELECT device_id FROM devices WHERE token_hash=?", (token_hash,)).fetchone()
        return row[0] if row else None

    def record_report(self, device_id: str, report: DeviceReport, now: str) -> None:
        self._db.execute(
            "UPDATE devices SET last_report_at=?, version=?, gallery_size=?, upgrade_state=?, target_version=?, "
            "progress=?, detail=? WHERE device_id=?",
            (now, report.version, report.gallery_size, report.upgrade_state, report.target_version,
             report.progress, report.detail, device_id),
        )

    def list_devices(self, after_seq: int, limit: int) -> list[DeviceRecord]:
        return self._devices("WHERE d.seq>? ORDER BY d.seq LIMIT ?", (after_seq, limit))

    def _devices(self, where: str, params: tuple) -> list[DeviceRecord]:
        rows = self._db.execute(
            "SELECT d.seq, d.device_id, d.name, d.label, d.enrolled_at, d.last_report_at, d.version, d.gallery_size, "
            "d.upgrade_state, d.target_version, d.progress, d.detail, "
            "(SELECT COALESCE(SUM(size), 0) FROM blobs b WHERE b.device_id=d.device_id), "
            "(SELECT COUNT(*) FROM blobs b WHERE b.device_id=d.device_id) "
            f"FROM devices d {where}",
            params,
        )
        return [
            DeviceRecord(seq, dev, name, label, enrolled, last, DeviceReport(*report), int(vb), int(vn))
            for seq, dev, name, label, enrolled, last, *report, vb, vn in rows
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
        if found not in (0, SCHEMA_VERSION):
            db.close()
            raise ConfigError(
                f"{path.parent}: metadata schema {found} is not the {SCHEMA_VERSION} this server "
                "understands; run the fctkit version that wrote it"
            )
        db.executescript(_SCHEMA)
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

"""The vault's blobs: the ``blobs`` index of device ciphertext (held in the blobs content
store) and the owners' uploads in progress (:mod:`.upload_sessions`).

Blobs belong to an owner (the uploading device is kept for audit) and are looked up per device
(its uploads) or per owner (what its devices may reach). A blob file is stored once and goes
when no record references it any more.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import cast

from . import upload_sessions
from .content_store import Contents
from .database import Database
from .device_store import owner_lock
from .upload_sessions import Reservation


@dataclass(frozen=True)
class BlobRecord:
    device_id: str
    sha256: str
    size: int
    item_id: str
    created_at: str
    owner_id: str | None = None  # None: the uploading device's owner


class BlobStore:
    """Blob records and upload reservations on the metadata database, files in ``blobs``;
    ``device_owner`` names the owner of a record that does not."""

    def __init__(self, db: Database, blobs: Contents, device_owner: Callable[[str], str | None]) -> None:
        self._db = db
        self._files = blobs
        self._device_owner = device_owner

    def blob(self, device_id: str, sha256: str) -> BlobRecord | None:
        return next(iter(self._blobs("device_id", device_id, "sha256=?", (sha256,), 1)), None)

    def owner_blob(self, owner_id: str, sha256: str) -> BlobRecord | None:
        return next(iter(self._blobs("owner_id", owner_id, "sha256=?", (sha256,), 1)), None)

    def blob_held_by_other_device(self, device_id: str, sha256: str) -> bool:
        return self._held_by_other("device_id", device_id, sha256)

    def blob_held_by_other_owner(self, owner_id: str, sha256: str) -> bool:
        return self._held_by_other("owner_id", owner_id, sha256)

    def add_blob(self, record: BlobRecord, source: Path) -> None:
        with self._db.transaction(_blob_lock(record.sha256)):
            self._add_blob(record, source)

    def _add_blob(self, record: BlobRecord, source: Path) -> None:
        """Inside a transaction holding the blob's lock: no delete of the same content can remove
        the stored object between this put and the row that keeps it."""
        self._files.put(source, record.sha256)
        owner_id = record.owner_id or self._device_owner(record.device_id)
        self._db.execute(
            "INSERT INTO blobs (device_id, sha256, size, item_id, created_at, owner_id) VALUES (?, ?, ?, ?, ?, ?) "
            "ON CONFLICT DO NOTHING",
            (record.device_id, record.sha256, record.size, record.item_id, record.created_at, owner_id),
        )

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

    def drop_unreferenced(self, sha256: str) -> bool:
        """Delete the stored object when no record names it (checked under the blob's lock); whether it went."""
        with self._db.transaction(_blob_lock(sha256)):
            return self._delete_file_if_unreferenced(sha256)

    def _delete_file_if_unreferenced(self, sha256: str) -> bool:
        """Inside a transaction holding the blob's lock: delete the stored object when no record names it."""
        if self._db.execute("SELECT 1 FROM blobs WHERE sha256=? LIMIT 1", (sha256,)).fetchone():
            return False
        self._files.delete(sha256)
        return True

    def referenced_blobs(self) -> set[str]:
        """The SHA-256 of every blob a record names (the ones garbage collection keeps)."""
        return {row[0] for row in self._db.execute("SELECT DISTINCT sha256 FROM blobs")}

    # -- uploads in progress (fctkit.server.upload_sessions) ----------------------------------

    def reserve_upload(
        self, owner_id: str, device_id: str, sha256: str, size: int, now: float, quota: int
    ) -> Reservation:
        with self._db.transaction(owner_lock(owner_id)):
            return upload_sessions.reserve(self._db, owner_id, device_id, sha256, size, now, quota)

    def finish_upload(self, record: BlobRecord, source: Path) -> None:
        """Store the finished upload's blob and end its reservation, in one transaction."""
        with self._db.transaction(owner_lock(record.owner_id), _blob_lock(record.sha256)):
            self._add_blob(record, source)
            upload_sessions.release(self._db, cast(str, record.owner_id), record.sha256)  # an upload names its owner

    def begin_upload(self, owner_id: str, sha256: str, device_id: str, token: str, now: float) -> bool | None:
        """Give the upload's lease to ``token`` (see :func:`.upload_sessions.take_lease`)."""
        with self._db.transaction(owner_lock(owner_id)):
            return upload_sessions.take_lease(self._db, owner_id, sha256, device_id, token, now)

    def renew_upload(self, owner_id: str, sha256: str, token: str, now: float, bytes_arrived: bool) -> bool:
        return upload_sessions.renew_lease(self._db, owner_id, sha256, token, now, bytes_arrived)

    def end_upload(self, owner_id: str, sha256: str, token: str, now: float, bytes_arrived: bool) -> None:
        with self._db.transaction(owner_lock(owner_id)):
            upload_sessions.end_lease(self._db, owner_id, sha256, token, now, bytes_arrived)

    def release_upload(self, owner_id: str, sha256: str, token: str) -> bool:
        return upload_sessions.release(self._db, owner_id, sha256, token)

    def expire_uploads(self, idle_since: float, leased_since: float) -> int:
        return upload_sessions.expire(self._db, idle_since, leased_since)

    def reserved_uploads(self) -> set[tuple[str, str]]:
        return upload_sessions.reserved_keys(self._db)

    # -- queries by device or by owner ------------------------------------------------------

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
        with self._db.transaction(_blob_lock(sha256)):
            deleted = self._db.execute(f"DELETE FROM blobs WHERE {column}=? AND sha256=?", (value, sha256)).rowcount
            if deleted:
                self._delete_file_if_unreferenced(sha256)
        return bool(deleted)

    def _usage(self, column: str, value: str) -> tuple[int, int]:
        size, count = self._db.execute(
            f"SELECT COALESCE(SUM(size), 0), COUNT(*) FROM blobs WHERE {column}=?", (value,)
        ).fetchone()
        return int(size), int(count)


def _blob_lock(sha256: str) -> str:
    """The lock key of one stored content object (shared by every owner holding it)."""
    return f"blob:{sha256}"

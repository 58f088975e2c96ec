"""The server's persistent state behind one small interface, :class:`Storage`, implemented once
(:class:`ServerStorage`) over a metadata database, two content stores and the unfinished uploads.
Two backends build it: :class:`SqliteStorage` (one server, one directory, below) and
:class:`fctkit.server.scale_out.ScaleOutStorage` (PostgreSQL and an S3 bucket, any number of replicas).

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

:class:`SqliteStorage` composes one store per concern, each with its own tables: the published
versions (:mod:`.version_store`), the devices and their enrolment (:mod:`.device_store`), the
vault's blobs and uploads (:mod:`.blob_store`) and the owners' replicas (:mod:`.replica_store`);
the schema and its migrations are in :mod:`.storage_schema`.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import time
from collections.abc import Callable, Collection, Coroutine, Sequence
from pathlib import Path
from typing import Any, Protocol

from fctkit.errors import ConfigError

from .blob_store import BlobRecord, BlobStore
from .content_store import Contents, ContentStore
from .database import Database
from .device_store import ANY_DEVICE, DeviceFilter, DeviceRecord, DeviceReport, DeviceStore, OwnerKeyMismatch
from .guard_failures import FailureTally, failure_tally
from .guard_votes import GuardTally
from .partial_uploads import PartialFiles, PartialUploads
from .replica_store import PushOutcome, ReplicaQuotaExceeded, ReplicaRecord, ReplicaStore
from .rollout_store import DeviceState, HealthReport, Rollout, RolloutStore
from .storage_schema import open_database, open_reader
from .trust_store import StoredTimestamp, TrustStore
from .upload_sessions import Reservation
from .version_store import StaleVersion, VersionRecord, VersionStore
from .withdrawal_store import StoredWithdrawal, WithdrawalOutcome, WithdrawalStore

__all__ = [
    "BlobRecord",
    "DeviceFilter",
    "DeviceRecord",
    "DeviceReport",
    "OwnerKeyMismatch",
    "PushOutcome",
    "ReplicaQuotaExceeded",
    "ReplicaRecord",
    "Reservation",
    "ServerStorage",
    "SqliteStorage",
    "StaleVersion",
    "Storage",
    "StoredTimestamp",
    "VersionRecord",
]


class Storage(Protocol):
    """What the services need from persistence. Every method is synchronous and short;
    contents go through the two content stores and the unfinished uploads; ``tmp_dir`` is this
    process's own scratch space (publish staging)."""

    artifacts: Contents
    blobs: Contents
    partials: PartialUploads
    tmp_dir: Path

    def listen(
        self, on_event: Callable[[str], None], on_connected: Callable[[], None], on_lost: Callable[[], None]
    ) -> Coroutine[Any, Any, None] | None: ...
    def single_flight(self, name: str) -> contextlib.AbstractContextManager[bool]: ...
    def round_trips(self) -> dict[str, int]: ...
    def revoked_among(self, device_ids: Collection[str]) -> list[str]: ...

    def versions(self) -> list[VersionRecord]: ...
    def add_version(
        self, record: VersionRecord, artifact_sha256s: Sequence[str], rollout: Rollout | None = None
    ) -> None: ...
    def latest_version(self) -> int: ...

    def rollouts(self) -> dict[int, Rollout]: ...
    def change_rollout(self, version: int, change: Callable[[Rollout | None], Rollout | None]) -> Rollout | None: ...
    def confirmations(self) -> dict[int, str]: ...
    def confirm_version(self, version: int, now: str, check: Callable[[Rollout | None], None]) -> str: ...
    def device_version(self, device_id: str) -> int: ...
    def device_reach(self, device_id: str) -> int: ...
    def rollout_devices(self) -> list[DeviceState]: ...
    def enrolled_devices(self, device_ids: list[str]) -> set[str]: ...
    def record_health(self, device_id: str, health: HealthReport, now: str) -> None: ...
    def health_reports(self, version: int) -> dict[str, HealthReport]: ...
    def guard_tally(self, version: int) -> GuardTally: ...
    def failure_tally(self, version: int) -> FailureTally: ...
    def device_state(self, device_id: str) -> DeviceState | None: ...
    def refresh_failures(self, version: int, device_id: str) -> None: ...
    def withdrawals(self) -> dict[int, StoredWithdrawal]: ...
    def add_withdrawal(self, withdrawal: StoredWithdrawal) -> WithdrawalOutcome: ...
    def record_revert(self, device_id: str, version: int, method: str, now: str) -> None: ...
    def device_reverts(self, version: int) -> dict[str, str]: ...

    def roots(self, after_version: int = 0, limit: int | None = None) -> list[tuple[int, bytes]]: ...
    def latest_root(self) -> tuple[int, bytes] | None: ...
    def add_root(self, version: int, data: bytes) -> bool: ...
    def timestamp(self) -> StoredTimestamp | None: ...
    def put_timestamp(self, version: int, data: bytes) -> bool: ...

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
    def reserve_upload(
        self, owner_id: str, device_id: str, sha256: str, size: int, now: float, quota: int
    ) -> Reservation: ...
    def finish_upload(self, record: BlobRecord, source: Path) -> None: ...
    def begin_upload(self, owner_id: str, sha256: str, device_id: str, token: str, now: float) -> bool | None: ...
    def renew_upload(self, owner_id: str, sha256: str, token: str, now: float, bytes_arrived: bool) -> bool: ...
    def end_upload(self, owner_id: str, sha256: str, token: str, now: float, bytes_arrived: bool) -> None: ...
    def release_upload(self, owner_id: str, sha256: str, token: str) -> bool: ...
    def expire_uploads(self, idle_since: float, leased_since: float) -> int: ...
    def reserved_uploads(self) -> set[tuple[str, str]]: ...

    def push_records(
        self, owner_id: str, device_id: str, records: Sequence[ReplicaRecord], now: str, quota: int
    ) -> PushOutcome: ...
    def pull_records(
        self, owner_id: str, after_sequence: int, max_rows: int, max_sealed_bytes: int
    ) -> list[ReplicaRecord]: ...
    def replica_usage(self, owner_id: str) -> tuple[int, int]: ...

    def add_enrolment_code(
        self, code_hash: str, label: str, created_at: str, expires_at: str, owner_id: str | None = None
    ) -> None: ...
    def enrol(
        self, code_hash: str, now: str, device_id: str, name: str, token_hash: str, owner_key_id: str = ""
    ) -> DeviceRecord | None: ...
    def device_for_token(self, token_hash: str) -> str | None: ...
    def device_owner(self, device_id: str) -> str | None: ...
    def record_report(self, device_id: str, report: DeviceReport, now: str) -> str | None: ...
    def admit_report(self, device_id: str, now_s: float, per_minute: int) -> float | None: ...
    def revoke_device(self, device_id: str, now: str) -> tuple[str, str | None] | None: ...
    def compact_replica_page(self, owner_id: str, after_item: str, limit: int) -> str | None: ...
    def list_devices(self, after_seq: int, limit: int, match: DeviceFilter = ...) -> list[DeviceRecord]: ...

    def counts(self) -> dict[str, int]: ...
    def collect_garbage(self) -> dict[str, int]: ...
    def reader(self) -> Storage: ...
    def close(self) -> None: ...


class ServerStorage:
    """:class:`Storage` over a metadata :class:`~.database.Database`, two content stores and the
    unfinished uploads; :class:`SqliteStorage` and :class:`fctkit.server.scale_out.ScaleOutStorage` build one."""

    def __init__(
        self,
        db: Database,
        artifacts: Contents,
        blobs: Contents,
        partials: PartialUploads,
        tmp_dir: Path,
        *,
        garbage_grace_s: float = 0.0,
    ) -> None:
        self._db, self.artifacts, self.blobs, self.partials, self.tmp_dir = db, artifacts, blobs, partials, tmp_dir
        self._garbage_grace_s = garbage_grace_s
        self._versions = VersionStore(self._db, self.artifacts)
        self._devices = DeviceStore(self._db)
        self._vault = BlobStore(self._db, self.blobs, self._devices.device_owner)
        self._replica = ReplicaStore(self._db)
        self._trust = TrustStore(self._db)
        self._rollouts = RolloutStore(self._db)
        self._withdrawals = WithdrawalStore(self._db)

    def listen(
        self, on_event: Callable[[str], None], on_connected: Callable[[], None], on_lost: Callable[[], None]
    ) -> Coroutine[Any, Any, None] | None:
        """A task to run that calls ``on_event`` for what other replicas do (``on_connected`` and
        ``on_lost`` as the shared database comes and goes); None: there are no other replicas."""
        return None

    def single_flight(self, name: str) -> contextlib.AbstractContextManager[bool]:
        """True for the one replica running ``name`` now (a sweep), False for the others."""
        return self._db.single_flight(name)

    def round_trips(self) -> dict[str, int]:
        """Network round trips to the storage services so far (none: everything is local)."""
        return {}

    # -- registry ---------------------------------------------------------------------------

    def versions(self) -> list[VersionRecord]:
        return self._versions.versions()

    def add_version(
        self, record: VersionRecord, artifact_sha256s: Sequence[str], rollout: Rollout | None = None
    ) -> None:
        """Publish ``record``; with ``rollout``, staged (stored in the same transaction)."""
        self._versions.add_version(record, artifact_sha256s, rollout)

    def latest_version(self) -> int:
        return self._versions.latest_version()

    # -- rollouts ----------------------------------------------------------------

    def rollouts(self) -> dict[int, Rollout]:
        return self._rollouts.rollouts()

    def change_rollout(self, version: int, change: Callable[[Rollout | None], Rollout | None]) -> Rollout | None:
        """Read-modify-write ``version``'s rollout under its lock (every replica takes turns)."""
        return self._rollouts.change(version, change)

    def confirmations(self) -> dict[int, str]:
        """When each confirmed version was confirmed."""
        return self._rollouts.confirmations()

    def confirm_version(self, version: int, now: str, check: Callable[[Rollout | None], None]) -> str:
        """Record ``version`` confirmed once ``check`` accepted its rollout (see :meth:`RolloutStore.confirm`)."""
        return self._rollouts.confirm(version, now, check)

    def device_version(self, device_id: str) -> int:
        return self._rollouts.device_version(device_id)

    def device_reach(self, device_id: str) -> int:
        """The highest version the device's stored report runs or upgrades to."""
        return self._rollouts.device_reach(device_id)

    def rollout_devices(self) -> list[DeviceState]:
        return self._rollouts.device_states()

    def enrolled_devices(self, device_ids: list[str]) -> set[str]:
        return self._rollouts.enrolled(device_ids)

    def record_health(self, device_id: str, health: HealthReport, now: str) -> None:
        self._rollouts.record_health(device_id, health, now)

    def health_reports(self, version: int) -> dict[str, HealthReport]:
        """The latest health each unrevoked device reported for ``version``."""
        return self._rollouts.health(version)

    def guard_tally(self, version: int) -> GuardTally:
        """The owners' votes the guard of ``version`` reads (:mod:`.guard_votes`, :mod:`.guard_failures`)."""
        return self._rollouts.guard_tally(version)

    def failure_tally(self, version: int) -> FailureTally:
        """The owners' failure rate of ``version`` as kept now (read only)."""
        return failure_tally(self._db, version)

    def device_state(self, device_id: str) -> DeviceState | None:
        return self._rollouts.device_state(device_id)

    def refresh_failures(self, version: int, device_id: str) -> None:
        self._rollouts.refresh_failures(version, device_id)

    def withdrawals(self) -> dict[int, StoredWithdrawal]:
        return self._withdrawals.withdrawals()

    def add_withdrawal(self, withdrawal: StoredWithdrawal) -> WithdrawalOutcome:
        """Store ``withdrawal`` unless its version or its ``revert_to`` is withdrawn (see the outcome)."""
        return self._withdrawals.add(withdrawal)

    def record_revert(self, device_id: str, version: int, method: str, now: str) -> None:
        self._withdrawals.record_revert(device_id, version, method, now)

    def device_reverts(self, version: int) -> dict[str, str]:
        """How each device went back from withdrawn ``version`` (device id -> method)."""
        return self._withdrawals.reverts(version)

    # -- root of trust ------------------------------------------------------------------------

    def roots(self, after_version: int = 0, limit: int | None = None) -> list[tuple[int, bytes]]:
        return self._trust.roots(after_version, limit)

    def latest_root(self) -> tuple[int, bytes] | None:
        return self._trust.latest_root()

    def add_root(self, version: int, data: bytes) -> bool:
        """Store the next root; False when another replica stored a root of that version first."""
        return self._trust.add_root(version, data)

    def timestamp(self) -> StoredTimestamp | None:
        return self._trust.timestamp()

    def put_timestamp(self, version: int, data: bytes) -> bool:
        """Store the next timestamp; False when another replica stored that version first."""
        return self._trust.put_timestamp(version, data)

    # -- vault ------------------------------------------------------------------------------

    def blob(self, device_id: str, sha256: str) -> BlobRecord | None:
        return self._vault.blob(device_id, sha256)

    def blob_held_by_other_device(self, device_id: str, sha256: str) -> bool:
        return self._vault.blob_held_by_other_device(device_id, sha256)

    def add_blob(self, record: BlobRecord, source: Path) -> None:
        self._vault.add_blob(record, source)

    def list_blobs(self, device_id: str, after_sha256: str, limit: int) -> list[BlobRecord]:
        return self._vault.list_blobs(device_id, after_sha256, limit)

    def delete_blob(self, device_id: str, sha256: str) -> bool:
        return self._vault.delete_blob(device_id, sha256)

    def vault_usage(self, device_id: str) -> tuple[int, int]:
        return self._vault.vault_usage(device_id)

    def owner_blob(self, owner_id: str, sha256: str) -> BlobRecord | None:
        return self._vault.owner_blob(owner_id, sha256)

    def blob_held_by_other_owner(self, owner_id: str, sha256: str) -> bool:
        return self._vault.blob_held_by_other_owner(owner_id, sha256)

    def list_owner_blobs(self, owner_id: str, after_sha256: str, limit: int) -> list[BlobRecord]:
        return self._vault.list_owner_blobs(owner_id, after_sha256, limit)

    def delete_owner_blob(self, owner_id: str, sha256: str) -> bool:
        return self._vault.delete_owner_blob(owner_id, sha256)

    def owner_vault_usage(self, owner_id: str) -> tuple[int, int]:
        return self._vault.owner_vault_usage(owner_id)

    def reserve_upload(
        self, owner_id: str, device_id: str, sha256: str, size: int, now: float, quota: int
    ) -> Reservation:
        return self._vault.reserve_upload(owner_id, device_id, sha256, size, now, quota)

    def finish_upload(self, record: BlobRecord, source: Path) -> None:
        self._vault.finish_upload(record, source)

    def begin_upload(self, owner_id: str, sha256: str, device_id: str, token: str, now: float) -> bool | None:
        """Give the upload's lease to ``token`` (the one call on any replica that may change its
        bytes now); None while another call holds it, else whether the upload had a reservation."""
        return self._vault.begin_upload(owner_id, sha256, device_id, token, now)

    def renew_upload(self, owner_id: str, sha256: str, token: str, now: float, bytes_arrived: bool) -> bool:
        """Keep ``token``'s lease (and restart the idle clock when bytes arrived); False when it was lost."""
        return self._vault.renew_upload(owner_id, sha256, token, now, bytes_arrived)

    def end_upload(self, owner_id: str, sha256: str, token: str, now: float, bytes_arrived: bool) -> None:
        """``token``'s call ends: the lease goes (and a row that never reserved anything)."""
        self._vault.end_upload(owner_id, sha256, token, now, bytes_arrived)

    def release_upload(self, owner_id: str, sha256: str, token: str) -> bool:
        """End the reservation while ``token`` holds the lease; whether it ended."""
        return self._vault.release_upload(owner_id, sha256, token)

    def expire_uploads(self, idle_since: float, leased_since: float) -> int:
        """End the reservations idle since ``idle_since`` that no live lease holds; how many."""
        return self._vault.expire_uploads(idle_since, leased_since)

    def reserved_uploads(self) -> set[tuple[str, str]]:
        return self._vault.reserved_uploads()

    # -- replica ----------------------------------------------------------------------------

    def push_records(
        self, owner_id: str, device_id: str, records: Sequence[ReplicaRecord], now: str, quota: int
    ) -> PushOutcome:
        return self._replica.push_records(owner_id, device_id, records, now, quota)

    def pull_records(
        self, owner_id: str, after_sequence: int, max_rows: int, max_sealed_bytes: int
    ) -> list[ReplicaRecord]:
        return self._replica.pull_records(owner_id, after_sequence, max_rows, max_sealed_bytes)

    def replica_usage(self, owner_id: str) -> tuple[int, int]:
        return self._replica.replica_usage(owner_id)

    def compact_replica_page(self, owner_id: str, after_item: str, limit: int) -> str | None:
        return self._replica.compact_replica_page(owner_id, after_item, limit)

    # -- fleet ------------------------------------------------------------------------------

    def add_enrolment_code(
        self, code_hash: str, label: str, created_at: str, expires_at: str, owner_id: str | None = None
    ) -> None:
        self._devices.add_enrolment_code(code_hash, label, created_at, expires_at, owner_id)

    def enrol(
        self, code_hash: str, now: str, device_id: str, name: str, token_hash: str, owner_key_id: str = ""
    ) -> DeviceRecord | None:
        return self._devices.enrol(code_hash, now, device_id, name, token_hash, owner_key_id)

    def device_for_token(self, token_hash: str) -> str | None:
        return self._devices.device_for_token(token_hash)

    def device_owner(self, device_id: str) -> str | None:
        return self._devices.device_owner(device_id)

    def record_report(self, device_id: str, report: DeviceReport, now: str) -> str | None:
        return self._devices.record_report(device_id, report, now)

    def admit_report(self, device_id: str, now_s: float, per_minute: int) -> float | None:
        """Count a report unless the device sent ``per_minute`` in the last minute (on any replica);
        None when counted, else the seconds to wait (see :meth:`DeviceStore.admit_report`)."""
        return self._devices.admit_report(device_id, now_s, per_minute)

    def revoke_device(self, device_id: str, now: str) -> tuple[str, str | None] | None:
        return self._devices.revoke_device(device_id, now)

    def list_devices(self, after_seq: int, limit: int, match: DeviceFilter = ANY_DEVICE) -> list[DeviceRecord]:
        return self._devices.list_devices(after_seq, limit, match)

    # -- housekeeping -----------------------------------------------------------------------

    def counts(self) -> dict[str, int]:
        """Row counts per table, for checks and the start-up log."""
        tables = ("versions", "devices", "blobs", "enrolment_codes")
        return {t: self._db.execute(f"SELECT COUNT(*) FROM {t}").fetchone()[0] for t in tables}

    def revoked_among(self, device_ids: Collection[str]) -> list[str]:
        return self._devices.revoked_among(device_ids)

    def collect_garbage(self) -> dict[str, int]:
        """Remove what no row references: leftovers of uploads and publishes cut short by a crash
        (objects older than the grace period only, by one replica at a time).

        Partial vault uploads are kept: they can still be resumed.
        """
        removed = {"artifacts": 0, "blobs": 0, "staging": 0}
        with self.single_flight("collect-garbage") as mine:
            if mine:
                cutoff = time.time() - self._garbage_grace_s
                wanted_artifacts = self._versions.referenced_artifacts()
                for sha256, changed in list(self.artifacts.listing()):
                    if sha256 not in wanted_artifacts and changed <= cutoff:
                        self.artifacts.delete(sha256)
                        removed["artifacts"] += 1
                wanted_blobs = self._vault.referenced_blobs()
                removed["blobs"] = sum(
                    self._vault.drop_unreferenced(sha256)
                    for sha256, changed in list(self.blobs.listing())
                    if sha256 not in wanted_blobs and changed <= cutoff
                )
        for staging in self.tmp_dir.glob("publish-*"):
            shutil.rmtree(staging, ignore_errors=True)
            removed["staging"] += 1
        return removed

    def reader(self) -> Storage:
        """A storage for reads from one other thread (:mod:`.status_reads`): this one, whose
        database hands each thread a connection of its own (PostgreSQL's pool)."""
        return self

    def close(self) -> None:
        self._db.close()


class SqliteStorage(ServerStorage):
    """:class:`Storage` on SQLite (WAL) plus two content-addressed file stores in ``data_dir``,
    for one server process (it holds ``DATA/server.lock``)."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._lock_fd = _lock_exclusively(self.data_dir / "server.lock")
        tmp_dir = self.data_dir / "tmp"
        tmp_dir.mkdir(exist_ok=True)
        try:
            db = open_database(self.data_dir / "meta.sqlite3")
        except BaseException:
            os.close(self._lock_fd)
            raise
        super().__init__(
            db,
            ContentStore(self.data_dir / "artifacts"),
            ContentStore(self.data_dir / "blobs"),
            PartialFiles(tmp_dir / "uploads"),
            tmp_dir,
        )

    def reader(self) -> Storage:
        """A storage on a read-only connection of its own to the same database, for the one
        thread that calls this (WAL: it reads the last committed state while this one writes)."""
        return ServerStorage(
            open_reader(self.data_dir / "meta.sqlite3"), self.artifacts, self.blobs, self.partials, self.tmp_dir
        )

    def close(self) -> None:
        super().close()
        os.close(self._lock_fd)  # releases the lock


def _lock_exclusively(path: Path) -> int:
    """Hold an exclusive lock on ``path`` for as long as the returned descriptor stays open:
    two servers on one data directory would race each other's uploads and publishes."""
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(
            f"{path.parent} is in use by another fctkit server; stop it or choose another --data"
        ) from None
    return fd

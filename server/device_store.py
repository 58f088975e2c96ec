"""The fleet's devices (``devices``), the one-time enrolment codes that add them
(``enrolment_codes``), each owner's key id (``owner_keys``) and how many reports each device sent
in each recent second (``report_counts``, schema 12); the devices' indexes (schema 13).

Every enrolment code names an owner (a fresh one unless the admin gives one) and the device it
enrols belongs to that owner; a device reaches everything of its owner and nothing of another.

The report limit is kept in the database, so every replica counts the same reports: a device
holds at most 61 rows (one per second of the last minute it reported in), the older ones go at
its next report.
"""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass

from . import upload_sessions
from .database import Database
from .guard_failures import refresh_device_failures
from .guard_votes import refresh_device_votes
from .replica_compaction import common_version, unique_chunks

REPORT_COUNTS_SCHEMA = """
CREATE TABLE IF NOT EXISTS report_counts (
    device_id TEXT NOT NULL,
    at_second INTEGER NOT NULL,
    reports INTEGER NOT NULL,
    PRIMARY KEY (device_id, at_second)
);
"""
REPORT_WINDOW_S = 60
DEVICE_INDEXES = """
CREATE INDEX IF NOT EXISTS devices_by_owner ON devices (owner_id, revoked_at, version);
CREATE INDEX IF NOT EXISTS uploads_by_device ON uploads (device_id);
CREATE INDEX IF NOT EXISTS devices_by_version ON devices (version, seq);
CREATE INDEX IF NOT EXISTS devices_by_state ON devices (upgrade_state, seq);
"""
"""Schema 13: what per-device calls look rows up by besides the tables' keys (the owner's common
version, :data:`~.replica_compaction.COMMON_VERSION`; a revoked device's uploads), so that none of
them reads a whole table; schema 14: what a filtered device listing pages through (:class:`DeviceFilter`:
a version's or an upgrade state's devices in enrolment order; an owner's come by ``devices_by_owner``)."""


@dataclass(frozen=True)
class DeviceReport:
    version: int
    gallery_size: int
    upgrade_state: int
    target_version: int
    progress: float
    detail: str
    root_version: int = 0
    trust_stale: bool = False
    seconds_since_fresh: int = 0


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


@dataclass(frozen=True)
class DeviceFilter:
    """Which devices a listing keeps: those matching every field given (None: any)."""

    version: int | None = None
    upgrade_state: int | None = None
    reported_before: str | None = None  # stale: no report since (never reported: enrolled before) this time
    owner_id: str | None = None

    def where(self) -> tuple[str, tuple]:
        """The filter's conditions on ``devices d``, each led by ``AND``, and their parameters."""
        conditions = (
            ("d.version=?", self.version),
            ("d.upgrade_state=?", self.upgrade_state),
            ("COALESCE(d.last_report_at, d.enrolled_at)<?", self.reported_before),
            ("d.owner_id=?", self.owner_id),
        )
        given = [(condition, value) for condition, value in conditions if value is not None]
        return "".join(f" AND {condition}" for condition, _ in given), tuple(value for _, value in given)


ANY_DEVICE = DeviceFilter()


class OwnerKeyMismatch(Exception):
    """Enrolment refused: the device's owner key id differs from the owner's (the code stays unused)."""


def owner_lock(owner_id: str | None) -> str:
    """The lock key of everything one owner holds: its devices' versions, vault quota and replica."""
    return f"owner:{owner_id}"


class DeviceStore:
    """Enrolment, tokens, reports and revocation of devices on the metadata database."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def add_enrolment_code(
        self, code_hash: str, label: str, created_at: str, expires_at: str, owner_id: str | None = None
    ) -> None:
        """A one-time code; the device it enrols joins ``owner_id`` (None: an owner of its own)."""
        self._db.execute(
            "INSERT INTO enrolment_codes (code_hash, label, created_at, expires_at, owner_id) VALUES (?, ?, ?, ?, ?)",
            (code_hash, label, created_at, expires_at, owner_id),
        )

    def enrol(
        self, code_hash: str, now: str, device_id: str, name: str, token_hash: str, owner_key_id: str = ""
    ) -> DeviceRecord | None:
        """Use up an unused, unexpired code and add the device, in one transaction; None when
        the code is unknown, used or expired. ``owner_key_id`` (when given) must be the one the
        owner's first device brought (:class:`OwnerKeyMismatch` otherwise, nothing changed)."""
        with self._db.transaction(f"code:{code_hash}"):
            row = self._db.execute(
                "SELECT label, owner_id FROM enrolment_codes WHERE code_hash=? AND used_at IS NULL AND expires_at>?",
                (code_hash, now),
            ).fetchone()
            if row is None:
                return None
            owner_id = row[1] or "own-" + device_id
            self._db.lock(owner_lock(owner_id))
            if owner_key_id:
                known = self._db.execute("SELECT key_id FROM owner_keys WHERE owner_id=?", (owner_id,)).fetchone()
                if known is not None and known[0] != owner_key_id:
                    raise OwnerKeyMismatch(owner_id)
                self._db.execute(
                    "INSERT INTO owner_keys VALUES (?, ?) ON CONFLICT DO NOTHING", (owner_id, owner_key_id)
                )
            self._db.execute(
                "UPDATE enrolment_codes SET used_at=?, device_id=? WHERE code_hash=?", (now, device_id, code_hash)
            )
            self._db.execute(
                "INSERT INTO devices (device_id, token_hash, name, label, enrolled_at, owner_id) VALUES (?, ?, ?, ?, ?, ?)",
                (device_id, token_hash, name, row[0], now, owner_id),
            )
        return self._devices("WHERE d.device_id=?", (device_id,))[0]

    def device_for_token(self, token_hash: str) -> str | None:
        row = self._db.execute(
            "SELECT device_id FROM devices WHERE token_hash=? AND revoked_at IS NULL", (token_hash,)
        ).fetchone()
        return row[0] if row else None

    def device_owner(self, device_id: str) -> str | None:
        row = self._db.execute("SELECT owner_id FROM devices WHERE device_id=?", (device_id,)).fetchone()
        return row[0] if row else None

    def record_report(self, device_id: str, report: DeviceReport, now: str) -> str | None:
        """Store the device's report. Returns its owner when every device of the owner has now
        reached the same version: records at older versions may have become superseded
        (``Storage.compact_replica_page``); None otherwise."""
        owner_id = self.device_owner(device_id)
        with self._db.transaction(owner_lock(owner_id)):
            return self._update_device(
                owner_id,
                "UPDATE devices SET last_report_at=?, version=?, gallery_size=?, upgrade_state=?, target_version=?, "
                "progress=?, detail=?, root_version=?, trust_stale=?, seconds_since_fresh=? WHERE device_id=?",
                (
                    now,
                    report.version,
                    report.gallery_size,
                    report.upgrade_state,
                    report.target_version,
                    report.progress,
                    report.detail,
                    report.root_version,
                    int(report.trust_stale),
                    report.seconds_since_fresh,
                    device_id,
                ),
            )

    def admit_report(self, device_id: str, now_s: float, per_minute: int) -> float | None:
        """Count a report of ``device_id`` at ``now_s`` (seconds since the epoch) unless the device
        sent ``per_minute`` already in the last :data:`REPORT_WINDOW_S` seconds (counted by whole
        seconds, the current one and the 60 before it: never more than ``per_minute`` in any 60 s,
        on every replica together); None when counted, else the seconds until it may report again."""
        second = int(now_s)
        oldest = second - REPORT_WINDOW_S
        with self._db.transaction(f"reports:{device_id}"):
            rows = self._db.execute(
                "SELECT at_second, reports FROM report_counts WHERE device_id=? AND at_second>=? ORDER BY at_second",
                (device_id, oldest),
            ).fetchall()
            if sum(reports for _, reports in rows) >= per_minute:
                return rows[0][0] + REPORT_WINDOW_S + 1 - now_s  # when its oldest counted second leaves the window
            self._db.execute("DELETE FROM report_counts WHERE device_id=? AND at_second<?", (device_id, oldest))
            self._db.execute(
                "INSERT INTO report_counts (device_id, at_second, reports) VALUES (?, ?, 1) "
                "ON CONFLICT (device_id, at_second) DO UPDATE SET reports = report_counts.reports + 1",
                (device_id, second),
            )
        return None

    def revoke_device(self, device_id: str, now: str) -> tuple[str, str | None] | None:
        """Revoke the device (its token stops working); None for an unknown device. Returns when
        it was revoked (the first time) and its owner if the owner's remaining devices now share
        a version (a replica compaction is due), else None."""
        owner_id = self.device_owner(device_id)  # every device has one (schema 2 on)
        if owner_id is None:
            return None
        with self._db.transaction(owner_lock(owner_id)):
            revoked_at = self._db.execute("SELECT revoked_at FROM devices WHERE device_id=?", (device_id,)).fetchone()[
                0
            ]
            if revoked_at is not None:
                return revoked_at, None
            upload_sessions.release_device(self._db, device_id)  # its partial files go at the next sweep
            self._db.notify(f"revoked:{device_id}")  # the other replicas end its open streams
            compaction_due = self._update_device(
                owner_id, "UPDATE devices SET revoked_at=? WHERE device_id=?", (now, device_id)
            )
            refresh_device_votes(self._db, device_id, owner_id)  # its health stops counting for the guard now
            refresh_device_failures(self._db, device_id, owner_id)  # and so do its downloads and failures
            return now, compaction_due

    def _update_device(self, owner_id: str | None, statement: str, params: tuple) -> str | None:
        """Run ``statement`` on a device of ``owner_id``; the owner if its devices now share a
        version they did not share before (a replica compaction is due), else None."""
        before = common_version(self._db, owner_id)
        self._db.execute(statement, params)
        return owner_id if owner_id is not None and common_version(self._db, owner_id) not in (0, before) else None

    def revoked_among(self, device_ids: Collection[str]) -> list[str]:
        """Those of ``device_ids`` that are revoked."""
        return [
            device_id
            for chunk in unique_chunks(list(device_ids))
            for (device_id,) in self._db.execute(
                f"SELECT device_id FROM devices WHERE revoked_at IS NOT NULL AND device_id IN ({','.join('?' * len(chunk))})",
                chunk,
            )
        ]

    def list_devices(self, after_seq: int, limit: int, match: DeviceFilter = ANY_DEVICE) -> list[DeviceRecord]:
        """Up to ``limit`` devices enrolled after ``after_seq`` that ``match``, in enrolment order."""
        conditions, params = match.where()
        return self._devices(f"WHERE d.seq>?{conditions} ORDER BY d.seq LIMIT ?", (after_seq, *params, limit))

    def _devices(self, where: str, params: tuple) -> list[DeviceRecord]:
        rows = self._db.execute(
            "SELECT d.seq, d.device_id, d.name, d.label, d.enrolled_at, d.last_report_at, d.version, d.gallery_size, "
            "d.upgrade_state, d.target_version, d.progress, d.detail, d.root_version, d.trust_stale, d.seconds_since_fresh, "
            "(SELECT COALESCE(SUM(size), 0) FROM blobs b WHERE b.device_id=d.device_id), "
            "(SELECT COUNT(*) FROM blobs b WHERE b.device_id=d.device_id), d.owner_id, d.revoked_at "
            f"FROM devices d {where}",
            params,
        )
        return [
            DeviceRecord(
                seq,
                dev,
                name,
                label,
                enrolled,
                last,
                DeviceReport(version, size, state, target, progress, detail, int(root), bool(stale), int(fresh)),
                int(vb),
                int(vn),
                owner or "",
                revoked,
            )
            for seq, dev, name, label, enrolled, last, version, size, state, target, progress, detail, root, stale, fresh, vb, vn, owner, revoked in rows
        ]

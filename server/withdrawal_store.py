"""Withdrawn releases and the devices' reverts in the metadata database (schema 10).

``withdrawals`` holds one row per withdrawn version: the version devices go back to, the reason,
the exact signed ``withdrawal.<V>.json`` as published (what every ListVersions page carries) and
when the server stored it. ``device_reverts`` keeps, per device and withdrawn version, how the
device reported going back (exact, backward, reembedded). A withdrawal is stored under one lock for
all withdrawals (a withdrawal's ``revert_to`` must not be withdrawn meanwhile) and announced to the
other replicas as ``withdrawal:V``.
"""

from __future__ import annotations

from dataclasses import dataclass

from .database import Database

WITHDRAWAL_SCHEMA = """
CREATE TABLE IF NOT EXISTS withdrawals (
    version INTEGER PRIMARY KEY REFERENCES versions(version),
    revert_to INTEGER NOT NULL,
    reason TEXT NOT NULL,
    document BLOB NOT NULL,
    stored_at TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS device_reverts (
    device_id TEXT NOT NULL,
    version INTEGER NOT NULL,
    method TEXT NOT NULL,
    reported_at TEXT NOT NULL,
    PRIMARY KEY (device_id, version)
);
CREATE INDEX IF NOT EXISTS device_reverts_by_version ON device_reverts (version);
"""


@dataclass(frozen=True)
class StoredWithdrawal:
    """A published withdrawal: ``document`` is the signed file's exact bytes."""

    version: int
    revert_to: int
    reason: str
    document: bytes
    stored_at: str


@dataclass(frozen=True)
class WithdrawalOutcome:
    """What :meth:`WithdrawalStore.add` did: ``stored`` is the withdrawal of the version now
    stored (the one added, or the one found); ``added`` False with ``stored`` None: its
    ``revert_to`` is itself withdrawn, and nothing was stored."""

    added: bool
    stored: StoredWithdrawal | None


class WithdrawalStore:
    """Withdrawals and device reverts on the metadata database."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def withdrawals(self) -> dict[int, StoredWithdrawal]:
        """Every withdrawal, by version."""
        rows = self._db.execute(
            "SELECT version, revert_to, reason, document, stored_at FROM withdrawals ORDER BY version"
        )
        return {v: StoredWithdrawal(v, r, why, bytes(doc), at) for v, r, why, doc, at in rows}

    def add(self, withdrawal: StoredWithdrawal) -> WithdrawalOutcome:
        """Store ``withdrawal`` unless its version is withdrawn already (the stored one is
        returned) or its ``revert_to`` is withdrawn (nothing stored), in one transaction."""
        with self._db.transaction("withdrawals"):
            stored = self.withdrawals()
            if withdrawal.version in stored:
                return WithdrawalOutcome(False, stored[withdrawal.version])
            if withdrawal.revert_to in stored:
                return WithdrawalOutcome(False, None)
            w = withdrawal
            self._db.execute(
                "INSERT INTO withdrawals (version, revert_to, reason, document, stored_at) VALUES (?, ?, ?, ?, ?)",
                (w.version, w.revert_to, w.reason, w.document, w.stored_at),
            )
            self._db.notify(f"withdrawal:{w.version}")
            return WithdrawalOutcome(True, w)

    def record_revert(self, device_id: str, version: int, method: str, now: str) -> None:
        """Keep that ``device_id`` went back from withdrawn ``version`` by ``method`` (its latest word)."""
        self._db.execute(
            "INSERT INTO device_reverts (device_id, version, method, reported_at) VALUES (?, ?, ?, ?) "
            "ON CONFLICT (device_id, version) DO UPDATE SET method = excluded.method, "
            "reported_at = excluded.reported_at",
            (device_id, version, method, now),
        )

    def reverts(self, version: int) -> dict[str, str]:
        """How each device that reported going back from ``version`` did it, by device id."""
        rows = self._db.execute("SELECT device_id, method FROM device_reverts WHERE version = ?", (version,))
        return dict(rows)

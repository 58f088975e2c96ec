"""Staged rollouts, confirmations and the devices' upgrade health in the metadata database
(schema 9; ``confirmations`` schema 11).

``rollouts`` holds one row per version published with a rollout (percent, state, guard, why the
guard halted it), ``rollout_stages`` each percent it was widened to and when, ``rollout_cohort``
the devices named explicitly, ``device_health`` the latest health each device reported for
each version, and ``confirmations`` when an admin confirmed a version (devices on it drop the
vectors kept for a revert). A version without a ``rollouts`` row is offered to every device. Every change is a
read-modify-write under the version's lock (:meth:`RolloutStore.change`), announced to the other
replicas as ``rollout:V``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field

from .database import Database
from .guard_failures import failure_tally, rebuild_failures, refresh_owner_failures
from .guard_votes import GuardTally, guard_tally, rebuild_votes, refresh_owner_vote

ROLLOUT_SCHEMA = """
CREATE TABLE IF NOT EXISTS rollouts (
    version INTEGER PRIMARY KEY REFERENCES versions(version),
    percent REAL NOT NULL,
    state TEXT NOT NULL,
    halt_below REAL NOT NULL DEFAULT 0,
    halt_min_devices INTEGER NOT NULL DEFAULT 0,
    halt_reason TEXT NOT NULL DEFAULT '',
    updated_at TEXT NOT NULL,
    guard_measure TEXT NOT NULL DEFAULT 'mean_cosine',
    max_failure_rate REAL NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS rollout_stages (
    version INTEGER NOT NULL REFERENCES rollouts(version),
    stage INTEGER NOT NULL,
    percent REAL NOT NULL,
    started_at TEXT NOT NULL,
    PRIMARY KEY (version, stage)
);
CREATE TABLE IF NOT EXISTS rollout_cohort (
    version INTEGER NOT NULL REFERENCES rollouts(version),
    device_id TEXT NOT NULL,
    PRIMARY KEY (version, device_id)
);
CREATE TABLE IF NOT EXISTS device_health (
    device_id TEXT NOT NULL,
    version INTEGER NOT NULL,
    rows_upgraded INTEGER NOT NULL,
    failures INTEGER NOT NULL,
    seconds REAL NOT NULL,
    sample_size INTEGER NOT NULL,
    mean_cosine REAL NOT NULL,
    p10_cosine REAL NOT NULL,
    recall_at_1 REAL NOT NULL,
    mean_reciprocal_rank REAL NOT NULL,
    reported_at TEXT NOT NULL,
    median_rank REAL NOT NULL DEFAULT 0,
    gallery_rows INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (device_id, version)
);
CREATE INDEX IF NOT EXISTS device_health_by_version ON device_health (version);
"""
#: columns schema 16 adds to tables of schema 15 (a new database gets them in its CREATE TABLE)
HEALTH_GUARD_COLUMNS = (
    ("device_health", "median_rank", "REAL NOT NULL DEFAULT 0"),
    ("device_health", "gallery_rows", "INTEGER NOT NULL DEFAULT 0"),
    ("rollouts", "guard_measure", "TEXT NOT NULL DEFAULT 'mean_cosine'"),
    ("rollouts", "max_failure_rate", "REAL NOT NULL DEFAULT 0"),
)
CONFIRMATION_SCHEMA = """
CREATE TABLE IF NOT EXISTS confirmations (
    version INTEGER PRIMARY KEY REFERENCES versions(version),
    confirmed_at TEXT NOT NULL
);
"""

STAGED, PAUSED, HALTED, COMPLETE = "staged", "paused", "halted", "complete"
STATE_PAGE = 5000  # devices per statement when a rollout status reads them all


@dataclass(frozen=True)
class Stage:
    percent: float
    started_at: str


@dataclass(frozen=True)
class Rollout:
    """A version's rollout. ``halt_min_devices`` 0: no guard. The guard compares ``guard_measure``:
    ``mean_cosine`` or ``recall_at_1`` against the absolute bound ``halt_below``, or ``expected``: the
    release's own measure against its expectation, halting ``halt_below`` (a margin) under it
    (:mod:`.guard_votes`); and, when ``max_failure_rate`` > 0, the owners' mean share of failed
    upgrades among the devices that got the version (:mod:`.guard_failures`)."""

    version: int
    percent: float
    state: str
    stages: tuple[Stage, ...] = ()
    cohort: frozenset[str] = field(default_factory=frozenset)
    halt_below: float = 0.0
    halt_min_devices: int = 0
    halt_reason: str = ""
    updated_at: str = ""
    guard_measure: str = "mean_cosine"
    max_failure_rate: float = 0.0


@dataclass(frozen=True)
class HealthReport:
    """What one device reported about its upgrade to ``version`` (``sample_size`` 0: no sample)."""

    version: int
    rows_upgraded: int
    failures: int
    seconds: float
    sample_size: int
    mean_cosine: float
    p10_cosine: float
    recall_at_1: float
    mean_reciprocal_rank: float
    median_rank: float = 0.0
    gallery_rows: int = 0


@dataclass(frozen=True)
class DeviceState:
    """A device's last reported place, as rollout status counts it."""

    device_id: str
    version: int
    target_version: int
    upgrade_state: int


_HEALTH_COLUMNS = (
    "version",
    "rows_upgraded",
    "failures",
    "seconds",
    "sample_size",
    "mean_cosine",
    "p10_cosine",
    "recall_at_1",
    "mean_reciprocal_rank",
    "median_rank",
    "gallery_rows",
)


class RolloutStore:
    """Rollouts and device health on the metadata database."""

    def __init__(self, db: Database) -> None:
        self._db = db

    def rollouts(self) -> dict[int, Rollout]:
        """Every rollout, by version."""
        return self._read("", ())

    def rollout(self, version: int) -> Rollout | None:
        """``version``'s rollout (None: published to every device), read alone."""
        return self._read(" WHERE version = ?", (version,)).get(version)

    def _read(self, where: str, params: tuple) -> dict[int, Rollout]:
        stages: dict[int, list[Stage]] = {}
        for version, percent, started_at in self._db.execute(
            f"SELECT version, percent, started_at FROM rollout_stages{where} ORDER BY version, stage", params
        ):
            stages.setdefault(version, []).append(Stage(percent, started_at))
        cohorts: dict[int, set[str]] = {}
        for version, device_id in self._db.execute(f"SELECT version, device_id FROM rollout_cohort{where}", params):
            cohorts.setdefault(version, set()).add(device_id)
        rows = self._db.execute(
            "SELECT version, percent, state, halt_below, halt_min_devices, halt_reason, updated_at, guard_measure, "
            f"max_failure_rate FROM rollouts{where} ORDER BY version",
            params,
        )
        return {
            v: Rollout(v, p, s, tuple(stages.get(v, ())), frozenset(cohorts.get(v, ())), hb, hm, why, at, gm, mf)
            for v, p, s, hb, hm, why, at, gm, mf in rows
        }

    def change(self, version: int, change: Callable[[Rollout | None], Rollout | None]) -> Rollout | None:
        """Apply ``change`` to the stored rollout of ``version`` (None: none) under the version's
        lock and store what it returns (None or the same: nothing changes). An exception from
        ``change`` leaves everything as it was."""
        with self._db.transaction(f"rollout:{version}"):
            current = self.rollout(version)
            changed = change(current)
            if changed is not None and changed != current:
                write_rollout(self._db, changed)
                if current is None or guard_inputs(current) != guard_inputs(changed):
                    rebuild_votes(self._db, version)
                    rebuild_failures(self._db, version)
            return changed

    def confirmations(self) -> dict[int, str]:
        """When each confirmed version was confirmed, by version."""
        return dict(self._db.execute("SELECT version, confirmed_at FROM confirmations ORDER BY version"))

    def confirm(self, version: int, now: str, check: Callable[[Rollout | None], None]) -> str:
        """Record ``version`` as confirmed at ``now`` unless it was already (announced as
        ``rollout:V``), under the version's lock, after ``check`` accepted its rollout (an exception
        from it stores nothing); returns when it was confirmed."""
        with self._db.transaction(f"rollout:{version}"):
            check(self.rollout(version))
            row = self._db.execute("SELECT confirmed_at FROM confirmations WHERE version = ?", (version,)).fetchone()
            if row is not None:
                return row[0]
            self._db.execute("INSERT INTO confirmations (version, confirmed_at) VALUES (?, ?)", (version, now))
            self._db.notify(f"rollout:{version}")
            return now

    def device_version(self, device_id: str) -> int:
        row = self._db.execute("SELECT version FROM devices WHERE device_id = ?", (device_id,)).fetchone()
        return int(row[0]) if row else 0

    def device_state(self, device_id: str) -> DeviceState | None:
        """The device's last reported version, target and upgrade state (None: unknown)."""
        row = self._db.execute(
            "SELECT device_id, version, target_version, upgrade_state FROM devices WHERE device_id = ?", (device_id,)
        ).fetchone()
        return None if row is None else DeviceState(*row)

    def device_reach(self, device_id: str) -> int:
        """The highest version the device's stored report runs or upgrades to (0: none)."""
        row = self._db.execute(
            "SELECT version, target_version FROM devices WHERE device_id = ?", (device_id,)
        ).fetchone()
        return int(max(row)) if row else 0

    def device_states(self) -> list[DeviceState]:
        """Every enrolled, unrevoked device's last reported version, target and upgrade state, read
        :data:`STATE_PAGE` rows a statement: a status counted on a worker thread then never holds
        the interpreter for one whole-fleet fetch while the event loop waits for it."""
        states: list[DeviceState] = []
        after = 0
        while True:
            rows = self._db.execute(
                "SELECT seq, device_id, version, target_version, upgrade_state FROM devices "
                "WHERE seq > ? AND revoked_at IS NULL ORDER BY seq LIMIT ?",
                (after, STATE_PAGE),
            ).fetchall()
            states += [DeviceState(*row[1:]) for row in rows]
            if len(rows) < STATE_PAGE:
                return states
            after = rows[-1][0]

    def enrolled(self, device_ids: list[str]) -> set[str]:
        """Those of ``device_ids`` that are enrolled and not revoked."""
        found: set[str] = set()
        for start in range(0, len(device_ids), 500):
            part = device_ids[start : start + 500]
            marks = ", ".join("?" * len(part))
            found |= {
                row[0]
                for row in self._db.execute(
                    f"SELECT device_id FROM devices WHERE revoked_at IS NULL AND device_id IN ({marks})", part
                )
            }
        return found

    def record_health(self, device_id: str, health: HealthReport, now: str) -> None:
        """Keep ``health`` as the device's latest for its version and recount its owner's guard
        vote for that version, together under the version's lock."""
        values = [getattr(health, c) for c in _HEALTH_COLUMNS]
        updates = ", ".join(f"{c} = excluded.{c}" for c in (*_HEALTH_COLUMNS[1:], "reported_at"))
        with self._db.transaction(f"rollout:{health.version}"):
            self._db.execute(
                f"INSERT INTO device_health (device_id, {', '.join(_HEALTH_COLUMNS)}, reported_at) "
                f"VALUES (?, {', '.join('?' * len(_HEALTH_COLUMNS))}, ?) "
                f"ON CONFLICT (device_id, version) DO UPDATE SET {updates}",
                (device_id, *values, now),
            )
            owner = self._db.execute("SELECT owner_id FROM devices WHERE device_id = ?", (device_id,)).fetchone()
            if owner is not None:
                refresh_owner_vote(self._db, health.version, owner[0])
                refresh_owner_failures(self._db, health.version, owner[0])  # a health report means a download

    def guard_tally(self, version: int) -> GuardTally:
        """What the guard of ``version`` reads (:mod:`.guard_votes`, :mod:`.guard_failures`); inside :meth:`change`."""
        failures = failure_tally(self._db, version)
        return dataclasses.replace(
            guard_tally(self._db, version), failure_owners=failures.owners, failure_rate=failures.rate
        )

    def refresh_failures(self, version: int, device_id: str) -> None:
        """Recount the failure vote of ``device_id``'s owner for ``version`` after its report, under the version's lock."""
        with self._db.transaction(f"rollout:{version}"):
            owner = self._db.execute("SELECT owner_id FROM devices WHERE device_id = ?", (device_id,)).fetchone()
            if owner is not None:
                refresh_owner_failures(self._db, version, owner[0])

    def health(self, version: int) -> dict[str, HealthReport]:
        """The latest health each enrolled, unrevoked device reported for ``version``, by device id
        (a revoked device's reports stop counting the moment it is revoked)."""
        columns = ", ".join(f"h.{c}" for c in _HEALTH_COLUMNS)
        rows = self._db.execute(
            f"SELECT h.device_id, {columns} FROM device_health h JOIN devices d ON d.device_id = h.device_id "
            "WHERE h.version = ? AND d.revoked_at IS NULL",
            (version,),
        )
        return {row[0]: HealthReport(*row[1:]) for row in rows}


def guard_inputs(rollout: Rollout) -> tuple[float, frozenset[str], float, str, float]:
    """What the guard's votes depend on: who is in the rollout, the measure and the bounds they are counted against."""
    return rollout.percent, rollout.cohort, rollout.halt_below, rollout.guard_measure, rollout.max_failure_rate


def write_rollout(db: Database, rollout: Rollout) -> None:
    """Store ``rollout`` whole (inside the caller's transaction) and tell the other replicas."""
    r = rollout
    db.execute(
        "INSERT INTO rollouts (version, percent, state, halt_below, halt_min_devices, halt_reason, updated_at, "
        "guard_measure, max_failure_rate) VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?) ON CONFLICT (version) DO UPDATE SET "
        "percent = excluded.percent, state = excluded.state, halt_below = excluded.halt_below, "
        "halt_min_devices = excluded.halt_min_devices, halt_reason = excluded.halt_reason, "
        "updated_at = excluded.updated_at, guard_measure = excluded.guard_measure, "
        "max_failure_rate = excluded.max_failure_rate",
        (
            r.version,
            r.percent,
            r.state,
            r.halt_below,
            r.halt_min_devices,
            r.halt_reason,
            r.updated_at,
            r.guard_measure,
            r.max_failure_rate,
        ),
    )
    db.execute("DELETE FROM rollout_stages WHERE version = ?", (r.version,))
    db.executemany(
        "INSERT INTO rollout_stages (version, stage, percent, started_at) VALUES (?, ?, ?, ?)",
        [(r.version, i + 1, s.percent, s.started_at) for i, s in enumerate(r.stages)],
    )
    db.execute("DELETE FROM rollout_cohort WHERE version = ?", (r.version,))
    db.executemany(
        "INSERT INTO rollout_cohort (version, device_id) VALUES (?, ?)", [(r.version, d) for d in sorted(r.cohort)]
    )
    db.notify(f"rollout:{r.version}")

"""The rollout guard's running tally (schema 15): one vote per owner per staged version, kept as
reports arrive, so the guard answers in O(log N) at any fleet size instead of re-reading every
health row of the version at every report.

An owner's vote for version V is the median signal of its devices that are enrolled, not revoked,
in V's rollout (cohort, or :func:`bucket` below its percent) and reported a sampled health for V
(``guard_votes``, one row per owner with a vote). A device's signal is what the rollout's
``guard_measure`` names (:class:`GuardInputs`): its ``mean_cosine`` or its self-retrieval
``recall_at_1`` as reported (against an absolute bound), or — ``expected`` — the release's own
measure as a fraction of what the release's manifest expects at the device's gallery size, over the
bound at that size (1 − margin, or the release's break-even there when it did worse than not
upgrading: :meth:`~fctkit.protos.health_expectation.HealthExpectation.vote`), against 1. ``guard_tallies`` keeps, per version, how
many owners vote, how many devices stand behind the votes and how many votes lie below the
guard's ``halt_below`` (its ``threshold``). From those counts and at most two indexed look-ups
:func:`median_below` tells whether the median vote is below the threshold, exactly as the median
of the recounted votes would.

Every change runs inside the caller's transaction holding the version's ``rollout:V`` lock, so
replicas take turns and a crash loses nothing: a health report refreshes its owner's vote
(:func:`refresh_owner_vote`), a revocation the revoked device's owner's votes
(:func:`refresh_device_votes`), and a change of the rollout's percent, cohort or threshold rebuilds
the version's votes from the health rows (:func:`rebuild_votes`; an admin call, O(reports)). A
version whose tally is missing (a database from before schema 15) is rebuilt the first time the
guard needs it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import statistics
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from fctkit.protos.health_expectation import HealthExpectation

from .database import Database

GUARD_VOTES_SCHEMA = """
CREATE TABLE IF NOT EXISTS guard_votes (
    version INTEGER NOT NULL,
    owner_id TEXT NOT NULL,
    vote REAL NOT NULL,
    devices INTEGER NOT NULL,
    PRIMARY KEY (version, owner_id)
);
CREATE INDEX IF NOT EXISTS guard_votes_by_vote ON guard_votes (version, vote);
CREATE TABLE IF NOT EXISTS guard_tallies (
    version INTEGER PRIMARY KEY,
    owners INTEGER NOT NULL,
    devices INTEGER NOT NULL,
    below INTEGER NOT NULL,
    threshold REAL NOT NULL
);
"""


def bucket(device_id: str, version: int) -> float:
    """Where ``device_id`` falls for ``version``'s rollout, in [0, 100): the device is in at any percent above it."""
    digest = hashlib.sha256(f"fctkit-rollout:{version}:{device_id}".encode()).digest()
    return int.from_bytes(digest[:8], "big") / 2**64 * 100.0


#: what a rollout's guard may compare: an absolute bound on a reported measure, or the release's expectation
GUARD_MEASURES = ("mean_cosine", "recall_at_1", "expected")


@dataclass(frozen=True)
class GuardTally:
    """What the guard reads for a version: ``owners`` voting, ``devices`` behind their votes, the
    median vote when it lies below the tally's threshold (else None), and what a vote is (``signal``)."""

    owners: int
    devices: int
    median_below: float | None
    signal: str = "mean_cosine"
    threshold: float = 0.0
    #: owners of devices that got the version, and their mean failed fraction (:mod:`.guard_failures`)
    failure_owners: int = 0
    failure_rate: float = 0.0


@dataclass(frozen=True)
class GuardInputs:
    """A version's rollout as its votes are counted: who is in (``percent``; the cohort is read with
    the health rows), the ``threshold`` a vote below counts against, the ``measure`` and, for an
    ``expected`` guard, the release's ``expectation`` (None: the release records none)."""

    percent: float
    threshold: float
    measure: str
    expectation: HealthExpectation | None
    margin: float = 0.0

    @property
    def signal(self) -> str:
        if self.measure != "expected":
            return self.measure
        base = "mean_cosine" if self.expectation is None else self.expectation.guard_measure
        return f"{base} / expected / bound"

    def value(self, mean_cosine: float, recall_at_1: float, gallery_rows: int) -> float | None:
        """One device's signal (None: it cannot be measured against an expectation the release lacks)."""
        reported = {"mean_cosine": mean_cosine, "recall_at_1": recall_at_1}
        if self.measure != "expected":
            return reported[self.measure]
        if self.expectation is None:
            return None
        measure = self.expectation.guard_measure
        return self.expectation.vote(measure, reported[measure], gallery_rows, self.margin)


# A health row as the votes read it: owner, device, mean cosine, R@1, the gallery's rows (rows
# upgraded from devices that did not say), whether the device is in the cohort; of a version
# (:data:`_VERSION_ROWS`, version) or of one owner's devices (:data:`_OWNER_ROWS`, owner, version).
_HEALTH_ROWS = (
    "SELECT d.owner_id, h.device_id, h.mean_cosine, h.recall_at_1, "
    "CASE WHEN h.gallery_rows > 0 THEN h.gallery_rows ELSE h.rows_upgraded END, c.device_id IS NOT NULL "
    "FROM device_health h JOIN devices d ON d.device_id = h.device_id "
    "LEFT JOIN rollout_cohort c ON c.version = h.version AND c.device_id = h.device_id "
    "WHERE d.revoked_at IS NULL AND h.sample_size > 0 AND "
)
_VERSION_ROWS = _HEALTH_ROWS + "h.version = ?"
# "+h.version": without it SQLite walks the version's health index (every device that reported the
# version) instead of the owner's devices, and a health report grows with the fleet
_OWNER_ROWS = _HEALTH_ROWS + "d.owner_id = ? AND +h.version = ?"


def _votes(
    rows: Iterable[tuple[str, str, float, float, int, bool]], version: int, guard: GuardInputs
) -> dict[str, tuple[float, int]]:
    """Each owner's vote and how many of its devices it stands for, from health rows of ``version``."""
    signal: dict[str, list[float]] = {}
    for owner_id, device_id, mean_cosine, recall_at_1, gallery_rows, in_cohort in rows:
        if in_cohort or bucket(device_id, version) < guard.percent:
            value = guard.value(float(mean_cosine), float(recall_at_1), int(gallery_rows))
            if value is not None:
                signal.setdefault(owner_id, []).append(value)
    return {owner: (statistics.median(values), len(values)) for owner, values in signal.items()}


def _rollout(db: Database, version: int) -> GuardInputs | None:
    """The version's rollout as its votes are counted, or None: no staged rollout (no guard)."""
    row = db.execute(
        "SELECT r.percent, r.halt_below, r.guard_measure, CASE WHEN r.guard_measure = 'expected' THEN v.manifest END "
        "FROM rollouts r "
        "JOIN versions v ON v.version = r.version WHERE r.version = ?",
        (version,),
    ).fetchone()
    if row is None:
        return None
    percent, halt_below, measure, manifest = float(row[0]), float(row[1]), str(row[2]), row[3]
    if measure != "expected":
        return GuardInputs(percent, halt_below, measure, None)
    # each vote is already over its own device's bound (HealthExpectation.vote): 1 is the line
    return GuardInputs(percent, 1.0, measure, release_expectation(bytes(manifest)), halt_below)


@functools.lru_cache(maxsize=64)
def release_expectation(manifest: bytes) -> HealthExpectation | None:
    """The ``health_expectation`` of a stored (verified) manifest, or None: the release records none."""
    raw = json.loads(manifest).get("health_expectation")
    return None if raw is None else HealthExpectation.from_json(raw, "manifest.health_expectation")


def rebuild_votes(db: Database, version: int) -> None:
    """Recount ``version``'s votes and tally from its health rows (inside the ``rollout:V`` lock)."""
    db.execute("DELETE FROM guard_votes WHERE version = ?", (version,))
    db.execute("DELETE FROM guard_tallies WHERE version = ?", (version,))
    guard = _rollout(db, version)
    if guard is None:
        return
    threshold = guard.threshold
    votes = _votes(db.execute(_VERSION_ROWS, (version,)), version, guard)
    db.executemany(
        "INSERT INTO guard_votes (version, owner_id, vote, devices) VALUES (?, ?, ?, ?)",
        [(version, owner, vote, devices) for owner, (vote, devices) in votes.items()],
    )
    db.execute(
        "INSERT INTO guard_tallies (version, owners, devices, below, threshold) VALUES (?, ?, ?, ?, ?)",
        (
            version,
            len(votes),
            sum(devices for _, devices in votes.values()),
            sum(vote < threshold for vote, _ in votes.values()),
            threshold,
        ),
    )


def _tally(db: Database, version: int) -> tuple[int, int, int, float] | None:
    """The version's tally (owners, devices, below, threshold), counted first when it is missing
    (a database from before schema 15); None: the version has no rollout."""
    query = "SELECT owners, devices, below, threshold FROM guard_tallies WHERE version = ?"
    row = db.execute(query, (version,)).fetchone()
    if row is None:
        rebuild_votes(db, version)
        row = db.execute(query, (version,)).fetchone()
    return None if row is None else (int(row[0]), int(row[1]), int(row[2]), float(row[3]))


def refresh_owner_vote(db: Database, version: int, owner_id: str) -> None:
    """Recount ``owner_id``'s vote for ``version`` and move the tally by the difference (inside the
    ``rollout:V`` lock); O(the owner's devices)."""
    guard, tally = _rollout(db, version), _tally(db, version)
    if guard is None or tally is None:
        return
    threshold = tally[3]
    rows = db.execute(_OWNER_ROWS, (owner_id, version))
    new = _votes(rows, version, guard).get(owner_id)
    old = store_owner_vote(db, "guard_votes", ("vote", "devices"), version, owner_id, new)
    if new == old:
        return

    def counts(vote: tuple[float, int] | None) -> tuple[int, int, int]:
        return (0, 0, 0) if vote is None else (1, vote[1], int(vote[0] < threshold))

    (o1, d1, b1), (o0, d0, b0) = counts(new), counts(old)
    db.execute(
        "UPDATE guard_tallies SET owners = owners + ?, devices = devices + ?, below = below + ? WHERE version = ?",
        (o1 - o0, d1 - d0, b1 - b0, version),
    )


def store_owner_vote(
    db: Database,
    table: str,
    columns: tuple[str, str],
    version: int,
    owner_id: str,
    new: tuple[Any, Any] | None,
) -> tuple[Any, Any] | None:
    """Put ``new`` as ``owner_id``'s row of ``table`` for ``version`` (its two ``columns``; None:
    delete the row) and return the row it replaced (None: there was none; equal to ``new``: nothing
    changed). The guard's health votes and its failure votes are both kept this way."""
    first, second = columns
    where = "WHERE version = ? AND owner_id = ?"
    row = db.execute(f"SELECT {first}, {second} FROM {table} {where}", (version, owner_id)).fetchone()
    old = None if row is None else (row[0], row[1])
    if new == old:
        return old
    if new is None:
        db.execute(f"DELETE FROM {table} {where}", (version, owner_id))
    else:
        db.execute(
            f"INSERT INTO {table} (version, owner_id, {first}, {second}) VALUES (?, ?, ?, ?) ON CONFLICT "
            f"(version, owner_id) DO UPDATE SET {first} = excluded.{first}, {second} = excluded.{second}",
            (version, owner_id, *new),
        )
    return old


def refresh_device_votes(db: Database, device_id: str, owner_id: str) -> None:
    """Recount ``owner_id``'s votes for every staged version ``device_id`` reported a sampled health
    for (after the device was revoked), taking each version's lock inside the caller's transaction."""
    versions = [
        int(v)
        for (v,) in db.execute(
            "SELECT h.version FROM device_health h JOIN rollouts r ON r.version = h.version "
            "WHERE h.device_id = ? AND h.sample_size > 0 ORDER BY h.version",
            (device_id,),
        )
    ]
    for version in versions:
        db.lock(f"rollout:{version}")
        refresh_owner_vote(db, version, owner_id)


def guard_tally(db: Database, version: int) -> GuardTally:
    """The version's tally for the guard: O(log N) with ``guard_votes_by_vote`` (the exact median,
    O(N), is read only when it lies below the threshold: the guard halts then, once)."""
    tally = _tally(db, version)
    guard = _rollout(db, version)
    if tally is None or guard is None:
        return GuardTally(0, 0, None)
    owners, devices, below, threshold = tally
    if not median_below(owners, below, lambda: _middle(db, version, threshold), threshold):
        return GuardTally(owners, devices, None, guard.signal, threshold)
    return GuardTally(owners, devices, _median(db, version, owners), guard.signal, threshold)


def median_below(owners: int, below: int, middle: Callable[[], tuple[float, float]], threshold: float) -> bool:
    """Whether the median of ``owners`` votes, ``below`` of them under ``threshold``, is under it.
    With an odd count the median is the middle vote; with an even count it is the mean of the two
    middle ones, so when exactly half lie below it takes those two (``middle()``: the largest vote
    below the threshold and the smallest at or above it)."""
    if owners == 0:
        return False
    half = owners // 2
    if owners % 2 or below != half:
        return below > half
    low, high = middle()
    return statistics.median((low, high)) < threshold


def _middle(db: Database, version: int, threshold: float) -> tuple[float, float]:
    low = db.execute("SELECT MAX(vote) FROM guard_votes WHERE version = ? AND vote < ?", (version, threshold))
    high = db.execute("SELECT MIN(vote) FROM guard_votes WHERE version = ? AND vote >= ?", (version, threshold))
    return float(low.fetchone()[0]), float(high.fetchone()[0])


def _median(db: Database, version: int, owners: int) -> float:
    """The exact median vote, read in vote order (O(owners): only when the guard is about to halt)."""
    skip = (owners - 1) // 2
    rows = db.execute(
        "SELECT vote FROM guard_votes WHERE version = ? ORDER BY vote LIMIT ? OFFSET ?",
        (version, 2 - owners % 2, skip),
    ).fetchall()
    return statistics.median(float(v) for (v,) in rows)

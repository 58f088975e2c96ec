"""The rollout guard's failure rate (schema 16), kept as reports arrive like the health votes of
:mod:`.guard_votes`: one vote per owner per version whose guard bounds the failure rate.

An owner's vote for version V counts its enrolled, unrevoked devices in V's rollout that got V's
bundle (``downloaded``: they run V or a later version, reported a health for V, or report upgrading,
backfilling or a failed upgrade towards V) and, of those, the ones whose last report is a failed
upgrade to V (``failed``). ``failure_tallies`` keeps per version the owners with a download and the
sum of their failed fractions, so the owners' mean failure rate — each owner weighs one, whatever
its number of devices — is read in O(1). A device report refreshes its owner's vote
(:func:`refresh_owner_failures`, O(the owner's devices)); a change of the rollout's percent, cohort or
guard recounts the version (:func:`rebuild_failures`, an admin call, O(devices that got V)).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from fctkit.protos import fleet_pb2

from .database import Database
from .guard_votes import bucket, store_owner_vote

FAILURE_SCHEMA = """
CREATE TABLE IF NOT EXISTS failure_votes (
    version INTEGER NOT NULL,
    owner_id TEXT NOT NULL,
    downloaded INTEGER NOT NULL,
    failed INTEGER NOT NULL,
    PRIMARY KEY (version, owner_id)
);
CREATE TABLE IF NOT EXISTS failure_tallies (
    version INTEGER PRIMARY KEY,
    owners INTEGER NOT NULL,
    failed_share REAL NOT NULL
);
"""

_GOT_BUNDLE = (fleet_pb2.UPGRADE_STATE_UPGRADING, fleet_pb2.UPGRADE_STATE_BACKFILLING, fleet_pb2.UPGRADE_STATE_FAILED)

# A device as the failure votes read it: owner, device, version, target, state, whether it reported a
# health for the version, whether it is in the cohort (parameters: version, version, then the filter's)
_DEVICE_ROWS = (
    "SELECT d.owner_id, d.device_id, d.version, d.target_version, d.upgrade_state, h.device_id IS NOT NULL, "
    "c.device_id IS NOT NULL FROM devices d "
    "LEFT JOIN device_health h ON h.device_id = d.device_id AND h.version = ? "
    "LEFT JOIN rollout_cohort c ON c.version = ? AND c.device_id = d.device_id "
    "WHERE d.revoked_at IS NULL AND "
)
_OWNER_ROWS = _DEVICE_ROWS + "d.owner_id = ?"
_VERSION_ROWS = _DEVICE_ROWS + "(d.version >= ? OR d.target_version = ? OR h.device_id IS NOT NULL)"


@dataclass(frozen=True)
class FailureTally:
    """Owners of devices that got the version, and their mean failed fraction (0 without owners)."""

    owners: int
    rate: float


def _counts(
    rows: Iterable[tuple[str, str, int, int, int, bool, bool]], version: int, percent: float
) -> dict[str, tuple[int, int]]:
    """Each owner's (downloaded, failed) devices of ``version``'s rollout, owners with a download only."""
    counts: dict[str, tuple[int, int]] = {}
    for owner_id, device_id, runs, target, state, reported, in_cohort in rows:
        if not (in_cohort or bucket(device_id, version) < percent):
            continue
        if runs >= version or reported or (target == version and state in _GOT_BUNDLE):
            downloaded, failed = counts.get(owner_id, (0, 0))
            counts[owner_id] = (
                downloaded + 1,
                failed + int(target == version and state == fleet_pb2.UPGRADE_STATE_FAILED),
            )
    return counts


def _percent(db: Database, version: int) -> float | None:
    """The rollout's percent when its guard bounds the failure rate, else None (nothing to keep)."""
    row = db.execute("SELECT percent, max_failure_rate FROM rollouts WHERE version = ?", (version,)).fetchone()
    return None if row is None or float(row[1]) <= 0 else float(row[0])


def rebuild_failures(db: Database, version: int) -> None:
    """Recount ``version``'s failure votes and tally (inside the ``rollout:V`` lock)."""
    db.execute("DELETE FROM failure_votes WHERE version = ?", (version,))
    db.execute("DELETE FROM failure_tallies WHERE version = ?", (version,))
    percent = _percent(db, version)
    if percent is None:
        return
    counts = _counts(db.execute(_VERSION_ROWS, (version, version, version, version)), version, percent)
    db.executemany(
        "INSERT INTO failure_votes (version, owner_id, downloaded, failed) VALUES (?, ?, ?, ?)",
        [(version, owner, downloaded, failed) for owner, (downloaded, failed) in counts.items()],
    )
    db.execute(
        "INSERT INTO failure_tallies (version, owners, failed_share) VALUES (?, ?, ?)",
        (version, len(counts), sum(failed / downloaded for downloaded, failed in counts.values())),
    )


def refresh_owner_failures(db: Database, version: int, owner_id: str) -> None:
    """Recount ``owner_id``'s failure vote for ``version`` and move the tally by the difference
    (inside the ``rollout:V`` lock; the tally is counted first when it is missing)."""
    percent = _percent(db, version)
    if percent is None:
        return
    if db.execute("SELECT 1 FROM failure_tallies WHERE version = ?", (version,)).fetchone() is None:
        rebuild_failures(db, version)
        return
    new = _counts(db.execute(_OWNER_ROWS, (version, version, owner_id)), version, percent).get(owner_id)
    old = store_owner_vote(db, "failure_votes", ("downloaded", "failed"), version, owner_id, new)
    if new == old:
        return

    def share(vote: tuple[int, int] | None) -> tuple[int, float]:
        return (0, 0.0) if vote is None else (1, vote[1] / vote[0])

    (owners_new, share_new), (owners_old, share_old) = share(new), share(old)
    db.execute(
        "UPDATE failure_tallies SET owners = owners + ?, failed_share = failed_share + ? WHERE version = ?",
        (owners_new - owners_old, share_new - share_old, version),
    )


def failure_tally(db: Database, version: int) -> FailureTally:
    """The version's failure tally (O(1)); owners 0 when its guard does not bound the failure rate."""
    row = db.execute("SELECT owners, failed_share FROM failure_tallies WHERE version = ?", (version,)).fetchone()
    if row is None or not int(row[0]):
        return FailureTally(0, 0.0)
    return FailureTally(int(row[0]), max(0.0, float(row[1])) / int(row[0]))


def refresh_device_failures(db: Database, device_id: str, owner_id: str) -> None:
    """Recount ``owner_id``'s failure votes for every version whose tally is kept (after
    ``device_id`` was revoked or reported), taking each version's lock inside the caller's transaction."""
    for (version,) in db.execute("SELECT version FROM failure_tallies ORDER BY version").fetchall():
        db.lock(f"rollout:{version}")
        refresh_owner_failures(db, int(version), owner_id)

"""The guard's running tally (issue 49): after every step of random sequences of health reports,
device state reports, revocations and rollout changes, spread over three replicas where the backend
has them, the tally the guard reads equals a recount from the health rows (the guard before schema
15: every unrevoked device's report, one median per owner, the median of the owners' votes) and,
for the failure rate (schema 16), a recount from every device's state (each owner's share of failed
upgrades among its devices that got the version, averaged over owners), on both backends; a
schema-14 database's votes are counted the first time the guard reads them."""

from __future__ import annotations

import dataclasses
import json
import random
import statistics

import pytest

from fctkit.protos import fleet_pb2
from fctkit.server.guard_votes import GuardTally, median_below
from fctkit.server.rollout import in_rollout
from fctkit.server.rollout.changes import guard_verdict
from fctkit.server.rollout_store import STAGED, HealthReport, Rollout, Stage
from fctkit.server.storage import DeviceReport, VersionRecord

GUARDED = 2  # the version with a staged rollout and a guard
OWNERS = 7
COSINES = tuple(round(0.3 + 0.05 * i, 2) for i in range(9))  # a coarse grid: ties and exact hits of the threshold


def recount(storage, version: int) -> GuardTally:
    """The guard's inputs recounted from scratch, as the guard computed them before schema 15."""
    rollout = storage.rollouts()[version]
    signal = {
        d: h.mean_cosine
        for d, h in storage.health_reports(version).items()
        if h.sample_size > 0 and in_rollout(rollout, d)
    }
    by_owner: dict[str, list[float]] = {}
    for device_id, value in signal.items():
        by_owner.setdefault(storage.device_owner(device_id), []).append(value)
    votes = [statistics.median(values) for values in by_owner.values()]
    median = statistics.median(votes) if votes else None
    below = median if median is not None and median < rollout.halt_below else None
    return GuardTally(len(votes), len(signal), below, "mean_cosine", rollout.halt_below)


GOT_BUNDLE = (fleet_pb2.UPGRADE_STATE_UPGRADING, fleet_pb2.UPGRADE_STATE_BACKFILLING, fleet_pb2.UPGRADE_STATE_FAILED)
STATES = (
    fleet_pb2.UPGRADE_STATE_IDLE,
    fleet_pb2.UPGRADE_STATE_DOWNLOADING,
    *GOT_BUNDLE,
    *[fleet_pb2.UPGRADE_STATE_FAILED] * 3,
)


def failure_recount(storage, version: int) -> tuple[int, float]:
    """(owners of devices in the rollout that got ``version``, their mean share of failed upgrades)."""
    rollout, reported = storage.rollouts()[version], storage.health_reports(version)
    shares: dict[str, list[bool]] = {}
    for d in storage.rollout_devices():
        got = (
            d.version >= version
            or d.device_id in reported
            or (d.target_version == version and d.upgrade_state in GOT_BUNDLE)
        )
        if in_rollout(rollout, d.device_id) and got:
            failed = d.target_version == version and d.upgrade_state == fleet_pb2.UPGRADE_STATE_FAILED
            shares.setdefault(storage.device_owner(d.device_id), []).append(failed)
    return len(shares), statistics.mean(sum(v) / len(v) for v in shares.values()) if shares else 0.0


def state_report(rng: random.Random) -> DeviceReport:
    """A device's report: running v1 or v2, maybe on its way to v2, in any upgrade state."""
    runs = rng.choice((1, 1, GUARDED))
    target = GUARDED if runs == 1 and rng.random() < 0.7 else 0
    return DeviceReport(runs, 64, rng.choice(STATES), target, 0.5, "", 0, False, 0)


def enrolled_fleet(storage, devices: int, rng: random.Random) -> list[str]:
    """``devices`` devices spread over :data:`OWNERS` owners, enrolled through the storage API."""
    ids = []
    for i in range(devices):
        code = f"code-{i}"
        storage.add_enrolment_code(code, "", "2026-01-01", "2999-01-01", f"own-{rng.randrange(OWNERS)}")
        device_id = f"dev-{i:016x}"
        assert storage.enrol(code, "2026-01-02", device_id, f"d{i}", f"token-{i}") is not None
        ids.append(device_id)
    return ids


def health(version: int, rng: random.Random) -> HealthReport:
    sampled = rng.random() < 0.85
    cosine = rng.choice(COSINES) if sampled else 0.0
    return HealthReport(version, 64, 0, 1.0, 16 if sampled else 0, cosine, cosine if sampled else 0.0, 0.0, 0.0)


def random_change(rollout: Rollout, device_ids: list[str], rng: random.Random) -> Rollout:
    """Widen, replace the cohort, or move the guard's threshold."""
    kind = rng.choice(("widen", "cohort", "threshold"))
    if kind == "widen":
        percent = min(100.0, rollout.percent + rng.choice((5.0, 20.0)))
        return dataclasses.replace(rollout, percent=percent, stages=(*rollout.stages, Stage(percent, "t")))
    if kind == "cohort":
        return dataclasses.replace(rollout, cohort=frozenset(rng.sample(device_ids, rng.randrange(6))))
    return dataclasses.replace(rollout, halt_below=rng.choice(COSINES))


@pytest.mark.parametrize("seed", [0, 1])
def test_the_tally_equals_a_recount_after_every_step(tmp_path, backend, open_storage, seed) -> None:
    rng = random.Random(seed)
    data_dir = tmp_path / "data"
    first = open_storage(data_dir)
    replicas = [first] + ([open_storage(data_dir) for _ in range(2)] if backend.name == "postgres" else [])
    try:
        device_ids = enrolled_fleet(first, 30, rng)
        cohort = frozenset(rng.sample(device_ids, 3))
        first.add_version(VersionRecord(1, b"{}", b"sig", "t"), [])
        guarded = Rollout(
            GUARDED, 20.0, STAGED, (Stage(20.0, "t"),), cohort, halt_below=0.6, halt_min_devices=1, max_failure_rate=0.1
        )
        first.add_version(VersionRecord(GUARDED, b"{}", b"sig", "t"), [], guarded)
        revoked: set[str] = set()
        checked_halts = checked_failures = 0
        for _ in range(160):
            storage = rng.choice(replicas)
            roll = rng.random()
            if roll < 0.45:
                device_id = rng.choice(device_ids)
                storage.record_health(device_id, health(rng.choice((1, GUARDED, GUARDED)), rng), "t")
            elif roll < 0.7:
                device_id = rng.choice(device_ids)
                storage.record_report(device_id, state_report(rng), "t")
                storage.refresh_failures(GUARDED, device_id)  # as Fleet.Report does for a watched rollout it is in
            elif roll < 0.8:
                device_id = rng.choice(device_ids)
                storage.revoke_device(device_id, "t")
                revoked.add(device_id)
            else:
                storage.change_rollout(GUARDED, lambda current: random_change(current, device_ids, rng))
            tally, expected = rng.choice(replicas).guard_tally(GUARDED), recount(first, GUARDED)
            owners, rate = failure_recount(first, GUARDED)
            assert dataclasses.replace(tally, failure_owners=0, failure_rate=0.0) == expected
            assert (tally.failure_owners, tally.failure_rate) == (owners, pytest.approx(rate, abs=1e-9))
            checked_failures += rate > 0.1 and owners >= 1
            rollout = first.rollouts()[GUARDED]
            verdict = guard_verdict(rollout, tally, "dev-x")
            tripped = (expected.median_below is not None and expected.owners >= 1) or (owners >= 1 and rate > 0.1)
            assert (verdict is not None) == tripped
            checked_halts += verdict is not None
        assert revoked and checked_halts and checked_failures  # it revoked devices and crossed both bounds
        assert first.guard_tally(1) == GuardTally(
            0, 0, None, "mean_cosine", 0.0
        )  # published to every device: no guard, no votes
    finally:
        for storage in replicas:
            storage.close()


def test_a_schema_14_database_counts_its_votes_when_the_guard_first_reads_them(tmp_path, backend, open_storage) -> None:
    rng = random.Random(5)
    data_dir = tmp_path / "data"
    storage = open_storage(data_dir)
    device_ids = enrolled_fleet(storage, 12, rng)
    rollout = Rollout(GUARDED, 100.0, STAGED, (Stage(100.0, "t"),), halt_below=0.9, halt_min_devices=1)
    storage.add_version(VersionRecord(1, b"{}", b"sig", "t"), [])
    storage.add_version(VersionRecord(GUARDED, b"{}", b"sig", "t"), [], rollout)
    for device_id in device_ids:
        storage.record_health(device_id, health(GUARDED, rng), "t")
    expected = recount(storage, GUARDED)
    storage.close()
    storage = backend.aged(data_dir, open_storage, 14, "DROP TABLE guard_votes", "DROP TABLE guard_tallies")
    try:
        assert backend.query(data_dir, "SELECT COUNT(*) FROM guard_tallies") == [(0,)]
        assert storage.guard_tally(GUARDED) == expected
        assert expected.owners > 1 and expected.median_below is not None
    finally:
        storage.close()


@pytest.mark.parametrize(
    ("votes", "threshold"),
    [((0.5,), 0.5), ((0.4,), 0.5), ((0.4, 0.6), 0.5), ((0.4, 0.59), 0.5), ((0.3, 0.5, 0.7, 0.9), 0.6),
     ((0.3, 0.5, 0.65, 0.9), 0.6), ((0.1, 0.2, 0.7, 0.8), 0.45), ((0.2, 0.2, 0.2), 0.2), ((), 0.5)],
)  # fmt: skip
def test_median_below_agrees_with_the_median(votes: tuple[float, ...], threshold: float) -> None:
    below = [v for v in votes if v < threshold]
    above = [v for v in votes if v >= threshold]
    expected = bool(votes) and statistics.median(votes) < threshold
    assert median_below(len(votes), len(below), lambda: (max(below), min(above)), threshold) == expected


def breaks(expectation, rows: int) -> float:
    """The break-even at ``rows``, recomputed: linear in log(rows) between the sizes, held outside them."""
    import math

    sizes, values = [math.log(r) for r in expectation.gallery_rows], expectation.break_even
    at = min(max(math.log(rows), sizes[0]), sizes[-1])
    k = next(i for i in range(1, len(sizes)) if at <= sizes[i])
    return values[k - 1] + (at - sizes[k - 1]) / (sizes[k] - sizes[k - 1]) * (values[k] - values[k - 1])


def test_an_expected_guard_tally_equals_a_recount_of_each_device_ratio(tmp_path, backend, open_storage) -> None:
    """The ``expected`` guard: each device's R@1 as a fraction of what the release's manifest expects
    at its gallery size over the bound there (1 - margin, or the break-even where it is above 1), one
    median per owner, against 1."""
    from fctkit.protos.health_expectation import HealthExpectation
    from fctkit.upgrade_health import MEASURES

    rng = random.Random(11)
    measures = dict.fromkeys(MEASURES, ((0.95, 0.8, 0.6), (0.02, 0.03, 0.04)))
    # the break-even is under 1 at 64 and 256 rows (no floor there) and above it at 1,024
    expectation = HealthExpectation("instance", 32, 16, (64, 256, 1024), measures, break_even=(0.7, 0.9, 1.2))
    manifest = json.dumps({"health_expectation": expectation.to_json()}).encode()
    storage = open_storage(tmp_path / "data")
    try:
        device_ids = enrolled_fleet(storage, 24, rng)
        storage.add_version(VersionRecord(1, b"{}", b"sig", "t"), [])
        guarded = Rollout(
            GUARDED, 50.0, STAGED, (Stage(50.0, "t"),), halt_below=0.2, halt_min_devices=1, guard_measure="expected"
        )
        storage.add_version(VersionRecord(GUARDED, manifest, b"sig", "t"), [], guarded)
        crossed = 0
        for step in range(80):
            if step % 10 == 9:
                margin = rng.choice((0.1, 0.2, 0.4))
                storage.change_rollout(GUARDED, lambda current, m=margin: dataclasses.replace(current, halt_below=m))
            rows = rng.choice((64, 100, 256, 700, 1024, 4096))
            report = HealthReport(GUARDED, rows, 0, 1.0, 32, 0.5, 0.4, rng.choice((0.3, 0.5, 0.7, 0.9)), 0.8, 1.0, rows)
            storage.record_health(rng.choice(device_ids), report, "t")
            rollout = storage.rollouts()[GUARDED]
            signal = {
                d: expectation.ratio("recall_at_1", h.recall_at_1, h.gallery_rows)
                / (max(be, 1.0) if (be := breaks(expectation, h.gallery_rows)) > 1 else 1 - rollout.halt_below)
                for d, h in storage.health_reports(GUARDED).items()
                if in_rollout(rollout, d)
            }
            by_owner: dict[str, list[float]] = {}
            for device_id, value in signal.items():
                by_owner.setdefault(storage.device_owner(device_id), []).append(value)
            votes = [statistics.median(v) for v in by_owner.values()]
            threshold = 1.0
            median = statistics.median(votes) if votes else None
            tally = storage.guard_tally(GUARDED)
            assert (tally.owners, tally.devices, tally.threshold) == (len(votes), len(signal), threshold)
            assert tally.median_below == (median if median is not None and median < threshold else None)
            assert tally.signal == "recall_at_1 / expected / bound"
            crossed += tally.median_below is not None
        assert 0 < crossed < 80  # the sequence went below the bound and back
    finally:
        storage.close()

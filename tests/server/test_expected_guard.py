"""The default guard of a staged rollout (issue 48, part 1): each release carries its own health
expectation, and the guard compares the fleet's measure of the release's level against it.

At instance level the mean cosine runs backwards (an InfoNCE adapter keeps identity, not the new
model's geometry), so a bad release reporting a high mean cosine must still be halted on its
self-retrieval R@1, and a good one reporting a low mean cosine must not be. The expectation is read
at each device's gallery size: a large gallery's lower R@1 is no fault. A release the gate itself
found worse than not upgrading (exported with its gate overridden) halts at its break-even. The
default guard also bounds the owners' mean share of failed upgrades."""

from __future__ import annotations

import pytest

from fctkit.protos.bundle import pack_bundle
from fctkit.protos.health_expectation import HealthExpectation
from fctkit.server.rollout.changes import DEFAULT_GUARD_MARGIN, DEFAULT_GUARD_OWNERS, DEFAULT_MAX_FAILURE_RATE
from tests.server.conftest import call_status, chain_bundle, enrolled_client
from tests.server.test_rollouts import FAILED, IDLE, admin, enrol, health

SIZES = (64, 256, 1024)
# self-retrieval falls as a gallery grows; the mean cosine stays put
MEASURES = {
    "mean_cosine": ((0.5, 0.5, 0.5), (0.02, 0.02, 0.02)),
    "p10_cosine": ((0.4, 0.4, 0.4), (0.02, 0.02, 0.02)),
    "recall_at_1": ((0.95, 0.85, 0.7), (0.03, 0.05, 0.06)),
    "mean_reciprocal_rank": ((0.97, 0.9, 0.8), (0.02, 0.03, 0.04)),
    "median_rank": ((1.0, 1.0, 1.0), (0.0, 0.0, 0.0)),
}
INSTANCE = {"old/old": {"recall@1": 0.6}, "new/h(old)": {"recall@1": 0.75}, "new/new": {"recall@1": 0.9}}


def expectation(cases: dict = INSTANCE) -> HealthExpectation:
    return HealthExpectation.measured(cases, SIZES, MEASURES, 32, 16)


@pytest.fixture(scope="module")
def releases(tmp_path_factory, publisher_key, bundles) -> dict[str, object]:
    root = tmp_path_factory.mktemp("expected")
    reason = "ships the crash fix; recall loss accepted"
    forced_cases = {"old/old": {"recall@1": 0.6}, "new/h(old)": {"recall@1": 0.5}, "new/new": {"recall@1": 0.9}}
    made = {
        "v1": pack_bundle(bundles[1], root / "v1.tar"),
        "expected": chain_bundle(root / "a", 2, publisher_key, cases=INSTANCE, health_expectation=expectation()),
        "forced": chain_bundle(
            root / "b",
            2,
            publisher_key,
            cases=forced_cases,
            force_reason=reason,
            health_expectation=expectation(forced_cases),
        ),
        "bare": bundles[2],
    }
    return {name: path if name == "v1" else pack_bundle(path, root / f"{name}.tar") for name, path in made.items()}


def staged(start_server, releases, name: str, devices: int, **publish):
    server = start_server()
    with admin(server) as a:
        a.publish_bundle(releases["v1"])
        a.publish_bundle(releases[name], rollout_percent=100, **publish)
    return server, enrol(server, devices)


def report(devices, *, recall_at_1: float, mean_cosine: float, gallery_rows: int = 64) -> None:
    for device in devices.values():
        device.report(
            2,
            gallery_rows,
            IDLE,
            health=health(
                2,
                mean_cosine,
                recall_at_1=recall_at_1,
                rows_upgraded=gallery_rows,
                gallery_rows=gallery_rows,
                median_rank=2.0,
            ),
        )


def test_a_staged_rollout_starts_guarded_against_the_release_expectation(start_server, releases):
    server, _ = staged(start_server, releases, "expected", 0)
    with admin(server) as a:
        status = a.rollout_status(2)
    assert (status.guard_measure, status.halt_min_devices) == ("expected", DEFAULT_GUARD_OWNERS)
    assert status.halt_below == pytest.approx(DEFAULT_GUARD_MARGIN["instance"])
    assert HealthExpectation.from_json(__import__("json").loads(status.health_expectation_json), "status") == (
        expectation()
    )


def test_an_instance_release_is_halted_on_self_retrieval_whatever_its_mean_cosine(start_server, releases):
    bad, bad_devices = staged(start_server, releases, "expected", DEFAULT_GUARD_OWNERS)
    report(bad_devices, recall_at_1=0.5, mean_cosine=0.8)  # a high cosine: the old guard read it as healthy
    good, good_devices = staged(start_server, releases, "expected", DEFAULT_GUARD_OWNERS)
    report(good_devices, recall_at_1=0.95, mean_cosine=0.45)  # a low cosine, as InfoNCE adapters report
    with admin(bad) as a:
        halted = a.rollout_status(2)
    with admin(good) as a:
        going = a.rollout_status(2)
    assert halted.state == "halted" and "recall_at_1 / expected" in halted.halt_reason, halted.halt_reason
    assert halted.stages[0].expected_shortfall.median == pytest.approx(0.5 / 0.95)
    assert halted.stages[0].recall_at_1.median == pytest.approx(0.5)
    assert halted.stages[0].mean_reciprocal_rank.median == pytest.approx(
        0.95
    )  # as tests.server.test_rollouts.health sends
    assert halted.stages[0].median_rank.median == 2.0
    assert going.state == "staged" and going.stages[0].expected_shortfall.median == pytest.approx(1.0)


def test_the_expectation_is_read_at_each_device_gallery_size(start_server, releases):
    server, devices = staged(start_server, releases, "expected", DEFAULT_GUARD_OWNERS)
    report(devices, recall_at_1=0.7, mean_cosine=0.5, gallery_rows=1024)  # what the release expects at 1,024 rows
    with admin(server) as a:
        assert a.rollout_status(2).state == "staged"
    small, small_devices = staged(start_server, releases, "expected", DEFAULT_GUARD_OWNERS)
    report(small_devices, recall_at_1=0.7, mean_cosine=0.5, gallery_rows=64)  # 0.74 of 0.95: too low at 64 rows
    with admin(small) as a:
        assert a.rollout_status(2).state == "halted"


def test_fewer_owners_than_the_default_never_halt(start_server, releases):
    server, devices = staged(start_server, releases, "expected", DEFAULT_GUARD_OWNERS - 1)
    report(devices, recall_at_1=0.1, mean_cosine=0.9)
    with admin(server) as a:
        assert a.rollout_status(2).state == "staged"


def test_a_release_the_gate_found_worse_than_not_upgrading_halts_at_its_break_even(start_server, releases):
    server, devices = staged(start_server, releases, "forced", DEFAULT_GUARD_OWNERS)
    report(devices, recall_at_1=0.95, mean_cosine=0.5)  # exactly as expected: still below not upgrading
    with admin(server) as a:
        status = a.rollout_status(2)
    # each vote is its ratio (1.0) over its bound, the break-even 1.2: 0.8333, under 1
    assert status.state == "halted" and "0.8333" in status.halt_reason and "fell below 1 " in status.halt_reason, (
        status.halt_reason
    )


def test_no_guard_at_publish_and_releases_without_an_expectation_start_unguarded(start_server, releases):
    server, devices = staged(start_server, releases, "expected", DEFAULT_GUARD_OWNERS, no_guard=True)
    report(devices, recall_at_1=0.1, mean_cosine=0.1)
    bare, _ = staged(start_server, releases, "bare", 0)
    with admin(server) as a:
        status = a.rollout_status(2)
        assert (status.state, status.halt_min_devices, status.guard_measure) == ("staged", 0, "")
    with admin(bare) as a:
        assert a.rollout_status(2).halt_min_devices == 0
        assert call_status(lambda: a.set_rollout(2, halt_below=0.2, halt_min_devices=3, guard_measure="expected")) == (
            "FAILED_PRECONDITION"
        )
        assert call_status(lambda: a.set_rollout(2, halt_below=0.2, halt_min_devices=3, guard_measure="median")) == (
            "INVALID_ARGUMENT"
        )
        assert call_status(
            lambda: a.set_rollout(2, halt_below=-0.5, halt_min_devices=3, guard_measure="recall_at_1")
        ) == ("INVALID_ARGUMENT")
        assert a.rollout_status(2).halt_min_devices == 0  # nothing changed
        a.set_rollout(2, halt_below=0.5, halt_min_devices=1, guard_measure="recall_at_1")  # an absolute bound on R@1
        assert a.rollout_status(2).guard_measure == "recall_at_1"


def test_an_absolute_recall_bound_halts_below_it(start_server, releases):
    server, devices = staged(start_server, releases, "bare", 2)
    with admin(server) as a:
        a.set_rollout(2, halt_below=0.6, halt_min_devices=2, guard_measure="recall_at_1")
        report(devices, recall_at_1=0.55, mean_cosine=0.95)
        status = a.rollout_status(2)
    assert status.state == "halted" and "median recall_at_1 0.5500" in status.halt_reason


@pytest.mark.parametrize(
    "fields",
    [
        {"median_rank": 70.0, "gallery_rows": 64},  # a rank past the gallery
        {"median_rank": 0.5, "gallery_rows": 64},
        {"median_rank": float("nan"), "gallery_rows": 64},
        {
            "sample_size": 0,
            "mean_cosine": 0.0,
            "p10_cosine": 0.0,
            "recall_at_1": 0.0,
            "mean_reciprocal_rank": 0.0,
            "gallery_rows": 64,
        },
    ],
)
def test_bad_rank_and_size_fields_are_refused_and_change_nothing(start_server, releases, fields):
    server, devices = staged(start_server, releases, "expected", 1)
    device = next(iter(devices.values()))
    assert call_status(lambda: device.report(2, 64, IDLE, health=health(2, **fields))) == "INVALID_ARGUMENT"
    with admin(server) as a:
        assert a.rollout_status(2).stages[0].health.devices == 0


def fail(device) -> None:
    device.report(1, 64, FAILED, target_version=2)


def upgraded(device) -> None:
    device.report(2, 64, IDLE)


def test_the_default_guard_halts_on_the_owners_failure_rate(start_server, releases):
    server, devices = staged(start_server, releases, "expected", DEFAULT_GUARD_OWNERS)
    ids = list(devices)
    for device_id in ids[:1]:
        fail(devices[device_id])
    for device_id in ids[1:]:
        upgraded(devices[device_id])
    with admin(server) as a:
        going = a.rollout_status(2)
        assert going.state == "staged" and going.max_failure_rate == DEFAULT_MAX_FAILURE_RATE
        assert (going.failure_owners, going.failure_rate) == (5, pytest.approx(0.2))  # 1 of 5: under 0.25
        fail(devices[ids[1]])  # upgraded, then failed again towards v2: 2 of 5
        halted = a.rollout_status(2)
    assert halted.state == "halted" and "failure rate 0.4000" in halted.halt_reason, halted.halt_reason
    assert ids[1] in halted.halt_reason
    counted = sum(s.failed for s in halted.stages) / sum(s.downloaded for s in halted.stages)
    assert halted.failure_rate == pytest.approx(counted)  # one device per owner: the tally is the plain share


def test_one_owner_failing_on_many_devices_is_one_vote_and_a_revoked_device_stops_counting(start_server, releases):
    server = start_server()
    with admin(server) as a:
        a.publish_bundle(releases["v1"])
        a.publish_bundle(releases["expected"], rollout_percent=100)
    many = [enrolled_client(server, owner="one-owner", name=f"m{k}")[0] for k in range(3)]
    others = enrol(server, DEFAULT_GUARD_OWNERS - 1)
    for device in many:
        fail(device)
    for device in others.values():
        upgraded(device)
    with admin(server) as a:
        status = a.rollout_status(2)
        assert status.state == "staged" and (status.failure_owners, status.failure_rate) == (5, pytest.approx(0.2))
        failing = next(iter(others))
        fail(others[failing])
        assert a.rollout_status(2).state == "halted"  # two owners of five: 0.4
        a.set_rollout(2, action="resume", halt_below=0.2, halt_min_devices=5, guard_measure="expected",
                      max_failure_rate=0.3)  # fmt: skip
        assert a.rollout_status(2).state == "staged"
        a.revoke_device(failing)
        status = a.rollout_status(2)
    assert (status.failure_owners, status.failure_rate) == (4, pytest.approx(0.25))  # its failure is gone at once
    assert call_status(
        lambda: admin(server).set_rollout(2, halt_below=0.2, halt_min_devices=5, max_failure_rate=1.0)
    ) == ("INVALID_ARGUMENT")


def test_rollout_status_shows_the_expectation_by_size_and_the_previous_release(
    start_server, releases, admin_token_file
):
    from tests.server.test_rollout_operator import cli_of

    server, devices = staged(start_server, releases, "expected", DEFAULT_GUARD_OWNERS)
    report(devices, recall_at_1=0.95, mean_cosine=0.45)
    shown = cli_of(server, admin_token_file)("rollout-status", "2")
    assert shown.exit_code == 0, shown.output
    assert "guard: halt at median recall_at_1 under 0.85 of the release's expectation" in shown.output, shown.output
    assert "expected health (instance level, samples of 32, 16 draws" in shown.output
    assert "0.950 ±0.030 (break-even 0.800) at 64 rows" in shown.output and "at 1,024 rows" in shown.output
    assert "previous release v1: no device reported a sampled health" in shown.output
    assert "vs expected" in shown.output and "rank median" in shown.output

"""Staged rollouts on the server (issue 36), on both storage backends: deterministic assignment
that widening keeps; a version offered per device through ListVersions, PlanUpgrade,
WatchVersions and DownloadArtifact (later versions held back behind one a device was not
offered); the cohort; pause, resume, complete; narrowing refused; ``publish --percent``; bad
input refused with nothing changed; device health validated, stored and rate-limited; the guard
halting at the report that tips it; per-stage status counts; two replicas agreeing within a
second; a schema-8 database migrated."""

from __future__ import annotations

import json
import math
import threading
import time

import pytest
from click.testing import CliRunner

from fctkit.errors import RpcStatusError
from fctkit.protos import fleet_pb2, registry_pb2
from fctkit.protos.client import FctkitClient
from fctkit.server.cli import admin_command
from fctkit.server.rollout import bucket
from fctkit.server.storage import VersionRecord
from fctkit.server.storage_schema import SCHEMA_VERSION
from tests.server.conftest import ADMIN_TOKEN, enrolled_client, status_code

IDLE, UPGRADING, FAILED = (
    fleet_pb2.UPGRADE_STATE_IDLE,
    fleet_pb2.UPGRADE_STATE_UPGRADING,
    fleet_pb2.UPGRADE_STATE_FAILED,
)


def admin(server) -> FctkitClient:
    return FctkitClient(server.target, ADMIN_TOKEN)


def enrol(server, count: int) -> dict[str, FctkitClient]:
    """``count`` enrolled devices: device id -> a client holding its token."""
    devices = {}
    for k in range(count):
        client, enrolment = enrolled_client(server, name=f"d{k}")
        devices[enrolment.device_id] = client
    return devices


def staged(start_server, archives, percent: float, *args: str, devices: int = 0):
    """A fresh server with v1 published to everyone and v2 staged at ``percent``, and ``devices`` devices."""
    server = start_server(*args)
    with admin(server) as a:
        a.publish_bundle(archives[1])
        a.publish_bundle(archives[2], rollout_percent=percent)
    return server, enrol(server, devices)


def listed(client: FctkitClient) -> tuple[list[int], int]:
    """The versions ListVersions lists to ``client`` and the latest it names."""
    listing = client.registry.ListVersions(registry_pb2.ListVersionsRequest(), metadata=client._metadata, timeout=10)
    return [v.version for v in listing.versions], listing.latest_version


def health(version: int, mean_cosine: float = 0.9, **fields) -> fleet_pb2.UpgradeHealth:
    values = {
        "version": version,
        "rows_upgraded": 100,
        "failures": 0,
        "seconds": 2.5,
        "sample_size": 32,
        "mean_cosine": mean_cosine,
        "p10_cosine": max(-1.0, mean_cosine - 0.1),
        "recall_at_1": 0.9,
        "mean_reciprocal_rank": 0.95,
    }
    return fleet_pb2.UpgradeHealth(**{**values, **fields})


def test_assignment_is_deterministic_and_widening_keeps_the_earlier_devices():
    ids = [f"dev-{k:016x}" for k in range(400)]
    assert [bucket(d, 2) for d in ids] == [bucket(d, 2) for d in ids]
    assert all(0.0 <= bucket(d, 2) < 100.0 for d in ids)
    within = {p: {d for d in ids if bucket(d, 2) < p} for p in (0, 5, 20, 50, 100)}
    assert within[0] == set() and within[100] == set(ids)
    assert within[5] <= within[20] <= within[50] <= within[100]
    assert 40 <= len(within[20]) <= 120 and 140 <= len(within[50]) <= 260  # about the percent asked for
    assert {d for d in ids if bucket(d, 3) < 20} != within[20]  # each version draws its own devices


def test_a_staged_version_is_offered_only_to_devices_in_it_and_widening_keeps_them(start_server, archives):
    server, devices = staged(start_server, archives, 20, devices=50)
    inside = {d for d in devices if bucket(d, 2) < 20}
    assert 0 < len(inside) < 50
    for device_id, client in devices.items():
        if device_id in inside:
            assert listed(client) == ([1, 2], 2)
            assert client.plan_upgrade(1).to_version == 2
        else:
            assert listed(client) == ([1], 1)
            assert client.plan_upgrade(1).to_version == 1
            assert status_code(lambda c=client: c.plan_upgrade(1, 2)) == "FAILED_PRECONDITION"
            assert status_code(lambda c=client: c.fetch_artifact(2, "embed", _Sink())) == "FAILED_PRECONDITION"
    with admin(server) as a:
        a.publish_bundle(archives[3])  # to everyone, but behind v2: devices outside v2 must not skip to it
        assert [v.version for v in a.list_versions()] == [1, 2, 3]
        for device_id, client in devices.items():
            assert listed(client) == (([1, 2, 3], 3) if device_id in inside else ([1], 1))
        status = a.set_rollout(2, percent=60)
        assert (status.state, status.percent, [s.percent for s in status.stages]) == ("staged", 60, [20, 60])
        wider = {d for d in devices if bucket(d, 2) < 60}
        assert inside < wider
        for device_id, client in devices.items():
            assert listed(client)[1] == (3 if device_id in wider else 1)
        assert status_code(lambda: a.set_rollout(2, percent=30)) == "FAILED_PRECONDITION"  # narrowing
        assert a.rollout_status(2).percent == 60
        outsider = next(d for d in devices if d not in wider)
        assert a.set_rollout(2, cohort=[outsider]).cohort_size == 1
        assert listed(devices[outsider])[1] == 3
        a.set_rollout(2, action="complete")
        assert all(listed(client) == ([1, 2, 3], 3) for client in devices.values())
        assert status_code(lambda: a.set_rollout(2, action="pause")) == "FAILED_PRECONDITION"


class _Sink:
    def write(self, data: bytes) -> int:
        return len(data)


def test_pause_offers_the_version_to_nobody_new_and_resume_brings_it_back(start_server, archives):
    server, devices = staged(start_server, archives, 100, devices=3)
    on_v2, waiting, _ = devices
    devices[on_v2].report(2, 10, IDLE)
    with admin(server) as a:
        assert a.set_rollout(2, action="pause").state == "paused"
        assert listed(devices[on_v2]) == ([1, 2], 2)  # devices on it stay
        assert listed(devices[waiting]) == ([1], 1)
        assert status_code(lambda: a.set_rollout(2, percent=100)) == "FAILED_PRECONDITION"  # resume first
        assert a.set_rollout(2, action="resume").state == "staged"
        assert listed(devices[waiting]) == ([1, 2], 2)
        assert status_code(lambda: a.set_rollout(2, action="resume")) == "FAILED_PRECONDITION"


def test_a_watch_gets_the_version_when_the_rollout_widens_to_the_device(start_server, archives):
    server, devices = staged(start_server, archives, 0, "--watch-keepalive", "0.3", devices=1)
    ((device_id, client),) = devices.items()
    stream = client.registry.WatchVersions(
        registry_pb2.WatchVersionsRequest(after_version=0), metadata=client._metadata
    )
    published: list[int] = []
    keepalives: list[int] = []

    def watch() -> None:
        for event in stream:
            if event.WhichOneof("event") == "published":
                published.append(event.published.version)
                if event.published.version == 2:
                    return
            else:
                keepalives.append(event.keepalive.latest_version)

    reader = threading.Thread(target=watch)
    reader.start()
    reader.join(1.0)
    assert published == [1] and keepalives and set(keepalives) == {1}
    with admin(server) as a:
        a.set_rollout(2, cohort=[device_id])
    changed = time.monotonic()
    reader.join(10)
    stream.cancel()
    assert published == [1, 2] and time.monotonic() - changed < 1.5


def test_publish_percent_from_the_cli_and_bad_input_changes_nothing(start_server, archives, admin_token_file, tmp_path):
    server = start_server()
    devices = enrol(server, 2)
    base = ["--server", server.target, "--admin-token-file", str(admin_token_file)]

    def cli(*args: str):
        return CliRunner().invoke(admin_command, [*base, *args], catch_exceptions=False)

    assert cli("publish", str(archives[1])).exit_code == 0
    result = cli("publish", str(archives[2]), "--percent", "0")
    assert result.exit_code == 0 and "staged rollout at 0%" in result.output
    assert all(listed(c) == ([1], 1) for c in devices.values())  # 0%: nobody but the (empty) cohort
    with admin(server) as a:
        before = a.rollout_status(2)
        assert before.state == "staged" and before.percent == 0
        assert status_code(lambda: a.set_rollout(2, percent=150)) == "INVALID_ARGUMENT"
        assert status_code(lambda: a.set_rollout(2, percent=math.nan)) == "INVALID_ARGUMENT"
        assert status_code(lambda: a.set_rollout(9, percent=10)) == "NOT_FOUND"
        assert status_code(lambda: a.set_rollout(1, percent=10)) == "FAILED_PRECONDITION"  # published to everyone
        assert status_code(lambda: a.set_rollout(2, cohort=["dev-0123456789abcdef"])) == "NOT_FOUND"
        assert status_code(lambda: a.set_rollout(2, cohort=["not-a-device"])) == "INVALID_ARGUMENT"
        assert (
            status_code(lambda: a.set_rollout(2, percent=50, halt_below=2.0, halt_min_devices=3)) == "INVALID_ARGUMENT"
        )
        assert a.rollout_status(2) == before
        assert status_code(lambda: a.publish_bundle(archives[3], rollout_percent=-1)) == "INVALID_ARGUMENT"
        assert [v.version for v in a.list_versions()] == [1, 2]
    assert cli("rollout", "2", "--percent", "150").exit_code == 2
    cohort = tmp_path / "cohort.txt"
    cohort.write_text(f"{next(iter(devices))}\nnot a device id\n")
    refused = CliRunner().invoke(admin_command, [*base, "rollout", "2", "--devices", str(cohort)])
    assert refused.exit_code != 0 and "cohort.txt:2" in str(refused.exception)
    with admin(server) as a:
        assert a.rollout_status(2) == before
    cohort.write_text("# testers\n" + "\n".join(devices) + "\n")
    widened = cli(
        "rollout", "2", "--devices", str(cohort), "--percent", "10", "--halt-below", "0.5", "--halt-min-devices", "4"
    )
    assert widened.exit_code == 0 and "staged at 10% (cohort of 2)" in widened.output
    assert all(listed(c) == ([1, 2], 2) for c in devices.values())
    table = cli("rollout-status", "2")
    assert (
        table.exit_code == 0
        and "cohort" in table.output
        and "guard: halt at median mean_cosine below 0.5 once 4 owners reported" in table.output
    )
    data = json.loads(cli("rollout-status", "2", "--json").output)
    assert data["state"] == "staged" and [s["stage"] for s in data["stages"]] == [0, 1, 2] and data["gate_cases"] == {}
    assert data["stages"][0]["offered"] == 2
    assert "no rollout" in cli("rollout-status", "1").output
    assert (
        cli("rollout", "2", "--complete").exit_code == 0
        and cli("rollout-status", "2", "--json").output.count('"complete"') == 1
    )
    paused = CliRunner().invoke(admin_command, [*base, "rollout", "2", "--pause"])
    assert paused.exit_code != 0 and "nothing to pause" in str(paused.exception)


BAD_HEALTH = {
    "a NaN cosine": {"mean_cosine": math.nan},
    "an infinite cosine": {"p10_cosine": -math.inf},
    "a cosine above 1": {"mean_cosine": 1.5},
    "R@1 above 1": {"recall_at_1": 1.01},
    "MRR below 0": {"mean_reciprocal_rank": -0.1},
    "a sample larger than the rows": {"sample_size": 101},
    "absurd seconds": {"seconds": 1e12},
    "negative seconds": {"seconds": -1.0},
    "a negative count sent as uint64": {"rows_upgraded": (1 << 64) - 1},
    "no version": {"version": 0},
    "measures without a sample": {"sample_size": 0},
}


def test_reports_health_is_validated_stored_and_rate_limited(start_server, archives, backend):
    server, devices = staged(start_server, archives, 100, "--max-reports-per-minute", "5", devices=4)
    *bad, third = devices
    for k, (case, fields) in enumerate(BAD_HEALTH.items()):
        client = devices[bad[k % 3]]  # each device may report 5 times a minute
        assert (
            status_code(lambda c=client, f=fields: c.report(2, 100, IDLE, health=health(**{"version": 2, **f})))
            == "INVALID_ARGUMENT"
        ), case
    assert backend.query(server.data_dir, "SELECT COUNT(*) FROM device_health") == [(0,)]
    with admin(server) as a:
        assert {d.device_id: d.last_report_at for d in a.list_devices()} == dict.fromkeys(devices, "")
    limited = devices[third]
    for k in range(5):
        limited.report(2, 100, IDLE, health=health(2, 0.5 + k / 10))
    refused = status_code(lambda: limited.report(2, 100, IDLE))
    assert refused == "RESOURCE_EXHAUSTED"
    stored = backend.query(server.data_dir, "SELECT device_id, version, mean_cosine, sample_size FROM device_health")
    assert [(d, v, round(c, 6), s) for d, v, c, s in stored] == [(third, 2, 0.9, 32)]  # the latest per version


def test_the_guard_halts_the_rollout_at_the_report_that_tips_it(start_server, archives):
    server, devices = staged(start_server, archives, 100, devices=5)
    ids = list(devices)
    with admin(server) as a:
        a.set_rollout(2, halt_below=0.8, halt_min_devices=3)
        for k, (signal, state) in enumerate([(0.95, "staged"), (0.3, "staged"), (0.9, "staged"), (0.2, "halted")]):
            devices[ids[k]].report(2, 100, IDLE, health=health(2, signal))
            assert a.rollout_status(2).state == state, f"after report {k + 1}"
            assert a.rollout_status(2).stages[0].offered == (5 if state == "staged" else 4)
        status = a.rollout_status(2)
    assert "median mean_cosine 0.6000 of 4 owners' votes (4 reporting devices, one vote per owner) fell below 0.8" in (
        status.halt_reason
    )
    assert ids[3] in status.halt_reason
    assert status.stages[0].offered == 4  # halted: offered only to the 4 that run v2, not to the fifth
    summary = status.stages[0].health
    assert (summary.devices, summary.median, summary.min) == (4, pytest.approx(0.6), pytest.approx(0.2))
    assert summary.p10 == pytest.approx(0.23)  # 0.2 + (0.3 - 0.2) * 0.3, interpolated as numpy does
    assert listed(devices[ids[0]]) == ([1, 2], 2)  # reported v2: stays
    assert listed(devices[ids[4]]) == ([1], 1)  # nobody new
    with admin(server) as a:
        # under the same guard it would halt again at the next report: refused, with what to do
        with pytest.raises(RpcStatusError, match=r"would halt it again at the next report .*--no-guard") as refused:
            a.set_rollout(2, action="resume")
        assert refused.value.code == "FAILED_PRECONDITION" and a.rollout_status(2).state == "halted"
        assert a.set_rollout(2, action="resume", halt_below=0.5, halt_min_devices=3).state == "staged"
        devices[ids[4]].report(2, 100, IDLE, health=health(2, 0.1))
        assert a.rollout_status(2).state == "halted"  # the new guard holds after a resume: median 0.3 < 0.5


def test_status_counts_each_device_in_the_stage_it_entered_in(start_server, archives):
    server, devices = staged(start_server, archives, 20, devices=30)

    def split() -> tuple[list[str], list[str], list[str]]:
        ids = list(devices)
        return (
            [d for d in ids if bucket(d, 2) < 20],
            [d for d in ids if 20 <= bucket(d, 2) < 70],
            [d for d in ids if bucket(d, 2) >= 70],
        )

    first, second, outside = split()
    while len(first) < 3 or len(second) < 3 or not outside:  # device ids are random: enrol until each stage has enough
        assert len(devices) < 300
        devices.update(enrol(server, 1))
        first, second, outside = split()
    cohort = outside[:1]
    with admin(server) as a:
        a.set_rollout(2, percent=70, cohort=cohort)
        devices[first[0]].report(2, 100, IDLE, health=health(2, 0.9))  # upgraded
        devices[first[1]].report(1, 100, UPGRADING, target_version=2)  # downloaded
        devices[first[2]].report(1, 100, FAILED, target_version=2)  # failed
        devices[second[0]].report(2, 100, IDLE, health=health(2, 0.7))
        devices[second[1]].report(2, 100, IDLE, health=health(2, 0.8))
        devices[second[1]].report(1, 100, IDLE)  # reverted
        devices[cohort[0]].report(2, 100, IDLE)
        status = a.rollout_status(2)
    counts = [
        (s.stage, s.offered, s.downloaded, s.upgraded, s.failed, s.reverted, s.health.devices) for s in status.stages
    ]
    assert counts == [(0, 1, 1, 1, 0, 0, 0), (1, len(first), 3, 1, 1, 0, 1), (2, len(second), 2, 1, 0, 1, 2)]
    assert status.stages[2].health.median == pytest.approx(0.75)


def test_replicas_agree_on_a_rollout_within_a_second(start_replicas, archives):
    first, second = start_replicas(2, "--watch-keepalive", "0.3")
    with admin(first) as a:
        a.publish_bundle(archives[1])
        a.publish_bundle(archives[2], rollout_percent=0)
    on_second, enrolment = enrolled_client(second)
    on_first = FctkitClient(first.target, enrolment.token)
    one = enrolment.device_id
    assert listed(on_second) == ([1], 1) and listed(on_first) == ([1], 1)
    with admin(first) as a:
        a.set_rollout(2, cohort=[one])
    changed = time.monotonic()
    while listed(on_second) != ([1, 2], 2):
        assert time.monotonic() - changed < 1.0, "the second replica still holds v2 back a second later"
        time.sleep(0.02)
    with admin(second) as a:
        assert a.rollout_status(2).cohort_size == 1
        a.set_rollout(2, action="pause")
    changed = time.monotonic()
    with admin(first) as a:
        while a.rollout_status(2).state != "paused" or listed(on_first)[1] != 1:
            assert time.monotonic() - changed < 1.0, "the first replica still stages v2 a second later"
            time.sleep(0.02)


def test_a_schema_8_database_gets_the_rollout_tables(tmp_path, open_storage, backend):
    data_dir = tmp_path / "data"
    storage = backend.aged(
        data_dir,
        open_storage,
        8,
        *(f"DROP TABLE {t}" for t in ("device_health", "rollout_cohort", "rollout_stages", "rollouts")),
        versions=(1,),
    )
    try:
        assert [r.version for r in storage.versions()] == [1] and storage.rollouts() == {}
        from fctkit.server.rollout.changes import new_rollout

        storage.add_version(VersionRecord(2, b"{}", b"sig", "now"), [], new_rollout(2, 5.0, "now"))
        assert storage.rollouts()[2].percent == 5.0 and storage.rollouts()[2].state == "staged"
    finally:
        storage.close()
    if backend.name == "sqlite":
        assert backend.query(data_dir, "PRAGMA user_version") == [(SCHEMA_VERSION,)]

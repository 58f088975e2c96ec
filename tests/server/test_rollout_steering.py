"""A guard and stages that a device cannot steer (issue 48), on both storage backends: what a
device is offered is the server's decision from its own records, so a Report (or a PlanUpgrade's
``from_version``) naming a version never offered to the device is refused (PERMISSION_DENIED,
logged) and one naming a version never published too (NOT_FOUND), with nothing stored; a device
offered a version keeps it after its rollout pauses, drops it from the cohort or is withdrawn;
revoked devices' health stops counting at once, for the guard and rollout status alike; the guard
takes one vote per owner, so three devices of one owner neither halt nor mask a rollout of many
owners; the report limit holds across replicas (counted in the database); a schema-11 database
gets the report counts."""

from __future__ import annotations

from fctkit.protos import fleet_pb2, registry_pb2
from fctkit.protos.client import FctkitClient
from fctkit.server.storage_schema import SCHEMA_VERSION
from tests.server.conftest import ADMIN_TOKEN, enrolled_client, status_code
from tests.server.test_rollouts import _Sink, admin, health, listed, staged

IDLE, UPGRADING = fleet_pb2.UPGRADE_STATE_IDLE, fleet_pb2.UPGRADE_STATE_UPGRADING


def fetch(client: FctkitClient, version: int) -> None:
    client.fetch_artifact(version, "embed", _Sink())


def stored_version(server, device_id: str) -> int:
    with admin(server) as a:
        return next(d.version for d in a.list_devices() if d.device_id == device_id)


def watched(client: FctkitClient) -> list[str]:
    """What a WatchVersions from version 0 sends up to its first keepalive."""
    stream = client.registry.WatchVersions(
        registry_pb2.WatchVersionsRequest(after_version=0), metadata=client._metadata, timeout=10
    )
    events = []
    for event in stream:
        kind = event.WhichOneof("event")
        events.append(f"{kind}:{event.published.version if kind == 'published' else event.keepalive.latest_version}")
        if kind == "keepalive":
            break
    stream.cancel()
    return events


def refused_claims(server) -> list[tuple[str, str, int]]:
    return [
        (e["device_id"], e["field"], e["version"]) for e in server.events() if e["event"] == "version claim refused"
    ]


def test_a_claimed_version_never_widens_what_a_device_is_offered(start_server, archives, backend):
    server, devices = staged(start_server, archives, 0, "--watch-keepalive", "0.3", devices=1)  # v2 at 0%: nobody
    with admin(server) as a:
        a.publish_bundle(archives[3])  # to everyone, but behind v2
    ((outsider, client),) = devices.items()
    client.report(1, 10, IDLE)
    never_offered = {
        "version": lambda: client.report(2, 10, IDLE),
        "a later version behind it": lambda: client.report(3, 10, IDLE),
        "target_version": lambda: client.report(1, 10, UPGRADING, target_version=2),
        "health.version": lambda: client.report(1, 10, IDLE, health=health(2)),
    }
    for case, call in never_offered.items():
        assert status_code(call) == "PERMISSION_DENIED", case
    never_published = {
        "version 2**32-1": lambda: client.report(2**32 - 1, 10, IDLE),
        "health.version 4000": lambda: client.report(1, 10, IDLE, health=health(4000)),
        "target_version 4000": lambda: client.report(1, 10, UPGRADING, target_version=4000),
    }
    for case, call in never_published.items():
        assert status_code(call) == "NOT_FOUND", case
    assert stored_version(server, outsider) == 1
    assert backend.query(server.data_dir, "SELECT COUNT(*) FROM device_health") == [(0,)]
    assert listed(client) == ([1], 1) and watched(client) == ["published:1", "keepalive:1"]
    for version in (2, 3):
        assert status_code(lambda v=version: fetch(client, v)) == "FAILED_PRECONDITION"
        assert status_code(lambda v=version: client.get_manifest(v)) == "FAILED_PRECONDITION"
    assert client.get_manifest(1)[0]
    assert status_code(lambda: client.plan_upgrade(2)) == "PERMISSION_DENIED"
    assert status_code(lambda: client.plan_upgrade(1, 3)) == "FAILED_PRECONDITION"
    assert client.report(1, 10, IDLE).latest_version == 1
    assert refused_claims(server) == [
        (outsider, "version", 2),
        (outsider, "version", 3),
        (outsider, "target_version", 2),
        (outsider, "health.version", 2),
        (outsider, "version", 2**32 - 1),
        (outsider, "health.version", 4000),
        (outsider, "target_version", 4000),
        (outsider, "from_version", 2),
    ]


def test_a_device_offered_a_version_keeps_it_when_its_rollout_pauses_drops_it_or_is_withdrawn(
    start_server, archives, publisher_key
):
    from tests.server.test_withdrawals import withdrawal

    server, devices = staged(start_server, archives, 0, devices=3)
    inside, leaving, never = devices
    with admin(server) as a:
        a.set_rollout(2, cohort=[inside, leaving])
    for device_id in (inside, leaving):
        assert listed(devices[device_id]) == ([1, 2], 2)
        devices[device_id].report(1, 10, UPGRADING, target_version=2)  # it set out for v2 while offered it
    with admin(server) as a:
        a.set_rollout(2, action="pause")
        a.set_rollout(2, cohort=[inside])  # `leaving` is out of the cohort now, mid-upgrade
    for device_id in (inside, leaving):
        devices[device_id].report(2, 10, IDLE, health=health(2))
        assert listed(devices[device_id]) == ([1, 2], 2)
        fetch(devices[device_id], 2)
        assert devices[device_id].get_manifest(2)[0]
        assert devices[device_id].plan_upgrade(2).to_version == 2
    assert status_code(lambda: devices[never].report(2, 10, IDLE)) == "PERMISSION_DENIED"
    assert status_code(lambda: fetch(devices[never], 2)) == "FAILED_PRECONDITION"
    with admin(server) as a:
        a.withdraw(withdrawal(2, 1, publisher_key))
    fetch(devices[inside], 2)  # it runs the withdrawn version: it keeps what it has
    devices[inside].report(2, 10, IDLE)
    devices[inside].report(1, 10, IDLE, reverted_from=2, revert_method="exact")
    for call in (lambda: devices[never].report(2, 10, IDLE), lambda: devices[never].plan_upgrade(2)):
        assert status_code(call) == "PERMISSION_DENIED"
    assert status_code(lambda: fetch(devices[never], 2)) == "FAILED_PRECONDITION"
    assert [v for _, _, v in refused_claims(server)] == [2, 2, 2]


def test_revoked_devices_stop_counting_for_the_guard_and_the_status_at_once(start_server, archives):
    server, devices = staged(start_server, archives, 0, devices=4)
    *liars, honest = devices
    with admin(server) as a:
        a.set_rollout(2, cohort=list(devices), halt_below=0.5, halt_min_devices=4)
        for liar in liars:
            devices[liar].report(2, 100, IDLE, health=health(2, -1.0))
            a.revoke_device(liar)
        devices[honest].report(2, 100, IDLE, health=health(2, 0.9))
        status = a.rollout_status(2)
        assert (status.state, sum(s.health.devices for s in status.stages)) == ("staged", 1)
        a.set_rollout(2, halt_below=0.95, halt_min_devices=1)
        devices[honest].report(2, 100, IDLE, health=health(2, 0.9))
        status = a.rollout_status(2)
    assert status.state == "halted" and sum(s.health.devices for s in status.stages) == 1
    assert "0.9000 of 1 owners' votes (1 reporting devices" in status.halt_reason


def owners_fleet(server, honest: int) -> tuple[list[FctkitClient], list[FctkitClient]]:
    """Three devices of one owner, and ``honest`` devices of an owner each."""
    first, enrolment = enrolled_client(server, name="sybil-0")
    sybils = [first, *(enrolled_client(server, enrolment.owner_id, f"sybil-{k}")[0] for k in (1, 2))]
    return sybils, [enrolled_client(server, name=f"honest-{k}")[0] for k in range(honest)]


def test_three_devices_of_one_owner_cannot_halt_a_good_rollout_of_many_owners(start_server, archives):
    server, _ = staged(start_server, archives, 100)
    sybils, honest = owners_fleet(server, 20)
    with admin(server) as a:
        a.set_rollout(2, halt_below=0.8, halt_min_devices=3)
        for sybil in sybils:
            sybil.report(2, 100, IDLE, health=health(2, -1.0))
        for k, device in enumerate(honest):
            device.report(2, 100, IDLE, health=health(2, 0.9))
            assert a.rollout_status(2).state == "staged", f"after {k + 1} honest owners reported"
        status = a.rollout_status(2)
    assert sum(s.health.devices for s in status.stages) == 23 and not status.halt_reason


def test_three_devices_of_one_owner_cannot_mask_a_bad_rollout_of_many_owners(start_server, archives):
    server, _ = staged(start_server, archives, 100)
    sybils, honest = owners_fleet(server, 20)
    with admin(server) as a:
        a.set_rollout(2, halt_below=0.8, halt_min_devices=3)
        for sybil in sybils:
            sybil.report(2, 100, IDLE, health=health(2, 1.0))
        honest[0].report(2, 100, IDLE, health=health(2, 0.3))
        assert a.rollout_status(2).state == "staged"  # two owners' votes: fewer than 3
        honest[1].report(2, 100, IDLE, health=health(2, 0.3))
        status = a.rollout_status(2)
    assert status.state == "halted"
    assert "median mean_cosine 0.3000 of 3 owners' votes (5 reporting devices" in status.halt_reason


def test_the_report_limit_counts_every_replica(start_replicas, archives):
    replicas = start_replicas(3, "--max-reports-per-minute", "10")
    with FctkitClient(replicas[0].target, ADMIN_TOKEN) as a:
        a.publish_bundle(archives[1])
    _, enrolment = enrolled_client(replicas[0])
    clients = [FctkitClient(r.target, enrolment.token) for r in replicas]
    outcomes = []
    for k in range(90):
        try:
            clients[k % 3].report(1, 10, IDLE)
            outcomes.append("OK")
        except Exception as exc:
            outcomes.append(getattr(exc, "code", repr(exc)))
    for client in clients:
        client.close()
    assert outcomes.count("OK") == 10 and outcomes.count("RESOURCE_EXHAUSTED") == 80


def test_the_report_window_slides_by_the_second(tmp_path, open_storage):
    storage = open_storage(tmp_path / "data")
    try:
        assert [storage.admit_report("dev-a", 1000.5 + k, 3) for k in range(3)] == [None, None, None]
        assert storage.admit_report("dev-a", 1060.0, 3) == 1.0  # the report at 1000.5 counts until 1061
        assert storage.admit_report("dev-b", 1060.0, 3) is None  # per device
        assert storage.admit_report("dev-a", 1061.0, 3) is None
        assert storage.admit_report("dev-a", 1061.9, 3) is not None
    finally:
        storage.close()


def test_a_schema_11_database_gets_the_report_counts(tmp_path, open_storage, backend):
    data_dir = tmp_path / "data"
    storage = backend.aged(data_dir, open_storage, 11, "DROP TABLE report_counts", versions=(1,))
    try:
        assert storage.admit_report("dev-a", 5.0, 1) is None and storage.admit_report("dev-a", 6.0, 1) is not None
    finally:
        storage.close()
    if backend.name == "sqlite":
        assert backend.query(data_dir, "PRAGMA user_version") == [(SCHEMA_VERSION,)]

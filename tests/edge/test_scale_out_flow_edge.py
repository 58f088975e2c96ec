"""Issue 21's acceptance flow on two `fctkit serve` replicas over a real PostgreSQL and a real S3
endpoint (moto): publish v1 on replica 1; a device enrols through replica 2, adds a gallery and
syncs; a second device of the same owner joins through replica 1 and pulls the gallery; v2 is
published on replica 2; both devices upgrade and answer queries identically. Then the devices
are given both addresses: with replica 2 killed, they still sync through replica 1."""

from __future__ import annotations

import functools

import numpy as np

from fctkit.edge_runtime import Device
from tests.edge.conftest import enrolment_code, publish
from tests.edge.test_replication_edge import state
from tests.server.conftest import scale_out, start_replicas  # noqa: F401 (fixtures)


def _enrol(device: Device, replica, owner: str, name: str) -> None:
    device.enrol(replica.target, enrolment_code(replica, owner=owner), device_name=name)


def test_two_replicas_serve_the_whole_flow_and_devices_fail_over(
    start_replicas,  # noqa: F811 (a pytest fixture, imported from tests/server/conftest.py)
    make_device,
    tiny_bundles,
    images,
    tmp_path,
):
    make = functools.partial(make_device, batch_size=8, health_sample=0)  # no health check: the rows stay adapted
    first, second = start_replicas(2)
    publish(first, tiny_bundles[1], tmp_path)

    phone = make("phone")
    _enrol(phone, second, "family", "phone")
    assert phone.sync().installed_after == 1
    phone.add(images(12, seed=3), item_ids=[f"photo-{k}" for k in range(12)], labels=["holiday"] * 12)
    phone.sync()
    key_file = phone.export_owner_key(tmp_path / "family.owner-key", "correct horse")

    tablet = make("tablet", owner_key_file=key_file, owner_key_passphrase="correct horse")
    _enrol(tablet, first, "family", "tablet")
    tablet.sync()
    assert state(tablet) == state(phone) and len(state(phone)) == 12

    publish(second, tiny_bundles[2], tmp_path)
    assert phone.sync().installed_after == 2 and tablet.sync().installed_after == 2
    for device in (phone, tablet):
        device.sync()  # each pulls what the other pushed after upgrading
    assert state(tablet) == state(phone)
    assert {tag for tag, *_ in state(phone).values()} == {"v1->v2 (forward)"}
    queries = images(4, seed=99)
    answers = [
        [[(m.item_id, round(m.distance, 5)) for m in row] for row in d.query(queries, k=5)] for d in (phone, tablet)
    ]
    assert answers[0] == answers[1] and all(len(row) == 5 for row in answers[0])

    # both addresses: one replica killed outright, the devices carry on through the other
    for device in (phone, tablet):
        device.use_servers(f"{first.target},{second.target}")
    second.process.kill()
    second.process.wait()
    phone.add(images(3, seed=7), item_ids=["late-0", "late-1", "late-2"], labels=["late"] * 3)
    phone.sync()
    tablet.sync()
    assert state(tablet) == state(phone) and len(state(phone)) == 15
    assert np.isfinite(np.asarray([m.distance for row in tablet.query(queries, k=3) for m in row])).all()

"""The issue's acceptance scenario with the digits release (real models, real server on loopback):
two devices of one owner add the evaluation images concurrently while one of them upgrades to
v2; after syncing, their decrypted galleries are identical and answer queries identically; a
wiped device restores the identical gallery from the owner key alone, with nothing re-embedded;
the server's data directory holds none of the gallery's float32 vectors."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import numpy as np
import pytest

from fctkit.edge_runtime import Device, DeviceSettings
from tests.edge.conftest import ServerProcess, enrolment_code, publish
from tests.edge.test_replication_edge import state
from tests.support.releases import digits_release, shared_folder

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    return digits_release(Path(os.environ.get("FCTKIT_TEST_RELEASE_CACHE") or shared_folder(tmp_path_factory)))


def test_owner_devices_converge_restore_and_leave_no_vector_on_the_server(release, tmp_path, admin_token_file):
    server = ServerProcess(tmp_path / "data", release.public_key_path, admin_token_file).start()
    opened: list[Device] = []

    def device(name: str, **init) -> Device:
        made = Device.init(tmp_path / name, settings=DeviceSettings(batch_size=64), **init)
        made.progress = False
        made.enrol(server.target, enrolment_code(server, owner="grace"), device_name=name, trust_on_first_use=True)
        opened.append(made)
        return made

    try:
        publish(server, release.bundle_dirs[1], tmp_path)
        phone = device("phone")
        phone.sync()
        key_file = phone.export_owner_key(tmp_path / "grace.key", "grace's passphrase")
        tablet = device("tablet", owner_key_file=key_file, owner_key_passphrase="grace's passphrase")
        tablet.sync()
        images, labels = release.eval_features["images"], release.eval_features["labels"]
        halves = np.array_split(np.arange(len(labels)), 2)
        errors: list[BaseException] = []

        def adding(member: Device, rows: np.ndarray, upgrade: bool) -> None:
            try:
                for step, part in enumerate(np.array_split(rows, 4)):
                    member.add(images[part], item_ids=[f"img{i}" for i in part], labels=[str(labels[i]) for i in part])
                    if upgrade and step == 1:
                        publish(server, release.bundle_dirs[2], tmp_path)
                    member.sync()
            except BaseException as exc:
                errors.append(exc)

        threads = [
            threading.Thread(target=adding, args=(phone, halves[0], False)),
            threading.Thread(target=adding, args=(tablet, halves[1], True)),
        ]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=600)
        assert not errors, errors
        for _ in range(2):
            phone.sync()
            tablet.sync()
        expected = state(phone)
        assert len(expected) == len(labels) and state(tablet) == expected
        assert phone.version == tablet.version == 2
        assert {tag for tag, *_ in expected.values()} <= {"v1->v2 (forward)", "v2"}
        queries = images[:50]
        assert [[m.item_id for m in q] for q in phone.query(queries, k=3)] == [
            [m.item_id for m in q] for q in tablet.query(queries, k=3)
        ]

        restored = device("new-phone", owner_key_file=key_file, owner_key_passphrase="grace's passphrase")
        restored.sync()
        assert state(restored) == expected and restored.status()["replica"]["unpushed"] == 0

        on_disk = b"".join(p.read_bytes() for p in server.data_dir.rglob("*") if p.is_file())
        for _, embedding, side_info, _ in expected.values():
            assert embedding not in on_disk and side_info not in on_disk
    finally:
        for member in opened:
            member.close()
        server.stop()

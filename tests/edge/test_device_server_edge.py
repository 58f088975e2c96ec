"""Devices against a real server on loopback (tiny bundles): enrol, add with sealed uploads,
the CLI with torch blocked, sync/upgrade hop by hop and by a direct adapter, an offline
outbox, and fleet reports."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fctkit.edge_runtime import Device
from fctkit.protos.bundle import pack_bundle
from fctkit.protos.client import ClientTls, FctkitClient
from tests.edge.conftest import ADMIN_TOKEN, ServerProcess, device_cli, device_cli_steps, enrolment_code, publish
from tests.server.conftest import make_certificates


def _all_server_bytes(server) -> bytes:
    return b"".join(p.read_bytes() for p in server.data_dir.rglob("*") if p.is_file())


@pytest.fixture(scope="module")
def published_v1(edge_server, tiny_bundles, tmp_path_factory):
    publish(edge_server, tiny_bundles[1], tmp_path_factory.mktemp("archives"))
    return edge_server


def test_cli_device_without_torch(published_v1, tmp_path, images):
    server, root = published_v1, tmp_path / "cli-dev"
    pictures = (images(6, seed=21) * 1000).astype(np.float32)
    np.savez(
        tmp_path / "add.npz",
        images=pictures,
        labels=np.array(list("abcdef")),
        ids=np.array([f"c{i}" for i in range(6)]),
    )
    np.save(tmp_path / "q.npy", pictures[:2])
    steps = [
        ("init", "--dir", str(root), "--batch-size", "4"),
        (
            "enrol",
            "--dir",
            str(root),
            "--server",
            server.target,
            "--code",
            enrolment_code(server),
            "--name",
            "cli",
            "--trust-on-first-use",
        ),
        ("sync", "--dir", str(root), "--quiet"),
        ("add", "--dir", str(root), str(tmp_path / "add.npz")),
        ("query", "--dir", str(root), str(tmp_path / "q.npy"), "-k", "1"),
        ("status", "--dir", str(root)),
    ]
    outputs = device_cli_steps(steps)
    assert json.loads(outputs[2])["installed_after"] == 1
    assert json.loads(outputs[3]) == {"added": 6, "skipped": [], "rows": 6, "queued_uploads": 0}
    assert [json.loads(line)[0]["item_id"] for line in outputs[4].splitlines()] == ["c0", "c1"]
    assert json.loads(outputs[4].splitlines()[0])[0]["label"] == "a"
    status = json.loads(outputs[5])
    assert status["installed_version"] == 1 and status["provider"] == "CPUExecutionProvider"
    # the sealed originals are in the vault; the image bytes are nowhere on the server's disk
    on_disk = _all_server_bytes(server)
    for picture in pictures:
        assert picture.tobytes() not in on_disk
    bad = device_cli("query", "--dir", str(tmp_path / "missing"), str(tmp_path / "q.npy"))
    assert bad.returncode == 2 and "fctkit device init" in bad.stderr


def test_sync_upgrade_paths_outbox_and_fleet(published_v1, tiny_bundles, tmp_path, images, make_device):
    server = published_v1
    # no health check (tests/edge/test_upgrade_check_edge.py): it would backfill every row of these small galleries
    early, late = (
        make_device("early", batch_size=5, health_sample=0),
        make_device("late", batch_size=5, health_sample=0),
    )
    for seed, (name, device) in enumerate((("early", early), ("late", late))):
        device.enrol(server.target, enrolment_code(server), device_name=name)
        assert device.sync().installed_after == 1
        device.add(images(12, seed=seed), item_ids=[f"{name}{i}" for i in range(12)])
    with FctkitClient(server.target, (early.root / "token").read_text()) as client:
        assert len(client.list_blobs()) == 12
    # offline: the sealed original waits in the outbox, nothing is lost, the next sync uploads it
    server.stop()
    early.add(images(2, seed=99), item_ids=["offline0", "offline1"])
    assert early.gallery.replica_log.outbox_size() == 2
    server.start()
    original = early.fetch_original("early0")
    np.testing.assert_array_equal(original, images(12, seed=0)[0])

    publish(server, tiny_bundles[2], tmp_path)
    result = early.sync()
    assert (result.installed_before, result.installed_after, result.hops, result.uploaded) == (1, 2, "v1 -> v2", 2)
    assert early.status()["rows_by_space"] == {"v1->v2 (forward)": 14}
    np.testing.assert_array_equal(early.fetch_original("offline1"), images(2, seed=99)[1])

    publish(server, tiny_bundles[3], tmp_path)
    deferred = late.sync(upgrade=False)  # downloaded and verified, gallery left as it is
    assert (deferred.installed_after, deferred.hops, deferred.rows_upgraded) == (1, "v1 -> v3", 0)
    assert (late.root / "bundles" / "v3").is_dir() and late.status()["rows_by_space"] == {"v1": 12}
    assert late.sync().hops == "v1 -> v3"  # skipped v2: the planned direct adapter
    assert early.sync().hops == "v2 -> v3"
    # the late device's rows went through h_{1->3}: the same as the direct graph on its v1 rows
    assert late.status()["rows_by_space"] == {"v1->v3 (forward)": 12}
    assert early.status()["rows_by_space"] == {"v1->v3 (forward)": 14}
    with FctkitClient(server.target, ADMIN_TOKEN) as admin:
        fleet = {d.name: d for d in admin.list_devices()}
    assert fleet["early"].version == 3 and fleet["early"].gallery_size == 14
    assert fleet["late"].version == 3 and fleet["late"].gallery_size == 12


def test_enrolment_refuses_a_server_with_another_publisher_key(published_v1, tmp_path):
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from fctkit.errors import DeviceError
    from fctkit.export.keys import save_public_key

    other = save_public_key(Ed25519PrivateKey.from_private_bytes(bytes(32)).public_key(), tmp_path / "other.pub")
    device = Device.init(tmp_path / "pinned", publisher_key=other)
    with pytest.raises(DeviceError, match="differs"):
        device.enrol(published_v1.target, enrolment_code(published_v1))
    assert not (device.root / "token").exists()
    device.close()


def test_watch_syncs_when_a_version_is_published(edge_server, publisher_key, tmp_path, images, make_device):
    import threading

    from tests.edge.conftest import make_tiny_bundle

    server = edge_server
    device = make_device("watcher", batch_size=4)
    device.enrol(server.target, enrolment_code(server), device_name="watcher")
    device.sync()
    start = device.version
    device.add(images(6, seed=31))
    results = []
    watcher = threading.Thread(target=lambda: results.extend(device.watch(max_versions=1)), daemon=True)
    watcher.start()
    next_version = start + 1
    publish(
        server, make_tiny_bundle(tmp_path / "next", publisher_key, next_version, ((start, next_version),)), tmp_path
    )
    watcher.join(timeout=60)
    assert not watcher.is_alive() and results[0].installed_after == next_version
    assert device.version == next_version and len(device.gallery.load()) == 6


def test_a_device_enrols_and_syncs_with_a_client_certificate(tmp_path, tiny_bundles, publisher_pub, admin_token_file):
    pki = make_certificates(tmp_path / "pki")
    server = ServerProcess(
        tmp_path / "mtls-data",
        publisher_pub,
        admin_token_file,
        "--tls-cert",
        str(pki["server"]),
        "--tls-key",
        str(pki["server_key"]),
        "--tls-ca",
        str(pki["ca"]),
    ).start()
    try:
        tls = ClientTls(pki["ca"].read_bytes(), pki["client"].read_bytes(), pki["client_key"].read_bytes())
        with FctkitClient(server.target, ADMIN_TOKEN, tls=tls) as admin:
            admin.publish_bundle(pack_bundle(tiny_bundles[1], tmp_path / "v1.tar"))
            codes = [admin.create_enrolment_code().code for _ in range(2)]
        root, ca = tmp_path / "dev", ["--tls-ca", str(pki["ca"])]
        enrol = (
            "enrol",
            "--dir",
            str(root),
            "--server",
            server.target,
            "--code",
            codes[0],
            "--trust-on-first-use",
            *ca,
        )
        device_cli_steps([("init", "--dir", str(root))])
        without_certificate = device_cli(*enrol)
        assert without_certificate.returncode == 2 and "UNAVAILABLE" in without_certificate.stderr
        assert "if it requires client certificates" in without_certificate.stderr
        assert "Traceback" not in without_certificate.stderr
        identity = ("--tls-cert", str(pki["client"]), "--tls-key", str(pki["client_key"]))
        outputs = device_cli_steps([(*enrol, *identity), ("sync", "--dir", str(root), "--quiet")])
        assert json.loads(outputs[1])["installed_after"] == 1  # the certificate paths were kept for sync
        settings = json.loads((root / "device.json").read_text())
        assert settings["tls_client_cert"] == str(pki["client"]) and settings["tls_client_key"] == str(
            pki["client_key"]
        )
    finally:
        server.stop()

"""Acceptance on real models: the tiny digits chain release (v1, v2 with h2+g2, v3 with h3
and a direct h13) served by a real server on loopback. Two devices enrol at v1, add the
evaluation images (sealed originals in the vault, no plaintext on the server's disk), sync
to v2 and v3 hop by hop; a third device that skipped v2 takes the direct 1->3 path. Each
device's top-1 after upgrading equals the trainer's figure for the same rows, computed with
the run's own (torch) adapters, within 0.5 point."""

from __future__ import annotations

import numpy as np
import pytest

from fctkit.edge_runtime import Device, DeviceSettings
from fctkit.protos.client import FctkitClient
from tests.edge.conftest import ServerProcess, enrolment_code, publish
from tests.support.releases import UNIFIED_METHOD, digits_release, shared_folder, unified_override

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    return digits_release(shared_folder(tmp_path_factory))


@pytest.fixture(scope="module")
def release_server(tmp_path_factory, release, admin_token_file):
    root = tmp_path_factory.mktemp("digits-server")
    server = ServerProcess(root / "data", release.public_key_path, admin_token_file).start()
    yield server
    if server.alive():
        server.stop()


def _device_top1(device: Device, images: np.ndarray, item_ids: list[str], labels: np.ndarray) -> float:
    """Leave-one-out top-1 through the device: each image queries the gallery, its own row excluded."""
    hits = 0
    for item_id, label, matches in zip(item_ids, labels, device.query(images, k=2), strict=True):
        nearest = next(m for m in matches if m.item_id != item_id)
        hits += nearest.label == str(label)
    return hits / len(item_ids)


def _reference_top1(release, rows: np.ndarray, path: str) -> float:
    """The trainer's figure for the same rows, with the run's torch adapters."""
    from fctkit.export.trained_run import TrainedRun
    from fctkit.trainer.evaluation import evaluate_retrieval

    run, f = TrainedRun.open(release.run_dir), release.eval_features
    old, side = f["v1_embedding"][rows], f["v1_side"][rows]
    h2, g2, h3, h13 = (run.load(f"adapters/chain_{n}.pt") for n in ("h2", "g2", "h3", "h13"))
    gallery, query = {
        "v1->v2": (lambda: h2.transform(old, side), "v2_embedding"),
        "v1->v2->v3": (lambda: h3.transform(h2.transform(old, side), g2.transform(old, side)), "v3_embedding"),
        "v1->v3": (lambda: h13.transform(old, side), "v3_embedding"),
    }[path]
    labels = f["labels"][rows]
    return evaluate_retrieval(f[query][rows], labels, gallery(), labels, distance=run.distance, leave_one_out=True).top1


def test_devices_upgrade_digits_release_to_the_trainers_figures(release, release_server, tmp_path):
    server, features = release_server, release.eval_features
    images, labels = features["images"], features["labels"]
    n = len(labels)
    shares = {"a": np.arange(0, n // 2), "b": np.arange(n // 2, n), "c": np.arange(n)}
    publish(server, release.bundle_dirs[1], tmp_path)
    devices: dict[str, Device] = {}
    for name, rows in shares.items():
        device = Device.init(
            tmp_path / name, settings=DeviceSettings(batch_size=128, health_sample=0)
        )  # adapted rows only
        device.progress = False
        device.enrol(server.target, enrolment_code(server, name), device_name=name, trust_on_first_use=True)
        assert device.sync().installed_after == 1
        device.add(images[rows], item_ids=[f"{name}-{i}" for i in rows], labels=[str(x) for x in labels[rows]])
        devices[name] = device
        with FctkitClient(server.target, (device.root / "token").read_text()) as client:
            assert len(client.list_blobs()) == len(rows)
    on_disk = b"".join(p.read_bytes() for p in server.data_dir.rglob("*") if p.is_file())
    assert not any(image.tobytes() in on_disk for image in images)
    assert not any(np.asarray(image, dtype=np.float32).tobytes() in on_disk for image in images)

    publish(server, release.bundle_dirs[2], tmp_path)
    for name in ("a", "b"):
        result = devices[name].sync()
        assert (result.installed_after, result.hops, result.rows_upgraded) == (2, "v1 -> v2", len(shares[name]))
        ids = [f"{name}-{i}" for i in shares[name]]
        got = _device_top1(devices[name], images[shares[name]], ids, labels[shares[name]])
        assert got == pytest.approx(_reference_top1(release, shares[name], "v1->v2"), abs=0.005)

    publish(server, release.bundle_dirs[3], tmp_path)
    expectations = {"a": ("v2 -> v3", "v1->v2->v3"), "c": ("v1 -> v3", "v1->v3")}
    for name, (hops, path) in expectations.items():
        result = devices[name].sync()
        assert (result.installed_after, result.hops) == (3, hops)
        ids = [f"{name}-{i}" for i in shares[name]]
        got = _device_top1(devices[name], images[shares[name]], ids, labels[shares[name]])
        assert got == pytest.approx(_reference_top1(release, shares[name], path), abs=0.005)
    assert devices["c"].status()["rows_by_space"] == {"v1->v3 (forward)": n}
    np.testing.assert_array_equal(devices["c"].fetch_original("c-5"), images[5])
    for device in devices.values():
        device.close()


def test_unified_lambda_orth_release_answers_b_new_against_f_old(release, tmp_path):
    """Unified mode on real models: the run's λ-orth (relaxed) adapters exported as v1/v2;
    the device rewrites its rows with F and answers with B(φ2(query)), matching the
    trainer's B(new)/F(old) figure on the same (all) evaluation rows."""
    import json

    from fctkit.export.keys import load_private_key
    from fctkit.export.release import build_release

    method = UNIFIED_METHOD
    build_release(
        release.run_dir,
        tmp_path / "unified",
        private_key=load_private_key(release.private_key_path),
        method=method,
        **unified_override(release.run_dir),
    )
    images, labels = release.eval_features["images"], release.eval_features["labels"]
    device = Device.init(
        tmp_path / "device", publisher_key=release.public_key_path, settings=DeviceSettings(batch_size=128)
    )
    device.progress = False
    device.upgrade(tmp_path / "unified" / "v1")
    ids = [f"u-{i}" for i in range(len(labels))]
    device.add(images, item_ids=ids, labels=[str(x) for x in labels])
    before = _device_top1(device, images, ids, labels)
    assert device.upgrade(tmp_path / "unified" / "v2") == len(labels)
    status = device.status()
    assert status["mode"] == "unified" and status["rows_by_space"] == {"v1->v2 (forward)": len(labels)}
    got = _device_top1(device, images, ids, labels)
    gate = json.loads((release.run_dir / "gate.json").read_text())["cases"]
    assert before == pytest.approx(gate["old/old"]["top1"], abs=0.005)
    assert got == pytest.approx(gate[method]["top1"], abs=0.005)
    device.close()

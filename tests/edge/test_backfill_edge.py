"""Partial backfill on devices against a real loopback server, with the tiny digits release.

Devices enrol at v1, add the evaluation images (sealed originals in the vault), upgrade to
v2 (rows adapted by h2), then backfill 30% of their rows from the vault: the class-mean
ordering's first 30% gives a top-1 at least that of a random 30%, and both at least the
adapted-only gallery; backfilled rows are tagged native. A backfill interrupted after a
batch (exception) or SIGKILLed mid-run resumes its recorded plan without redoing rows and
ends with the same gallery as an uninterrupted one. FastFill σ orders rows when the bundle
ships an uncertainty graph (σ recorded at upgrade time)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from fctkit.edge_runtime import Device, DeviceSettings
from fctkit.errors import InputError
from tests.edge.conftest import ServerProcess, device_cli, enrolment_code, publish
from tests.support.releases import digits_release, shared_folder

pytestmark = pytest.mark.slow
FRACTION = 0.3
CRASH_ROWS = slice(0, 360)


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    # FCTKIT_TEST_RELEASE_CACHE: a folder kept between runs (the release build takes minutes on busy cores)
    return digits_release(Path(os.environ.get("FCTKIT_TEST_RELEASE_CACHE") or shared_folder(tmp_path_factory)))


@pytest.fixture(scope="module")
def server(tmp_path_factory, release, admin_token_file):
    root = tmp_path_factory.mktemp("backfill-server")
    process = ServerProcess(root / "data", release.public_key_path, admin_token_file).start()
    archives = root / "archives"
    archives.mkdir()
    publish(process, release.bundle_dirs[1], archives)
    yield process
    if process.alive():
        process.stop()


def _enrolled_v1_device(
    server, release, root, name: str, rows: slice = slice(None)
) -> tuple[Device, np.ndarray, list[str], np.ndarray]:
    features = release.eval_features
    images, labels = features["images"][rows], features["labels"][rows]
    device = Device.init(
        root / name, settings=DeviceSettings(batch_size=128, health_sample=0)
    )  # no health sample: the backfill alone re-embeds rows
    device.progress = False
    device.enrol(server.target, enrolment_code(server, name), device_name=name, trust_on_first_use=True)
    assert device.sync().installed_after == 1
    ids = [f"{name}-{i}" for i in range(len(labels))]
    device.add(images, item_ids=ids, labels=[str(x) for x in labels])
    return device, images, ids, labels


def _top1(device: Device, images: np.ndarray, ids: list[str], labels: np.ndarray) -> float:
    hits = 0
    for item_id, label, matches in zip(ids, labels, device.query(images, k=2), strict=True):
        hits += next(m for m in matches if m.item_id != item_id).label == str(label)
    return hits / len(ids)


@pytest.fixture(scope="module")
def upgraded(server, release, tmp_path_factory):
    """v1 devices upgraded to v2 (adapted rows): two with the whole evaluation split, three
    (for the crash tests) with its first half."""
    root = tmp_path_factory.mktemp("backfill-devices")
    made = {name: _enrolled_v1_device(server, release, root, name) for name in ("cm", "rnd")}
    made |= {name: _enrolled_v1_device(server, release, root, name, CRASH_ROWS) for name in ("crash", "ref", "killed")}
    publish(server, release.bundle_dirs[2], tmp_path_factory.mktemp("archives-v2"))
    for device, *_ in made.values():
        assert device.sync().installed_after == 2
    yield made
    for device, *_ in made.values():
        device.close()


def test_class_mean_beats_random_beats_adapted(upgraded):
    device, images, ids, labels = upgraded["cm"]
    budget = int(FRACTION * len(ids))
    adapted = _top1(device, images, ids, labels)
    assert device.status()["rows_by_space"] == {"v1->v2 (forward)": len(ids)}

    result = device.backfill(budget, order="class-mean-l2")
    assert (result.planned, result.backfilled, result.skipped, result.order) == (budget, budget, 0, "class-mean-l2")
    assert result.bytes_downloaded > budget * images[0].nbytes  # sealed originals: at least the image bytes each
    assert device.status()["rows_by_space"] == {"v1->v2 (forward)": len(ids) - budget, "v2": budget}
    class_mean = _top1(device, images, ids, labels)

    rnd, _, rnd_ids, _ = upgraded["rnd"]
    assert rnd.backfill(budget, order="random", seed=3).backfilled == budget
    random_top1 = _top1(rnd, images, rnd_ids, labels)
    assert class_mean >= random_top1 >= adapted
    assert class_mean > adapted

    # the command line, in an interpreter where importing torch fails
    cli = device_cli("backfill", "--dir", str(rnd.root), "--budget", "5", "--order", "kmeans", "--quiet")
    assert cli.returncode == 0, cli.stderr
    assert json.loads(cli.stdout)["backfilled"] == 5 and json.loads(cli.stdout)["order"] == "kmeans"
    assert rnd.status()["rows_by_space"]["v2"] == budget + 5
    blob_bytes = result.bytes_downloaded // budget  # every sealed 8x8 original has the same size
    by_bytes = rnd.backfill(budget_bytes=3 * blob_bytes + blob_bytes // 2, order="random")
    assert (by_bytes.backfilled, by_bytes.bytes_downloaded) == (3, 3 * blob_bytes)

    # a second backfill with the same budget takes the next rows: none is redone
    again = device.backfill(budget, order="class-mean-l2")
    assert again.backfilled == budget
    assert device.status()["rows_by_space"]["v2"] == 2 * budget


@pytest.fixture(scope="module")
def reference(upgraded):
    """The crash tests' uninterrupted backfill (class-mean-l2, 30%) and its decrypted gallery."""
    device, _, ids, _ = upgraded["ref"]
    budget = int(FRACTION * len(ids))
    assert device.backfill(budget, order="class-mean-l2", batch_size=50).backfilled == budget
    return device.gallery.load()


def _assert_same_gallery(device: Device, reference) -> None:
    mine = device.gallery.load()
    assert [str(t) for t in mine.tags] == [str(t) for t in reference.tags]
    np.testing.assert_allclose(mine.embeddings, reference.embeddings, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(mine.side_infos, reference.side_infos, rtol=1e-5, atol=1e-6)


def test_interrupted_backfill_resumes_without_redoing_rows(upgraded, reference):
    device, _images, ids, _labels = upgraded["crash"]
    budget = int(FRACTION * len(ids))
    batches = []

    def crash_after_two(rows: int) -> None:
        batches.append(rows)
        if len(batches) == 2:
            raise KeyboardInterrupt("injected crash after the second committed batch")

    with pytest.raises(KeyboardInterrupt):
        device.backfill(budget, order="class-mean-l2", batch_size=16, on_batch=crash_after_two)
    assert device.status()["rows_by_space"]["v2"] == 32
    # the recorded plan wins over a new budget or order: the same rows, the rest of them
    resumed = device.backfill(5, order="random", batch_size=16)
    assert (resumed.planned, resumed.skipped, resumed.backfilled, resumed.order) == (
        budget,
        32,
        budget - 32,
        "class-mean-l2",
    )

    _assert_same_gallery(device, reference)


_KILLED_BACKFILL = """
import sys
from fctkit.edge_runtime import Device
device = Device.open(sys.argv[1])
device.progress = False
def slow(rows):
    print("batch", flush=True)
device.backfill(int(sys.argv[2]), order="class-mean-l2", batch_size=8, on_batch=slow)
print("done", flush=True)
"""


def test_sigkilled_backfill_resumes_to_the_same_gallery(upgraded, reference):
    killed, _images, ids, _labels = upgraded["killed"]
    budget = int(FRACTION * len(ids))
    killed.close()
    for kill_after in (1, 3, 6):  # SIGKILL after this many committed batches of the run
        process = subprocess.Popen(
            [sys.executable, "-c", _KILLED_BACKFILL, str(killed.root), str(budget)],
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=True,
        )
        seen = 0
        for line in process.stdout:
            seen += line.startswith("batch")
            if seen >= kill_after or line.startswith("done"):
                break
        os.killpg(process.pid, signal.SIGKILL)
        process.wait()
    killed = Device.open(killed.root)
    killed.progress = False
    native_before = killed.status()["rows_by_space"].get("v2", 0)
    assert 0 < native_before <= budget
    finished = killed.backfill()  # no budget: resumes the recorded plan
    assert finished.skipped == native_before and finished.backfilled == budget - native_before
    _assert_same_gallery(killed, reference)
    killed.close()


def test_fastfill_sigma_orders_the_backfill(release, tmp_path_factory, admin_token_file):
    """A FastFill release (σ graph 1->2) on a second server: σ is recorded at the upgrade and
    the uncertainty ordering takes the rows of largest σ first."""
    from fctkit.export.keys import load_private_key
    from fctkit.export.release import build_release

    root = tmp_path_factory.mktemp("fastfill")
    bundles = build_release(
        release.run_dir, root / "bundles", private_key=load_private_key(release.private_key_path), method="fastfill"
    )
    process = ServerProcess(root / "data", release.public_key_path, admin_token_file).start()
    try:
        publish(process, bundles[0].bundle.root, root)
        features = release.eval_features
        images, labels = features["images"], features["labels"]
        device = Device.init(
            root / "dev", settings=DeviceSettings(batch_size=128, health_sample=0)
        )  # no health sample: the backfill alone re-embeds rows
        device.progress = False
        device.enrol(process.target, enrolment_code(process), device_name="ff", trust_on_first_use=True)
        device.sync()
        ids = [f"ff-{i}" for i in range(len(labels))]
        device.add(images, item_ids=ids, labels=[str(x) for x in labels])
        old = device.gallery.load()
        publish(process, bundles[1].bundle.root, root)
        assert device.sync().installed_after == 2
        from fctkit.edge_runtime.backfill import recorded_uncertainty

        sigma = recorded_uncertainty(device.parts, 2, old.row_ids)
        engine = device.engine()
        graph = engine.manifest.artifact("uncertainty")
        expected = engine.run(graph, old.embeddings, old.side_infos).reshape(len(ids), -1).mean(axis=1)
        np.testing.assert_allclose(sigma, expected, rtol=1e-5)
        budget = 20
        result = device.backfill(budget)  # default order: the bundle ships σ
        assert result.order == "uncertainty"
        native = {r for r, t in zip(device.gallery.load().item_ids, device.gallery.load().tags) if t.via == "native"}
        top = {old.item_ids[i] for i in np.argsort(-sigma, kind="stable")[:budget]}
        assert native == top
        with pytest.raises(InputError, match="budget"):
            device.backfill()
        device.close()
    finally:
        process.stop()

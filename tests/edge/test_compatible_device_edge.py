"""A compatible backbone (BT², trained on digits) published as two bundles in mode
"compatible" and deployed to a device through a real server on loopback: the upgrade switches
the query model and leaves every gallery row's bytes as they were; queries, truncated to the
old-compatible prefix against the old rows, get better or hold."""

from __future__ import annotations

import dataclasses
import json
import shutil
import sqlite3

import numpy as np
import pytest
import torch

from fctkit.config import from_mapping
from fctkit.errors import BundleFormatError, GateError, SignatureError
from fctkit.export.compatible_release import export_compatible_release
from fctkit.protos.bundle import MANIFEST_FILE, Manifest, verify_bundle
from fctkit.trainer.backbones import extract_features
from fctkit.trainer.compatible_config import CompatibleConfig
from fctkit.trainer.compatible_models import load_compatible_model
from fctkit.trainer.run_data import load_image_splits
from tests.edge.conftest import enrolment_code, publish
from tests.support.compatible_run import digits_compatible_run
from tests.support.releases import shared_folder

GALLERY, QUERIES = 360, 200


@pytest.fixture(scope="module")
def compatible_run(tmp_path_factory):
    return digits_compatible_run(shared_folder(tmp_path_factory))


@pytest.fixture(scope="module")
def bt2_release(compatible_run, publisher_key, tmp_path_factory):
    out = tmp_path_factory.mktemp("bt2-release")
    return export_compatible_release(compatible_run, out, private_key=publisher_key, method="bt2")


@pytest.fixture(scope="module")
def digits_eval(compatible_run):
    config = from_mapping(CompatibleConfig, json.loads((compatible_run / "config.json").read_text()))
    splits = load_image_splits(config)
    index = splits.evaluation
    return splits.images[index], splits.labels[index]


def _row_bytes(device) -> list[tuple]:
    """Every stored row of the gallery file as raw bytes: the sealed vectors (both tables) and
    the items (not their replication bookkeeping, which sync updates)."""
    selects = (
        "SELECT row_id, item_id, origin_version, label, vault_sha256 FROM items ORDER BY row_id",
        "SELECT * FROM vectors_0 ORDER BY row_id",
        "SELECT * FROM vectors_1 ORDER BY row_id",
    )
    with sqlite3.connect(f"file:{device.gallery.path}?mode=ro", uri=True) as db:
        return [row for select in selects for row in db.execute(select)]


def _top1(device, images, labels) -> float:
    found = device.query(images, k=1)
    return float(np.mean([hits[0].label == str(label) for hits, label in zip(found, labels, strict=True)]))


@pytest.mark.slow  # trains configs/digits-compatible.toml once per session (~40 s CPU)
def test_bt2_bundles_are_compatible_mode_with_a_signed_prefix(bt2_release, compatible_run, publisher_key, tmp_path):
    v1, v2 = (b.manifest for b in bt2_release)
    assert (v1.mode, v2.mode) == ("compatible", "compatible") and v2.parents == (1,)
    assert v1.compatible_prefix_dim is None and "compatible_prefix_dim" not in json.loads(bt2_release[0].manifest_bytes)
    assert (v2.embedding_dim, v2.compatible_prefix_dim, v2.compatible_dims) == (80, 32, 32)
    assert not any(a.role in ("forward", "backward") for a in v2.artifacts)
    gate = json.loads((compatible_run / "gate.json").read_text())
    assert v2.gate["cases"]["new/old"] == gate["cases"]["bt2"]["new/old"]
    # the prefix is covered by the signature: changing it breaks verification
    tampered = tmp_path / "v2"
    shutil.copytree(bt2_release[1].root, tampered)
    raw = (tampered / MANIFEST_FILE).read_bytes()
    (tampered / MANIFEST_FILE).write_bytes(raw.replace(b'"compatible_prefix_dim":32', b'"compatible_prefix_dim":16'))
    assert Manifest.from_bytes((tampered / MANIFEST_FILE).read_bytes()).compatible_prefix_dim == 16
    with pytest.raises(SignatureError):
        verify_bundle(tampered, publisher_key.public_key())


@pytest.mark.slow  # trains configs/digits-compatible.toml once per session (~40 s CPU)
def test_export_refuses_a_method_whose_ecc_failed(compatible_run, publisher_key, tmp_path):
    run = tmp_path / "run"
    shutil.copytree(compatible_run, run)
    gate = json.loads((run / "gate.json").read_text())
    gate["ecc"]["bct"] = False
    (run / "gate.json").write_text(json.dumps(gate))
    with pytest.raises(GateError, match="ECC does not hold for bct"):
        export_compatible_release(run, tmp_path / "out", private_key=publisher_key, method="bct")
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    with pytest.raises(GateError, match="needs a reason"):
        export_compatible_release(run, tmp_path / "out", private_key=publisher_key, method="bct", force=True)
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").iterdir())
    # forced with a reason: published, and the override is in v2's signed manifest
    v1, v2 = export_compatible_release(
        run, tmp_path / "out", private_key=publisher_key, method="bct", force=True, force_reason="pilot devices only"
    )
    assert v2.manifest.gate["ecc"] == {"embed": False} and v2.manifest.gate["forced"] is True
    assert v2.manifest.gate["force_reason"] == "pilot devices only" and v1.manifest.gate["forced"] is False


@pytest.mark.slow  # trains configs/digits-compatible.toml once per session (~40 s CPU)
def test_a_compatible_bundle_must_record_its_embed_gate(bt2_release, publisher_key, tmp_path):
    """The bundle format gates a compatible version's embed graph like an adapter: a v2 that
    records no ECC verdict for it (or a failed one without the override) is not a valid bundle."""
    v2 = bt2_release[1].manifest
    assert v2.gate["ecc"] == {"embed": True} and bt2_release[0].manifest.gate["ecc"] == {}
    for ecc in ({}, {"embed": False}):
        with pytest.raises(BundleFormatError, match="ECC does not hold for embed"):
            dataclasses.replace(v2, gate={**v2.gate, "ecc": ecc})


@pytest.mark.slow
def test_device_upgrade_through_compatible_bundle_keeps_rows_and_queries_hold(
    edge_server, bt2_release, compatible_run, digits_eval, make_device, tmp_path
):
    images, labels = digits_eval
    gallery_images, gallery_labels = images[:GALLERY], labels[:GALLERY]
    queries, query_labels = images[GALLERY : GALLERY + QUERIES], labels[GALLERY : GALLERY + QUERIES]
    publish(edge_server, bt2_release[0].root, tmp_path)
    device = make_device("compatible", batch_size=64)
    device.enrol(edge_server.target, enrolment_code(edge_server), device_name="compatible")
    assert device.sync().installed_after == 1
    device.add(gallery_images, item_ids=[f"g{i}" for i in range(GALLERY)], labels=[str(x) for x in gallery_labels])
    assert device.flush_outbox()[1] == 0  # originals in the vault: the items' upload records are final
    before_rows, before_top1 = _row_bytes(device), _top1(device, queries, query_labels)

    publish(edge_server, bt2_release[1].root, tmp_path)
    result = device.sync()
    assert result.installed_after == 2 and result.rows_upgraded == 0
    assert _row_bytes(device) == before_rows  # not one row rewritten
    after_top1 = _top1(device, queries, query_labels)
    assert after_top1 >= before_top1

    # the device answers exactly as the trainer's models do: v2's first 32 dims against v1's rows
    v1 = load_compatible_model(compatible_run / "models" / "upgrade" / "independent" / "v1.pt")
    v2 = load_compatible_model(compatible_run / "models" / "upgrade" / "bt2" / "v2.pt")
    with torch.no_grad():
        rows = extract_features(v1, gallery_images)
        asked = extract_features(v2, queries)[:, :32]
    rows /= np.linalg.norm(rows, axis=1, keepdims=True)
    asked /= np.linalg.norm(asked, axis=1, keepdims=True)
    expected = gallery_labels[np.argmax(asked @ rows.T, axis=1)]
    assert abs(after_top1 - float(np.mean(expected == query_labels))) <= 1.0 / QUERIES

    # rows added after the switch are native v2 (80-d); the mixed gallery is searched on the prefix
    device.add(queries[:5], item_ids=[f"n{i}" for i in range(5)], labels=[str(x) for x in query_labels[:5]])
    hits = device.query(queries[:5], k=1)
    assert [h[0].item_id for h in hits] == [f"n{i}" for i in range(5)]
    assert device.status()["rows_by_space"] == {"v1": GALLERY, "v2": 5}


def test_comparable_dims_follow_installed_compatible_parents():
    from types import SimpleNamespace

    from fctkit.edge_runtime.compatible_search import comparable_dims, compatible_rows
    from fctkit.errors import GalleryError

    def manifest(mode, parents, dim, prefix=None):
        return SimpleNamespace(mode=mode, parents=parents, embedding_dim=dim, compatible_dims=prefix or dim)

    installed = {
        1: manifest("compatible", (), 32),
        2: manifest("compatible", (1,), 80, 32),
        3: manifest("compatible", (2,), 96, 80),
        5: manifest("forward", (3,), 96),
    }
    assert comparable_dims(installed.get, 3) == {3: 96, 2: 80, 1: 32}
    assert comparable_dims(installed.get, 2) == {2: 80, 1: 32}
    assert comparable_dims(installed.get, 5) == {5: 96}  # a forward bundle searches its own rows only
    assert comparable_dims({3: installed[3], 1: installed[1]}.get, 3) == {3: 96}  # v2 not installed: the chain stops
    with pytest.raises(GalleryError, match="not installed"):
        comparable_dims(installed.get, 4)

    ragged = np.empty(4, dtype=object)
    ragged[:] = [np.arange(32.0), np.arange(80.0), np.arange(96.0), np.arange(96.0)]
    keep, vectors = compatible_rows([1, 2, 3, 5], ragged, comparable_dims(installed.get, 3))
    assert keep == [0, 1, 2] and vectors.shape == (3, 32)
    np.testing.assert_array_equal(vectors[2], np.arange(32.0))
    keep, vectors = compatible_rows([3, 3], np.ones((2, 96), np.float32), comparable_dims(installed.get, 3))
    assert vectors.shape == (2, 96)  # only the query version's rows: all dims
    short = np.empty(2, dtype=object)
    short[:] = [np.arange(16.0), np.arange(80.0)]
    with pytest.raises(GalleryError, match="fewer than the 32"):
        compatible_rows([1, 2], short, comparable_dims(installed.get, 3))

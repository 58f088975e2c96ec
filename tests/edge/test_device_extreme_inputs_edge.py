"""Extreme inputs on a device (issue 34, section 2): items that cannot be embedded to finite
vectors are refused by id before anything is stored, complex arrays are refused, queries of
any finite scale give the same answers, and an upgrade names the rows it cannot move."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from fctkit.edge_runtime.gallery.rows import NewRow, VersionTag
from fctkit.errors import GalleryError, InputError, ItemError
from fctkit.export.bundle_builder import build_bundle
from tests.server.conftest import IMAGE_DIM, _sources
from tests.support.device_damage import fctkit


@pytest.fixture
def device(make_device, tiny_bundles):
    device = make_device("extreme")
    device.upgrade(tiny_bundles[1])
    return device


@pytest.mark.parametrize("value", [3e38, 1e39, np.inf, np.nan])
def test_items_that_cannot_embed_to_finite_vectors_are_refused_by_id_before_anything_is_stored(device, images, value):
    batch = images(6, seed=1).astype(np.float64)
    batch[[2, 5], 3] = value
    ids = [f"x{i}" for i in range(6)]
    with pytest.raises(ItemError, match=r"2 item\(s\) cannot be embedded, nothing was added: 'x2' .*; 'x5' "):
        device.add(batch, item_ids=ids, upload=False)
    assert len(device.gallery) == 0 and device.gallery.replica_log.outbox_size() == 0
    added = device.add_items(batch, item_ids=ids, upload=False, on_bad_item="skip")
    assert added.item_ids == ["x0", "x1", "x3", "x4"] and [i for i, _ in added.skipped] == ["x2", "x5"]
    rows = device.gallery.load()
    assert len(rows) == 4 and np.isfinite(rows.embeddings).all() and np.isfinite(rows.side_infos).all()


def test_complex_arrays_are_refused_for_items_and_queries(device, images):
    device.add(images(4, seed=2), item_ids=list("abcd"), upload=False)
    complex_batch = images(2, seed=3) + 1j
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # not a numpy ComplexWarning: an error of the kit
        with pytest.raises(InputError, match="complex"):
            device.add(complex_batch, item_ids=["e", "f"], upload=False)
        with pytest.raises(InputError, match="real"):
            device.query(complex_batch, k=2)
        with pytest.raises(InputError, match="complex"):
            device.query_items(complex_batch, ["q1", "q2"], k=2)
    assert len(device.gallery) == 4


@pytest.mark.parametrize("scale", [1e19, 1e-19])
def test_a_query_of_any_finite_scale_gets_the_unscaled_answers_each_item_once(device, images, scale):
    device.add(images(50, seed=4), item_ids=[f"g{i}" for i in range(50)], upload=False)
    queries = images(8, seed=5)
    plain = [[m.item_id for m in found] for found in device.query(queries, k=5)]
    scaled = [[m.item_id for m in found] for found in device.query(queries * np.float32(scale), k=5)]
    assert scaled == plain and all(len(set(found)) == 5 for found in scaled)


def test_an_upgrade_names_the_rows_of_an_older_gallery_that_are_not_finite(device, tiny_bundles, images):
    device.add(images(4, seed=6), item_ids=["ok0", "ok1", "ok2", "ok3"], upload=False)
    broken = np.full(8, np.inf, np.float32)  # what a gallery written before items were checked may hold
    device.gallery.add_rows([NewRow("huge", broken, np.ones(4, np.float32), None)], VersionTag(1, 1, "native"))
    with pytest.raises(
        GalleryError, match=r"1 item\(s\) cannot be upgraded \('huge'\).*NaN or inf.*fctkit device remove"
    ):
        device.upgrade(tiny_bundles[2])
    device.remove(["huge"])
    device.upgrade()
    assert device.version == 2 and len(device.gallery) == 4


@pytest.fixture(scope="module")
def l2_bundle(tmp_path_factory, publisher_key):
    """A tiny v1 bundle ranked by L2 distance (unnormalised), signed by the edge tests' key."""
    out = tmp_path_factory.mktemp("l2")
    sources = _sources(out / "src", 1, (), IMAGE_DIM)
    return build_bundle(
        out / "v1",
        version=1,
        parents=(),
        mode="forward",
        distance="l2",
        normalize=False,
        artifacts=sources,
        gate={"cases": {}, "ecc": {}},
        private_key=publisher_key,
    ).root


@pytest.mark.parametrize("backend", ["numpy", "faiss"])
@pytest.mark.parametrize("scale", [1e19, 1e25, 1e30])
def test_huge_l2_queries_get_distinct_items_at_finite_distances(
    make_device, l2_bundle, images, tmp_path, backend, scale
):
    device = make_device(f"l2-{backend}-{scale:g}", search_backend=backend)
    device.upgrade(l2_bundle)
    device.add(images(30, seed=7), item_ids=[f"g{i}" for i in range(30)], upload=False)
    device.close()
    np.save(tmp_path / "q.npy", images(4, seed=8) * np.float32(scale))
    asked = fctkit("device", "query", "--dir", str(device.root), "-k", "5", str(tmp_path / "q.npy"))
    assert asked.code == 0 and not asked.error, asked
    for line in asked.stdout.splitlines():
        found = json.loads(line)
        assert len({m["item_id"] for m in found}) == 5  # never one item k times
        assert all(np.isfinite(m["distance"]) and m["distance"] != float(np.finfo(np.float32).max) for m in found)

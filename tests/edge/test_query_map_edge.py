"""The ``query_map`` bundle role: a map the device runs on its query embedding before search
(trained on the server with the gallery-side adapter; here a real ONNX graph)."""

from __future__ import annotations

import numpy as np
import pytest

from fctkit.edge_runtime import Engine
from fctkit.errors import BundleFormatError
from fctkit.export.bundle_builder import ArtifactSource, build_bundle
from fctkit.protos.bundle import verify_bundle
from tests.edge.conftest import TINY_CHAIN
from tests.server.conftest import EMBED_DIM, IMAGE_DIM, _sources, linear_onnx


def bundle_with_query_map(folder, key, *, mode="forward", query_dim=EMBED_DIM):
    sources = _sources(folder / "src", 2, TINY_CHAIN[2], IMAGE_DIM)
    query_map = linear_onnx(
        folder / "src" / "query_map.onnx", {"new": query_dim}, query_dim, seed=7, output="embedding"
    )
    ecc = {s.artifact_name: True for s in sources if s.role == "forward"}
    return build_bundle(
        folder / "v2",
        version=2,
        parents=(1,),
        mode=mode,
        distance="cosine",
        normalize=True,
        artifacts=[*sources, ArtifactSource(query_map, "query_map")],
        gate={"cases": {}, "ecc": ecc},
        private_key=key,
    ).root


def test_queries_go_through_the_bundles_query_map_before_search(
    make_device, tiny_bundles, images, publisher_key, publisher_pub, tmp_path
):
    v2 = bundle_with_query_map(tmp_path, publisher_key)
    device = make_device()
    device.install_bundle(tiny_bundles[1])
    device.gallery.set_meta({"query_version": "1"})
    ids = device.add(images(30, seed=1))
    assert device.upgrade(v2) == 30
    new_ids = device.add(images(5, seed=2), item_ids=[f"n{i}" for i in range(5)])
    queries = images(6, seed=3)

    engine = Engine(verify_bundle(v2, publisher_pub))
    mapped = engine.run(engine.query_map(), engine.embed(queries))
    assert not np.allclose(mapped, engine.embed(queries))  # the map really changes the query
    index, rows = device.searchable()
    rows_unit = index.vectors / np.linalg.norm(index.vectors, axis=1, keepdims=True)
    expected = np.argsort(
        -(mapped / np.linalg.norm(mapped, axis=1, keepdims=True)) @ rows_unit.T, axis=1, kind="stable"
    )[:, :3]
    found = device.query(queries, k=3)
    assert [[m.item_id for m in row] for row in found] == [[rows.item_ids[j] for j in row] for row in expected]
    assert set(rows.item_ids) == set(ids) | set(new_ids)


def test_a_query_map_belongs_to_a_forward_bundle_and_keeps_the_embedding_dim(publisher_key, tmp_path):
    with pytest.raises(BundleFormatError, match="query_map artifact belongs to a forward-mode bundle"):
        bundle_with_query_map(tmp_path / "unified", publisher_key, mode="unified")
    with pytest.raises(BundleFormatError, match="query_map artifact 'query_map' input"):
        bundle_with_query_map(tmp_path / "wide", publisher_key, query_dim=EMBED_DIM + 1)

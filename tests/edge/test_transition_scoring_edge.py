"""Transition scoring and hubness offsets on a real device (real signed bundles of tiny ONNX
graphs, real ONNX Runtime, real AES-GCM gallery), checked against the formulas computed
here independently:

- transition: ``w·cos(φ_prev(q), φ_prev(x)) + (1 − w)·cos(φ_new(q), h(x))`` while the device
  keeps the previous graph and the rows' previous embeddings; a row without one (or whose
  record fails to open) scores ``cos(φ_new(q), h(x))``; the transition ends on command, after
  a full backfill and after the manifest's days, and its records are then gone;
- hubness: ``cos − β·r(row)`` with ``r`` computed on the device by the bundle's graph at
  upgrade/add time and stored sealed with the row (here cross-checked with the trainer's numpy).
"""

from __future__ import annotations

import json
import sqlite3
import time

import numpy as np
import pytest

from fctkit.edge_runtime import Engine
from fctkit.errors import BundleFormatError
from fctkit.export.bundle_builder import ArtifactSource, build_bundle
from fctkit.export.hubness_graph import hubness_onnx
from fctkit.protos.bundle import verify_bundle
from fctkit.protos.search_policy import HubnessPolicy, TransitionPolicy
from fctkit.trainer.hubness import hubness_offsets
from tests.edge.conftest import TINY_CHAIN, device_cli_steps, enrolment_code, flip_stored_byte, publish
from tests.server.conftest import IMAGE_DIM, _sources

WEIGHT, BETA, K = 0.4, 0.5, 3


def scoring_bundle(
    folder,
    key,
    *,
    transition: TransitionPolicy | None = None,
    hubness: HubnessPolicy | None = None,
    mode: str = "forward",
    with_graph: bool | None = None,
):
    sources = _sources(folder / "src", 2, TINY_CHAIN[2], IMAGE_DIM)
    if with_graph if with_graph is not None else hubness is not None:
        reference = np.random.default_rng(5).standard_normal((20, 8))
        sources.append(ArtifactSource(hubness_onnx(reference, K, folder / "src" / "hubness.onnx"), "hubness"))
    ecc = {s.artifact_name: True for s in sources if s.role == "forward"}
    return build_bundle(
        folder / "v2",
        version=2,
        parents=(1,),
        mode=mode,
        distance="cosine",
        normalize=True,
        artifacts=sources,
        gate={"cases": {}, "ecc": ecc},
        private_key=key,
        transition=transition,
        hubness=hubness,
    ).root


def unit(x):
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def ranking(scores, item_ids, k):
    order = np.argsort(-scores, axis=1, kind="stable")[:, :k]
    return [[item_ids[j] for j in row] for row in order], np.take_along_axis(scores, order, axis=1)


def found(device, queries, k):
    matches = device.query(queries, k=k)
    return [[m.item_id for m in row] for row in matches], np.array([[m.distance for m in row] for row in matches])


@pytest.fixture
def upgraded(make_device, tiny_bundles, images, publisher_key, tmp_path):
    """A v1 device with 30 rows upgraded to a v2 bundle declaring a transition (w = 0.4), then 5 rows added."""
    v2 = scoring_bundle(tmp_path, publisher_key, transition=TransitionPolicy(1, WEIGHT, 2.0))
    device = make_device()
    device.upgrade(tiny_bundles[1])
    pictures = {f"a{i}": x for i, x in enumerate(images(30, seed=1))}
    device.add(np.stack(list(pictures.values())), item_ids=list(pictures), upload=False)
    assert device.upgrade(v2) == 30
    later = {f"b{i}": x for i, x in enumerate(images(5, seed=2))}
    device.add(np.stack(list(later.values())), item_ids=list(later), upload=False)
    return device, pictures | later


def expected_transition(device, pictures, queries, k, without_previous=()):
    previous, current = device.engine(1), device.engine(2)
    rows = device.gallery.load()
    prev_rows = previous.embed(np.stack([pictures[i] for i in rows.item_ids]))
    scores = (1 - WEIGHT) * unit(current.embed(queries)) @ unit(rows.embeddings).T
    fused = scores + WEIGHT * unit(previous.embed(queries)) @ unit(prev_rows).T
    plain = unit(current.embed(queries)) @ unit(rows.embeddings).T
    columns = [j for j, i in enumerate(rows.item_ids) if i in without_previous]
    fused[:, columns] = plain[:, columns]
    return ranking(fused, rows.item_ids, k)


def test_queries_during_a_transition_fuse_the_previous_and_the_adapted_scores(upgraded, images):
    device, pictures = upgraded
    assert device.status()["transition"] == {
        "from_version": 1,
        "weight": WEIGHT,
        "rows_with_previous": 35,
        "max_days": 2.0,
    }
    assert device.status()["scoring"] == "transition"
    queries = images(7, seed=3)
    ids, scores = expected_transition(device, pictures, queries, 6)
    got_ids, distances = found(device, queries, 6)
    assert got_ids == ids
    np.testing.assert_allclose(distances, 1.0 - scores, atol=1e-5)
    # the fused ranking is not the plain one here (the test would not notice a missing fusion otherwise)
    plain = unit(device.engine(2).embed(queries)) @ unit(device.gallery.load().embeddings).T
    assert ranking(plain, device.gallery.load().item_ids, 6)[0] != ids


def test_a_row_without_a_readable_previous_embedding_scores_on_its_adapted_vector(upgraded, images):
    device, pictures = upgraded
    with sqlite3.connect(device.gallery.path) as db:  # a0's record tampered, a1's swapped into a2's place
        assert (
            flip_stored_byte(db, "row_extras", "sealed", "row_id = (SELECT row_id FROM items WHERE item_id = 'a0')", 20)
            == 1
        )
        db.execute(
            "UPDATE row_extras SET sealed = (SELECT sealed FROM row_extras e JOIN items i USING (row_id) "
            "WHERE i.item_id = 'a1') WHERE row_id = (SELECT row_id FROM items WHERE item_id = 'a2')"
        )
        db.execute("DELETE FROM row_extras WHERE row_id = (SELECT row_id FROM items WHERE item_id = 'b0')")
    queries = images(9, seed=4)
    ids, scores = expected_transition(device, pictures, queries, 35, without_previous={"a0", "a2", "b0"})
    got_ids, distances = found(device, queries, 35)
    assert got_ids == ids
    np.testing.assert_allclose(distances, 1.0 - scores, atol=1e-5)


def test_ending_the_transition_drops_the_previous_embeddings_and_plain_search_returns(upgraded, images):
    device, _ = upgraded
    assert device.end_transition() is True
    assert device.gallery.extras.count("previous_embedding") == 0 and device.transition is None
    assert 1 not in device.bundles.loaded_versions() and "transition" not in device.status()
    queries = images(5, seed=6)
    rows = device.gallery.load()
    ids, _scores = ranking(unit(device.engine(2).embed(queries)) @ unit(rows.embeddings).T, rows.item_ids, 4)
    assert found(device, queries, 4)[0] == ids
    assert device.end_transition() is False


def test_the_transition_ends_by_itself_after_the_manifests_days(upgraded, images):
    device, _ = upgraded
    state = json.loads(device.gallery.meta("transition"))
    device.gallery.set_meta({"transition": json.dumps(state | {"started_at": time.time() - 2.01 * 86400})})
    device.query(images(2, seed=7), k=3)
    assert device.transition is None and device.gallery.extras.count("previous_embedding") == 0


def test_a_transition_needs_the_version_it_declares(make_device, tiny_bundles, images, publisher_key, tmp_path):
    """A bundle declaring a transition from v1 upgrades a v1 gallery with one; a device whose
    rows came from elsewhere (here: v2 rows upgraded to a v3 that declares none) has none."""
    v2 = scoring_bundle(tmp_path, publisher_key, transition=TransitionPolicy(1, WEIGHT))
    device = make_device()
    device.upgrade([tiny_bundles[1], v2])  # no rows at v1 yet: the device just installs v2
    assert device.transition is None and device.version == 2
    device.add(images(4, seed=8), upload=False)
    device.upgrade(tiny_bundles[3])
    assert device.transition is None and device.status()["scoring"] == "plain"


def test_a_full_backfill_ends_the_transition(edge_server, make_device, tiny_bundles, images, publisher_key, tmp_path):
    archives = tmp_path / "archives"
    archives.mkdir()
    publish(edge_server, tiny_bundles[1], archives)
    device = make_device("backfilled", health_sample=0)  # the health check would backfill every row of 12
    device.enrol(edge_server.target, enrolment_code(edge_server))
    device.sync()
    device.add(images(12, seed=9))
    publish(edge_server, scoring_bundle(tmp_path, publisher_key, transition=TransitionPolicy(1, WEIGHT)), archives)
    device.sync()
    assert device.transition is not None
    device.backfill(6)
    assert device.transition is not None  # half the rows are still adapted
    device.backfill(6)
    assert device.transition is None and device.gallery.extras.count("previous_embedding") == 0
    assert device.status()["rows_by_space"] == {"v2": 12}


def test_the_device_cli_shows_and_ends_a_transition_without_torch(upgraded, images, tmp_path):
    device, _ = upgraded
    root = str(device.root)
    device.close()
    np.savez(tmp_path / "q.npz", images=images(2, seed=10))
    status, query, ended, again = device_cli_steps(
        [
            ("status", "--dir", root),
            ("query", "--dir", root, str(tmp_path / "q.npz")),
            ("end-transition", "--dir", root),
            ("status", "--dir", root),
        ]
    )
    assert json.loads(status)["transition"]["rows_with_previous"] == 35
    assert len(query.splitlines()) == 2 and all(len(json.loads(line)) == 5 for line in query.splitlines())
    assert json.loads(ended) == {"ended": True}
    assert "transition" not in json.loads(again) and json.loads(again)["scoring"] == "plain"


# -- hubness offsets ------------------------------------------------------------------------


def test_hubness_offsets_are_computed_on_the_device_stored_and_used(
    make_device, tiny_bundles, images, publisher_key, publisher_pub, tmp_path
):
    v2 = scoring_bundle(tmp_path, publisher_key, hubness=HubnessPolicy(BETA))
    device = make_device()
    device.upgrade(tiny_bundles[1])
    device.add(images(25, seed=11), upload=False)
    device.upgrade(v2)
    device.add(images(5, seed=12), upload=False)
    assert device.gallery.extras.count("hubness_offset") == 30 and device.status()["scoring"] == "hubness"
    stored = device.gallery.extras.load("hubness_offset")
    rows = device.gallery.load()
    reference = np.random.default_rng(5).standard_normal((20, 8))
    np.testing.assert_allclose(stored.embeddings[:, 0], hubness_offsets(rows.embeddings, reference, K), atol=1e-5)

    queries = images(6, seed=13)
    engine = Engine(verify_bundle(v2, publisher_pub))
    scores = unit(engine.embed(queries)) @ unit(rows.embeddings).T - BETA * hubness_offsets(
        rows.embeddings, reference, K
    )
    ids, expected = ranking(scores, rows.item_ids, 30)
    got_ids, distances = found(device, queries, 30)
    assert got_ids == ids
    np.testing.assert_allclose(distances, 1.0 - expected, atol=1e-5)

    with sqlite3.connect(device.gallery.path) as db:  # a tampered offset is computed again, not trusted
        assert flip_stored_byte(db, "row_extras", "sealed", "row_id = 3", 20) == 1
    assert len(device.gallery.extras.load("hubness_offset").corrupt) == 1
    assert found(device, queries, 30)[0] == ids


def test_a_bundle_with_both_fuses_over_the_offset_and_keeps_the_offset_after_the_transition(
    make_device, tiny_bundles, images, publisher_key, publisher_pub, tmp_path
):
    """``w·cos_prev + (1 − w)·(cos − β·r)`` during the transition (a row without a previous
    embedding: ``cos − β·r``), then ``cos − β·r`` alone once it ends."""
    v2 = scoring_bundle(
        tmp_path, publisher_key, transition=TransitionPolicy(1, WEIGHT, 2.0), hubness=HubnessPolicy(BETA)
    )
    device = make_device()
    device.upgrade(tiny_bundles[1])
    pictures = {f"a{i}": x for i, x in enumerate(images(20, seed=21))}
    device.add(np.stack(list(pictures.values())), item_ids=list(pictures), upload=False)
    device.upgrade(v2)
    later = {f"b{i}": x for i, x in enumerate(images(4, seed=22))}
    device.add(np.stack(list(later.values())), item_ids=list(later), upload=False)
    assert device.status()["scoring"] == "transition+hubness"
    with sqlite3.connect(device.gallery.path) as db:
        db.execute(
            "DELETE FROM row_extras WHERE field = 'previous_embedding' AND "
            "row_id = (SELECT row_id FROM items WHERE item_id = 'a3')"
        )
    rows = device.gallery.load()
    reference = np.random.default_rng(5).standard_normal((20, 8))
    offsets = hubness_offsets(rows.embeddings, reference, K)
    queries = images(6, seed=23)
    engine, previous = Engine(verify_bundle(v2, publisher_pub)), device.engine(1)
    adapted = unit(engine.embed(queries)) @ unit(rows.embeddings).T - BETA * offsets
    previous_scores = (
        unit(previous.embed(queries)) @ unit(previous.embed(np.stack([(pictures | later)[i] for i in rows.item_ids]))).T
    )
    fused = WEIGHT * previous_scores + (1 - WEIGHT) * adapted
    without = [j for j, i in enumerate(rows.item_ids) if i == "a3"]
    fused[:, without] = adapted[:, without]
    ids, expected = ranking(fused, rows.item_ids, 24)
    got_ids, distances = found(device, queries, 24)
    assert got_ids == ids
    np.testing.assert_allclose(distances, 1.0 - expected, atol=1e-5)
    assert ranking(adapted, rows.item_ids, 24)[0] != ids  # the fusion changes the ranking here

    assert device.end_transition() is True
    assert device.status()["scoring"] == "hubness"
    ids, expected = ranking(adapted, rows.item_ids, 24)
    got_ids, distances = found(device, queries, 24)
    assert got_ids == ids
    np.testing.assert_allclose(distances, 1.0 - expected, atol=1e-5)


def test_search_declarations_are_checked_in_the_manifest(publisher_key, tmp_path):
    cases = [
        (
            {"transition": TransitionPolicy(1, WEIGHT), "hubness": HubnessPolicy(BETA), "with_graph": False},
            "needs exactly one hubness artifact",
        ),
        (
            {"transition": TransitionPolicy(1, WEIGHT), "hubness": HubnessPolicy(BETA), "mode": "unified"},
            "transition and hubness scoring belongs to a forward-mode cosine bundle",
        ),
        ({"hubness": HubnessPolicy(BETA), "with_graph": False}, "needs exactly one hubness artifact"),
        ({"with_graph": True}, "needs exactly one hubness artifact"),
        ({"transition": TransitionPolicy(2, WEIGHT)}, "no forward adapter from it"),
        ({"transition": TransitionPolicy(1, WEIGHT), "mode": "unified"}, "belongs to a forward-mode cosine bundle"),
    ]
    for i, (options, message) in enumerate(cases):
        with pytest.raises(BundleFormatError, match=message):
            scoring_bundle(tmp_path / str(i), publisher_key, **options)
    for bad in ({"weight": 0.0}, {"weight": 1.0}, {"weight": float("nan")}, {"max_days": -1.0}):
        with pytest.raises(BundleFormatError, match=r"weight|max_days"):
            TransitionPolicy(**({"previous_version": 1, "weight": WEIGHT} | bad))
    with pytest.raises(BundleFormatError, match="beta"):
        HubnessPolicy(0.0)

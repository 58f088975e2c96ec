"""Retrieval metrics: hand-made answers, brute-force references, chunking, ties, bad input."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from scipy.spatial.distance import cdist
from sklearn.metrics import average_precision_score

from fctkit.errors import InputError
from fctkit.trainer.backfill_curves import BackfillCurve, backfill_curve
from fctkit.trainer.compatibility import compatibility_matrix, ecc
from fctkit.trainer.evaluation import evaluate_retrieval, rank_queries
from fctkit.trainer.ranking import pairwise_distances
from fctkit.trainer.retrieval_result import RetrievalResult, metric_value


def line(*xs: float) -> np.ndarray:
    """Points on a line as 1-d embeddings."""
    return np.array(xs, dtype=float)[:, None]


def brute_force(q, ql, g, gl, distance, leave_one_out=False, ks=(1, 5, 10)):
    """Reference: exact distances (scipy), sklearn AP per query, CMC by walking sorted distances."""
    dist = cdist(q, g, "sqeuclidean" if distance == "l2" else "cosine")
    aps, firsts = [], []
    for i in range(len(q)):
        keep = np.arange(len(g)) != i if leave_one_out else np.ones(len(g), bool)
        relevant = (gl == ql[i])[keep]
        if not relevant.any():
            continue
        aps.append(average_precision_score(relevant, -dist[i][keep]))
        order = np.lexsort((np.flatnonzero(keep), dist[i][keep]))  # distance, then index
        firsts.append(next(r for r, j in enumerate(order, 1) if relevant[j]))
    firsts = np.array(firsts)
    return np.mean(aps), {k: float(np.mean(firsts <= k)) for k in ks}, len(q) - len(firsts)


def clustered(rng, n, dim, classes, spread=1.0):
    labels = rng.integers(0, classes, n)
    centers = rng.normal(size=(classes, dim))
    return centers[labels] + spread * rng.normal(size=(n, dim)), labels


# -- hand-made cases ------------------------------------------------------------------------


def test_hand_made_ranking_known_answers():
    gallery, gallery_labels = line(0, 1, 2, 3, 4), np.array(["a", "b", "a", "b", "b"])
    query, query_labels = line(0.1, 1.1), np.array(["a", "a"])
    # query 0.1: order 0(a) 1(b) 2(a) ... -> positives at ranks 1, 3: AP = (1 + 2/3) / 2
    # query 1.1: order 1(b) 2(a) 0(a) ... -> positives at ranks 2, 3: AP = (1/2 + 2/3) / 2
    result = evaluate_retrieval(query, query_labels, gallery, gallery_labels, topk=(1, 2, 5))
    assert result.cmc == {1: 0.5, 2: 1.0, 5: 1.0}
    assert result.mean_ap == pytest.approx((5 / 6 + 7 / 12) / 2, abs=1e-15)
    assert (result.n_queries, result.n_skipped) == (2, 0)
    assert result.cmc_curve == (0.5, 1.0, 1.0, 1.0, 1.0)
    ranks = rank_queries(query, query_labels, gallery, gallery_labels)
    assert ranks.first_positive_rank.tolist() == [1, 2]


def test_query_class_missing_from_gallery_is_skipped():
    result = evaluate_retrieval(line(0, 5), np.array([1, 9]), line(0, 1), np.array([1, 2]), topk=(1,))
    assert (result.n_queries, result.n_skipped, result.top1, result.mean_ap) == (1, 1, 1.0, 1.0)


def test_leave_one_out_excludes_self_and_counts_skipped():
    items, labels = line(0, 3, 1, 9), np.array([0, 0, 1, 2])
    # query 0 sees 2 (d=1) before 1 (d=9); query 1 sees 2 (d=4) before 0 (d=9); 2 and 3 have no positive.
    result = evaluate_retrieval(items, labels, items, labels, leave_one_out=True, topk=(1, 2))
    assert result.cmc == {1: 0.0, 2: 1.0}
    assert result.mean_ap == 0.5
    assert (result.n_queries, result.n_skipped) == (2, 2)
    # without leave-one-out every query finds itself first; queries 0 and 1 then have AP (1 + 2/3) / 2
    plain = evaluate_retrieval(items, labels, items, labels, topk=(1,))
    assert (plain.top1, plain.n_queries) == (1.0, 4)
    assert plain.mean_ap == pytest.approx((5 / 6 + 5 / 6 + 1 + 1) / 4, abs=1e-15)


def test_leave_one_out_works_across_models_of_the_same_items():
    rng = np.random.default_rng(3)
    old, labels = clustered(rng, 60, 5, 4)
    new = old + 0.01 * rng.normal(size=old.shape)  # another model's view of the same items
    result = evaluate_retrieval(new, labels, old, labels, leave_one_out=True)
    ref_map, ref_cmc, skipped = brute_force(new, labels, old, labels, "l2", leave_one_out=True, ks=(1, 5))
    assert result.mean_ap == pytest.approx(ref_map, abs=1e-12)
    assert result.cmc == ref_cmc and result.n_skipped == skipped == 0


def test_no_evaluable_query_is_an_error():
    with pytest.raises(InputError, match="no query has a positive"):
        evaluate_retrieval(line(0, 1), np.array([0, 1]), line(0, 1), np.array([0, 1]), leave_one_out=True)


# -- ties -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("positions", "relevant", "ours_ap", "ours_top1", "sklearn_ap"),
    [
        # equal distances 1, 1: the lower gallery index ranks first
        ((-1, 1), (False, True), 0.5, 0.0, 0.5),
        ((-1, 1), (True, False), 1.0, 1.0, 0.5),
        # distances 0, 1, 1 with a tie between two positives behind a negative
        ((0, -1, 1), (False, True, True), 7 / 12, 0.0, 2 / 3),
        # tie group of a negative and a positive behind a positive
        ((0.5, 2, -2), (True, False, True), (1 + 2 / 3) / 2, 1.0, (1 + 2 / 3) / 2),
        ((0.5, -2, 2), (True, True, False), 1.0, 1.0, (1 + 2 / 3) / 2),
    ],
)
def test_ties_break_by_gallery_index(positions, relevant, ours_ap, ours_top1, sklearn_ap):
    gallery = line(*positions)
    labels = np.where(relevant, 1, 0)
    result = evaluate_retrieval(line(0), np.array([1]), gallery, labels, topk=(1,))
    assert result.mean_ap == pytest.approx(ours_ap, abs=1e-15)
    assert result.top1 == ours_top1
    # scikit-learn groups ties at one threshold: documented difference
    dist = cdist(line(0), gallery, "sqeuclidean")[0]
    assert average_precision_score(relevant, -dist) == pytest.approx(sklearn_ap, abs=1e-15)


def test_duplicate_gallery_items_rank_by_index_in_every_chunking():
    rng = np.random.default_rng(7)
    base = rng.integers(-3, 4, size=(6, 3)).astype(float)
    gallery = np.repeat(base, 4, axis=0)  # every vector four times, exact ties
    gallery_labels = rng.integers(0, 3, len(gallery))
    query = rng.integers(-3, 4, size=(9, 3)).astype(float)
    query_labels = rng.integers(0, 3, len(query))
    dist = cdist(query, gallery, "sqeuclidean")
    expected_first, expected_ap = [], []
    for i in range(len(query)):
        order = np.lexsort((np.arange(len(gallery)), dist[i]))
        hits = np.flatnonzero(gallery_labels[order] == query_labels[i]) + 1
        expected_first.append(hits[0])
        expected_ap.append(np.mean(np.arange(1, hits.size + 1) / hits))
    for chunk in (1, 4, 100):
        ranks = rank_queries(query, query_labels, gallery, gallery_labels, chunk_size=chunk)
        assert ranks.first_positive_rank.tolist() == expected_first
        np.testing.assert_allclose(ranks.average_precision, expected_ap, rtol=0, atol=1e-15)


@settings(max_examples=60, deadline=None)
@given(
    st.integers(1, 6).flatmap(
        lambda n_q: st.tuples(
            st.lists(st.tuples(st.integers(-2, 2), st.integers(-2, 2), st.integers(0, 2)), min_size=n_q, max_size=n_q),
            st.lists(st.tuples(st.integers(-2, 2), st.integers(-2, 2), st.integers(0, 2)), min_size=1, max_size=12),
            st.integers(1, 13),
            st.booleans(),
        )
    )
)
def test_tie_heavy_integer_data_matches_a_lexsort_reference(data):
    """Small integer grids are full of exact ties; ranks must follow (distance, gallery index)."""
    query_rows, gallery_rows, chunk, leave_one_out = data
    if leave_one_out:
        query_rows = gallery_rows
    q, ql = np.array([r[:2] for r in query_rows], float), np.array([r[2] for r in query_rows])
    g, gl = np.array([r[:2] for r in gallery_rows], float), np.array([r[2] for r in gallery_rows])
    dist = cdist(q, g, "sqeuclidean")
    ranks = rank_queries(q, ql, g, gl, chunk_size=chunk, leave_one_out=leave_one_out)
    for i in range(len(q)):
        keep = np.flatnonzero(np.arange(len(g)) != i) if leave_one_out else np.arange(len(g))
        order = keep[np.lexsort((keep, dist[i][keep]))]
        hits = np.flatnonzero(gl[order] == ql[i]) + 1
        assert ranks.n_positives[i] == hits.size
        if hits.size:
            assert ranks.first_positive_rank[i] == hits[0]
            assert ranks.average_precision[i] == pytest.approx(np.mean(np.arange(1, hits.size + 1) / hits), abs=1e-15)


# -- random data against brute force ---------------------------------------------------------


@pytest.mark.parametrize("distance", ["l2", "cosine"])
@pytest.mark.parametrize("seed", [0, 1])
def test_random_data_matches_sklearn_and_direct_cmc(distance, seed):
    rng = np.random.default_rng(seed)
    gallery, gallery_labels = clustered(rng, 400, 12, 9, spread=2.0)
    query, query_labels = clustered(rng, 150, 12, 11, spread=2.0)  # classes 9, 10 are skipped
    result = evaluate_retrieval(query, query_labels, gallery, gallery_labels, distance=distance, topk=(1, 5, 10))
    ref_map, ref_cmc, skipped = brute_force(query, query_labels, gallery, gallery_labels, distance)
    assert abs(result.mean_ap - ref_map) < 1e-9
    assert result.cmc == ref_cmc
    assert result.n_skipped == skipped > 0
    assert result.n_queries + result.n_skipped == len(query)


def test_random_leave_one_out_matches_sklearn():
    rng = np.random.default_rng(5)
    items, labels = clustered(rng, 300, 8, 30, spread=1.5)
    labels[:3] = [97, 98, 99]  # singletons: nothing left after leave-one-out
    result = evaluate_retrieval(items, labels, items, labels, leave_one_out=True, topk=(1, 5, 10))
    ref_map, ref_cmc, skipped = brute_force(items, labels, items, labels, "l2", leave_one_out=True)
    assert abs(result.mean_ap - ref_map) < 1e-9
    assert result.cmc == ref_cmc
    assert result.n_skipped == skipped == 3


def test_pairwise_distances_are_the_exact_distances():
    rng = np.random.default_rng(2)
    q, g = rng.normal(size=(20, 6)) + 50.0, rng.normal(size=(30, 6)) + 50.0  # far from the origin
    np.testing.assert_allclose(pairwise_distances(q, g, "l2"), cdist(q, g, "sqeuclidean"), rtol=1e-10, atol=1e-10)
    np.testing.assert_allclose(pairwise_distances(q, g, "cosine"), cdist(q, g, "cosine"), rtol=0, atol=1e-13)


def test_cosine_ignores_scale_and_equals_l2_on_unit_vectors():
    rng = np.random.default_rng(4)
    gallery, gallery_labels = clustered(rng, 200, 10, 5)
    query, query_labels = clustered(rng, 50, 10, 5)
    cosine = evaluate_retrieval(query, query_labels, gallery, gallery_labels, distance="cosine")
    scales = rng.uniform(0.1, 10.0, size=(len(gallery), 1))
    assert evaluate_retrieval(query, query_labels, gallery * scales, gallery_labels, distance="cosine") == cosine
    unit = lambda x: x / np.linalg.norm(x, axis=1, keepdims=True)  # noqa: E731
    l2_unit = evaluate_retrieval(unit(query), query_labels, unit(gallery), gallery_labels, distance="l2")
    assert l2_unit.cmc == cosine.cmc and l2_unit.mean_ap == pytest.approx(cosine.mean_ap, abs=1e-12)
    assert cosine.distance == "cosine"
    assert evaluate_retrieval(query, query_labels, gallery * scales, gallery_labels, distance="l2") != cosine


# -- chunking -------------------------------------------------------------------------------


@pytest.mark.parametrize("distance", ["l2", "cosine"])
@pytest.mark.parametrize("leave_one_out", [False, True])
def test_chunked_equals_unchunked_exactly(distance, leave_one_out):
    rng = np.random.default_rng(11)
    items, labels = clustered(rng, 203, 16, 7, spread=3.0)
    query = items if leave_one_out else clustered(rng, 97, 16, 7, spread=3.0)[0]
    query_labels = labels if leave_one_out else rng.integers(0, 7, 97)
    kwargs = {"distance": distance, "topk": (1, 3, 10), "leave_one_out": leave_one_out}
    full = rank_queries(
        query,
        query_labels,
        items,
        labels,
        chunk_size=len(query),
        workers=1,
        distance=distance,
        leave_one_out=leave_one_out,
    )
    reference = evaluate_retrieval(query, query_labels, items, labels, chunk_size=len(query), workers=1, **kwargs)
    for chunk, workers in [(1, 1), (2, 2), (7, 3), (8, 1), (64, 2), (len(query) + 5, 4)]:
        ranks = rank_queries(
            query,
            query_labels,
            items,
            labels,
            chunk_size=chunk,
            workers=workers,
            distance=distance,
            leave_one_out=leave_one_out,
        )
        np.testing.assert_array_equal(ranks.first_positive_rank, full.first_positive_rank)
        np.testing.assert_array_equal(ranks.average_precision, full.average_precision)
        assert (
            evaluate_retrieval(query, query_labels, items, labels, chunk_size=chunk, workers=workers, **kwargs)
            == reference
        )


def near_tie_sets(distance: str):
    """Galleries where many distances agree up to float64 rounding noise."""
    rng = np.random.default_rng(21)
    angles = rng.uniform(0, 2 * np.pi, 40)
    if distance == "l2":  # points on a unit circle around the first query
        centre = np.array([0.1, 0.2])
        gallery = centre + np.stack([np.cos(angles), np.sin(angles)], axis=1)
        query = np.vstack([centre, rng.normal(size=(4, 2))])
    else:  # a few directions at many scales: equal cosines, unequal rounding
        directions = np.stack([np.cos(angles[:5]), np.sin(angles[:5])], axis=1)
        gallery = directions[rng.integers(0, 5, 40)] * rng.uniform(0.1, 10, size=(40, 1))
        query = np.vstack([directions[:2] * 3.3, rng.normal(size=(3, 2))])
    return query, rng.integers(0, 3, len(query)), gallery, rng.integers(0, 3, len(gallery))


@pytest.mark.parametrize("distance", ["l2", "cosine"])
def test_near_ties_resolve_by_canonical_distance_then_index(distance):
    """BLAS rounding differs with the chunk shape; near ties must not: they are decided by a
    fixed-order distance of the two vectors (np.add.reduce along the row), then the index."""
    q, ql, g, gl = near_tie_sets(distance)
    if distance == "l2":
        canonical = lambda i: np.add.reduce(np.square(q[i] - g), axis=1)  # noqa: E731
    else:
        unit = lambda x: x / np.linalg.norm(x, axis=1)[:, None]  # noqa: E731
        canonical = lambda i: -np.add.reduce(unit(q)[i] * unit(g), axis=1)  # noqa: E731
    expected_first, expected_ap = [], []
    for i in range(len(q)):
        order = np.lexsort((np.arange(len(g)), canonical(i)))
        hits = np.flatnonzero(gl[order] == ql[i]) + 1
        expected_first.append(hits[0])
        expected_ap.append(np.mean(np.arange(1, hits.size + 1) / hits))
    assert len(set(canonical(0).tolist())) < len(g)  # the data really holds exact ties, too
    for chunk, workers in [(1, 1), (2, 2), (3, 1), (len(q), 2)]:
        ranks = rank_queries(q, ql, g, gl, distance=distance, chunk_size=chunk, workers=workers)
        assert ranks.first_positive_rank.tolist() == expected_first
        np.testing.assert_array_equal(ranks.average_precision, expected_ap)


def test_float32_and_integer_inputs_are_accepted():
    rng = np.random.default_rng(8)
    gallery, labels = clustered(rng, 100, 4, 3)
    as64 = evaluate_retrieval(gallery.astype(np.float32).astype(np.float64), labels, gallery.astype(np.float32), labels)
    assert evaluate_retrieval(gallery.astype(np.float32), labels, gallery.astype(np.float32), labels) == as64
    ints = np.round(gallery * 10).astype(np.int32)
    assert evaluate_retrieval(ints, labels, ints, labels).top1 == 1.0


# -- results, metrics, ECC ------------------------------------------------------------------


def test_result_dict_round_trips_through_json():
    rng = np.random.default_rng(9)
    gallery, labels = clustered(rng, 80, 4, 4)
    result = evaluate_retrieval(gallery, labels, gallery, labels, topk=(1, 5, 10), leave_one_out=True)
    assert RetrievalResult.from_dict(json.loads(json.dumps(result.to_dict()))) == result
    assert result.to_dict()["top1"] == result.top1 == result.cmc[1]
    with pytest.raises(InputError, match="not a retrieval result"):
        RetrievalResult.from_dict({"cmc": {"1": 0.5}})


def test_metric_values_and_ecc():
    old = RetrievalResult(
        cmc={1: 0.5, 5: 0.8}, mean_ap=0.40, n_queries=10, n_skipped=0, cmc_curve=(0.5, 0.6, 0.7, 0.75, 0.8)
    )
    new = RetrievalResult(cmc={1: 0.6, 5: 0.8}, mean_ap=0.35, n_queries=10, n_skipped=0)
    assert metric_value(old, "top3") == 0.7
    assert metric_value(old, "mean_ap") == 0.40
    assert ecc(new, old) is True
    assert ecc(new, old, "top5") is False  # equal is not better
    assert ecc(new, old, "mean_ap") is False
    assert ecc(old, new) is False
    with pytest.raises(InputError, match="unknown metric"):
        metric_value(old, "recall")
    with pytest.raises(InputError, match="unknown metric"):
        metric_value(old, "top0")
    with pytest.raises(InputError, match="has CMC only for k"):
        metric_value(new, "top3")


# -- compatibility matrix -------------------------------------------------------------------


def test_compatibility_matrix_ac_am_on_hand_made_values():
    table = {(0, 0): 0.5, (1, 0): 0.6, (1, 1): 0.7, (2, 0): 0.4, (2, 1): 0.8, (2, 2): 0.9}
    calls = []

    def evaluate(i: int, j: int) -> float:
        calls.append((i, j))
        return table[i, j]

    matrix = compatibility_matrix(evaluate, 3)
    assert sorted(calls) == sorted(table)
    # pairs i > j: C10 > C00 yes, C20 > C00 no, C21 > C11 yes -> AC = 2 / 6 * 2
    assert matrix.ac == pytest.approx(2 / 3, abs=1e-15)
    assert matrix.am == pytest.approx(2 / 12 * 3.9, abs=1e-15)
    assert np.isnan(matrix.values[0, 1]) and np.isnan(matrix.values[1, 2])
    assert matrix.values[2, 1] == 0.8
    md = matrix.to_markdown(["v1", "v2", "v3"])
    assert "| v3 | 0.4000 | 0.8000 | 0.9000 |" in md and "AC = 0.6667" in md and "AM = 0.6500" in md
    with pytest.raises(InputError, match="need 3 version names"):
        matrix.to_markdown(["v1", "v2"])


def test_compatibility_matrix_bad_input():
    with pytest.raises(InputError, match="at least two versions"):
        compatibility_matrix(lambda i, j: 0.5, 1)
    with pytest.raises(InputError, match="expected a finite metric"):
        compatibility_matrix(lambda i, j: float("nan"), 2)


# -- backfill curve -------------------------------------------------------------------------


def test_backfill_curve_endpoints_and_area():
    rng = np.random.default_rng(12)
    backfilled, labels = clustered(rng, 120, 6, 4, spread=0.8)
    adapted = backfilled + rng.normal(scale=1.5, size=backfilled.shape)  # a worse adapter
    query = backfilled + rng.normal(scale=0.3, size=backfilled.shape)
    order = rng.permutation(len(labels))
    curve = backfill_curve(query, labels, adapted, backfilled, labels, order, steps=4, leave_one_out=True)
    at = lambda gallery, metric="top1": metric_value(  # noqa: E731
        evaluate_retrieval(query, labels, gallery, labels, leave_one_out=True), metric
    )
    np.testing.assert_array_equal(curve.fractions, [0, 0.25, 0.5, 0.75, 1])
    assert curve.values[0] == at(adapted) and curve.values[-1] == at(backfilled)
    assert curve.values[-1] > curve.values[0]
    half = adapted.copy()
    half[order[:60]] = backfilled[order[:60]]
    assert curve.values[2] == at(half)
    v = curve.values
    assert curve.area == pytest.approx(0.25 * (v[0] / 2 + v[1] + v[2] + v[3] + v[4] / 2), abs=1e-15)
    by_map = backfill_curve(
        query, labels, adapted, backfilled, labels, order, steps=1, metric="mean_ap", leave_one_out=True
    )
    assert by_map.values.tolist() == [at(adapted, "mean_ap"), at(backfilled, "mean_ap")]
    assert by_map.area == pytest.approx(by_map.values.mean(), abs=1e-15)
    assert (curve.metric, by_map.metric) == ("top1", "mean_ap")
    assert BackfillCurve.from_dict(json.loads(json.dumps(curve.to_dict()))).area == curve.area


def test_backfill_curve_bad_input():
    g, labels = line(0, 1, 2), np.array([0, 0, 1])
    with pytest.raises(InputError, match="permutation"):
        backfill_curve(g, labels, g, g, labels, np.array([0, 0, 1]))
    with pytest.raises(InputError, match="permutation"):
        backfill_curve(g, labels, g, g, labels, np.array([0.0, 1.0, 2.0]))
    with pytest.raises(InputError, match="permutation"):
        backfill_curve(g, labels, g, g, labels, np.array([0, 1]))
    with pytest.raises(InputError, match="same shape"):
        backfill_curve(g, labels, g, line(0, 1), labels, np.array([0, 1, 2]))
    with pytest.raises(InputError, match="steps"):
        backfill_curve(g, labels, g, g, labels, np.array([0, 1, 2]), steps=0)
    with pytest.raises(InputError, match="unknown metric"):
        backfill_curve(g, labels, g, g, labels, np.array([0, 1, 2]), metric="top-1")


# -- bad input ------------------------------------------------------------------------------

Q, QL, G, GL = line(0, 1), np.array([0, 1]), line(0, 1, 2), np.array([0, 1, 1])


@pytest.mark.parametrize(
    ("args", "kwargs", "message"),
    [
        ((np.zeros((2, 3)), QL, np.zeros((3, 4)), GL), {}, "different dims"),
        ((np.array([[np.nan], [1.0]]), QL, G, GL), {}, "NaN/inf in 1 row"),
        ((Q, QL, np.array([[0.0], [np.inf], [2.0]]), GL), {}, "gallery embeddings contain NaN/inf"),
        ((np.zeros((0, 1)), np.array([], int), G, GL), {}, "query set is empty"),
        ((Q, QL, np.zeros((0, 1)), np.array([], int)), {}, "gallery set is empty"),
        ((Q, np.array([0, 1, 1]), G, GL), {}, "query has 2 embeddings but 3 labels"),
        ((Q, QL, G, np.array([0, 1])), {}, "gallery has 3 embeddings but 2 labels"),
        ((Q, QL[:, None], G, GL), {}, "labels must be 1-D"),
        ((Q, np.array([0.0, np.nan]), G, GL), {}, "labels contain NaN"),
        ((Q, np.array(["0", "1"]), G, GL), {}, "use the same label type"),
        ((np.zeros(2), QL, G, GL), {}, "must be 2-D"),
        ((np.array([["a"], ["b"]]), QL, G, GL), {}, "must be real numbers"),
        ((Q, QL, G, GL), {"leave_one_out": True}, "same items"),
        ((G, np.array([1, 1, 0]), G, GL), {"leave_one_out": True}, "different labels"),
        ((Q, QL, G, GL), {"topk": (1, 0)}, "integers >= 1"),
        ((Q, QL, G, GL), {"topk": (-5,)}, "integers >= 1"),
        ((Q, QL, G, GL), {"topk": (1.5,)}, "integers >= 1"),
        ((Q, QL, G, GL), {"topk": (True,)}, "integers >= 1"),
        ((Q, QL, G, GL), {"topk": 5}, "sequence of integers"),
        ((Q, QL, G, GL), {"chunk_size": 0}, "chunk_size must be"),
        ((Q, QL, G, GL), {"workers": 0}, "workers must be"),
        ((Q, QL, G, GL), {"distance": "dot"}, "distance must be one of"),
        ((Q, QL, line(0, 0, 1), GL), {"distance": "cosine"}, "all-zero embedding"),
    ],
)
def test_bad_input_gets_a_clear_error(args, kwargs, message):
    with pytest.raises(InputError, match=message):
        evaluate_retrieval(*args, **kwargs)


def test_evaluation_imports_without_torch_or_matplotlib():
    code = (
        "import sys, numpy as np\n"
        "class Block:\n"
        "    def find_spec(self, name, path=None, target=None):\n"
        "        if name.split('.')[0] in ('torch', 'matplotlib'):\n"
        "            raise ImportError('blocked ' + name)\n"
        "sys.meta_path.insert(0, Block())\n"
        "import fctkit.trainer, fctkit.trainer.evaluation, fctkit.trainer.report\n"
        "from fctkit.trainer import Report, evaluate_retrieval\n"
        "r = evaluate_retrieval(np.eye(3), [0, 0, 1], np.eye(3), [0, 0, 1])\n"
        "rep = Report('t'); rep.add_case('a/a', r); print(rep.to_markdown())\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "| a/a |" in done.stdout


def test_large_benchmark_script_agrees_with_its_baseline_at_a_small_size():
    from pathlib import Path

    script = Path(__file__).resolve().parents[2] / "benchmarks" / "eval_large.py"
    done = subprocess.run(
        [sys.executable, str(script), "--n", "400", "--baseline-n", "300", "--dim", "16", "--classes", "10"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert "same metrics as the baseline at 300: yes" in done.stdout
    assert "throughput ratio ours / baseline at 300:" in done.stdout

"""Instance-level metrics (R@k, MRR, nDCG@10, mAP over explicit positives): hand-computed
answers, trec_eval (pytrec_eval) as the independent implementation, chunking, bad input."""

from __future__ import annotations

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from fctkit.errors import InputError
from fctkit.trainer.evaluation import evaluate_retrieval
from fctkit.trainer.relevance import Positives
from fctkit.trainer.retrieval_result import RetrievalResult, metric_value

pytrec_eval = pytest.importorskip("pytrec_eval", reason="pytrec-eval-terrier (trec_eval) is in the dev extra")


def line(*xs: float) -> np.ndarray:
    return np.array(xs, dtype=float)[:, None]


def test_hand_computed_graded_query():
    # Query at 0; gallery at 1..6, so gallery row j has rank j + 1. Positives: row 1 (rank 2,
    # grade 2) and row 3 (rank 4, grade 1).
    positives = Positives.from_lists([[3, 1]], n_gallery=6, grades=[[1.0, 2.0]])
    result = evaluate_retrieval(line(0), None, line(1, 2, 3, 4, 5, 6), None, positives=positives, topk=(1, 5, 10))
    assert result.relevance == "explicit"
    assert result.cmc[1] == 0.0 and result.cmc[5] == 1.0
    assert result.recall == {1: 0.0, 5: 1.0, 10: 1.0}
    assert result.mrr == 0.5
    assert result.mean_ap == pytest.approx((1 / 2 + 2 / 4) / 2)
    dcg = 2 / math.log2(3) + 1 / math.log2(5)
    ideal = 2 / math.log2(2) + 1 / math.log2(3)
    assert result.ndcg10 == pytest.approx(dcg / ideal)


def test_recall_counts_the_share_of_positives_not_a_hit():
    # Two positives at ranks 1 and 7: a hit at 1 (CMC@1 = 1) but half the positives (R@1 = 0.5).
    positives = Positives.from_lists([[0, 6]], n_gallery=8)
    result = evaluate_retrieval(line(0), None, line(*range(1, 9)), None, positives=positives, topk=(1,))
    assert result.cmc[1] == 1.0
    assert result.recall[1] == 0.5 and result.recall[5] == 0.5 and result.recall[10] == 1.0
    assert metric_value(result, "recall@10") == 1.0 and metric_value(result, "mrr") == 1.0


def test_a_query_without_positives_is_skipped_and_counted():
    positives = Positives.from_lists([[0], []], n_gallery=3)
    result = evaluate_retrieval(line(0, 5), None, line(0, 1, 2), None, positives=positives)
    assert result.n_queries == 1 and result.n_skipped == 1 and result.mrr == 1.0


def trec_eval_reference(query, gallery, positives: Positives, cutoffs=(1, 5, 10)):
    """trec_eval's numbers (via pytrec_eval) on a run scored by −squared distance."""
    scores = -((query[:, None, :] - gallery[None, :, :]) ** 2).sum(axis=2)
    qrels, run = {}, {}
    for i in range(len(query)):
        rows, grades = positives.of(i)
        if not len(rows):
            continue
        qrels[f"q{i}"] = {f"d{j}": int(g) for j, g in zip(rows, grades)}
        run[f"q{i}"] = {f"d{j}": float(s) for j, s in enumerate(scores[i])}
    measures = {"map", "recip_rank", "ndcg_cut_10", *(f"recall_{k}" for k in cutoffs)}
    per_query = pytrec_eval.RelevanceEvaluator(qrels, measures).evaluate(run)
    mean = lambda key: float(np.mean([m[key] for m in per_query.values()]))  # noqa: E731
    return {
        "map": mean("map"),
        "mrr": mean("recip_rank"),
        "ndcg10": mean("ndcg_cut_10"),
        **{f"recall@{k}": mean(f"recall_{k}") for k in cutoffs},
    }


def random_positives(rng, n_queries, n_gallery, max_positives, graded):
    lists = [
        rng.choice(n_gallery, size=rng.integers(0, max_positives + 1), replace=False).tolist() for _ in range(n_queries)
    ]
    grades = [rng.integers(1, 4, size=len(p)).astype(float).tolist() for p in lists] if graded else None
    return Positives.from_lists(lists, n_gallery, grades)


@pytest.mark.parametrize("graded", [False, True])
@pytest.mark.parametrize("chunk_size", [1, 7, 1000])
def test_matches_trec_eval_on_random_tasks(graded, chunk_size):
    rng = np.random.default_rng(3 + graded)
    query, gallery = rng.normal(size=(60, 8)), rng.normal(size=(200, 8))
    positives = random_positives(rng, 60, 200, max_positives=5, graded=graded)
    ours = evaluate_retrieval(query, None, gallery, None, positives=positives, chunk_size=chunk_size, topk=(1, 5, 10))
    reference = trec_eval_reference(query, gallery, positives)
    assert ours.mean_ap == pytest.approx(reference["map"], abs=1e-9)
    assert ours.mrr == pytest.approx(reference["mrr"], abs=1e-9)
    assert ours.ndcg10 == pytest.approx(reference["ndcg10"], abs=1e-9)
    for k in (1, 5, 10):
        assert ours.recall[k] == pytest.approx(reference[f"recall@{k}"], abs=1e-9)


@settings(max_examples=25, deadline=None)
@given(seed=st.integers(0, 10_000), n_query=st.integers(1, 20), n_gallery=st.integers(1, 40))
def test_matches_trec_eval_on_any_small_task(seed, n_query, n_gallery):
    rng = np.random.default_rng(seed)
    query, gallery = rng.normal(size=(n_query, 3)), rng.normal(size=(n_gallery, 3))
    positives = random_positives(rng, n_query, n_gallery, max_positives=min(n_gallery, 4), graded=True)
    if not np.diff(positives.indptr).any():
        return
    ours = evaluate_retrieval(query, None, gallery, None, positives=positives, chunk_size=3)
    reference = trec_eval_reference(query, gallery, positives)
    for ours_value, key in (
        (ours.mean_ap, "map"),
        (ours.mrr, "mrr"),
        (ours.ndcg10, "ndcg10"),
        (ours.recall[5], "recall@5"),
    ):
        assert ours_value == pytest.approx(reference[key], abs=1e-9)


def test_class_labels_and_the_same_relevance_as_explicit_positives_agree():
    rng = np.random.default_rng(0)
    labels_q, labels_g = rng.integers(0, 5, 40), rng.integers(0, 5, 90)
    query, gallery = rng.normal(size=(40, 6)), rng.normal(size=(90, 6))
    by_labels = evaluate_retrieval(query, labels_q, gallery, labels_g, topk=(1, 5, 10))
    lists = [np.flatnonzero(labels_g == c).tolist() for c in labels_q]
    explicit = evaluate_retrieval(
        query, None, gallery, None, positives=Positives.from_lists(lists, 90), topk=(1, 5, 10)
    )
    for field in ("cmc", "mean_ap", "recall", "mrr", "ndcg10", "n_queries"):
        assert getattr(by_labels, field) == pytest.approx(getattr(explicit, field))


def test_results_round_trip_through_json_and_old_reports_still_load():
    positives = Positives.from_lists([[1], [0]], n_gallery=2)
    result = evaluate_retrieval(line(0, 1), None, line(0.9, 0.1), None, positives=positives)
    assert RetrievalResult.from_dict(result.to_dict()) == result
    old_style = {"cmc": {"1": 0.5}, "mean_ap": 0.5, "n_queries": 2, "n_skipped": 0}
    legacy = RetrievalResult.from_dict(old_style)
    with pytest.raises(InputError, match="computed without it"):
        metric_value(legacy, "mrr")


@pytest.mark.parametrize(
    ("build", "message"),
    [
        (lambda: Positives.from_lists([[5]], n_gallery=3), "gallery row is outside"),
        (lambda: Positives.from_lists([[1, 1]], n_gallery=3), "listed twice"),
        (lambda: Positives.from_lists([[1]], n_gallery=3, grades=[[0.0]]), "grades must be finite and > 0"),
        (lambda: Positives.from_pairs(np.array([0]), np.array([0.5]), 1, 3), "integer arrays"),
    ],
)
def test_bad_positives_are_refused(build, message):
    with pytest.raises(InputError, match=message):
        build()


def test_labels_and_positives_together_or_neither_are_refused():
    positives = Positives.from_lists([[0]], n_gallery=1)
    with pytest.raises(InputError, match="either as labels or as positives"):
        evaluate_retrieval(line(0), np.array([0]), line(1), np.array([0]), positives=positives)
    with pytest.raises(InputError, match="no relevance given"):
        evaluate_retrieval(line(0), None, line(1), None)
    with pytest.raises(InputError, match="describe 1 queries x 1 gallery"):
        evaluate_retrieval(line(0, 1), None, line(1), None, positives=positives)


def test_unknown_metric_names_say_what_exists():
    with pytest.raises(InputError, match="recall@1"):
        metric_value(RetrievalResult(cmc={1: 1.0}, mean_ap=1.0, n_queries=1, n_skipped=0), "R@1")

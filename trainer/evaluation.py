"""Retrieval evaluation: CMC top-k, mAP@1.0 and the IR metrics R@k, MRR and nDCG@10, chunked,
exact and deterministic (numpy only).

Relevance is given either by class labels (class-level retrieval: every gallery item of the
query's class is a positive) or by explicit positives per query (:class:`~.relevance.Positives`:
instance-level retrieval, one or many positives, optionally graded).

Ranking semantics (used everywhere in the kit):

* ``l2`` ranks the gallery by squared Euclidean distance (the order of Euclidean distance;
  no square root, so no extra ties), ``cosine`` by ``1 - cos(q, g)``.
* Ties are broken by gallery index: the gallery is ordered by the pair (distance, index).
* CMC@k: the fraction of evaluated queries with an item of their class among the first k.
* AP of a query: ``mean_i(i / rank_i)`` over its positives, ``rank_i`` the 1-based rank of
  the i-th positive in that order; mAP@1.0 is the mean over evaluated queries.
* R@k (recall at k, the IR definition): the fraction of a query's positives among its first
  k, averaged over queries. With one positive per query it equals CMC@k (hit rate).
* MRR: the mean over queries of ``1 / rank`` of the first positive.
* nDCG@10: ``DCG@10 / IDCG@10`` with linear gains (the positive's grade, 1 when ungraded) and
  discount ``1 / log2(rank + 1)``, as trec_eval's ``ndcg_cut_10``.

How distances are compared so that the ranking is exact and deterministic (for every chunk
size and thread count): :mod:`.ranking`.

Without exact distance ties this AP equals ``sklearn.metrics.average_precision_score(
y_true, -distance)``. With ties the two differ on purpose: scikit-learn puts a whole tie group
at one threshold, so every positive in the group gets the precision at the group's end,
while we rank tied items by gallery index (a strict order, the same one CMC uses). Example:
gallery distances ``[1, 1]`` with labels ``[neg, pos]``: scikit-learn gives AP 0.5 and we
give 0.5; labels ``[pos, neg]``: scikit-learn 0.5, we 1.0; distances ``[0, 1, 1]`` with
labels ``[neg, pos, pos]``: scikit-learn 2/3, we ``(1/2 + 2/3) / 2 = 7/12``.

Memory: one chunk of ``chunk_size`` queries x gallery keys (float64, reused) plus the
float64 embeddings and per-query results: ~1.3 GiB for 100k x 100k x 128 at chunk 1024.
Only gallery items no farther than a query's farthest positive are sorted, and AP comes
from the ranks of the positives, never from a full argsort.

Its parts, each its own module: :mod:`.evaluation_inputs` (checks of the inputs),
:mod:`.relevance` (labels or positives), :mod:`.ranking` (the order) and
:mod:`.retrieval_result` (the result and its metrics by name). Built on the results:
:mod:`.compatibility` (ECC, the compatibility matrix) and :mod:`.backfill_curves`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

import numpy as np
from tqdm.auto import tqdm

from fctkit.errors import InputError

from .evaluation_inputs import Distance, check_positive_int, check_topk, prepare_embeddings
from .ranking import RankingKeys, positive_ranks
from .relevance import Positives, relevance_lookup
from .retrieval_result import RetrievalResult


@dataclass(frozen=True)
class QueryRanks:
    """Per-query ranking facts, the raw material of every metric.

    ``first_positive_rank[i]`` is the 1-based rank of query i's nearest positive,
    ``average_precision[i]`` its AP, ``found_at[i, c]`` how many of its positives rank within
    ``cutoffs[c]`` and ``ndcg10[i]`` its nDCG@10; all are 0 / nan for skipped queries
    (``n_positives`` 0).
    """

    first_positive_rank: np.ndarray
    average_precision: np.ndarray
    n_positives: np.ndarray = field(repr=False)
    cutoffs: tuple[int, ...] = ()
    found_at: np.ndarray | None = field(default=None, repr=False)
    ndcg10: np.ndarray | None = field(default=None, repr=False)
    relevance: str = "class"

    @property
    def evaluated(self) -> np.ndarray:
        return self.n_positives > 0


def evaluate_retrieval(
    query: np.ndarray,
    query_labels: np.ndarray | None,
    gallery: np.ndarray,
    gallery_labels: np.ndarray | None,
    *,
    positives: Positives | None = None,
    distance: Distance = "l2",
    topk: Sequence[int] = (1, 5),
    leave_one_out: bool = False,
    chunk_size: int = 1024,
    workers: int | None = None,
    progress: bool = False,
) -> RetrievalResult:
    """CMC@k for every k in ``topk`` (k = 1 always included), mAP@1.0, R@k (k in ``topk`` and
    1, 5, 10), MRR and nDCG@10.

    Relevance: the labels (same class = positive), or ``positives`` (then both labels are None).
    ``leave_one_out=True`` says query i and gallery i are the same item (possibly embedded
    by different models): the sets must have the same length and labels, and query i never
    sees gallery i. Queries without any positive in the gallery are skipped and counted.
    ``workers`` threads rank the rows of a chunk (default: up to 4 CPUs); results do not
    depend on it. Raises :class:`InputError` on bad input or when no query can be evaluated.
    """
    ks = check_topk(topk)
    ranks = rank_queries(
        query,
        query_labels,
        gallery,
        gallery_labels,
        positives=positives,
        distance=distance,
        leave_one_out=leave_one_out,
        chunk_size=chunk_size,
        workers=workers,
        progress=progress,
        cutoffs=tuple(sorted({*ks, *RECALL_CUTOFFS})),
    )
    return summarize(ranks, ks, distance=distance)


RECALL_CUTOFFS = (1, 5, 10)


def summarize(ranks: QueryRanks, topk: Sequence[int] = (1, 5), *, distance: str = "l2") -> RetrievalResult:
    """Aggregate per-query ranks into a :class:`RetrievalResult`."""
    ks = check_topk(topk)
    evaluated = ranks.evaluated
    n = int(np.count_nonzero(evaluated))
    if n == 0:
        raise InputError(
            "no query has a positive in the gallery (after leave-one-out): nothing to evaluate; "
            "check that query and gallery labels use the same classes, or that every query lists a positive"
        )
    first = ranks.first_positive_rank[evaluated]
    k_max = max(ks)
    hits = np.bincount(np.minimum(first, k_max + 1), minlength=k_max + 2)[1 : k_max + 1]
    curve = tuple(float(c) / n for c in np.cumsum(hits))
    mean = lambda values: math.fsum(values[evaluated].tolist()) / n  # noqa: E731
    recall = {}
    if ranks.found_at is not None:
        share = ranks.found_at / np.maximum(ranks.n_positives, 1)[:, None]
        recall = {k: mean(share[:, c]) for c, k in enumerate(ranks.cutoffs)}
    return RetrievalResult(
        cmc={k: curve[k - 1] for k in ks},
        mean_ap=mean(ranks.average_precision),
        n_queries=n,
        n_skipped=int(evaluated.size - n),
        cmc_curve=curve,
        distance=distance,
        recall=recall,
        mrr=mean(1.0 / np.maximum(ranks.first_positive_rank, 1)),
        ndcg10=mean(ranks.ndcg10) if ranks.ndcg10 is not None else math.nan,
        relevance=ranks.relevance,
    )


def rank_queries(
    query: np.ndarray,
    query_labels: np.ndarray | None,
    gallery: np.ndarray,
    gallery_labels: np.ndarray | None,
    *,
    positives: Positives | None = None,
    distance: Distance = "l2",
    leave_one_out: bool = False,
    chunk_size: int = 1024,
    workers: int | None = None,
    progress: bool = False,
    cutoffs: Sequence[int] = RECALL_CUTOFFS,
) -> QueryRanks:
    """Per-query first-positive rank, AP, positives found within each cutoff and nDCG@10 (see
    the module docstring and :mod:`.ranking` for the ranking)."""
    q, g = prepare_embeddings(query, gallery, distance)
    relevance_of = relevance_lookup(query_labels, gallery_labels, positives, len(q), len(g), leave_one_out)
    cutoffs = check_topk(cutoffs)
    chunk_size = check_positive_int(chunk_size, "chunk_size")
    n_workers = check_positive_int(workers, "workers") if workers is not None else min(4, os.cpu_count() or 1)
    keys = RankingKeys(q, g, distance, min(chunk_size, len(q)))

    first = np.zeros(len(q), dtype=np.int64)
    ap = np.full(len(q), np.nan)
    n_pos = np.zeros(len(q), dtype=np.int64)
    found = np.zeros((len(q), len(cutoffs)), dtype=np.int64)
    ndcg = np.full(len(q), np.nan)
    cutoff_array = np.asarray(cutoffs)

    def rank_rows(rows: range, block: np.ndarray, start: int) -> None:
        for i in rows:
            pos, grades = relevance_of(i)
            row = block[i - start]
            if leave_one_out:
                keep = pos != i
                pos, grades = pos[keep], grades[keep]
                row[i] = np.inf
            if pos.size:
                ranks, order = positive_ranks(row, pos, keys.tolerance[i], partial(keys.canonical, i))
                first[i] = ranks[0]
                ap[i] = float(np.mean(np.arange(1, ranks.size + 1) / ranks))
                n_pos[i] = ranks.size
                found[i] = np.searchsorted(ranks, cutoff_array, side="right")
                ndcg[i] = _ndcg_at_10(ranks, order, grades)

    with ThreadPoolExecutor(n_workers) as pool:
        starts = range(0, len(q), chunk_size)
        for start in tqdm(starts, desc="ranking query chunks", unit="chunk", disable=not progress or len(starts) < 2):
            stop = min(start + chunk_size, len(q))
            block = keys.chunk(start, stop)
            list(pool.map(partial(rank_rows, block=block, start=start), _split(range(start, stop), n_workers)))
    return QueryRanks(
        first_positive_rank=first,
        average_precision=ap,
        n_positives=n_pos,
        cutoffs=cutoffs,
        found_at=found,
        ndcg10=ndcg,
        relevance="class" if positives is None else "explicit",
    )


_DISCOUNT_10 = 1.0 / np.log2(np.arange(2, 12))


def _ndcg_at_10(ranks: np.ndarray, order: np.ndarray, gains: np.ndarray) -> float:
    """nDCG@10 of one query: ``ranks`` sorted, ``gains[order[j]]`` the gain of the positive at ``ranks[j]``."""
    within = int(np.searchsorted(ranks, 10, side="right"))
    dcg = float(np.sum(gains[order[:within]] / np.log2(ranks[:within] + 1)))
    top = min(10, gains.size)
    ideal = -np.sort(np.partition(-gains, top - 1)[:top])  # the 10 largest gains, largest first: O(n), not a full sort
    return dcg / float(np.sum(ideal * _DISCOUNT_10[:top]))


def _split(rows: range, parts: int) -> list[range]:
    step = -(-len(rows) // parts)
    return [rows[i : i + step] for i in range(0, len(rows), step)]

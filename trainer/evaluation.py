"""Retrieval evaluation: CMC top-k, mAP@1.0 and the IR metrics R@k, MRR and nDCG@10, chunked,
exact and deterministic (numpy only).

Relevance is given either by class labels (class-level retrieval: every gallery item of the
query's class is a positive) or by explicit positives per query (:class:`Positives`:
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

How distances are compared: a float64 matrix product gives fast keys for a chunk of
queries against the whole gallery, accurate to a proven per-query tolerance (~1e-13
relative). Pairs further apart than that are ordered by the fast keys; items within it of
a positive (exact ties or near ties) are compared by a canonical float64 distance computed
from the two vectors alone, then by gallery index. So the ranking agrees with exact
distances wherever they differ by more than float64 rounding, and it does not depend on how
BLAS blocks or threads the product: results are identical for every ``chunk_size`` and
``workers`` (sums over queries are exact, too). Float32 keys would be 3x faster to compute
but would invent thousands of ties in a 100k gallery.

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
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
from tqdm.auto import tqdm

from fctkit.errors import InputError

Distance = Literal["l2", "cosine"]
DISTANCES: tuple[str, ...] = ("l2", "cosine")


@dataclass(frozen=True)
class RetrievalResult:
    """Aggregate retrieval metrics of one query set against one gallery.

    ``cmc`` always holds k = 1; ``cmc_curve[k - 1]`` is CMC@k for every k up to the largest
    requested k (what report plots draw).
    """

    cmc: dict[int, float]
    mean_ap: float
    n_queries: int
    n_skipped: int
    cmc_curve: tuple[float, ...] = ()
    distance: str = "l2"
    recall: dict[int, float] = field(default_factory=dict)
    mrr: float = math.nan
    ndcg10: float = math.nan
    relevance: str = "class"  # "class" (by labels) or "explicit" (positives per query)

    @property
    def top1(self) -> float:
        return self.cmc[1]

    def to_dict(self) -> dict:
        """JSON-serialisable form; :meth:`from_dict` inverts it."""
        return {
            "cmc": {str(k): v for k, v in sorted(self.cmc.items())},
            "top1": self.top1,
            "mean_ap": self.mean_ap,
            "n_queries": self.n_queries,
            "n_skipped": self.n_skipped,
            "cmc_curve": list(self.cmc_curve),
            "distance": self.distance,
            "recall": {str(k): v for k, v in sorted(self.recall.items())},
            "mrr": None if math.isnan(self.mrr) else self.mrr,
            "ndcg10": None if math.isnan(self.ndcg10) else self.ndcg10,
            "relevance": self.relevance,
        }

    @classmethod
    def from_dict(cls, data: dict) -> RetrievalResult:
        try:
            return cls(
                cmc={int(k): float(v) for k, v in data["cmc"].items()},
                mean_ap=float(data["mean_ap"]),
                n_queries=int(data["n_queries"]),
                n_skipped=int(data["n_skipped"]),
                cmc_curve=tuple(float(v) for v in data.get("cmc_curve", ())),
                distance=str(data.get("distance", "l2")),
                recall={int(k): float(v) for k, v in data.get("recall", {}).items()},
                mrr=_float_or_nan(data.get("mrr")),
                ndcg10=_float_or_nan(data.get("ndcg10")),
                relevance=str(data.get("relevance", "class")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise InputError(f"not a retrieval result: {exc!r} in {data!r}") from exc


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


@dataclass(frozen=True)
class Positives:
    """Explicit relevance: the positives of each query as gallery row indices, with grades.

    Stored compressed by query (CSR): query i's positives are ``indices[indptr[i]:indptr[i+1]]``
    with grades ``grades[...]`` (all > 0; 1.0 when ungraded). Build with :meth:`from_lists`
    or :meth:`from_pairs`.
    """

    indptr: np.ndarray
    indices: np.ndarray
    grades: np.ndarray
    n_gallery: int

    @property
    def n_queries(self) -> int:
        return len(self.indptr) - 1

    def of(self, query: int) -> tuple[np.ndarray, np.ndarray]:
        lo, hi = self.indptr[query], self.indptr[query + 1]
        return self.indices[lo:hi], self.grades[lo:hi]

    @property
    def graded(self) -> bool:
        return bool(np.any(self.grades != 1.0))

    @classmethod
    def from_lists(cls, positives: Sequence[Sequence[int]], n_gallery: int,
                   grades: Sequence[Sequence[float]] | None = None) -> Positives:
        """``positives[i]`` lists query i's gallery rows (``grades[i]`` their grades, if any)."""
        query = np.repeat(np.arange(len(positives)), [len(p) for p in positives])
        flat = np.asarray([g for p in positives for g in p], dtype=np.int64)
        flat_grades = None if grades is None else np.asarray([x for gs in grades for x in gs], dtype=np.float64)
        return cls.from_pairs(query, flat, len(positives), n_gallery, flat_grades)

    @classmethod
    def from_pairs(cls, query: np.ndarray, gallery: np.ndarray, n_queries: int, n_gallery: int,
                   grades: np.ndarray | None = None) -> Positives:
        """Positives from aligned (query row, gallery row[, grade]) pairs, in any order."""
        query = np.asarray(query).reshape(-1)
        gallery = np.asarray(gallery).reshape(-1)
        if query.dtype.kind not in "iu" or gallery.dtype.kind not in "iu" or len(query) != len(gallery):
            raise InputError("positives: query and gallery rows must be aligned integer arrays")
        if len(query) and (query.min() < 0 or query.max() >= n_queries):
            raise InputError(f"positives: a query row is outside 0..{n_queries - 1}")
        if len(gallery) and (gallery.min() < 0 or gallery.max() >= n_gallery):
            raise InputError(f"positives: a gallery row is outside 0..{n_gallery - 1}")
        grades = np.ones(len(query)) if grades is None else np.asarray(grades, dtype=np.float64).reshape(-1)
        if len(grades) != len(query):
            raise InputError(f"positives: {len(grades)} grades for {len(query)} pairs")
        if not np.all(np.isfinite(grades)) or np.any(grades <= 0):
            raise InputError("positives: grades must be finite and > 0 (list only relevant items)")
        order = np.lexsort((gallery, query))
        query, gallery, grades = query[order], gallery[order], grades[order]
        if np.any((np.diff(query) == 0) & (np.diff(gallery) == 0)):
            raise InputError("positives: a (query, gallery item) pair is listed twice")
        indptr = np.concatenate([[0], np.cumsum(np.bincount(query, minlength=n_queries))]).astype(np.int64)
        return cls(indptr, gallery.astype(np.int64), grades, int(n_gallery))


def metric_value(result: RetrievalResult, metric: str) -> float:
    """The value of ``metric`` in ``result``: ``top1``, ``topK`` (any k in its CMC), ``mean_ap``,
    ``recall@K``, ``mrr`` or ``ndcg@10``."""
    kind, k = parse_metric(metric)
    if kind == "mean_ap":
        return result.mean_ap
    if kind in ("mrr", "ndcg@10"):
        value = result.mrr if kind == "mrr" else result.ndcg10
        if math.isnan(value):
            raise InputError(f"metric {metric!r}: this result was computed without it (an older report)")
        return value
    if kind == "recall":
        if k in result.recall:
            return result.recall[k]
        raise InputError(f"metric {metric!r}: this result has R@k only for k in {sorted(result.recall)}")
    if k in result.cmc:
        return result.cmc[k]
    if k <= len(result.cmc_curve):
        return result.cmc_curve[k - 1]
    raise InputError(f"metric {metric!r}: this result has CMC only for k in {sorted(result.cmc)}")


METRIC_NAMES = "'top1', 'top5', ... (CMC), 'recall@1', 'recall@10', ... (R@k), 'mrr', 'ndcg@10' or 'mean_ap'"


def parse_metric(metric: str) -> tuple[str, int | None]:
    """``("top", k)``, ``("recall", k)``, ``("mrr", None)``, ``("ndcg@10", None)`` or
    ``("mean_ap", None)``; anything else is an :class:`InputError`."""
    if metric in ("mean_ap", "mrr", "ndcg@10"):
        return metric, None
    if isinstance(metric, str):
        for prefix, kind in (("top", "top"), ("recall@", "recall")):
            rest = metric[len(prefix):]
            if metric.startswith(prefix) and rest.isdigit() and int(rest) >= 1:
                return kind, int(rest)
    raise InputError(f"unknown metric {metric!r}: use {METRIC_NAMES}")


def metric_label(metric: str) -> str:
    """How reports write a metric: top-1, R@10, MRR, nDCG@10, mAP."""
    kind, k = parse_metric(metric)
    return {"top": f"top-{k}", "recall": f"R@{k}", "mrr": "MRR", "ndcg@10": "nDCG@10", "mean_ap": "mAP"}[kind]


def _metric_k(metric: str) -> int | None:
    """k of a ``topK`` or ``recall@K`` metric, None for the others."""
    return parse_metric(metric)[1]


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
    ks = _check_topk(topk)
    ranks = rank_queries(
        query, query_labels, gallery, gallery_labels, positives=positives, distance=distance,
        leave_one_out=leave_one_out, chunk_size=chunk_size, workers=workers, progress=progress,
        cutoffs=tuple(sorted({*ks, *RECALL_CUTOFFS})),
    )
    return summarize(ranks, ks, distance=distance)


RECALL_CUTOFFS = (1, 5, 10)


def summarize(ranks: QueryRanks, topk: Sequence[int] = (1, 5), *, distance: str = "l2") -> RetrievalResult:
    """Aggregate per-query ranks into a :class:`RetrievalResult`."""
    ks = _check_topk(topk)
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
    the module docstring for the ranking)."""
    q, g = _prepare_embeddings(query, gallery, distance)
    relevance_of = _relevance(query_labels, gallery_labels, positives, len(q), len(g), leave_one_out)
    cutoffs = _check_topk(cutoffs)
    chunk_size = _check_positive_int(chunk_size, "chunk_size")
    n_workers = _check_positive_int(workers, "workers") if workers is not None else min(4, os.cpu_count() or 1)
    keys = _RankingKeys(q, g, distance, min(chunk_size, len(q)))

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
                ranks, order = _positive_ranks(row, pos, keys.tolerance[i], lambda idx: keys.canonical(i, idx))
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
            list(pool.map(lambda rows: rank_rows(rows, block, start), _split(range(start, stop), n_workers)))
    return QueryRanks(first_positive_rank=first, average_precision=ap, n_positives=n_pos, cutoffs=cutoffs,
                      found_at=found, ndcg10=ndcg, relevance="class" if positives is None else "explicit")


_DISCOUNT_10 = 1.0 / np.log2(np.arange(2, 12))


def _ndcg_at_10(ranks: np.ndarray, order: np.ndarray, gains: np.ndarray) -> float:
    """nDCG@10 of one query: ``ranks`` sorted, ``gains[order[j]]`` the gain of the positive at ``ranks[j]``."""
    within = int(np.searchsorted(ranks, 10, side="right"))
    dcg = float(np.sum(gains[order[:within]] / np.log2(ranks[:within] + 1)))
    top = min(10, gains.size)
    ideal = -np.sort(np.partition(-gains, top - 1)[:top])  # the 10 largest gains, largest first: O(n), not a full sort
    return dcg / float(np.sum(ideal * _DISCOUNT_10[:top]))


def _relevance(
    query_labels: np.ndarray | None, gallery_labels: np.ndarray | None, positives: Positives | None,
    n_q: int, n_g: int, leave_one_out: bool,
) -> Callable[[int], tuple[np.ndarray, np.ndarray]]:
    """``relevance_of(i) -> (positive gallery rows, their grades)`` from labels or explicit positives."""
    if positives is not None:
        if query_labels is not None or gallery_labels is not None:
            raise InputError("give relevance either as labels or as positives=, not both")
        if positives.n_queries != n_q or positives.n_gallery != n_g:
            raise InputError(f"positives describe {positives.n_queries} queries x {positives.n_gallery} gallery items; "
                             f"the embeddings are {n_q} x {n_g}")
        if leave_one_out and n_q != n_g:
            raise InputError(f"leave_one_out needs query and gallery to be the same items; got {n_q} and {n_g}")
        return positives.of
    if query_labels is None or gallery_labels is None:
        raise InputError("no relevance given: pass query and gallery labels, or positives=")
    q_codes, g_codes = _encode_labels(query_labels, gallery_labels, n_q, n_g)
    if leave_one_out and (n_q != n_g or not np.array_equal(q_codes, g_codes)):
        raise InputError(
            "leave_one_out needs query and gallery to be the same items in the same order "
            f"(same length and labels); got {n_q} queries and {n_g} gallery items"
            + ("" if n_q != n_g else " with different labels")
        )
    by_class = _positives_by_class(g_codes)
    ones = {c: np.ones(len(idx)) for c, idx in by_class.items()}
    return lambda i: (by_class.get(int(q_codes[i]), _EMPTY), ones.get(int(q_codes[i]), _EMPTY_GRADES))


def pairwise_distances(query: np.ndarray, gallery: np.ndarray, distance: Distance = "l2") -> np.ndarray:
    """The full (n_query, n_gallery) float64 distance matrix (small sets only).

    Squared Euclidean for ``l2``, ``1 - cos`` for ``cosine``: the fast ranking keys plus a
    per-row constant (see :class:`_RankingKeys`).
    """
    q, g = _prepare_embeddings(query, gallery, distance)
    keys = _RankingKeys(q, g, distance, len(q)).chunk(0, len(q))
    if distance == "l2":
        return keys + np.einsum("ij,ij->i", q, q)[:, None]
    return keys + 1.0


_EMPTY = np.zeros(0, dtype=np.int64)
_EMPTY_GRADES = np.zeros(0)


def _positives_by_class(codes: np.ndarray) -> dict[int, np.ndarray]:
    """Class code -> sorted gallery indices of that class."""
    order = np.argsort(codes, kind="stable")
    classes, starts = np.unique(codes[order], return_index=True)
    return {int(c): idx for c, idx in zip(classes, np.split(order, starts[1:]))}


def _positive_ranks(
    row: np.ndarray, pos: np.ndarray, tolerance: float, canonical: Callable[[np.ndarray], np.ndarray]
) -> tuple[np.ndarray, np.ndarray]:
    """Sorted 1-based ranks of the gallery items ``pos`` in the order (distance, gallery index),
    and the permutation of ``pos`` they belong to (``pos[order[j]]`` has rank ``ranks[j]``).

    ``row`` holds fast keys accurate to ``tolerance``: items whose key is below a positive's
    by more than that precede it for certain. Only items no farther than the farthest
    positive (plus the tolerance) can precede a positive, so only those are sorted. Items
    within the tolerance of a positive (exact or near ties, rare) are compared by their
    ``canonical`` keys, then by gallery index.
    """
    order = np.argsort(row[pos], kind="stable")
    pos = pos[order]
    d_pos = row[pos]
    limit = d_pos[-1] + tolerance
    candidates = np.compress(row <= limit, row)  # several times faster than row[mask] here
    candidates.sort()
    before = np.searchsorted(candidates, d_pos - tolerance, side="left")  # sorted keys: fast
    ranks = before + 1
    band_end = np.searchsorted(candidates, d_pos + tolerance, side="right")
    ambiguous = np.flatnonzero(band_end - before > 1)  # more than the positive itself in its band
    if ambiguous.size:
        cand_index = np.flatnonzero(row <= limit)
        in_key_order = cand_index[np.argsort(row[cand_index], kind="stable")]
        for j in ambiguous:
            band = in_key_order[before[j] : band_end[j]]
            keys = canonical(band)
            own = keys[band == pos[j]][0]
            ranks[j] += np.count_nonzero((keys < own) | ((keys == own) & (band < pos[j])))
        resort = np.argsort(ranks, kind="stable")
        ranks, order = ranks[resort], order[resort]
    return ranks, order


class _RankingKeys:
    """Fast ranking keys of query rows [start, stop) against the whole gallery, plus the
    exact comparison for near ties.

    Fast keys come out of one float64 matrix product of augmented rows written into one
    reused buffer: ``l2``: ``[-2q, 1] . [g, |g|^2] = |q - g|^2 - |q|^2`` (scaling by -2 is
    exact); ``cosine``: ``-q.g`` of unit rows. BLAS sums in an order that depends on the
    block shape and threading, so one pair's key can differ in its last bits between
    chunkings. ``tolerance[i]`` bounds that error for query row i (a rounding-error bound
    valid for any summation order, with a 2x margin): keys further apart than it are
    ordered correctly; closer pairs are compared by :meth:`canonical`, which computes the
    distance from the two vectors alone in a fixed order.
    """

    def __init__(self, q: np.ndarray, g: np.ndarray, distance: str, max_rows: int) -> None:
        self.q_rows, self.g_rows, self.distance = q, g, distance
        bound = 4 * (2 * q.shape[1] + 8) * np.finfo(np.float64).eps / 2
        if distance == "l2":
            self.q = np.hstack([-2.0 * q, np.ones((len(q), 1))])
            self.g_t = np.ascontiguousarray(np.hstack([g, np.einsum("ij,ij->i", g, g)[:, None]]).T)
            reach = np.linalg.norm(q, axis=1) + np.linalg.norm(g, axis=1).max()
            self.tolerance = bound * reach * reach
        else:
            self.q = -q
            self.g_t = np.ascontiguousarray(g.T)
            self.tolerance = np.full(len(q), bound)
        self.buffer = np.empty((max_rows, self.g_t.shape[1]))

    def chunk(self, start: int, stop: int) -> np.ndarray:
        out = self.buffer[: stop - start]
        np.matmul(self.q[start:stop], self.g_t, out=out)
        return out

    def canonical(self, i: int, gallery_index: np.ndarray) -> np.ndarray:
        """Keys of query i against some gallery items: a row-local numpy reduction whose
        value depends on the two vectors only (squared distance, or -cos)."""
        if self.distance == "l2":
            return np.add.reduce(np.square(self.q_rows[i] - self.g_rows[gallery_index]), axis=1)
        return -np.add.reduce(self.q_rows[i] * self.g_rows[gallery_index], axis=1)


def _prepare_embeddings(query: np.ndarray, gallery: np.ndarray, distance: str) -> tuple[np.ndarray, np.ndarray]:
    if distance not in DISTANCES:
        raise InputError(f"distance must be one of {', '.join(DISTANCES)}; got {distance!r}")
    q = _as_matrix(query, "query")
    g = _as_matrix(gallery, "gallery")
    if q.shape[1] != g.shape[1]:
        raise InputError(
            f"query and gallery embeddings have different dims ({q.shape[1]} vs {g.shape[1]}); "
            "embed both with the same model or adapt one into the other's space first"
        )
    if distance == "cosine":
        return _unit_rows(q, "query"), _unit_rows(g, "gallery")
    return q, g


def _as_matrix(x: np.ndarray, name: str) -> np.ndarray:
    try:
        arr = np.asarray(x)
    except (TypeError, ValueError) as exc:
        raise InputError(f"{name} embeddings are not an array: {exc}") from exc
    if arr.dtype.kind not in "iuf":
        raise InputError(f"{name} embeddings must be real numbers; got dtype {arr.dtype}")
    if arr.ndim != 2:
        raise InputError(f"{name} embeddings must be 2-D (items x dims); got shape {arr.shape}")
    if arr.shape[0] == 0 or arr.shape[1] == 0:
        raise InputError(f"{name} set is empty (shape {arr.shape}); give at least one item of dim >= 1")
    arr = np.ascontiguousarray(arr, dtype=np.float64)
    bad = ~np.isfinite(arr)
    if bad.any():
        rows = np.unique(np.nonzero(bad)[0])
        raise InputError(
            f"{name} embeddings contain NaN/inf in {rows.size} row(s), first at row {int(rows[0])}; "
            "fix or drop those items"
        )
    return arr


def _unit_rows(x: np.ndarray, name: str) -> np.ndarray:
    norms = np.linalg.norm(x, axis=1)
    zero = np.flatnonzero(norms == 0)
    if zero.size:
        raise InputError(
            f"{name} has {zero.size} all-zero embedding(s) (first at row {int(zero[0])}): "
            "cosine distance is undefined for them; use distance='l2' or drop them"
        )
    return x / norms[:, None]


def _encode_labels(query_labels: np.ndarray, gallery_labels: np.ndarray, n_q: int, n_g: int) -> tuple[np.ndarray, np.ndarray]:
    """Map both label arrays to shared integer class codes."""
    ql = _as_labels(query_labels, "query", n_q)
    gl = _as_labels(gallery_labels, "gallery", n_g)
    if _label_kind(ql) != _label_kind(gl):
        raise InputError(
            f"query labels are {_label_kind(ql)} ({ql.dtype}) but gallery labels are {_label_kind(gl)} "
            f"({gl.dtype}); use the same label type for both"
        )
    _, codes = np.unique(np.concatenate([gl, ql]), return_inverse=True)
    return codes[n_g:].astype(np.int64), codes[:n_g].astype(np.int64)


def _as_labels(labels: np.ndarray, name: str, n: int) -> np.ndarray:
    arr = np.asarray(labels)
    if arr.ndim != 1:
        raise InputError(f"{name} labels must be 1-D; got shape {arr.shape}")
    if arr.shape[0] != n:
        raise InputError(f"{name} has {n} embeddings but {arr.shape[0]} labels; give one label per item")
    if arr.dtype.kind == "f" and not np.isfinite(arr).all():
        raise InputError(f"{name} labels contain NaN/inf; every item needs a class")
    if arr.dtype.kind not in "iufUSb":
        raise InputError(f"{name} labels must be integers or strings; got dtype {arr.dtype}")
    return arr


def _label_kind(labels: np.ndarray) -> str:
    return {"U": "text", "S": "bytes"}.get(labels.dtype.kind, "numbers")


def _float_or_nan(value: object) -> float:
    return math.nan if value is None else float(value)


def _check_topk(topk: Sequence[int]) -> tuple[int, ...]:
    try:
        ks = list(topk)
    except TypeError as exc:
        raise InputError(f"topk must be a sequence of integers >= 1; got {topk!r}") from exc
    for k in ks:
        if isinstance(k, (bool, np.bool_)) or not isinstance(k, (int, np.integer)) or k < 1:
            raise InputError(f"topk values must be integers >= 1; got {k!r} in {topk!r}")
    return tuple(sorted({1, *(int(k) for k in ks)}))


def _check_positive_int(value: int, name: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
        raise InputError(f"{name} must be an integer >= 1; got {value!r}")
    return int(value)


def _split(rows: range, parts: int) -> list[range]:
    step = -(-len(rows) // parts)
    return [rows[i : i + step] for i in range(0, len(rows), step)]


def ecc(new_to_adapted: RetrievalResult, old_to_old: RetrievalResult, metric: str = "top1") -> bool:
    """Empirical compatibility criterion: M(new, h(old)) > M(old, old), strictly."""
    return metric_value(new_to_adapted, metric) > metric_value(old_to_old, metric)


@dataclass(frozen=True)
class CompatibilityMatrix:
    """C[i, j] = M(query model i, gallery model j) for j <= i (nan above the diagonal).

    ``ac``: average compatibility, the fraction of pairs i > j with C[i, j] > C[j, j];
    ``am``: average multi-model accuracy, the mean of C over i >= j (CoReS definitions).
    """

    values: np.ndarray
    ac: float
    am: float

    def to_markdown(self, names: Sequence[str]) -> str:
        t = self.values.shape[0]
        if len(names) != t:
            raise InputError(f"need {t} version names for a {t}x{t} compatibility matrix; got {len(names)}")
        lines = [
            "| query \\ gallery | " + " | ".join(names) + " |",
            "|---" * (t + 1) + "|",
        ]
        for i, name in enumerate(names):
            cells = [f"{self.values[i, j]:.4f}" if j <= i else "" for j in range(t)]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
        lines.append(f"AC = {self.ac:.4f}, AM = {self.am:.4f}")
        return "\n".join(lines)

    def to_dict(self) -> dict:
        return {
            "values": [[None if np.isnan(v) else float(v) for v in row] for row in self.values],
            "ac": self.ac,
            "am": self.am,
        }

    @classmethod
    def from_dict(cls, data: dict) -> CompatibilityMatrix:
        values = np.array([[np.nan if v is None else v for v in row] for row in data["values"]], dtype=float)
        return cls(values=values, ac=float(data["ac"]), am=float(data["am"]))


def compatibility_matrix(evaluate: Callable[[int, int], float], n_versions: int) -> CompatibilityMatrix:
    """Fill C[i, j] = evaluate(i, j) for every j <= i and compute AC and AM.

    AC = 2 / (T (T - 1)) * sum_{i > j} 1[C_ij > C_jj];  AM = 2 / (T (T + 1)) * sum_{i >= j} C_ij.
    """
    t = _check_positive_int(n_versions, "n_versions")
    if t < 2:
        raise InputError("a compatibility matrix needs at least two versions")
    values = np.full((t, t), np.nan)
    for i in range(t):
        for j in range(i + 1):
            value = float(evaluate(i, j))
            if not math.isfinite(value):
                raise InputError(f"evaluate({i}, {j}) returned {value!r}; expected a finite metric")
            values[i, j] = value
    lower = np.tril_indices(t, k=-1)
    ac = float(np.count_nonzero(values[lower] > np.diag(values)[lower[1]])) * 2 / (t * (t - 1))
    am = math.fsum(values[np.tril_indices(t)].tolist()) * 2 / (t * (t + 1))
    return CompatibilityMatrix(values=values, ac=ac, am=am)


@dataclass(frozen=True)
class BackfillCurve:
    """Metric after backfilling each fraction of the gallery; ``area`` is M~ (trapezoid on [0, 1])."""

    fractions: np.ndarray
    values: np.ndarray
    area: float
    metric: str = "top1"

    def to_dict(self) -> dict:
        return {
            "fractions": self.fractions.tolist(),
            "values": self.values.tolist(),
            "area": self.area,
            "metric": self.metric,
        }

    @classmethod
    def from_dict(cls, data: dict) -> BackfillCurve:
        return cls(
            fractions=np.asarray(data["fractions"], dtype=float),
            values=np.asarray(data["values"], dtype=float),
            area=float(data["area"]),
            metric=str(data.get("metric", "top1")),
        )


def backfill_curve(
    query: np.ndarray,
    query_labels: np.ndarray | None,
    adapted_gallery: np.ndarray,
    backfilled_gallery: np.ndarray,
    gallery_labels: np.ndarray | None,
    order: np.ndarray,
    *,
    positives: Positives | None = None,
    steps: int = 10,
    distance: Distance = "l2",
    metric: str = "top1",
    chunk_size: int = 1024,
    leave_one_out: bool = False,
    workers: int | None = None,
    progress: bool = False,
) -> BackfillCurve:
    """Evaluate ``metric`` at fractions t = 0, 1/steps, ..., 1 of the gallery backfilled.

    At fraction t the first ``round(t * N)`` items of ``order`` (a permutation of the gallery
    indices, most useful first) use their backfilled (new-model) embedding, the rest the
    adapted one; t = 0 is the adapted gallery, t = 1 the fully backfilled one.
    """
    adapted = _as_matrix(adapted_gallery, "adapted gallery")
    backfilled = _as_matrix(backfilled_gallery, "backfilled gallery")
    if adapted.shape != backfilled.shape:
        raise InputError(
            f"adapted and backfilled galleries must have the same shape; got {adapted.shape} and {backfilled.shape}"
        )
    n = adapted.shape[0]
    perm = np.asarray(order)
    if perm.ndim != 1 or perm.dtype.kind not in "iu" or perm.shape[0] != n or not np.array_equal(np.sort(perm), np.arange(n)):
        raise InputError(f"order must be a permutation of the {n} gallery indices (integers 0..{n - 1}, each once)")
    steps = _check_positive_int(steps, "steps")
    k = _metric_k(metric)
    fractions = np.linspace(0.0, 1.0, steps + 1)
    values = np.empty(steps + 1)
    for s, t in enumerate(tqdm(fractions, desc="backfill curve", unit="step", disable=not progress)):
        gallery = adapted.copy()
        chosen = perm[: int(round(t * n))]
        gallery[chosen] = backfilled[chosen]
        result = evaluate_retrieval(
            query, query_labels, gallery, gallery_labels, positives=positives, distance=distance, topk=(k or 1,),
            leave_one_out=leave_one_out, chunk_size=chunk_size, workers=workers,
        )
        values[s] = metric_value(result, metric)
    area = float(np.sum((values[1:] + values[:-1]) / 2 * np.diff(fractions)))
    return BackfillCurve(fractions=fractions, values=values, area=area, metric=metric)

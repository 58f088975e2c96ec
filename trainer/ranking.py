"""How the gallery is ordered for each query, exactly and deterministically (numpy only): the
fast keys of a chunk of queries (:class:`RankingKeys`), the ranks of one query's positives
(:func:`positive_ranks`), both used by :func:`~.evaluation.rank_queries`, and the full
distance matrix of small sets (:func:`pairwise_distances`).

How distances are compared: a float64 matrix product gives fast keys for a chunk of
queries against the whole gallery, accurate to a proven per-query tolerance (~1e-13
relative). Pairs further apart than that are ordered by the fast keys; items within it of
a positive (exact ties or near ties) are compared by a canonical float64 distance computed
from the two vectors alone, then by gallery index. So the ranking agrees with exact
distances wherever they differ by more than float64 rounding, and it does not depend on how
BLAS blocks or threads the product: results are identical for every ``chunk_size`` and
``workers`` (sums over queries are exact, too). Float32 keys would be 3x faster to compute
but would invent thousands of ties in a 100k gallery.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from .evaluation_inputs import Distance, prepare_embeddings


def positive_ranks(
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


class RankingKeys:
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


def pairwise_distances(query: np.ndarray, gallery: np.ndarray, distance: Distance = "l2") -> np.ndarray:
    """The full (n_query, n_gallery) float64 distance matrix (small sets only).

    Squared Euclidean for ``l2``, ``1 - cos`` for ``cosine``: the fast ranking keys plus a
    per-row constant (see :class:`RankingKeys`).
    """
    q, g = prepare_embeddings(query, gallery, distance)
    keys = RankingKeys(q, g, distance, len(q)).chunk(0, len(q))
    if distance == "l2":
        return keys + np.einsum("ij,ij->i", q, q)[:, None]
    return keys + 1.0

"""Backfill orderings: which gallery items to re-embed with the new model first (numpy only;
shared by the trainer's backfill curves and the device's `fctkit device backfill`).

- ``random``: a seeded permutation (the baseline).
- ``uncertainty``: FastFill's σ, largest first.
- ``class-mean-l2`` / ``class-mean-cosine``: distance of each embedding to the mean of its class,
  farthest first (λ-orth §3.6). Cosine uses L2-normalised rows, the mean of the normalised rows
  of the class, and distance ``1 − cos``. Without labels, k-means clusters stand in for classes.
- ``kmeans``: always k-means clusters (L2 distance to the cluster centre), labels or not.

Ties are broken by gallery index, so every ordering is deterministic.
"""

from __future__ import annotations

from typing import Literal, cast

import numpy as np

from fctkit.errors import InputError
from fctkit.feature_checks import check_features, validate_labels

OrderingKind = Literal["random", "uncertainty", "class-mean-l2", "class-mean-cosine", "kmeans"]
ORDERING_KINDS: tuple[str, ...] = ("random", "uncertainty", "class-mean-l2", "class-mean-cosine", "kmeans")


def backfill_order(
    kind: OrderingKind,
    embeddings: np.ndarray | None = None,
    labels: np.ndarray | None = None,
    uncertainty: np.ndarray | None = None,
    seed: int = 0,
    n_clusters: int | None = None,
) -> np.ndarray:
    """A permutation of the gallery rows (int64), most useful to backfill first.

    ``embeddings`` are the gallery rows as stored (e.g. φ_old); ``n_clusters`` (default
    ``round(sqrt(N / 2))``) is used when k-means stands in for classes.
    """
    if kind not in ORDERING_KINDS:
        raise InputError(f"unknown backfill ordering {kind!r}; choose one of {', '.join(ORDERING_KINDS)}")
    if kind == "uncertainty":
        sigma = _checked_uncertainty(uncertainty)
        if embeddings is not None and len(embeddings) != len(sigma):
            raise InputError(f"uncertainty has {len(sigma)} values for {len(embeddings)} gallery rows")
        return _descending(sigma)
    if embeddings is None:
        raise InputError(f"the {kind!r} ordering needs the gallery embeddings")
    embeddings = check_features("embeddings", embeddings)
    if kind == "random":
        return np.random.default_rng(seed).permutation(len(embeddings)).astype(np.int64)
    metric: Literal["l2", "cosine"] = "cosine" if kind == "class-mean-cosine" else "l2"
    if kind == "kmeans" or labels is None:
        clusters = default_clusters(len(embeddings)) if n_clusters is None else n_clusters
        groups = kmeans(embeddings, clusters, seed)
    else:
        groups = validate_labels(labels, len(embeddings), "labels")
    return _descending(distance_to_group_mean(embeddings, groups, metric))


def distance_to_group_mean(embeddings: np.ndarray, groups: np.ndarray, metric: Literal["l2", "cosine"]) -> np.ndarray:
    """Per row, the L2 or cosine distance to the mean of the rows sharing its group."""
    vectors = _unit_rows(embeddings) if metric == "cosine" else embeddings.astype(np.float64)
    _, index = np.unique(groups, return_inverse=True)
    means = np.zeros((index.max() + 1, vectors.shape[1]))
    np.add.at(means, index, vectors)
    means /= np.bincount(index)[:, None]
    if metric == "cosine":
        return cast(np.ndarray, 1.0 - np.einsum("ij,ij->i", vectors, _unit_rows(means)[index]))
    return cast(np.ndarray, np.linalg.norm(vectors - means[index], axis=1))


def default_clusters(n: int) -> int:
    return int(min(n, max(1, round(np.sqrt(n / 2)))))


def kmeans(embeddings: np.ndarray, n_clusters: int, seed: int = 0, iterations: int = 50) -> np.ndarray:
    """Seeded k-means (k-means++ start, Lloyd steps); returns the cluster of each row."""
    if not 1 <= n_clusters <= len(embeddings):
        raise InputError(f"n_clusters must be between 1 and the number of rows ({len(embeddings)}), got {n_clusters}")
    rng = np.random.default_rng(seed)
    points = embeddings.astype(np.float64)
    centres = _kmeans_plus_plus(points, n_clusters, rng)
    assignment = np.full(len(points), -1)
    for _ in range(iterations):
        new_assignment = _squared_distances(points, centres).argmin(axis=1)
        if np.array_equal(new_assignment, assignment):
            break
        assignment = new_assignment
        for cluster in range(n_clusters):
            members = points[assignment == cluster]
            if len(members):  # an emptied cluster keeps its previous centre
                centres[cluster] = members.mean(axis=0)
    return assignment


def _kmeans_plus_plus(points: np.ndarray, n_clusters: int, rng: np.random.Generator) -> np.ndarray:
    centres = [points[rng.integers(len(points))]]
    closest = _squared_distances(points, centres[0][None]).ravel()
    for _ in range(1, n_clusters):
        total = closest.sum()
        pick = rng.choice(len(points), p=closest / total) if total > 0 else rng.integers(len(points))
        centres.append(points[pick])
        closest = np.minimum(closest, _squared_distances(points, points[pick][None]).ravel())
    return np.array(centres)


def _squared_distances(points: np.ndarray, centres: np.ndarray) -> np.ndarray:
    return cast(
        np.ndarray, np.maximum((points**2).sum(1)[:, None] - 2 * points @ centres.T + (centres**2).sum(1)[None], 0.0)
    )


def _unit_rows(vectors: np.ndarray) -> np.ndarray:
    vectors = vectors.astype(np.float64)
    return cast(np.ndarray, vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12))


def _descending(scores: np.ndarray) -> np.ndarray:
    """Indices by decreasing score, ties by increasing index."""
    return np.lexsort((np.arange(len(scores)), -scores)).astype(np.int64)


def _checked_uncertainty(uncertainty: np.ndarray | None) -> np.ndarray:
    if uncertainty is None:
        raise InputError("the 'uncertainty' ordering needs σ per gallery row (FastFillAdapter.uncertainty)")
    sigma = np.asarray(uncertainty, dtype=np.float64)
    if sigma.ndim != 1 or len(sigma) == 0:
        raise InputError(f"uncertainty: expected a non-empty 1-D array (one σ per row), got shape {sigma.shape}")
    if not np.isfinite(sigma).all():
        raise InputError("uncertainty: holds NaN or inf; recompute σ with the fitted FastFill adapter")
    return sigma

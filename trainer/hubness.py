"""A per-item hubness offset (CSLS-style) for cosine search over adapted rows (numpy only).

Some rows — "hubs" — are near to many queries whatever they are asked: an adapted row h(φ_old)
that sits in a dense part of the new space, or a backfilled φ_new row next to adapted ones
(it shares the queries' exact space, so its cosines run higher). CSLS (Conneau et al., 2018)
discounts each row by how close it is to queries in general::

    r(g)   = mean of the k largest cos(q_ref, g) over reference queries q_ref
    score  = cos(q, g) − β · r(g)

The reference queries are a sample of real queries embedded the way the device embeds them
(the task's training queries); ``r`` is computed once per row — at upgrade time on a device —
and stored with it. β (and whether to use the offset at all) is chosen on held-out training data.

:func:`offset_vectors` turns the score into a plain L2 search: ``|[q̂, 0] − [ĝ, t_g]|² =
2 − 2·cos(q, g) + t_g²`` with ``t_g² = 2β(r(g) − r_min)``, so ranking by that distance is
ranking by ``cos − β·r`` exactly (``r_min`` only keeps ``t_g`` real; a constant does not change
any ranking).
"""

from __future__ import annotations

import numpy as np

from fctkit.errors import InputError


def hubness_offsets(rows: np.ndarray, reference_queries: np.ndarray, k: int = 10, chunk_size: int = 2048) -> np.ndarray:
    """``r(g)`` for every row: the mean of its ``k`` largest cosines to the reference queries."""
    rows, reference = _unit(rows, "rows"), _unit(reference_queries, "reference queries")
    if rows.shape[1] != reference.shape[1]:
        raise InputError(f"rows have {rows.shape[1]} dims but the reference queries {reference.shape[1]}")
    k = min(int(k), len(reference))
    if k < 1:
        raise InputError("hubness offsets need k >= 1 and at least one reference query")
    offsets = np.empty(len(rows))
    for start in range(0, len(rows), chunk_size):
        cosines = rows[start : start + chunk_size] @ reference.T
        top = np.partition(cosines, cosines.shape[1] - k, axis=1)[:, -k:]
        offsets[start : start + chunk_size] = top.mean(axis=1)
    return offsets


def offset_vectors(
    queries: np.ndarray, rows: np.ndarray, offsets: np.ndarray, beta: float, floor: float | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """(queries, rows) whose squared L2 distance ranks by ``cos(q, g) − beta · offset(g)``
    (see the module docstring). ``floor`` (default: the smallest offset) must not exceed any
    offset; pass a common one when rows of several sets are searched together."""
    if beta < 0:
        raise InputError(f"beta must be >= 0, got {beta}")
    offsets = np.asarray(offsets, dtype=np.float64)
    floor = float(offsets.min()) if floor is None else floor
    if np.any(offsets < floor - 1e-12):
        raise InputError("floor must not exceed any offset")
    extra = np.sqrt(2.0 * beta * np.maximum(offsets - floor, 0.0))
    q = np.hstack([_unit(queries, "queries"), np.zeros((len(queries), 1))])
    g = np.hstack([_unit(rows, "rows"), extra[:, None]])
    return q, g


def _unit(x: np.ndarray, name: str) -> np.ndarray:
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 2 or not len(x):
        raise InputError(f"{name}: expected a non-empty (N, d) array, got shape {x.shape}")
    norms = np.linalg.norm(x, axis=1, keepdims=True)
    if np.any(norms == 0):
        raise InputError(f"{name}: an all-zero vector has no direction for cosine search")
    return x / norms

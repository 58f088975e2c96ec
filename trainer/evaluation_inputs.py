"""Checks of what the retrieval evaluation is handed (numpy only): the distance, embedding
matrices (float64, finite, non-empty, same dims; unit rows for cosine), cutoffs and counts.
Every failure is an :class:`InputError` that says what to fix."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import numpy as np

from fctkit.errors import InputError

Distance = Literal["l2", "cosine"]
DISTANCES: tuple[str, ...] = ("l2", "cosine")


def prepare_embeddings(query: np.ndarray, gallery: np.ndarray, distance: str) -> tuple[np.ndarray, np.ndarray]:
    if distance not in DISTANCES:
        raise InputError(f"distance must be one of {', '.join(DISTANCES)}; got {distance!r}")
    q = as_matrix(query, "query")
    g = as_matrix(gallery, "gallery")
    if q.shape[1] != g.shape[1]:
        raise InputError(
            f"query and gallery embeddings have different dims ({q.shape[1]} vs {g.shape[1]}); "
            "embed both with the same model or adapt one into the other's space first"
        )
    if distance == "cosine":
        return _unit_rows(q, "query"), _unit_rows(g, "gallery")
    return q, g


def as_matrix(x: np.ndarray, name: str) -> np.ndarray:
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


def check_topk(topk: Sequence[int]) -> tuple[int, ...]:
    try:
        ks = list(topk)
    except TypeError as exc:
        raise InputError(f"topk must be a sequence of integers >= 1; got {topk!r}") from exc
    for k in ks:
        if isinstance(k, (bool, np.bool_)) or not isinstance(k, (int, np.integer)) or k < 1:
            raise InputError(f"topk values must be integers >= 1; got {k!r} in {topk!r}")
    return tuple(sorted({1, *(int(k) for k in ks)}))


def check_positive_int(value: int, name: str) -> int:
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, np.integer)) or value < 1:
        raise InputError(f"{name} must be an integer >= 1; got {value!r}")
    return int(value)

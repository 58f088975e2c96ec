"""Validation of feature matrices and class labels (numpy only, no torch): the trainer and the
device check what they are handed with the same rules."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, TypeVar

import numpy as np

from fctkit.errors import InputError


def check_features(name: str, array: Any, *, dim: int | None = None, rows: int | None = None) -> np.ndarray:
    """Validate a feature matrix and return it as contiguous float32.

    Raises :class:`InputError` for anything that is not a finite, non-empty 2-D array with the
    expected number of columns (``dim``) and rows (``rows``).
    """
    if array is None:
        raise InputError(f"{name}: features are missing")
    array = np.asarray(array)
    if array.ndim != 2:
        raise InputError(f"{name}: expected a 2-D array (rows × dims), got shape {array.shape}")
    if array.shape[0] == 0:
        raise InputError(f"{name}: the feature matrix is empty")
    if not np.issubdtype(array.dtype, np.number) or np.issubdtype(array.dtype, np.complexfloating):
        raise InputError(f"{name}: expected real numbers, got dtype {array.dtype}")
    if dim is not None and array.shape[1] != dim:
        raise InputError(
            f"{name}: expected {dim} dims, got {array.shape[1]}; use features of the model this adapter was fitted on"
        )
    if rows is not None and array.shape[0] != rows:
        raise InputError(
            f"{name}: has {array.shape[0]} rows but the other inputs have {rows}; rows must be aligned item by item"
        )
    array = np.ascontiguousarray(array, dtype=np.float32)
    if not np.isfinite(array).all():
        bad = int((~np.isfinite(array)).any(axis=1).sum())
        raise InputError(f"{name}: {bad} row(s) hold NaN or inf; drop or repair them first")
    return array


_Id = TypeVar("_Id")  # an item id, or a position


def nonfinite_items(item_ids: Sequence[_Id], *arrays: np.ndarray) -> list[_Id]:
    """The ids of the rows (aligned with ``item_ids``) holding NaN or inf in any of ``arrays``,
    each dense (rows × dims) or ragged (an object array of rows)."""
    finite = np.ones(len(item_ids), dtype=bool)
    for array in arrays:
        if array.dtype == object:
            finite &= np.fromiter(
                (np.isfinite(np.asarray(r, np.float64)).all() for r in array), dtype=bool, count=len(array)
            )
        elif len(array):  # no rows: nothing to check (a (0, d) reshape cannot infer d)
            finite &= np.isfinite(array.reshape(len(array), -1)).all(axis=1)
    return [item_ids[i] for i in np.flatnonzero(~finite).tolist()]


def nonfinite_message(item_ids: Sequence[str], what: str) -> str:
    """``what`` (e.g. "cannot be upgraded") said of the rows ``item_ids``, named (the first ten)."""
    listed = ", ".join(repr(i) for i in item_ids[:10]) + (
        f" and {len(item_ids) - 10} more" if len(item_ids) > 10 else ""
    )
    return f"{len(item_ids)} item(s) {what} ({listed}): their vectors hold NaN or inf"


def validate_labels(labels: np.ndarray, n: int | None = None, where: str = "labels") -> np.ndarray:
    """Check that ``labels`` is a non-empty integer vector (of length ``n`` when given); return int64."""
    labels = np.asarray(labels)
    if labels.ndim != 1 or len(labels) == 0:
        raise InputError(f"{where}: expected a non-empty 1-D array, got shape {labels.shape}")
    integral_floats = np.issubdtype(labels.dtype, np.floating) and bool(np.all(labels == np.round(labels)))
    if not (np.issubdtype(labels.dtype, np.integer) or integral_floats):
        raise InputError(f"{where}: expected integer class labels, got dtype {labels.dtype}")
    if n is not None and len(labels) != n:
        raise InputError(f"{where}: {len(labels)} labels for {n} items; they must match one to one")
    return labels.astype(np.int64, copy=False)

"""Who is relevant to a query (numpy only): every gallery item of its class (class labels), or
its explicit positives (:class:`Positives`: instance-level retrieval, one or many positives,
optionally graded). :func:`relevance_lookup` turns either into one ``relevance_of(i)``."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from fctkit.errors import InputError


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
    def from_lists(
        cls, positives: Sequence[Sequence[int]], n_gallery: int, grades: Sequence[Sequence[float]] | None = None
    ) -> Positives:
        """``positives[i]`` lists query i's gallery rows (``grades[i]`` their grades, if any)."""
        query = np.repeat(np.arange(len(positives)), [len(p) for p in positives])
        flat = np.asarray([g for p in positives for g in p], dtype=np.int64)
        flat_grades = None if grades is None else np.asarray([x for gs in grades for x in gs], dtype=np.float64)
        return cls.from_pairs(query, flat, len(positives), n_gallery, flat_grades)

    @classmethod
    def from_pairs(
        cls, query: np.ndarray, gallery: np.ndarray, n_queries: int, n_gallery: int, grades: np.ndarray | None = None
    ) -> Positives:
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


_EMPTY = np.zeros(0, dtype=np.int64)
_EMPTY_GRADES = np.zeros(0)


def relevance_lookup(
    query_labels: np.ndarray | None,
    gallery_labels: np.ndarray | None,
    positives: Positives | None,
    n_q: int,
    n_g: int,
    leave_one_out: bool,
) -> Callable[[int], tuple[np.ndarray, np.ndarray]]:
    """``relevance_of(i) -> (positive gallery rows, their grades)`` from labels or explicit positives."""
    if positives is not None:
        if query_labels is not None or gallery_labels is not None:
            raise InputError("give relevance either as labels or as positives=, not both")
        if positives.n_queries != n_q or positives.n_gallery != n_g:
            raise InputError(
                f"positives describe {positives.n_queries} queries x {positives.n_gallery} gallery items; "
                f"the embeddings are {n_q} x {n_g}"
            )
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


def _positives_by_class(codes: np.ndarray) -> dict[int, np.ndarray]:
    """Class code -> sorted gallery indices of that class."""
    order = np.argsort(codes, kind="stable")
    classes, starts = np.unique(codes[order], return_index=True)
    return {int(c): idx for c, idx in zip(classes, np.split(order, starts[1:]))}


def _encode_labels(
    query_labels: np.ndarray, gallery_labels: np.ndarray, n_q: int, n_g: int
) -> tuple[np.ndarray, np.ndarray]:
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

"""Exact k-nearest-neighbour search over a decrypted gallery, with the bundle's distance.

Cosine ranks by inner product of L2-normalised vectors, L2 by squared Euclidean distance,
"inner" by the inner product of the vectors as given (distance ``1 − q·g``): the device's
prepared vectors for transition scoring and hubness offsets (:mod:`.scoring`).
Ties are broken by gallery position, so the same inputs always give the same ranking.
faiss (IndexFlatIP / IndexFlatL2, also exact) is used when installed and asked for.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from typing import Any, cast

import numpy as np

from fctkit.errors import InputError

BACKENDS = ("auto", "numpy", "faiss")


@dataclass(frozen=True)
class Neighbours:
    """``indices[i, j]``: gallery position of query i's j-th nearest; ``distances`` likewise
    (cosine: 1 - similarity; l2: squared distance)."""

    indices: np.ndarray
    distances: np.ndarray


def normalise(x: np.ndarray) -> np.ndarray:
    """Rows scaled to unit length. A row whose squared norm overflows or nears underflow (values
    like 1e20 or 1e-16) is first divided by its largest magnitude, so rows of any finite scale
    give the same direction; the others take the one-pass path."""
    squared = np.einsum("ij,ij->i", x, x)
    out = x / np.maximum(np.sqrt(squared), np.float32(1e-12))[:, None]
    extreme = np.flatnonzero(~(squared < 1e30) | (squared < 1e-30))
    if len(extreme) and x.shape[1]:
        rows = x[extreme]
        scale = np.maximum(rows.max(axis=1), -rows.min(axis=1))
        scaled = rows / np.where(scale > 0, scale, 1).astype(rows.dtype)[:, None]
        out[extreme] = scaled / np.maximum(np.sqrt(np.einsum("ij,ij->i", scaled, scaled)), np.float32(1e-12))[:, None]
    return cast(np.ndarray, out)  # x / (N, 1) norms: an array


def faiss_available() -> bool:
    return importlib.util.find_spec("faiss") is not None


class ExactIndex:
    """The gallery vectors, prepared once; :meth:`search` answers batches of queries."""

    def __init__(self, vectors: np.ndarray, distance: str, backend: str = "auto") -> None:
        if distance not in ("cosine", "l2", "inner"):
            raise InputError(f"distance {distance!r} is not cosine, l2 or inner")
        if backend not in BACKENDS:
            raise InputError(f"backend {backend!r} is not one of {', '.join(BACKENDS)}")
        vectors = np.ascontiguousarray(vectors, dtype=np.float32)
        if vectors.ndim != 2:
            raise InputError(f"gallery vectors must be 2-D, got shape {vectors.shape}")
        self.distance = distance
        self.backend = "faiss" if backend == "faiss" or (backend == "auto" and faiss_available()) else "numpy"
        self._faiss_index = None
        if self.backend == "faiss" and len(vectors):
            self._faiss_index, self.vectors = _faiss_index(vectors, distance)
        else:
            self.vectors = normalise(vectors) if distance == "cosine" else vectors
        self._squared_norms = (self.vectors**2).sum(axis=1) if distance == "l2" else None

    def __len__(self) -> int:
        return len(self.vectors)

    def search(self, queries: np.ndarray, k: int) -> Neighbours:
        queries = np.ascontiguousarray(queries, dtype=np.float32)
        if queries.ndim != 2 or (len(self) and queries.shape[1] != self.vectors.shape[1]):
            raise InputError(
                f"queries of shape {queries.shape} do not match gallery vectors of dim {self.vectors.shape[1:]}"
            )
        if not np.isfinite(queries).all():
            raise InputError("queries hold NaN or inf values")
        if k < 1:
            raise InputError(f"k must be >= 1, got {k}")
        k = min(k, len(self))
        if k == 0:
            empty = np.zeros((len(queries), 0))
            return Neighbours(empty.astype(np.int64), empty.astype(np.float32))
        if self.distance == "cosine":
            queries = normalise(queries)
        elif _beyond_float32(queries):  # e.g. a query scaled by 1e19: its L2 distances overflow float32
            return self._numpy_search(queries.astype(np.float64), k)
        if self._faiss_index is not None:
            scores, indices = self._faiss_index.search(queries, k)
            distances = scores if self.distance == "l2" else 1.0 - scores
            return _tie_ordered(indices.astype(np.int64), distances.astype(np.float32))
        return self._numpy_search(queries, k)

    def _numpy_search(self, queries: np.ndarray, k: int) -> Neighbours:
        """Exact distances in the queries' float type (float64 for those beyond float32's range)."""
        vectors = self.vectors.astype(queries.dtype, copy=False)
        if self.distance != "l2":
            distances, offsets = 1.0 - queries @ vectors.T, 0.0
        else:  # ranked without each query's own squared norm, which would swamp the rest at a large scale
            norms = self._squared_norms if queries.dtype == np.float32 else (vectors**2).sum(axis=1)
            distances, offsets = norms - 2.0 * (queries @ vectors.T), (queries**2).sum(axis=1, keepdims=True)
        if k < distances.shape[1]:
            part = np.argpartition(distances, k - 1, axis=1)[:, :k]
        else:
            part = np.broadcast_to(np.arange(distances.shape[1]), distances.shape).copy()
        picked = np.take_along_axis(distances, part, axis=1)
        order = np.lexsort((part, picked), axis=1)  # by distance, then gallery position, before the offsets
        part, picked = np.take_along_axis(part, order, axis=1), np.take_along_axis(picked, order, axis=1)
        return Neighbours(part.astype(np.int64), (picked + offsets).astype(queries.dtype))


def _beyond_float32(queries: np.ndarray) -> bool:
    """Whether a query's squared norm nears float32's range (about 3.4e38), so that its distances
    and products would overflow there: such queries are answered exactly in float64."""
    wide = queries.astype(np.float64)
    return bool((np.einsum("ij,ij->i", wide, wide) > 1e30).any())


def _faiss_index(vectors: np.ndarray, distance: str, chunk: int = 65_536) -> tuple[Any, np.ndarray]:
    """A faiss flat index of ``vectors`` and a read-only numpy view of the vectors it holds. The
    index's storage is sized once and filled in place (normalised for cosine) a chunk at a
    time, so neither a second full copy nor faiss's growth by doubling ever exists."""
    import faiss

    index = faiss.IndexFlatL2(vectors.shape[1]) if distance == "l2" else faiss.IndexFlatIP(vectors.shape[1])
    index.codes.resize(vectors.size * 4)
    index.ntotal = len(vectors)
    held = np.asarray(_HeldByFaiss(index))
    for first in range(0, len(vectors), chunk):
        part = vectors[first : first + chunk]
        held[first : first + chunk] = normalise(part) if distance == "cosine" else part
    held.flags.writeable = False
    return index, held


class _HeldByFaiss:
    """The vectors inside a faiss flat index as an array interface; an array made from it keeps
    the index (the memory's owner) alive, so the view can never outlive the memory."""

    def __init__(self, index: Any) -> None:  # a faiss flat index
        self.index = index
        self.__array_interface__ = {
            "shape": (index.ntotal, index.d),
            "typestr": "<f4",
            "version": 3,
            "data": (int(index.codes.data()), False),
        }


def _tie_ordered(indices: np.ndarray, distances: np.ndarray) -> Neighbours:
    """Sort each row by (distance, gallery position)."""
    order = np.lexsort((indices, distances), axis=1)
    return Neighbours(np.take_along_axis(indices, order, axis=1), np.take_along_axis(distances, order, axis=1))

"""Exact k-NN: numpy and faiss agree with brute force, distances per the manifest, ties by position."""

from __future__ import annotations

import numpy as np
import pytest

from fctkit.edge_runtime import ExactIndex
from fctkit.edge_runtime.search import faiss_available
from fctkit.errors import InputError

BACKENDS = [
    "numpy",
    pytest.param("faiss", marks=pytest.mark.skipif(not faiss_available(), reason="faiss-cpu is not installed")),
]


def _brute_force(gallery, queries, distance, k):
    if distance == "cosine":
        g = gallery / np.linalg.norm(gallery, axis=1, keepdims=True)
        q = queries / np.linalg.norm(queries, axis=1, keepdims=True)
        d = 1 - q.astype(np.float64) @ g.T.astype(np.float64)
    else:
        d = ((queries[:, None, :].astype(np.float64) - gallery[None].astype(np.float64)) ** 2).sum(-1)
    return np.argsort(d, axis=1, kind="stable")[:, :k], np.sort(d, axis=1)[:, :k]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("distance", ["cosine", "l2"])
def test_exact_search_matches_brute_force(backend, distance):
    rng = np.random.default_rng(0)
    gallery, queries = (
        rng.standard_normal((500, 16)).astype(np.float32),
        rng.standard_normal((40, 16)).astype(np.float32),
    )
    found = ExactIndex(gallery, distance, backend).search(queries, 7)
    indices, distances = _brute_force(gallery, queries, distance, 7)
    np.testing.assert_array_equal(found.indices, indices)
    np.testing.assert_allclose(found.distances, distances, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", BACKENDS)
def test_ties_are_broken_by_gallery_position_and_k_is_capped(backend):
    gallery = np.tile(np.array([[1.0, 0.0]], np.float32), (6, 1))
    gallery[2] = [0.0, 1.0]
    found = ExactIndex(gallery, "l2", backend).search(np.array([[1.0, 0.0]], np.float32), 10)
    assert found.indices.tolist() == [[0, 1, 3, 4, 5, 2]]


def test_bad_queries_are_refused():
    index = ExactIndex(np.ones((3, 4), np.float32), "cosine", "numpy")
    with pytest.raises(InputError, match="do not match"):
        index.search(np.ones((1, 5), np.float32), 1)
    with pytest.raises(InputError, match="NaN"):
        index.search(np.full((1, 4), np.nan, np.float32), 1)
    with pytest.raises(InputError, match="k must be"):
        index.search(np.ones((1, 4), np.float32), 0)
    with pytest.raises(InputError, match="not cosine, l2 or inner"):
        ExactIndex(np.ones((3, 4), np.float32), "dot")

"""The device's label-free upgrade health signal (sampled fidelity): known answers on synthetic
galleries, the blocked scan against a brute-force ranking, input validation and the sampler's
determinism. How well it separates real good and broken adapters is measured by
benchmarks/upgrade_health_signal.py."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from fctkit.errors import InputError
from fctkit.upgrade_health import UpgradeHealth, sample_rows, self_retrieval_ranks, upgrade_health

METRICS = ("cosine", "l2")


def gallery(rows: int = 400, dim: int = 16, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, dim)).astype(np.float32)


def brute_force_ranks(adapted: np.ndarray, sample: np.ndarray, queries: np.ndarray, metric: str) -> np.ndarray:
    """Every query against every row at once, ranked by sorting (ties: earlier row first)."""
    g, q = adapted.astype(np.float64), queries.astype(np.float64)
    if metric == "cosine":
        g = g / np.linalg.norm(g, axis=1, keepdims=True)
        scores = (q / np.linalg.norm(q, axis=1, keepdims=True)) @ g.T
    else:
        scores = -((q[:, None, :] - g[None, :, :]) ** 2).sum(axis=2)
    positions = np.arange(len(g))
    return np.array(
        [1 + int(np.flatnonzero(np.lexsort((positions, -scores[i])) == own)[0]) for i, own in enumerate(sample)]
    )


@pytest.mark.parametrize("metric", METRICS)
def test_an_identity_adapter_scores_perfectly(metric):
    g = gallery()
    sample = sample_rows([f"row-{i}" for i in range(len(g))], 48, seed=3)
    health = upgrade_health(g, sample, g[sample].copy(), metric)
    assert health.sample_size == 48
    assert health.mean_cosine == pytest.approx(1.0, abs=1e-9)
    assert health.p10_cosine == pytest.approx(1.0, abs=1e-9)
    assert health.recall_at_1 == 1.0 and health.mean_reciprocal_rank == 1.0


@pytest.mark.parametrize("metric", METRICS)
def test_a_random_rotation_of_the_right_space_scores_low(metric):
    """The adapter's output is the new space turned by a random orthogonal map: old-space
    neighbourhoods are all kept, yet the signal sees it is wrong."""
    g = gallery(rows=1000, dim=32)
    rotation, _ = np.linalg.qr(np.random.default_rng(5).standard_normal((32, 32)))
    sample = sample_rows([str(i) for i in range(len(g))], 64, seed=1)
    health = upgrade_health(g, sample, (g[sample] @ rotation).astype(np.float32), metric)
    assert abs(health.mean_cosine) < 0.25
    assert health.recall_at_1 <= 0.05
    assert health.mean_reciprocal_rank < 0.1


def test_mean_and_tenth_percentile_cosine_are_those_of_the_sampled_rows():
    g = gallery(rows=200, dim=8)
    sample = np.arange(0, 200, 10)
    angles = np.linspace(0.0, 1.5, len(sample))
    unit = g[sample] / np.linalg.norm(g[sample], axis=1, keepdims=True)
    other = np.random.default_rng(2).standard_normal(unit.shape)
    other -= np.einsum("ij,ij->i", other, unit)[:, None] * unit
    other /= np.linalg.norm(other, axis=1, keepdims=True)
    queries = 3.0 * (np.cos(angles)[:, None] * unit + np.sin(angles)[:, None] * other)
    health = upgrade_health(g, sample, queries.astype(np.float32), "cosine")
    assert health.mean_cosine == pytest.approx(np.cos(angles).mean(), abs=1e-6)
    assert health.p10_cosine == pytest.approx(np.percentile(np.cos(angles), 10), abs=1e-6)


@pytest.mark.parametrize("metric", METRICS)
@pytest.mark.parametrize("block_rows", [1, 7, 64, 10_000])
def test_blocked_ranks_equal_a_brute_force_ranking(metric, block_rows):
    g = gallery(rows=64, dim=6, seed=4)
    g[40] = g[9]  # an exact duplicate: the tie goes to the earlier row
    sample = np.array([9, 40, 0, 17, 63, 31, 5, 22])
    queries = (g[sample] + 0.8 * np.random.default_rng(6).standard_normal((len(sample), 6))).astype(np.float32)
    queries[0], queries[1] = g[9], g[40]
    ranks = self_retrieval_ranks(g, sample, queries, metric, block_rows=block_rows)
    expected = brute_force_ranks(g, sample, queries, metric)
    np.testing.assert_array_equal(ranks, expected)
    assert ranks[0] == 1 and ranks[1] == 2
    assert ranks.max() > 1  # the noise puts some rows behind others: not a trivially perfect case
    health = upgrade_health(g, sample, queries, metric, block_rows=block_rows)
    assert health.recall_at_1 == pytest.approx(np.mean(expected == 1))
    assert health.mean_reciprocal_rank == pytest.approx(np.mean(1.0 / expected))


def test_only_aggregates_leave_the_device():
    names = [f.name for f in dataclasses.fields(UpgradeHealth)]
    assert names == [
        "sample_size",
        "mean_cosine",
        "p10_cosine",
        "recall_at_1",
        "mean_reciprocal_rank",
        "median_rank",
        "gallery_rows",
    ]
    health = upgrade_health(gallery(), np.arange(4), gallery()[:4], "l2")
    assert health.gallery_rows == len(gallery()) and health.median_rank >= 1
    with pytest.raises(dataclasses.FrozenInstanceError):
        health.recall_at_1 = 0.5  # type: ignore[misc]


def _with(array: np.ndarray, row: int, value: float) -> np.ndarray:
    array = array.copy()
    array[row, 0] = value
    return array


G = gallery(rows=20, dim=4)
GOOD_SAMPLE = np.array([1, 5, 7])


@pytest.mark.parametrize(
    "adapted, sample, reembedded, metric, block_rows, message",
    [
        (G, GOOD_SAMPLE, G[GOOD_SAMPLE], "inner", 64, "not one of cosine, l2"),
        (G, GOOD_SAMPLE, G[GOOD_SAMPLE], "cosine", 0, "block_rows must be >= 1"),
        (G[0], GOOD_SAMPLE, G[GOOD_SAMPLE], "cosine", 64, "non-empty N×d"),
        (G[:0], np.array([0]), G[:1], "cosine", 64, "non-empty N×d"),
        (G, np.array([], dtype=np.int64), G[:0], "cosine", 64, "non-empty 1-D"),
        (G, GOOD_SAMPLE.astype(float), G[GOOD_SAMPLE], "cosine", 64, "must be integers"),
        (G[:2], np.array([0, 1, 2]), G[:3], "cosine", 64, "larger than the gallery's 2 rows"),
        (G, np.array([1, 20]), G[:2], "cosine", 64, r"must lie in \[0, 20\)"),
        (G, np.array([-1, 3]), G[:2], "cosine", 64, r"must lie in \[0, 20\)"),
        (G, np.array([3, 3]), G[:2], "cosine", 64, "sample positions repeat"),
        (G, GOOD_SAMPLE, G[:2], "cosine", 64, r"shape \(2, 4\) do not match 3 sampled rows"),
        (G, GOOD_SAMPLE, G[GOOD_SAMPLE][:, :3], "l2", 64, "do not match 3 sampled rows of dimension 4"),
        (G, GOOD_SAMPLE, _with(G[GOOD_SAMPLE], 1, np.nan), "cosine", 64, "re-embedded vectors hold NaN or inf"),
        (_with(G, 13, np.inf), GOOD_SAMPLE, G[GOOD_SAMPLE], "l2", 8, "adapted gallery row 13 holds NaN or inf"),
        (_with(G, 2, np.nan), GOOD_SAMPLE, G[GOOD_SAMPLE], "cosine", 64, "adapted gallery row 2 holds NaN or inf"),
    ],
)
def test_bad_input_gets_a_clear_error(adapted, sample, reembedded, metric, block_rows, message):
    with pytest.raises(InputError, match=message):
        upgrade_health(adapted, sample, reembedded, metric, block_rows=block_rows)
    with pytest.raises(InputError, match=message):
        self_retrieval_ranks(adapted, sample, reembedded, metric, block_rows=block_rows)


def test_the_sampler_is_deterministic_in_the_seed_and_the_ids_not_their_order():
    ids = [f"item-{i:05d}" for i in range(2000)]
    first = sample_rows(ids, 64, seed=11)
    assert len(first) == 64 and len(np.unique(first)) == 64 and np.all(np.diff(first) > 0)
    np.testing.assert_array_equal(first, sample_rows(ids, 64, seed=11))
    shuffled = list(np.random.default_rng(0).permutation(ids))
    assert {shuffled[i] for i in sample_rows(shuffled, 64, seed=11)} == {ids[i] for i in first}
    assert set(sample_rows(ids, 64, seed=12)) != set(first)
    assert first.max() > 1000 and first.min() < 1000  # spread over the gallery, not its first rows
    assert {ids[i] for i in sample_rows(ids, 32, seed=11)} <= {ids[i] for i in first}


@pytest.mark.parametrize(
    "ids, size, seed, message",
    [
        (["a", "b"], 3, 0, "cannot be drawn from 2 rows"),
        (["a", "b"], 0, 0, "between 1 and 2"),
        ([], 1, 0, "from 0 rows"),
        (["a", "b"], 1, -1, "seed must be in"),
        (["a", "b", "a"], 2, 0, "row ids repeat"),
    ],
)
def test_the_sampler_refuses_what_it_cannot_draw(ids, size, seed, message):
    with pytest.raises(InputError, match=message):
        sample_rows(ids, size, seed)

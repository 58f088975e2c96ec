"""Backfill orderings: permutations, determinism, farthest-from-class-mean first, σ first, k-means."""

from __future__ import annotations

import numpy as np
import pytest

from fctkit.backfill_order import ORDERING_KINDS, backfill_order, distance_to_group_mean, kmeans
from fctkit.errors import InputError


def blobs(n_per_class: int = 40, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    centres = np.array([[10.0, 0.0, 0.0], [0.0, 10.0, 0.0], [0.0, 0.0, 10.0]])
    labels = np.repeat(np.arange(3), n_per_class)
    return centres[labels] + rng.normal(size=(len(labels), 3)), labels


@pytest.mark.parametrize("kind", ORDERING_KINDS)
def test_every_ordering_is_a_deterministic_permutation(kind):
    embeddings, labels = blobs()
    sigma = np.random.default_rng(1).random(len(labels))
    order = backfill_order(kind, embeddings, labels, uncertainty=sigma, seed=3)
    assert order.dtype == np.int64
    np.testing.assert_array_equal(np.sort(order), np.arange(len(labels)))
    np.testing.assert_array_equal(order, backfill_order(kind, embeddings, labels, uncertainty=sigma, seed=3))


def test_random_ordering_depends_on_the_seed():
    embeddings, _ = blobs()
    assert not np.array_equal(
        backfill_order("random", embeddings, seed=0), backfill_order("random", embeddings, seed=1)
    )


def test_class_mean_puts_the_farthest_item_of_each_class_first():
    embeddings, labels = blobs()
    embeddings[7] += [0.0, 0.0, 9.0]  # class 0's outlier, pulled toward class 2
    embeddings[50] += [6.0, 0.0, 0.0]  # class 1's milder outlier
    order = backfill_order("class-mean-l2", embeddings, labels)
    assert list(order[:2]) == [7, 50]
    distances = distance_to_group_mean(embeddings, labels, "l2")
    assert np.all(np.diff(distances[order]) <= 0)  # farthest first, all the way down
    class_means = np.stack([embeddings[labels == c].mean(0) for c in range(3)])
    np.testing.assert_allclose(distances, np.linalg.norm(embeddings - class_means[labels], axis=1))


def test_cosine_ignores_the_norm_and_l2_does_not():
    embeddings, labels = blobs()
    embeddings[5] *= 3.0  # same direction as its class, far in L2
    embeddings[60] = [7.0, 7.0, 0.0]  # class 1 item pointing between classes 0 and 1
    assert backfill_order("class-mean-l2", embeddings, labels)[0] == 5
    cosine = backfill_order("class-mean-cosine", embeddings, labels)
    assert cosine[0] == 60
    assert list(cosine).index(5) > len(labels) // 2


def test_uncertainty_orders_largest_sigma_first_with_ties_by_index():
    sigma = np.array([0.1, 0.5, 0.3, 0.5, 0.0])
    np.testing.assert_array_equal(backfill_order("uncertainty", uncertainty=sigma), [1, 3, 2, 0, 4])


def test_without_labels_kmeans_clusters_stand_in_for_classes():
    embeddings, labels = blobs()
    clusters = kmeans(embeddings, 3, seed=0)
    assert len(set(zip(clusters, labels))) == 3  # the clusters are exactly the classes
    for kind in ("class-mean-l2", "class-mean-cosine"):
        np.testing.assert_array_equal(
            backfill_order(kind, embeddings, None, n_clusters=3), backfill_order(kind, embeddings, labels)
        )
    np.testing.assert_array_equal(
        backfill_order("kmeans", embeddings, labels, n_clusters=3), backfill_order("class-mean-l2", embeddings, labels)
    )


def test_kmeans_is_seeded_and_uses_a_default_cluster_count():
    embeddings = np.random.default_rng(4).normal(size=(200, 5))
    np.testing.assert_array_equal(kmeans(embeddings, 6, seed=2), kmeans(embeddings, 6, seed=2))
    order = backfill_order("kmeans", embeddings)  # round(sqrt(200 / 2)) = 10 clusters
    np.testing.assert_array_equal(order, backfill_order("kmeans", embeddings, n_clusters=10))


def test_bad_inputs_raise_input_error():
    embeddings, labels = blobs()
    with pytest.raises(InputError, match="unknown backfill ordering"):
        backfill_order("newest", embeddings)
    with pytest.raises(InputError, match="needs σ"):
        backfill_order("uncertainty", embeddings)
    with pytest.raises(InputError, match="NaN or inf"):
        backfill_order("uncertainty", uncertainty=np.array([0.1, np.nan]))
    with pytest.raises(InputError, match="values for"):
        backfill_order("uncertainty", embeddings, uncertainty=np.ones(3))
    with pytest.raises(InputError, match="needs the gallery embeddings"):
        backfill_order("class-mean-l2", labels=labels)
    with pytest.raises(InputError, match="labels"):
        backfill_order("class-mean-l2", embeddings, labels[:5])
    with pytest.raises(InputError, match="NaN"):
        backfill_order("random", np.full((4, 2), np.nan))
    for clusters in (0, 500):
        with pytest.raises(InputError, match="n_clusters"):
            backfill_order("kmeans", embeddings, n_clusters=clusters)

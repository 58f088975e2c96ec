"""A small synthetic instance-level task on which MSE-trained adapters fail ECC (numpy only).

It reproduces, in seconds, what the kit measured on real text models: the new model weighs
the shared *topic* of an item four times more than the old one did, while the old model's
view of the topic is noisy. A least-squares or MSE adapter predicts the new topic coordinates
from the noisy old ones and so amplifies the old noise fourfold, right in the directions the
new model's queries weigh most; it ranks the one right item below old/old. A contrastive
(InfoNCE) adapter learns to keep item identity instead and holds ECC.

Items: a topic ``t`` (one of ``n_topics`` centres, ``topic_dims`` dims) and an identity ``z``
(``identity_dims`` dims). Queries are asymmetric views of one item: the same topic, the
identity plus noise, seen through a fixed mix of it and a rotation of it (``query_view``
from 0, the same kind of thing as the items, towards 1, another kind). Old model: ``[t + noise, z + noise] R_old``; new model:
``[4 t, z] R_new`` (R: random orthonormal projections). Relevance: one positive per query.
Use it for tests, to try settings, and as the example task file of the README.
"""

from __future__ import annotations

import numpy as np

from .relevance import Positives
from .tasks import RetrievalTask, TaskSet, TaskSplit

D_OLD, D_NEW = 32, 48


def synthetic_instance_task(
    n_train: int = 4000,
    n_eval: int = 1500,
    seed: int = 0,
    *,
    n_topics: int = 10,
    topic_dims: int = 8,
    identity_dims: int = 16,
    new_topic_scale: float = 4.0,
    old_topic_noise: float = 1.0,
    query_noise: float = 0.8,
    query_view: float = 0.0,
) -> RetrievalTask:
    """An asymmetric instance-level task (see the module docstring); the models (topic
    centres, projections) are fixed, ``seed`` draws the items and the noise."""
    world = np.random.default_rng(12345)
    centres = world.normal(size=(n_topics, topic_dims))
    r_old, r_new = (_orthonormal(world, topic_dims + identity_dims, d) for d in (D_OLD, D_NEW))
    view = (1 - query_view) * np.eye(identity_dims) + query_view * _orthonormal(world, identity_dims, identity_dims)
    rng = np.random.default_rng(seed)

    def old_model(topic: np.ndarray, identity: np.ndarray) -> np.ndarray:
        seen = np.hstack(
            [topic + old_topic_noise * rng.normal(size=topic.shape), identity + 0.3 * rng.normal(size=identity.shape)]
        )
        return (seen @ r_old).astype(np.float32)

    def new_model(topic: np.ndarray, identity: np.ndarray) -> np.ndarray:
        clean = np.hstack([new_topic_scale * topic, identity]) @ r_new
        return (clean + 0.05 * rng.normal(size=clean.shape)).astype(np.float32)

    def split(n: int, first_id: int) -> TaskSplit:
        topic = centres[rng.integers(0, n_topics, n)]
        identity = rng.normal(size=(n, identity_dims))
        query_identity = identity @ view + query_noise * rng.normal(size=identity.shape)
        ids = np.arange(first_id, first_id + n)
        no_side = np.zeros((n, 0), np.float32)
        gallery = TaskSet(ids, old_model(topic, identity), new_model(topic, identity), no_side)
        query = TaskSet(ids, old_model(topic, query_identity), new_model(topic, query_identity), no_side)
        return TaskSplit(query, gallery, Positives.from_lists([[i] for i in range(n)], n))

    return RetrievalTask("synthetic-instance", "instance", "recall@1", split(n_train, 0), split(n_eval, n_train))


def _orthonormal(rng: np.random.Generator, rows: int, cols: int) -> np.ndarray:
    q, _ = np.linalg.qr(rng.normal(size=(max(rows, cols), max(rows, cols))))
    return q[:rows, :cols]

"""What a device searches with after an upgrade, as arrays the evaluation ranks (numpy in,
numpy out; the adapters run through their own ``transform``).

An :class:`EvalSet` holds the queries, the gallery and their relevance. From an adapter (plain,
:class:`WithQueryMap`, :class:`Transition` or :class:`Hubness`) :func:`scored_retrieval` gives the (queries, rows, distance) whose ranking is what the device
would return; :class:`Evaluator` ranks them with the run's settings.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

import numpy as np

from .adapter_base import Adapter, OldSideAdapter
from .evaluation import evaluate_retrieval
from .evaluation_inputs import Distance
from .hubness import hubness_offsets, offset_vectors
from .lambda_orth import LambdaOrthAdapter
from .query_map import QueryMap
from .retrieval_result import RetrievalResult
from .tasks import TaskSplit


@dataclasses.dataclass
class EvaluationConfig:
    distance: Distance = "l2"
    topk: tuple[int, ...] = (1, 5)
    chunk_size: int = 1024


@dataclasses.dataclass
class Features:
    """φ_old, ψ (possibly (N, 0)), φ_new and labels (None in an instance-level task), for one set."""

    old: np.ndarray
    side: np.ndarray
    new: np.ndarray
    labels: np.ndarray | None

    def subset(self, index: np.ndarray) -> Features:
        labels = None if self.labels is None else self.labels[index]
        return Features(self.old[index], self.side[index], self.new[index], labels)


@dataclasses.dataclass
class EvalSet:
    """What the report judges: queries and gallery (the same items, leave-one-out, for image
    and features data; a task's own sets) and the relevance between them."""

    queries: Features
    gallery: Features
    relevance: dict[str, Any]
    leave_one_out: bool

    @classmethod
    def labelled(cls, features: Features) -> EvalSet:
        return cls(features, features, {"query_labels": features.labels, "gallery_labels": features.labels}, True)

    @classmethod
    def of_task(cls, split: TaskSplit) -> EvalSet:
        return cls(task_features(split.query), task_features(split.gallery), split.relevance(), False)


def task_features(items: Any) -> Features:
    return Features(items.old, items.side, items.new, items.labels)


@dataclasses.dataclass
class WithQueryMap:
    """A gallery-side adapter h and the query map Q trained with it: queries are Q(φ_new)."""

    adapter: Adapter
    query_map: QueryMap

    def save(self, path: Path) -> None:
        self.adapter.save(path)
        self.query_map.save(path.with_name(path.stem + ".query_map.pt"))


@dataclasses.dataclass(frozen=True)
class HeldOutScores:
    """The primary metric on held-out training data with the chosen weight or β (``chosen``) and
    without the scoring (``without``: the variant it builds on)."""

    chosen: float
    without: float


@dataclasses.dataclass
class Transition:
    """Transition scoring with ``base``: rank by ``weight·cos_old + (1 − weight)·cos_adapted``."""

    base: Adapter | WithQueryMap | Hubness  # a Hubness base: its offset is part of the adapted score
    weight: float
    held_out: HeldOutScores | None = None


@dataclasses.dataclass
class Hubness:
    """``base`` searched with a per-item hubness offset: rank by cos − beta·r(g), r from
    ``reference`` (the training queries, embedded as the device embeds queries)."""

    base: Adapter | WithQueryMap
    beta: float
    reference: np.ndarray
    k: int
    held_out: HeldOutScores | None = None


def forward_transform(adapter: Adapter, features: Features) -> np.ndarray:
    """h(φ_old[, ψ]) for the forward-mode adapters."""
    if isinstance(adapter, OldSideAdapter):
        return adapter.transform(features.old, features.side if adapter.d_side else None)
    return adapter.transform(features.old)


def adapted_retrieval(adapter: Adapter | WithQueryMap, data: EvalSet) -> tuple[np.ndarray, np.ndarray]:
    """(queries, gallery) of the case a device runs after the upgrade: new/h(old) in forward
    mode, Q(new)/h(old) with a query map, B(new)/F(old) in unified mode."""
    if isinstance(adapter, LambdaOrthAdapter):
        return adapter.transform_new(data.queries.new), adapter.transform(data.gallery.old)
    if isinstance(adapter, WithQueryMap):
        return adapter.query_map.transform(data.queries.new), forward_transform(adapter.adapter, data.gallery)
    return data.queries.new, forward_transform(adapter, data.gallery)


def device_queries(adapter: Adapter | WithQueryMap, new_queries: np.ndarray) -> np.ndarray:
    """Queries as a device searches with them: Q(φ_new) with a query map, else φ_new."""
    return adapter.query_map.transform(new_queries) if isinstance(adapter, WithQueryMap) else new_queries


def fused_retrieval(adapter: Adapter | WithQueryMap, data: EvalSet, weight: float) -> tuple[np.ndarray, np.ndarray]:
    """(queries, gallery) whose cosine is ``w·cos(q_old, g_old) + (1 − w)·cos(q_adapted, g_adapted)``:
    each side is the concatenation of its two unit vectors scaled by √w and √(1 − w)."""
    query, gallery = adapted_retrieval(adapter, data)
    return _fused(data.queries.old, query, weight), _fused(data.gallery.old, gallery, weight)


def _fused(old: np.ndarray, adapted: np.ndarray, weight: float) -> np.ndarray:
    return np.hstack([np.sqrt(weight) * _unit(old), np.sqrt(1.0 - weight) * _unit(adapted)])


def hubness_retrieval(hub: Hubness, data: EvalSet) -> tuple[np.ndarray, np.ndarray]:
    """(queries, rows) whose L2 ranking is cos − β·r (see :func:`.hubness.offset_vectors`)."""
    query, gallery = adapted_retrieval(hub.base, data)
    return offset_vectors(query, gallery, hubness_offsets(gallery, hub.reference, hub.k), hub.beta)


def hubness_of(adapter: Any) -> Hubness | None:
    """The hubness offset a variant searches with: the variant itself, or a transition's base."""
    if isinstance(adapter, Transition):
        adapter = adapter.base
    return adapter if isinstance(adapter, Hubness) else None


def scored_retrieval(
    adapter: Adapter | WithQueryMap | Transition | Hubness, data: EvalSet
) -> tuple[np.ndarray, np.ndarray, Distance | None]:
    """(queries, rows, distance) whose ranking is what a device running ``adapter`` returns;
    distance ``None``: the run's own. Transition over a hubness base ranks by
    ``w·cos_old + (1 − w)·(cos_adapted − β·r)`` — and by ``cos_adapted − β·r`` once it ends."""
    if isinstance(adapter, Hubness):
        return (*hubness_retrieval(adapter, data), "l2")
    if not isinstance(adapter, Transition):
        return (*adapted_retrieval(adapter, data), None)
    if not isinstance(adapter.base, Hubness):
        return (*fused_retrieval(adapter.base, data, adapter.weight), "cosine")
    hub, weight = adapter.base, adapter.weight
    query, gallery = adapted_retrieval(hub.base, data)
    fused_query, fused_gallery = _fused(data.queries.old, query, weight), _fused(data.gallery.old, gallery, weight)
    offsets = hubness_offsets(gallery, hub.reference, hub.k)
    return (*offset_vectors(fused_query, fused_gallery, offsets, (1.0 - weight) * hub.beta), "l2")


def offset_galleries(
    hub: Hubness, queries: np.ndarray, adapted: np.ndarray, backfilled: np.ndarray
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Queries, adapted rows and backfilled rows with hubness offsets on a common floor."""
    offsets = [hubness_offsets(rows, hub.reference, hub.k) for rows in (adapted, backfilled)]
    floor = min(o.min() for o in offsets)
    query, adapted_rows = offset_vectors(queries, adapted, offsets[0], hub.beta, floor)
    return query, adapted_rows, offset_vectors(queries, backfilled, offsets[1], hub.beta, floor)[1]


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def searched_as(adapter: Adapter | WithQueryMap | Hubness) -> str:
    if isinstance(adapter, Hubness):
        return f"({searched_as(adapter.base)} − β·r)"
    return "cos(Q(new), h(old))" if isinstance(adapter, WithQueryMap) else "cos(new, h(old))"


@dataclasses.dataclass
class Evaluator:
    """Evaluates query/gallery embeddings of one :class:`EvalSet` with its relevance."""

    config: EvaluationConfig
    data: EvalSet

    def __call__(self, query: np.ndarray, gallery: np.ndarray, distance: Distance | None = None) -> RetrievalResult:
        """Rank ``gallery`` for each ``query`` by ``distance`` (default: the run's)."""
        n = min(query.shape[1], gallery.shape[1])  # differing dims: compare the first n (λ-orth truncation)
        return evaluate_retrieval(
            query[:, :n],
            gallery=gallery[:, :n],
            **self.data.relevance,
            distance=distance or self.config.distance,
            topk=self.config.topk,
            leave_one_out=self.data.leave_one_out,
            chunk_size=self.config.chunk_size,
        )

    @classmethod
    def labelled(cls, labels: np.ndarray, config: EvaluationConfig) -> Evaluator:
        """Query = gallery = one labelled set, leave-one-out (the papers' protocol)."""
        items = np.zeros((len(labels), 0), np.float32)
        return cls(config, EvalSet.labelled(Features(items, items, items, labels)))


def gate_metrics(result: RetrievalResult) -> dict[str, float]:
    """A result as the gate records it: top-k, mAP and, for explicit relevance, R@k, MRR, nDCG@10."""
    metrics = {f"top{k}": v for k, v in result.cmc.items()} | {"mAP": result.mean_ap}
    if result.relevance == "explicit":
        metrics |= {f"recall@{k}": v for k, v in result.recall.items()} | {"mrr": result.mrr, "ndcg@10": result.ndcg10}
    return metrics

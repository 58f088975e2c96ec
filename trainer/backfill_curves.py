"""Backfill curves (numpy only): the metric as a growing part of the gallery, in a given order,
trades its adapted embedding for the new model's, and the area under that curve (M̃)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from fctkit.errors import InputError

from .evaluation import evaluate_retrieval
from .evaluation_inputs import Distance, as_matrix, check_positive_int
from .relevance import Positives
from .retrieval_result import metric_k, metric_value


@dataclass(frozen=True)
class BackfillCurve:
    """Metric after backfilling each fraction of the gallery; ``area`` is M~ (trapezoid on [0, 1])."""

    fractions: np.ndarray
    values: np.ndarray
    area: float
    metric: str = "top1"

    def to_dict(self) -> dict[str, Any]:
        return {
            "fractions": self.fractions.tolist(),
            "values": self.values.tolist(),
            "area": self.area,
            "metric": self.metric,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> BackfillCurve:
        return cls(
            fractions=np.asarray(data["fractions"], dtype=float),
            values=np.asarray(data["values"], dtype=float),
            area=float(data["area"]),
            metric=str(data.get("metric", "top1")),
        )


def backfill_curve(
    query: np.ndarray,
    query_labels: np.ndarray | None,
    adapted_gallery: np.ndarray,
    backfilled_gallery: np.ndarray,
    gallery_labels: np.ndarray | None,
    order: np.ndarray,
    *,
    positives: Positives | None = None,
    steps: int = 10,
    distance: Distance = "l2",
    metric: str = "top1",
    chunk_size: int = 1024,
    leave_one_out: bool = False,
    workers: int | None = None,
    progress: bool = False,
) -> BackfillCurve:
    """Evaluate ``metric`` at fractions t = 0, 1/steps, ..., 1 of the gallery backfilled.

    At fraction t the first ``round(t * N)`` items of ``order`` (a permutation of the gallery
    indices, most useful first) use their backfilled (new-model) embedding, the rest the
    adapted one; t = 0 is the adapted gallery, t = 1 the fully backfilled one.
    """
    adapted = as_matrix(adapted_gallery, "adapted gallery")
    backfilled = as_matrix(backfilled_gallery, "backfilled gallery")
    if adapted.shape != backfilled.shape:
        raise InputError(
            f"adapted and backfilled galleries must have the same shape; got {adapted.shape} and {backfilled.shape}"
        )
    n = adapted.shape[0]
    perm = np.asarray(order)
    if (
        perm.ndim != 1
        or perm.dtype.kind not in "iu"
        or perm.shape[0] != n
        or not np.array_equal(np.sort(perm), np.arange(n))
    ):
        raise InputError(f"order must be a permutation of the {n} gallery indices (integers 0..{n - 1}, each once)")
    steps = check_positive_int(steps, "steps")
    k = metric_k(metric)
    fractions = np.linspace(0.0, 1.0, steps + 1)
    values = np.empty(steps + 1)
    for s, t in enumerate(tqdm(fractions, desc="backfill curve", unit="step", disable=not progress)):
        gallery = adapted.copy()
        chosen = perm[: round(t * n)]
        gallery[chosen] = backfilled[chosen]
        result = evaluate_retrieval(
            query,
            query_labels,
            gallery,
            gallery_labels,
            positives=positives,
            distance=distance,
            topk=(k or 1,),
            leave_one_out=leave_one_out,
            chunk_size=chunk_size,
            workers=workers,
        )
        values[s] = metric_value(result, metric)
    area = float(np.sum((values[1:] + values[:-1]) / 2 * np.diff(fractions)))
    return BackfillCurve(fractions=fractions, values=values, area=area, metric=metric)

"""What a retrieval evaluation returns (:class:`RetrievalResult`, numpy-free) and how a metric
is named and read from it: ``top1``, ``topK``, ``recall@K``, ``mrr``, ``ndcg@10``, ``mean_ap``."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from fctkit.errors import InputError


@dataclass(frozen=True)
class RetrievalResult:
    """Aggregate retrieval metrics of one query set against one gallery.

    ``cmc`` always holds k = 1; ``cmc_curve[k - 1]`` is CMC@k for every k up to the largest
    requested k (what report plots draw).
    """

    cmc: dict[int, float]
    mean_ap: float
    n_queries: int
    n_skipped: int
    cmc_curve: tuple[float, ...] = ()
    distance: str = "l2"
    recall: dict[int, float] = field(default_factory=dict)
    mrr: float = math.nan
    ndcg10: float = math.nan
    relevance: str = "class"  # "class" (by labels) or "explicit" (positives per query)

    @property
    def top1(self) -> float:
        return self.cmc[1]

    def to_dict(self) -> dict[str, Any]:
        """JSON-serialisable form; :meth:`from_dict` inverts it."""
        return {
            "cmc": {str(k): v for k, v in sorted(self.cmc.items())},
            "top1": self.top1,
            "mean_ap": self.mean_ap,
            "n_queries": self.n_queries,
            "n_skipped": self.n_skipped,
            "cmc_curve": list(self.cmc_curve),
            "distance": self.distance,
            "recall": {str(k): v for k, v in sorted(self.recall.items())},
            "mrr": None if math.isnan(self.mrr) else self.mrr,
            "ndcg10": None if math.isnan(self.ndcg10) else self.ndcg10,
            "relevance": self.relevance,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> RetrievalResult:
        try:
            return cls(
                cmc={int(k): float(v) for k, v in data["cmc"].items()},
                mean_ap=float(data["mean_ap"]),
                n_queries=int(data["n_queries"]),
                n_skipped=int(data["n_skipped"]),
                cmc_curve=tuple(float(v) for v in data.get("cmc_curve", ())),
                distance=str(data.get("distance", "l2")),
                recall={int(k): float(v) for k, v in data.get("recall", {}).items()},
                mrr=_float_or_nan(data.get("mrr")),
                ndcg10=_float_or_nan(data.get("ndcg10")),
                relevance=str(data.get("relevance", "class")),
            )
        except (KeyError, TypeError, ValueError, AttributeError) as exc:
            raise InputError(f"not a retrieval result: {exc!r} in {data!r}") from exc


def _float_or_nan(value: Any) -> float:
    return math.nan if value is None else float(value)


def metric_value(result: RetrievalResult, metric: str) -> float:
    """The value of ``metric`` in ``result``: ``top1``, ``topK`` (any k in its CMC), ``mean_ap``,
    ``recall@K``, ``mrr`` or ``ndcg@10``."""
    kind, k = parse_metric(metric)
    if kind == "mean_ap":
        return result.mean_ap
    if kind in ("mrr", "ndcg@10"):
        value = result.mrr if kind == "mrr" else result.ndcg10
        if math.isnan(value):
            raise InputError(f"metric {metric!r}: this result was computed without it (an older report)")
        return value
    if kind == "recall":
        if k in result.recall:
            return result.recall[k]
        raise InputError(f"metric {metric!r}: this result has R@k only for k in {sorted(result.recall)}")
    assert k is not None  # parse_metric gives k for every kind but mean_ap, mrr and ndcg@10
    if k in result.cmc:
        return result.cmc[k]
    if k <= len(result.cmc_curve):
        return result.cmc_curve[k - 1]
    raise InputError(f"metric {metric!r}: this result has CMC only for k in {sorted(result.cmc)}")


METRIC_NAMES = "'top1', 'top5', ... (CMC), 'recall@1', 'recall@10', ... (R@k), 'mrr', 'ndcg@10' or 'mean_ap'"


def parse_metric(metric: str) -> tuple[str, int | None]:
    """``("top", k)``, ``("recall", k)``, ``("mrr", None)``, ``("ndcg@10", None)`` or
    ``("mean_ap", None)``; anything else is an :class:`InputError`."""
    if metric in ("mean_ap", "mrr", "ndcg@10"):
        return metric, None
    if isinstance(metric, str):
        for prefix, kind in (("top", "top"), ("recall@", "recall")):
            rest = metric[len(prefix) :]
            if metric.startswith(prefix) and rest.isdigit() and int(rest) >= 1:
                return kind, int(rest)
    raise InputError(f"unknown metric {metric!r}: use {METRIC_NAMES}")


def metric_label(metric: str) -> str:
    """How reports write a metric: top-1, R@10, MRR, nDCG@10, mAP."""
    kind, k = parse_metric(metric)
    return {"top": f"top-{k}", "recall": f"R@{k}", "mrr": "MRR", "ndcg@10": "nDCG@10", "mean_ap": "mAP"}[kind]


def metric_k(metric: str) -> int | None:
    """k of a ``topK`` or ``recall@K`` metric, None for the others."""
    return parse_metric(metric)[1]

"""A query-side map Q(φ_new(query)), trained jointly with a gallery-side adapter h.

After an upgrade the device embeds queries with the new model and searches rows h(φ_old)
(and, once backfilled, φ_new). A small map on the query side lets both sides move towards
each other instead of asking h alone to reach φ_new. Q starts as the identity (a residual
MLP whose last layer is zero) and is trained on the task's training positives, together with
h, by three InfoNCE terms over a batch of (query, positive item) pairs::

    L = InfoNCE(h(φ_old(g)), φ_new(g))                     # h stays compatible with φ_new rows
      + w · [InfoNCE(Q(φ_new(q)), h(φ_old(g)))              # queries find adapted rows
             + InfoNCE(Q(φ_new(q)), φ_new(g))]              # and backfilled rows

So the same Q serves a gallery of adapted rows, of backfilled rows, or a mix. It is a bundle
role of its own (``query_map``), run on the device before search. Because Q learns from the
task's own positives it is task supervision as much as compatibility: the report shows it as
its own case next to the gallery-side adapter alone.

The same loss with Q fixed to the identity (:class:`QueryPositivesConfig`) trains h alone on
the task's positives: no new role, the device searches with the new model's queries as they
are. On WordNet lemma → gloss this gallery-side adapter did better than a learned Q
(BENCHMARKS.md, "query positives").
"""

from __future__ import annotations

import dataclasses
from typing import Any, cast

import numpy as np
import torch
from torch import nn

from fctkit.errors import ConfigError, InputError
from fctkit.feature_checks import check_features

from .adapter_base import Adapter, config_of
from .fitting import History, TrainConfig, fit
from .losses import info_nce, info_nce_with_negatives, neighbourhood_kl


@dataclasses.dataclass
class QueryPositivesConfig:
    """Training a forward adapter further on the task's (query, positive) pairs, with the
    new model's queries as they are: a gallery-side adapter that has seen the task's queries."""

    # `fctkit train`: also fit each forward method's adapter on the task's query positives
    # (None: on for an instance-level task, see PipelineConfig.for_task)
    enabled: bool | None = None
    task_weight: float = 1.0  # w: the query terms against h's own compatibility term
    temperature: float = 0.05
    # per training pair, this many of its positive's nearest training-gallery items by the old
    # model (h-mapped) join the batch's candidates as negatives for the query term
    hard_negatives: int = 8
    # weight of a KL term matching each query's softmax over the batch's adapted rows to its
    # softmax over the same rows embedded by the new model (the new model's neighbourhoods)
    distill_weight: float = 0.0
    # batch_size None: derived from the task's pairs (PipelineConfig.for_task); a run's settings
    # search chooses it and hard_negatives on held-out training data (selection.batch_sizes, .hard_negatives)
    train: TrainConfig = dataclasses.field(
        default_factory=lambda: TrainConfig(
            epochs=30, batch_size=None, lr=1e-3, weight_decay=1e-4, warmup_epochs=2, patience=6
        )
    )

    def __post_init__(self) -> None:
        if self.task_weight < 0 or self.temperature <= 0 or self.hard_negatives < 0 or self.distill_weight < 0:
            raise ConfigError(
                f"{self.section}: task_weight, hard_negatives and distill_weight must be >= 0 and temperature > 0"
            )
        if getattr(self, "width", 1) < 1:
            raise ConfigError(f"{self.section}: width must be >= 1")

    @property
    def section(self) -> str:
        return "query_positives"


@dataclasses.dataclass
class QueryMapConfig(QueryPositivesConfig):
    """The same training with a query map Q learned jointly on the new model's queries."""

    enabled: bool | None = False  # `fctkit train`: also fit each forward method's adapter jointly with a query map
    width: int = 256

    @property
    def section(self) -> str:
        return "query_map"


class QueryMap(Adapter):
    """Q(q) = q + Lin(w→d)(GELU(Lin(d→w) q)), the identity at the start."""

    kind = "query_map"
    config_class = QueryMapConfig

    def __init__(self, config: QueryMapConfig, d_new: int) -> None:
        super().__init__(config)
        if d_new < 1:
            raise InputError(f"query map dim must be positive, got {d_new}")
        self.d_new = d_new
        widen = nn.Linear(d_new, config.width)
        narrow = nn.Linear(config.width, d_new)  # built second, as the seeded initialisation expects
        nn.init.zeros_(narrow.weight)
        nn.init.zeros_(narrow.bias)
        self.residual = nn.Sequential(widen, nn.GELU(), narrow)

    def dims(self) -> dict[str, int]:
        return {"d_new": self.d_new}

    @property
    def input_names(self) -> tuple[str, ...]:
        return ("new",)

    def forward(self, new: torch.Tensor) -> torch.Tensor:
        return new + self.residual(new)

    def transform(self, new: np.ndarray) -> np.ndarray:
        return self._run(self, check_features("new", new, dim=self.d_new))


@dataclasses.dataclass(frozen=True)
class MinedNegatives:
    """Hard negatives for :func:`fit_jointly`: the training gallery's ``old`` (and ``side``)
    rows, and per training pair the rows mined for it (``rows``, (pairs, m)) and its own
    positive's row (``positive``), which never counts as its negative."""

    old: np.ndarray
    side: np.ndarray | None
    rows: np.ndarray
    positive: np.ndarray

    @classmethod
    def nearest(
        cls,
        gallery_old: np.ndarray,
        gallery_side: np.ndarray | None,
        positive: np.ndarray,
        m: int,
        chunk_size: int = 2048,
    ) -> MinedNegatives:
        """Each pair's ``m`` nearest gallery rows to its positive by the old model's cosine."""
        unit = gallery_old / np.maximum(np.linalg.norm(gallery_old, axis=1, keepdims=True), 1e-12)
        m = min(m, len(unit) - 1)
        if m < 1:
            raise InputError("mining hard negatives needs m >= 1 and a training gallery of at least 2 rows")
        rows = np.empty((len(positive), m), np.int64)
        for start in range(0, len(positive), chunk_size):
            items = positive[start : start + chunk_size]
            cosines = unit[items] @ unit.T
            cosines[np.arange(len(items)), items] = -np.inf
            rows[start : start + chunk_size] = np.argpartition(-cosines, m - 1, axis=1)[:, :m]
        return cls(gallery_old, gallery_side, rows, positive.astype(np.int64))


class _Joint(nn.Module):
    def __init__(self, adapter: nn.Module, query_side: nn.Module) -> None:
        super().__init__()
        self.adapter, self.query_side = adapter, query_side


def _mined_tensors(negatives: MinedNegatives, adapter: Adapter) -> tuple[torch.Tensor, ...]:
    """The gallery rows the mined indices point into, as CPU tensors (gathered per batch)."""
    arrays = [negatives.old] + ([negatives.side] if getattr(adapter, "d_side", 0) else [])
    return tuple(torch.as_tensor(np.asarray(a, np.float32)) for a in arrays)


def fit_jointly(
    adapter: Adapter,
    query_new: np.ndarray,
    gallery_old: np.ndarray,
    gallery_side: np.ndarray | None,
    gallery_new: np.ndarray,
    config: QueryPositivesConfig | dict[str, Any] | None = None,
    negatives: MinedNegatives | None = None,
) -> tuple[QueryMap | None, History]:
    """Train ``adapter`` further (in place) on aligned positive pairs: row i of ``query_new`` is
    a training query, row i of the gallery arrays one of its positives. With a
    :class:`QueryMapConfig` a new query map is trained together with it and returned; with a
    :class:`QueryPositivesConfig` the queries stay as the new model made them (Q = identity)
    and ``None`` is returned.

    ``adapter`` must take ``(old[, side])`` like the forward adapters. ``negatives`` (with
    ``config.hard_negatives`` > 0): the mined rows each query must also rank below its positive.
    ``config.distill_weight`` > 0 adds :func:`~.losses.neighbourhood_kl` towards the new model's
    ranking of the batch."""
    if not isinstance(config, QueryPositivesConfig):
        config = cast(QueryMapConfig, config_of(QueryMapConfig, config))
    query_new = check_features("query_new", query_new)
    rows = len(query_new)
    arrays = [query_new, check_features("gallery_old", gallery_old, rows=rows)]
    if getattr(adapter, "d_side", 0):
        arrays.append(check_features("gallery_side", gallery_side, rows=rows))
    arrays.append(check_features("gallery_new", gallery_new, rows=rows, dim=query_new.shape[1]))
    torch.manual_seed(config.train.seed)
    query_map = QueryMap(config, d_new=query_new.shape[1]) if isinstance(config, QueryMapConfig) else None
    joint = _Joint(adapter, query_map if query_map is not None else nn.Identity())
    tau, weight = config.temperature, config.task_weight
    mined: tuple[torch.Tensor, ...] | None = None
    if config.hard_negatives and negatives is not None:
        mined = _mined_tensors(negatives, adapter)
        arrays += [negatives.rows, negatives.positive]

    def loss(model: _Joint, query: torch.Tensor, *batch: torch.Tensor) -> torch.Tensor:
        gallery = batch[:-2] if mined is not None else batch
        *inputs, target = gallery
        adapted = model.adapter(*inputs)
        mapped = model.query_side(query)
        if mined is not None:
            rows, positive = batch[-2:]
            pool = rows.reshape(-1)
            negatives_adapted = model.adapter(*(t[pool.cpu()].to(query.device) for t in mined))
            valid = pool.reshape(1, -1) != positive.reshape(-1, 1)
            query_term = info_nce_with_negatives(mapped, adapted, negatives_adapted, valid, tau)
        else:
            query_term = info_nce(mapped, adapted, tau)
        total = info_nce(adapted, target, tau) + weight * (query_term + info_nce(mapped, target, tau))
        if config.distill_weight:
            total = total + config.distill_weight * neighbourhood_kl(mapped, adapted, target, tau)
        return total

    label = "query map + adapter" if query_map is not None else "adapter on query positives"
    history = fit(joint, arrays, loss, config.train, description=f"fit {label}")
    adapter.eval()
    if query_map is None:
        return None, history
    query_map.metrics["best_val_loss"] = min(history.val_loss) if history.val_loss else history.train_loss[-1]
    return query_map.eval(), history

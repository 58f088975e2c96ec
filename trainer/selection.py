"""Hyper-parameter selection on held-out *training* data, by the task's primary metric.

The training split is cut in two by gallery item: adapters are fitted on one part and judged
on the other (its gallery items, and the training queries whose positives lie there). The
evaluation split is never read. The search is coordinate-wise: start from the configured
values, then try each knob's values in turn, keeping a change only when it scores higher;
epochs are chosen inside each fit by early stopping on held-out pairs (``train.patience``).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np
from tqdm.auto import tqdm

from fctkit.errors import ConfigError, InputError

from .tasks import TaskSplit


@dataclasses.dataclass
class SelectionConfig:
    enabled: bool = True  # task runs: choose each trainable method's settings on held-out training data
    holdout_fraction: float = 0.2  # share of the training gallery (and its queries) held out to judge
    temperatures: tuple[float, ...] = (0.02, 0.05, 0.1)
    learning_rates: tuple[float, ...] = (1e-3, 3e-3, 1e-2)
    widths: tuple[int, ...] = (256, 1024)  # residual MLP width; FCT mixer width
    weight_decays: tuple[float, ...] = (0.0, 1e-4, 1e-3)
    # the residual adapter's least-squares start; empty: not searched (residual.ridge stands). Worth
    # searching when training pairs are fewer than input dims: e.g. (1e-3, 0.1, 1.0) for 1280-d image models
    ridges: tuple[float, ...] = ()
    # batch sizes of the residual adapter and of query-positives training, each kept only when it
    # leaves at least MIN_STEPS_PER_EPOCH optimiser steps an epoch on the rows it trains on (see
    # batch_candidates); the first one allowed is where the search starts
    batch_sizes: tuple[int, ...] = (256, 1024)
    # mined hard negatives per pair in query-positives training (QueryPositivesConfig.hard_negatives)
    hard_negatives: tuple[int, ...] = (0, 8)

    def __post_init__(self) -> None:
        if not 0 < self.holdout_fraction < 1:
            raise ConfigError("selection.holdout_fraction must be in (0, 1)")
        if any(r <= 0 for r in self.ridges):
            raise ConfigError(f"selection.ridges must be > 0, got {list(self.ridges)}")
        if not self.batch_sizes or any(b < 2 for b in self.batch_sizes):
            raise ConfigError(f"selection.batch_sizes must be non-empty and >= 2, got {list(self.batch_sizes)}")
        if any(h < 0 for h in self.hard_negatives):
            raise ConfigError(f"selection.hard_negatives must be >= 0, got {list(self.hard_negatives)}")


# A batch so large that an epoch is one or two steps trains badly on a small task: measured on a
# 2,000-pair photo task, batch 1,024 (1-2 steps an epoch) gave 0.775 of new/new, batch 256 0.983.
MIN_STEPS_PER_EPOCH = 4
SMALLEST_BATCH = 32


def batch_candidates(rows: int, sizes: Sequence[int], val_fraction: float = 0.1) -> tuple[int, ...]:
    """The batch sizes of ``sizes`` that leave at least :data:`MIN_STEPS_PER_EPOCH` steps an
    epoch on ``rows`` training rows (less the validation share). When none does, the one size
    the task allows: the largest power of two that leaves that many steps (at least
    :data:`SMALLEST_BATCH`), so a small task is never trained in one or two steps an epoch."""
    trained = rows * (1.0 - val_fraction)
    allowed = tuple(b for b in sizes if trained / b >= MIN_STEPS_PER_EPOCH)
    if allowed:
        return allowed
    return (max(SMALLEST_BATCH, 2 ** int(np.floor(np.log2(max(trained / MIN_STEPS_PER_EPOCH, 1.0))))),)


@dataclasses.dataclass(frozen=True)
class Knob:
    """One hyper-parameter: a dotted path into a method's config and the values to try."""

    path: str
    values: tuple[Any, ...]


def knobs_for(method: str, config: Any, selection: SelectionConfig, rows: int | None = None) -> list[Knob]:
    """The knobs searched for ``method`` (none for closed-form methods); ``rows``: how many
    training rows a fit during the search sees, which bounds the batch sizes worth trying."""
    if method == "residual":
        knobs = [Knob("objective.temperature", selection.temperatures), Knob("train.lr", selection.learning_rates)]
        if config.form == "mlp":
            knobs.append(Knob("width", selection.widths))
        knobs.append(Knob("train.weight_decay", selection.weight_decays))
        if selection.ridges:
            knobs.insert(0, Knob("ridge", selection.ridges))
        return [*batch_knob(rows, selection.batch_sizes, config.train.val_fraction), *knobs]
    if method in ("query-positives", "query-map"):
        return [
            *batch_knob(rows, selection.batch_sizes, config.train.val_fraction),
            *([Knob("hard_negatives", selection.hard_negatives)] if len(selection.hard_negatives) > 1 else []),
        ]
    if method in ("fct", "fct-no-side-info"):
        knobs = [Knob("objective.temperature", selection.temperatures)] if config.objective.kind != "mse" else []
        return [
            *knobs,
            Knob("train.lr", selection.learning_rates),
            Knob("mixer_width", selection.widths),
            Knob("train.weight_decay", selection.weight_decays),
        ]
    if method in ("lambda-orth", "lambda-orth-relaxed"):
        return [Knob("tau", selection.temperatures), Knob("train.lr", selection.learning_rates)]
    return []


def batch_knob(rows: int | None, sizes: Sequence[int], val_fraction: float) -> list[Knob]:
    """The batch-size knob, when more than one size suits ``rows`` training rows."""
    allowed = batch_candidates(rows, sizes, val_fraction) if rows is not None else tuple(sizes)
    return [Knob("train.batch_size", allowed)] if len(allowed) > 1 else []


def with_value(config: Any, path: str, value: Any) -> Any:
    """A copy of the dataclass ``config`` with the dotted ``path`` set to ``value``."""
    head, _, rest = path.partition(".")
    if rest:
        return dataclasses.replace(config, **{head: with_value(getattr(config, head), rest, value)})
    return dataclasses.replace(config, **{head: value})


def value_at(config: Any, path: str) -> Any:
    for part in path.split("."):
        config = getattr(config, part)
    return config


@dataclasses.dataclass(frozen=True)
class Selection:
    config: Any
    score: float
    tried: int
    chosen: dict[str, Any]
    outcome: Any = None  # what ``score`` made for the best config (e.g. the adapter it fitted)
    # per knob: how much its best value raised the score over the value it started the knob at
    # (0.0: the search could have left it alone); what the suite reports as "what each setting moved"
    gains: dict[str, float] = dataclasses.field(default_factory=dict)
    seconds: float = 0.0


def coordinate_search(
    config: Any,
    knobs: Sequence[Knob],
    score: Callable[[Any], tuple[float, Any]],
    progress: bool = False,
    description: str = "settings",
) -> Selection:
    """Best config found by trying each knob's values in turn (see the module docstring).
    ``score(config)`` returns the score and what it made to get it; the best one's is kept.
    ``progress``: a bar over the fits (at most one per value, fewer when a value is the current one)."""
    started = time.perf_counter()
    bar = tqdm(
        total=1 + sum(len(k.values) for k in knobs), desc=description, unit="fit", disable=not progress, leave=False
    )
    best, (best_score, best_outcome), tried = config, score(config), 1
    gains: dict[str, float] = {}
    bar.update()
    for knob in knobs:
        before = best_score
        for value in knob.values:
            if value == value_at(best, knob.path):
                bar.update()
                continue
            candidate = with_value(best, knob.path, value)
            candidate_score, outcome = score(candidate)
            tried += 1
            bar.update()
            bar.set_postfix(best=f"{max(best_score, candidate_score):.4f}")
            if candidate_score > best_score:
                best, best_score, best_outcome = candidate, candidate_score, outcome
        gains[knob.path] = best_score - before
    bar.close()
    chosen = {k.path: value_at(best, k.path) for k in knobs}
    return Selection(best, best_score, tried, chosen, best_outcome, gains, time.perf_counter() - started)


@dataclasses.dataclass(frozen=True)
class Holdout:
    """The training split cut in two: ``fit`` (gallery rows ``fit_rows`` and the queries whose
    positives all lie there) and ``held_out`` (the other gallery rows and the queries with a
    positive among them)."""

    fit_rows: np.ndarray
    fit: TaskSplit
    held_out: TaskSplit


def holdout_split(split: TaskSplit, fraction: float, seed: int) -> Holdout:
    """Cut ``split`` by gallery item (see :class:`Holdout`); deterministic from ``seed``."""
    n = len(split.gallery)
    held = np.sort(np.random.default_rng(seed).permutation(n)[: max(1, round(n * fraction))])
    fit_rows = np.setdiff1d(np.arange(n), held)
    if len(fit_rows) < 2:
        raise InputError(
            f"the training split has {n} gallery items: too few to hold some out for selection; "
            f"add training data or set selection.enabled = false"
        )
    if split.positives is not None:
        owners = np.repeat(np.arange(len(split.query)), np.diff(split.positives.indptr))
        touching = np.isin(split.positives.indices, held)
        held_queries = np.unique(owners[touching])
        fit_queries = np.setdiff1d(np.arange(len(split.query)), held_queries)
    else:
        assert split.query.labels is not None and split.gallery.labels is not None  # class level: labels
        held_queries = np.flatnonzero(np.isin(split.query.labels, split.gallery.labels[held]))
        fit_queries = np.flatnonzero(np.isin(split.query.labels, split.gallery.labels[fit_rows]))
    if len(held_queries) == 0:
        raise InputError(
            "no training query has a positive among the held-out gallery items; "
            "raise selection.holdout_fraction or set selection.enabled = false"
        )
    return Holdout(fit_rows, split.subset(fit_queries, fit_rows), split.subset(held_queries, held))

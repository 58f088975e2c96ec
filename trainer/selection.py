"""Hyper-parameter selection on held-out *training* data, by the task's primary metric.

The training split is cut in two by gallery item: adapters are fitted on one part and judged
on the other (its gallery items, and the training queries whose positives lie there). The
evaluation split is never read. The search is coordinate-wise: start from the configured
values, then try each knob's values in turn, keeping a change only when it scores higher;
epochs are chosen inside each fit by early stopping on held-out pairs (``train.patience``).
"""

from __future__ import annotations

import dataclasses
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

    def __post_init__(self) -> None:
        if not 0 < self.holdout_fraction < 1:
            raise ConfigError("selection.holdout_fraction must be in (0, 1)")
        if any(r <= 0 for r in self.ridges):
            raise ConfigError(f"selection.ridges must be > 0, got {list(self.ridges)}")


@dataclasses.dataclass(frozen=True)
class Knob:
    """One hyper-parameter: a dotted path into a method's config and the values to try."""

    path: str
    values: tuple[Any, ...]


def knobs_for(method: str, config: Any, selection: SelectionConfig) -> list[Knob]:
    """The knobs searched for ``method`` (none for closed-form methods)."""
    if method == "residual":
        knobs = [Knob("objective.temperature", selection.temperatures), Knob("train.lr", selection.learning_rates)]
        if config.form == "mlp":
            knobs.append(Knob("width", selection.widths))
        knobs.append(Knob("train.weight_decay", selection.weight_decays))
        return [Knob("ridge", selection.ridges), *knobs] if selection.ridges else knobs
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
    bar = tqdm(
        total=1 + sum(len(k.values) for k in knobs), desc=description, unit="fit", disable=not progress, leave=False
    )
    best, (best_score, best_outcome), tried = config, score(config), 1
    bar.update()
    for knob in knobs:
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
    bar.close()
    return Selection(best, best_score, tried, {k.path: value_at(best, k.path) for k in knobs}, best_outcome)


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

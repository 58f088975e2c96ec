"""Choices a run makes on held-out *training* data (never on the evaluation split): each
method's settings (:func:`select_settings`), the transition weight and the hubness β; and the
query map trained jointly with an adapter on the task's positives.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Mapping
from typing import Any

import numpy as np

from fctkit.errors import ConfigError

from .adapter_base import Adapter
from .method_names import joint_fit_of, method_label
from .methods import fit_method, quiet_training, run_seeded
from .pipeline_config import PipelineConfig
from .query_map import MinedNegatives, QueryPositivesConfig, fit_jointly
from .report import Report
from .retrieval_result import metric_value
from .searches import (
    EvalSet,
    Evaluator,
    HeldOutScores,
    Hubness,
    Transition,
    WithQueryMap,
    adapted_retrieval,
    device_queries,
    scored_retrieval,
    task_features,
)
from .selection import Holdout, Selection, coordinate_search, knobs_for
from .tasks import RetrievalTask, TaskSplit


def select_settings(
    config: PipelineConfig,
    method: str,
    section: Any,
    knobs: list,
    task: RetrievalTask,
    holdout: Holdout,
    report: Report | None,
) -> tuple[Any, Adapter, dict[str, Any]]:
    """The best settings on ``holdout``, the adapter they fitted on its fit part, and the
    search's record (:func:`search_record`)."""
    fit_part = task_features(holdout.fit.gallery)

    def fit(candidate: Any) -> Adapter:
        return fit_method(method, quiet_training(candidate), fit_part)

    return _search(config, method_label(method), section, knobs, fit, task, holdout, report)


def select_joint_settings(
    config: PipelineConfig,
    variant: str,
    section: QueryPositivesConfig,
    fit_part_adapter: Adapter,
    task: RetrievalTask,
    holdout: Holdout,
    report: Report | None,
) -> tuple[QueryPositivesConfig, Adapter | WithQueryMap, dict[str, Any]]:
    """The joint fit's settings (batch size, hard negatives) chosen on ``holdout``: each candidate
    continues a copy of ``fit_part_adapter`` on the fit part's positives, as the final fit does."""
    knobs = knobs_for(str(joint_fit_of(variant)), section, config.selection, pair_count(holdout.fit))

    def fit(candidate: QueryPositivesConfig) -> Adapter | WithQueryMap:
        return fit_on_positives(config, quiet_training(candidate), copy.deepcopy(fit_part_adapter), holdout.fit)

    return _search(config, method_label(variant), section, knobs, fit, task, holdout, report)


def _search(
    config: PipelineConfig,
    label: str,
    section: Any,
    knobs: list,
    fit: Any,
    task: RetrievalTask,
    holdout: Holdout,
    report: Report | None,
) -> tuple[Any, Any, dict[str, Any]]:
    judge = EvalSet.of_task(holdout.held_out)
    evaluate = Evaluator(config.evaluation, judge)

    def score(candidate: Any) -> tuple[float, Any]:
        adapter = fit(candidate)
        return metric_value(evaluate(*adapted_retrieval(adapter, judge)), task.primary_metric), adapter

    chosen = coordinate_search(section, knobs, score, progress=config.progress, description=f"selecting {label}")
    if report is not None:
        settings = ", ".join(f"{path} = {value}" for path, value in chosen.chosen.items())
        gains = ", ".join(f"{path} {gain:+.4f}" for path, gain in chosen.gains.items())
        report.add_fact(
            f"selected [{label}]",
            f"{settings} ({task.primary_metric} {chosen.score:.4f} on held-out training data, {chosen.tried} fits, "
            f"{chosen.seconds:.0f} s; gain over the starting value: {gains})",
        )
    return chosen.config, chosen.outcome, search_record(chosen)


def search_record(chosen: Selection) -> dict[str, Any]:
    """What a settings search chose and what each searched setting gained on held-out training
    data (the gate keeps it, so the quality suite can tell which settings earn their fits)."""
    return {
        "chosen": dict(chosen.chosen),
        "gains": {path: round(gain, 6) for path, gain in chosen.gains.items()},
        "score": round(chosen.score, 6),
        "fits": chosen.tried,
        "seconds": round(chosen.seconds, 2),
    }


def pair_count(split: TaskSplit) -> int:
    """How many (query, positive) pairs a joint fit trains on."""
    return len(split.positives.indices) if split.positives is not None else len(split.query)


def fit_on_fit_part(method: str, section: Any, holdout: Holdout) -> Adapter:
    """``method`` fitted with ``section`` on the fit part of ``holdout``."""
    return fit_method(method, quiet_training(section), task_features(holdout.fit.gallery))


@dataclasses.dataclass
class HeldOutFit:
    """An adapter (and query map) fitted on part of the training split the way the final one
    was fitted on all of it, and the held-out rest to choose scoring settings on."""

    adapter: Adapter | WithQueryMap
    holdout: Holdout


def fit_on_holdout(config: PipelineConfig, fit_part_adapter: Adapter, holdout: Holdout, variant: str) -> HeldOutFit:
    """Like the final fit of ``variant``, but from ``fit_part_adapter`` (the method fitted on the
    fit part): a copy of it, trained on the fit part's query positives when the variant was."""
    copied = copy.deepcopy(fit_part_adapter)
    joint = joint_fit_of(variant)
    if joint is None:
        return HeldOutFit(copied, holdout)
    return HeldOutFit(fit_on_positives(config, joint_section(config, joint), copied, holdout.fit), holdout)


def joint_section(config: PipelineConfig, joint: str) -> QueryPositivesConfig:
    """The run's config section of a joint fit ("query-map" or "query-positives")."""
    return {"query-map": config.query_map, "query-positives": config.query_positives}[joint]


def fit_on_positives(
    config: PipelineConfig, section: QueryPositivesConfig, adapter: Adapter, train: TaskSplit
) -> Adapter | WithQueryMap:
    """Continue training ``adapter`` on the training positives: with a new query map
    (a :class:`QueryMapConfig` ``section``) or with the new model's queries as they are."""
    positives = train.positives
    if positives is None:
        raise ConfigError(f"{section.section} needs an instance-level task (explicit positives per query)")
    queries = np.repeat(np.arange(len(train.query)), np.diff(positives.indptr))
    items = positives.indices
    gallery = train.gallery
    side = gallery.side if gallery.side.shape[1] else None
    negatives = (
        MinedNegatives.nearest(gallery.old, side, items, section.hard_negatives) if section.hard_negatives else None
    )
    query_map, _ = fit_jointly(
        adapter,
        train.query.new[queries],
        gallery.old[items],
        None if side is None else side[items],
        gallery.new[items],
        run_seeded(config, section),
        negatives,
    )
    return adapter if query_map is None else WithQueryMap(adapter, query_map)


def choose_transition(
    config: PipelineConfig,
    task: RetrievalTask,
    variant: str,
    final: Adapter | WithQueryMap | Hubness,
    refit: HeldOutFit,
    report: Report | None,
) -> Transition:
    """The weight with the best primary metric on held-out training data. With a
    :class:`Hubness` ``final``, its β is kept and its offset is part of the adapted score."""
    judge = EvalSet.of_task(refit.holdout.held_out)
    evaluate = Evaluator(config.evaluation, judge)
    base: Adapter | WithQueryMap | Hubness = refit.adapter
    if isinstance(final, Hubness):
        base = Hubness(refit.adapter, final.beta, device_queries(refit.adapter, refit.holdout.fit.query.new), final.k)
    scores = {
        w: metric_value(evaluate(*scored_retrieval(Transition(base, w), judge)), task.primary_metric)
        for w in config.transition.weights
    }
    weight = max(config.transition.weights, key=lambda w: (scores[w], -w))
    if report is not None:
        report.add_fact(
            f"transition weight [{method_label(variant)}]",
            f"w = {weight} ({task.primary_metric} {scores[weight]:.4f} on held-out training data; "
            f"w = 0: {scores.get(0.0, float('nan')):.4f})",
        )
    return Transition(final, weight, HeldOutScores(scores[weight], scores.get(0.0, float("nan"))))


def choose_hubness(
    config: PipelineConfig,
    task: RetrievalTask,
    variant: str,
    final: Adapter | WithQueryMap,
    refit: HeldOutFit,
    report: Report | None,
) -> Hubness:
    """β with the best primary metric on held-out training data (offsets from the fit part's queries)."""
    judge = EvalSet.of_task(refit.holdout.held_out)
    evaluate = Evaluator(config.evaluation, judge)
    reference = device_queries(refit.adapter, refit.holdout.fit.query.new)
    scores = {
        beta: metric_value(
            evaluate(*scored_retrieval(Hubness(refit.adapter, beta, reference, config.hubness.k), judge)),
            task.primary_metric,
        )
        for beta in config.hubness.betas
    }
    beta = max(config.hubness.betas, key=lambda b: (scores[b], -b))
    if report is not None:
        report.add_fact(
            f"hubness β [{method_label(variant)}]",
            f"β = {beta} ({task.primary_metric} {scores[beta]:.4f} on "
            f"held-out training data; β = 0: {scores.get(0.0, float('nan')):.4f}), k = {config.hubness.k}",
        )
    return Hubness(
        final,
        beta,
        device_queries(final, task.train.query.new),
        config.hubness.k,
        HeldOutScores(scores[beta], scores.get(0.0, float("nan"))),
    )


def held_out_scores(adapters: Mapping[str, Any]) -> dict[str, float]:
    """Each variant's primary metric on held-out training data, from the scoring choices made
    there (a variant's own score is the "without" of the scorings built on it)."""
    scores: dict[str, float] = {}
    for key, adapter in adapters.items():
        held = getattr(adapter, "held_out", None)
        if held is None:
            continue
        scores[key] = held.chosen
        if not np.isnan(held.without):
            scores.setdefault(key.rsplit("+", 1)[0], held.without)
    return scores


def recommended(held_out: dict[str, float]) -> dict[str, str]:
    """The variants to publish, chosen on held-out training data only: the best that needs no
    old model on the device (``gallery side``) and the best while devices still keep it
    (``during the transition``, which may be the same). Ties go to the variant with fewer parts."""

    def best(keys: list[str]) -> str | None:
        return max(keys, key=lambda k: (held_out[k], -k.count("+")), default=None)

    choice = {
        "gallery side": best([k for k in held_out if "transition" not in k.split("+")]),
        "during the transition": best(list(held_out)),
    }
    return {name: key for name, key in choice.items() if key is not None}

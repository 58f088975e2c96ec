"""`fctkit train`: one run from data to a gated report, readable top to bottom.

1. **features** — for image data, train the old backbone on the old classes, the new backbone
   on all classes and the side-info model ψ on the old data (no labels); extract φ_old, ψ,
   φ_new for the training split and the evaluation split. For pre-extracted features, load
   the ``.npz`` files and split them. For a retrieval task (:mod:`.tasks`), read its splits.
2. **adapters** — fit every enabled method on the training split's features; on a task, first
   choose each method's settings on held-out training data by the task's primary metric
   (:mod:`.selection`).
3. **evaluation** — every case of the papers' tables on the evaluation split (query = gallery,
   leave-one-out; a task's own queries, gallery and relevance), the ECC verdicts on the
   primary metric, CKA(φ_old, ψ), backfill curves per ordering with M̃.
4. **chain** (image data, optional) — v1 → v2 → v3 hop by hop and direct (FCT Table 5).
5. **outputs** — models, adapters, evaluation features, ``report.{md,json,png}`` and
   ``gate.json`` (the gate results that `fctkit bundle build` records in a manifest).
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np

from fctkit.config import load_config, to_mapping
from fctkit.errors import ConfigError

from .adapter_base import Adapter
from .adapters import FastFillAdapter, FastFillConfig, FCTAdapter, FCTConfig
from .backbones import BackboneConfig, extract_features, save_backbone, train_backbone
from .backfill import backfill_order
from .cka import linear_cka
from .closed_form import ClosedFormAdapter, ClosedFormConfig
from .datasets import load_dataset, load_feature_versions, make_splits, old_class_subset
from .evaluation import Distance, RetrievalResult, backfill_curve, ecc, evaluate_retrieval, metric_value
from .lambda_orth import LambdaOrthAdapter, LambdaOrthConfig
from .query_map import QueryMap, QueryMapConfig, fit_jointly
from .report import Report
from .residual import ResidualAdapter, ResidualConfig
from .hubness import hubness_offsets, offset_vectors
from .selection import Holdout, SelectionConfig, coordinate_search, holdout_split, knobs_for
from .side_info import SideInfoConfig, extract_side_info, save_side_info, train_side_info
from .tasks import RetrievalTask, TaskSplit, load_task

ForwardMethod = Literal["fct", "fct-no-side-info", "fastfill", "residual", "least-squares", "procrustes"]
UnifiedMethod = Literal["lambda-orth", "lambda-orth-relaxed"]
METHOD_LABELS = {
    "fct": "FCT, side-info ψ",
    "fct-no-side-info": "FCT, no side-info",
    "fastfill": "FastFill, side-info ψ",
    "residual": "residual adapter",
    "least-squares": "least squares",
    "procrustes": "Procrustes",
    "lambda-orth": "λ-orth, B⊥",
    "lambda-orth-relaxed": "λ-orth, B_λ",
}
# What `methods = []` (the default) means: every method for class-level data; for an
# instance-level task the identity-keeping ones (InfoNCE) next to the closed-form baseline.
INSTANCE_METHODS = ("residual", "fct", "least-squares", "lambda-orth")


# --- configuration -----------------------------------------------------------------------


@dataclasses.dataclass
class DataConfig:
    """``digits`` / ``fashion-mnist`` (images) or ``features`` (your own .npz per version)."""

    name: Literal["digits", "fashion-mnist", "features", "task"] = "digits"
    old_class_fraction: float = 0.5  # FCT protocol: the old model sees only the first half of the classes
    train_fraction: float = 0.6  # the rest is the evaluation set (query = gallery, leave-one-out)
    max_items: int = 0  # 0 = all; otherwise a stratified subsample (e.g. to keep fashion-mnist runs short)
    old_features: str = ""  # features mode: .npz with `embeddings`, `labels` (and optional `side_info`)
    new_features: str = ""
    side_features: str = ""  # features mode: optional .npz with ψ; else `side_info` inside old_features, else none
    task: str = ""  # task mode: a retrieval task file (fctkit-task/1 .npz; see the README)

    def __post_init__(self) -> None:
        if self.name == "features" and not (self.old_features and self.new_features):
            raise ConfigError("data.name = 'features' needs data.old_features and data.new_features (.npz paths)")
        if (self.name == "task") != bool(self.task):
            raise ConfigError("data.name = 'task' needs data.task (a task .npz path), and data.task needs data.name = 'task'")
        if not 0 < self.old_class_fraction <= 1 or not 0 < self.train_fraction < 1:
            raise ConfigError("data.old_class_fraction must be in (0, 1] and data.train_fraction in (0, 1)")


@dataclasses.dataclass
class EvaluationConfig:
    distance: Distance = "l2"
    topk: tuple[int, ...] = (1, 5)
    chunk_size: int = 1024


@dataclasses.dataclass
class BackfillConfig:
    orderings: tuple[str, ...] = ("random", "uncertainty", "class-mean-l2", "class-mean-cosine", "kmeans")
    steps: int = 10


@dataclasses.dataclass
class ChainConfig:
    enabled: bool = False
    classes: tuple[int, ...] = (4, 7, 10)  # classes seen by v1, v2, v3


@dataclasses.dataclass
class TransitionConfig:
    """Transition scoring: while a device still holds the old model and its rows' old vectors,
    it may rank by ``w·cos_old + (1 − w)·cos_adapted``; ``w`` is chosen on held-out training data."""

    enabled: bool = False
    weights: tuple[float, ...] = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)

    def __post_init__(self) -> None:
        if not self.weights or any(not 0.0 <= w <= 1.0 for w in self.weights):
            raise ConfigError("transition.weights must be fractions in [0, 1]")


@dataclasses.dataclass
class HubnessConfig:
    """A per-item hubness offset r(g) (CSLS-style, :mod:`.hubness`): rank by cos − β·r, with r
    from the task's training queries and β chosen on held-out training data."""

    enabled: bool = False
    k: int = 10
    betas: tuple[float, ...] = (0.0, 0.25, 0.5, 1.0, 1.5, 2.0)

    def __post_init__(self) -> None:
        if self.k < 1 or not self.betas or any(b < 0 for b in self.betas):
            raise ConfigError("hubness.k must be >= 1 and hubness.betas non-empty and >= 0")


@dataclasses.dataclass
class PipelineConfig:
    seed: int = 0
    device: str = "auto"
    progress: bool = True
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    old_backbone: BackboneConfig = dataclasses.field(default_factory=lambda: BackboneConfig(architecture="small"))
    new_backbone: BackboneConfig = dataclasses.field(default_factory=lambda: BackboneConfig(architecture="wide", embedding_dim=64))
    side_info: SideInfoConfig = dataclasses.field(default_factory=SideInfoConfig)
    methods: tuple[str, ...] = ()  # () = the defaults for the data: all methods, or INSTANCE_METHODS for an instance-level task
    fct: FCTConfig = dataclasses.field(default_factory=FCTConfig)
    residual: ResidualConfig = dataclasses.field(default_factory=ResidualConfig)
    selection: SelectionConfig = dataclasses.field(default_factory=SelectionConfig)
    query_map: QueryMapConfig = dataclasses.field(default_factory=QueryMapConfig)
    transition: TransitionConfig = dataclasses.field(default_factory=TransitionConfig)
    hubness: HubnessConfig = dataclasses.field(default_factory=HubnessConfig)
    fastfill: FastFillConfig = dataclasses.field(default_factory=FastFillConfig)
    lambda_orth: LambdaOrthConfig = dataclasses.field(default_factory=LambdaOrthConfig)
    lambda_orth_relaxed: LambdaOrthConfig = dataclasses.field(default_factory=lambda: LambdaOrthConfig(backward="lambda"))
    evaluation: EvaluationConfig = dataclasses.field(default_factory=EvaluationConfig)
    backfill: BackfillConfig = dataclasses.field(default_factory=BackfillConfig)
    chain: ChainConfig = dataclasses.field(default_factory=ChainConfig)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.methods) - set(METHOD_LABELS))
        if unknown:
            raise ConfigError(f"methods: unknown {', '.join(unknown)}; choose from {', '.join(METHOD_LABELS)}")
        for name in ("transition", "hubness"):
            if getattr(self, name).enabled and (self.data.name != "task" or self.evaluation.distance != "cosine"):
                raise ConfigError(f"{name} works on cosine scores of a retrieval task: set data.name = 'task' "
                                  "and evaluation.distance = 'cosine'")
        if self.query_map.enabled and self.data.name != "task":
            raise ConfigError("query_map needs a retrieval task (data.name = 'task'): it learns from the task's positives")
        if self.chain.enabled and self.data.name in ("features", "task"):
            raise ConfigError("chain needs image data (it trains v1/v2/v3 backbones); disable chain for features and tasks")


def load_pipeline_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> PipelineConfig:
    """A config from a TOML file (unknown keys are errors) with optional dotted-key overrides."""
    return load_config(PipelineConfig, path, overrides)


# --- stage 1: features -------------------------------------------------------------------


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
class ImageSplits:
    images: np.ndarray
    labels: np.ndarray
    n_classes: int
    train: np.ndarray  # indices
    evaluation: np.ndarray


def load_image_splits(config: PipelineConfig) -> ImageSplits:
    """The run's images, subsampled and split deterministically from ``config.seed``."""
    dataset = load_dataset(config.data.name)
    images, labels = _subsample(dataset.images, dataset.labels, config.data.max_items, config.seed)
    splits = make_splits(labels, config.seed, train_fraction=config.data.train_fraction, query_fraction=0.0)
    return ImageSplits(images, labels, dataset.n_classes, splits.train, splits.gallery)


def image_features(config: PipelineConfig, out: Path, log: Callable[[str], None]) -> tuple[Features, Features]:
    data = load_image_splits(config)
    images, labels = data.images, data.labels
    train_images, train_labels = images[data.train], labels[data.train]
    old_items = old_class_subset(train_labels, config.data.old_class_fraction)

    log(f"old backbone on {len(old_items)} images of classes {sorted(set(train_labels[old_items].tolist()))}")
    old_model = train_backbone(train_images[old_items], train_labels[old_items], config.old_backbone, config.seed, config.device)
    log(f"new backbone on {len(train_images)} images of all {data.n_classes} classes")
    new_model = train_backbone(train_images, train_labels, config.new_backbone, config.seed + 1, config.device)
    log(f"side-info model ψ ({config.side_info.kind}) on the old data")
    side_model = train_side_info(train_images[old_items], train_labels[old_items], config.side_info, config.seed + 2, config.device)

    models = out / "models"
    save_backbone(old_model, models / "old_backbone.pt")
    save_backbone(new_model, models / "new_backbone.pt")
    save_side_info(side_model, models / "side_info.pt")

    def embed(index: np.ndarray) -> Features:
        x = images[index]
        side = extract_side_info(side_model, x) if config.side_info.kind != "none" else np.zeros((len(x), 0), np.float32)
        return Features(extract_features(old_model, x), side, extract_features(new_model, x), labels[index])

    return embed(data.train), embed(data.evaluation)


def npz_features(config: PipelineConfig) -> tuple[Features, Features]:
    data = config.data
    paths = [data.old_features, data.new_features] + ([data.side_features] if data.side_features else [])
    versions = load_feature_versions(paths)
    old, new = versions[0], versions[1]
    if data.side_features:
        side = versions[2].embeddings
    elif old.side_info is not None:
        side = old.side_info
    else:
        side = np.zeros((len(old), 0), np.float32)
    everything = Features(old.embeddings, side, new.embeddings, old.labels)
    index = _subsample(np.arange(len(old)), old.labels, data.max_items, config.seed)[0]
    labels = old.labels[index]
    splits = make_splits(labels, config.seed, train_fraction=data.train_fraction, query_fraction=0.0)
    return everything.subset(index[splits.train]), everything.subset(index[splits.gallery])


def load_run_task(config: PipelineConfig) -> RetrievalTask | None:
    return load_task(config.data.task) if config.data.name == "task" else None


def _subsample(items: np.ndarray, labels: np.ndarray, max_items: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    if not max_items or max_items >= len(labels):
        return items, labels
    keep = make_splits(labels, seed, train_fraction=max_items / len(labels), query_fraction=0.0).train
    return items[keep], labels[keep]


# --- stage 2: adapters -------------------------------------------------------------------


def run_methods(config: PipelineConfig, task: RetrievalTask | None) -> tuple[str, ...]:
    if config.methods:
        return config.methods
    return INSTANCE_METHODS if task is not None and task.level == "instance" else tuple(METHOD_LABELS)


def method_config(config: PipelineConfig, method: str, has_side: bool, level: str) -> Any:
    """The method's config as the run fits it: seeded by the run, side-info when the data has
    it, and the objective ``auto`` resolved (MSE for class level, InfoNCE for instance level)."""
    if method in ("least-squares", "procrustes"):
        return ClosedFormConfig(method=method.replace("-", "_"))
    section = {"fct": config.fct, "fct-no-side-info": config.fct, "fastfill": config.fastfill, "residual": config.residual,
               "lambda-orth": config.lambda_orth, "lambda-orth-relaxed": config.lambda_orth_relaxed}[method]
    section = run_seeded(config, section)
    if method in ("fct", "fct-no-side-info", "fastfill", "residual"):
        section = dataclasses.replace(section, side_info=has_side and method != "fct-no-side-info")
    if method in ("fct", "fct-no-side-info") and section.objective.kind == "auto":
        section = dataclasses.replace(section, objective=dataclasses.replace(
            section.objective, kind="infonce" if level == "instance" else "mse"))
    return section


def fit_method(method: str, section: Any, train: Features) -> Adapter:
    """Fit one method on aligned training features (old, side → new)."""
    side = train.side if getattr(section, "side_info", False) and train.side.shape[1] else None
    if method in ("fct", "fct-no-side-info"):
        return FCTAdapter.fit(train.old, train.new, side, section)[0]
    if method == "fastfill":
        return FastFillAdapter.fit(train.old, train.new, side, section)[0]
    if method == "residual":
        return ResidualAdapter.fit(train.old, train.new, side, section)[0]
    if method in ("least-squares", "procrustes"):
        return ClosedFormAdapter.fit(train.old, train.new, section)[0]
    return LambdaOrthAdapter.fit(train.old, train.new, train.labels, section)[0]


def fit_adapters(config: PipelineConfig, train: Features, log: Callable[[str], None],
                 task: RetrievalTask | None = None, report: Report | None = None) -> dict[str, Adapter]:
    """Every enabled method, fitted on the training split (all classes, like FCT); on a task,
    with the settings chosen on held-out training data (recorded as report facts)."""
    fitted: dict[str, Adapter] = {}
    level = task.level if task is not None else "class"
    for method in run_methods(config, task):
        section = method_config(config, method, train.side.shape[1] > 0, level)
        knobs = knobs_for(method, section, config.selection)
        if task is not None and config.selection.enabled and knobs:
            log(f"choosing settings of {METHOD_LABELS[method]} on held-out training data ({task.primary_metric})")
            section = select_settings(config, method, section, knobs, task, report)
        log(f"fitting {METHOD_LABELS[method]}")
        fitted[method] = fit_method(method, section, train)
        if task is not None and config.query_map.enabled and method in QUERY_MAP_METHODS:
            log(f"fitting a query map jointly with {METHOD_LABELS[method]}")
            fitted[f"{method}+query-map"] = fit_with_query_map(config, copy.deepcopy(fitted[method]), task.train)
        for variant in [v for v in (method, f"{method}+query-map") if v in fitted and task is not None]:
            if config.transition.enabled or config.hubness.enabled:
                log(f"choosing the transition weight / hubness offset of {method_label(variant)} on held-out training data")
                refit = fit_on_holdout(config, method, section, task, fitted[variant])
            if config.transition.enabled:
                fitted[f"{variant}+transition"] = choose_transition(config, task, variant, fitted[variant], refit, report)
            if config.hubness.enabled:
                fitted[f"{variant}+hubness"] = choose_hubness(config, task, variant, fitted[variant], refit, report)
    return fitted


@dataclasses.dataclass
class HeldOutFit:
    """An adapter (and query map) fitted on part of the training split the way the final one
    was fitted on all of it, and the held-out rest to choose scoring settings on."""

    adapter: Adapter | WithQueryMap
    holdout: Holdout


def fit_on_holdout(config: PipelineConfig, method: str, section: Any, task: RetrievalTask,
                   final: Adapter | WithQueryMap) -> HeldOutFit:
    holdout = holdout_split(task.train, config.selection.holdout_fraction, config.seed)
    adapter: Adapter | WithQueryMap = fit_method(method, _quiet(section), task_features(holdout.fit.gallery))
    if isinstance(final, WithQueryMap):
        adapter = fit_with_query_map(config, adapter, holdout.fit)
    return HeldOutFit(adapter, holdout)


@dataclasses.dataclass
class Hubness:
    """``base`` searched with a per-item hubness offset: rank by cos − beta·r(g), r from
    ``reference`` (the training queries, embedded as the device embeds queries)."""

    base: Adapter | WithQueryMap
    beta: float
    reference: np.ndarray
    k: int


def device_queries(adapter: Adapter | WithQueryMap, new_queries: np.ndarray) -> np.ndarray:
    """Queries as a device searches with them: Q(φ_new) with a query map, else φ_new."""
    return adapter.query_map.transform(new_queries) if isinstance(adapter, WithQueryMap) else new_queries


def hubness_retrieval(hub: Hubness, data: EvalSet) -> tuple[np.ndarray, np.ndarray]:
    """(queries, rows) whose L2 ranking is cos − β·r (see :func:`.hubness.offset_vectors`)."""
    query, gallery = adapted_retrieval(hub.base, data)
    return offset_vectors(query, gallery, hubness_offsets(gallery, hub.reference, hub.k), hub.beta)


def choose_hubness(config: PipelineConfig, task: RetrievalTask, variant: str, final: Adapter | WithQueryMap,
                   refit: HeldOutFit, report: Report | None) -> Hubness:
    """β with the best primary metric on held-out training data (offsets from the fit part's queries)."""
    judge = EvalSet.of_task(refit.holdout.held_out)
    evaluate = Evaluator(dataclasses.replace(config.evaluation, distance="l2"), judge)
    reference = device_queries(refit.adapter, refit.holdout.fit.query.new)
    scores = {beta: metric_value(evaluate(*hubness_retrieval(Hubness(refit.adapter, beta, reference, config.hubness.k), judge)),
                                 task.primary_metric) for beta in config.hubness.betas}
    beta = max(config.hubness.betas, key=lambda b: (scores[b], -b))
    if report is not None:
        report.add_fact(f"hubness β [{method_label(variant)}]", f"β = {beta} ({task.primary_metric} {scores[beta]:.4f} on "
                        f"held-out training data; β = 0: {scores.get(0.0, float('nan')):.4f}), k = {config.hubness.k}")
    return Hubness(final, beta, device_queries(final, task.train.query.new), config.hubness.k)


@dataclasses.dataclass
class Transition:
    """Transition scoring with ``base``: rank by ``weight·cos_old + (1 − weight)·cos_adapted``."""

    base: Adapter | WithQueryMap
    weight: float


def fused_retrieval(adapter: Adapter | WithQueryMap, data: EvalSet, weight: float) -> tuple[np.ndarray, np.ndarray]:
    """(queries, gallery) whose cosine is ``w·cos(q_old, g_old) + (1 − w)·cos(q_adapted, g_adapted)``:
    each side is the concatenation of its two unit vectors scaled by √w and √(1 − w)."""
    query, gallery = adapted_retrieval(adapter, data)

    def joined(old: np.ndarray, adapted: np.ndarray) -> np.ndarray:
        return np.hstack([np.sqrt(weight) * _unit(old), np.sqrt(1.0 - weight) * _unit(adapted)])

    return joined(data.queries.old, query), joined(data.gallery.old, gallery)


def _unit(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def choose_transition(config: PipelineConfig, task: RetrievalTask, variant: str, final: Adapter | WithQueryMap,
                      refit: HeldOutFit, report: Report | None) -> Transition:
    """The weight with the best primary metric on held-out training data."""
    judge = EvalSet.of_task(refit.holdout.held_out)
    evaluate = Evaluator(config.evaluation, judge)
    scores = {w: metric_value(evaluate(*fused_retrieval(refit.adapter, judge, w)), task.primary_metric)
              for w in config.transition.weights}
    weight = max(config.transition.weights, key=lambda w: (scores[w], -w))
    if report is not None:
        report.add_fact(f"transition weight [{method_label(variant)}]",
                        f"w = {weight} ({task.primary_metric} {scores[weight]:.4f} on held-out training data; "
                        f"w = 0: {scores.get(0.0, float('nan')):.4f})")
    return Transition(final, weight)


QUERY_MAP_METHODS = ("residual", "fct", "fct-no-side-info")


@dataclasses.dataclass
class WithQueryMap:
    """A gallery-side adapter h and the query map Q trained with it: queries are Q(φ_new)."""

    adapter: Adapter
    query_map: QueryMap

    def save(self, path: Path) -> None:
        self.adapter.save(path)
        self.query_map.save(path.with_name(path.stem + ".query_map.pt"))


def fit_with_query_map(config: PipelineConfig, adapter: Adapter, train: TaskSplit) -> WithQueryMap:
    """Continue training ``adapter`` jointly with a new query map on the training positives."""
    positives = train.positives
    if positives is None:
        raise ConfigError("query_map needs an instance-level task (explicit positives per query)")
    queries = np.repeat(np.arange(len(train.query)), np.diff(positives.indptr))
    items = positives.indices
    gallery = train.gallery
    query_map, _ = fit_jointly(adapter, train.query.new[queries], gallery.old[items],
                               gallery.side[items] if gallery.side.shape[1] else None, gallery.new[items],
                               run_seeded(config, config.query_map))
    return WithQueryMap(adapter, query_map)


def select_settings(config: PipelineConfig, method: str, section: Any, knobs: list, task: RetrievalTask,
                    report: Report | None) -> Any:
    holdout = holdout_split(task.train, config.selection.holdout_fraction, config.seed)
    fit_part = task_features(holdout.fit.gallery)
    judge = EvalSet.of_task(holdout.held_out)
    evaluate = Evaluator(config.evaluation, judge)

    def score(candidate: Any) -> float:
        adapter = fit_method(method, _quiet(candidate), fit_part)
        query, gallery = adapted_retrieval(adapter, judge)
        return metric_value(evaluate(query, gallery), task.primary_metric)

    chosen = coordinate_search(section, knobs, score)
    if report is not None:
        settings = ", ".join(f"{path} = {value}" for path, value in chosen.chosen.items())
        report.add_fact(f"selected [{method_label(method)}]",
                        f"{settings} ({task.primary_metric} {chosen.score:.4f} on held-out training data, {chosen.tried} fits)")
    return chosen.config


def _quiet(section: Any) -> Any:
    return dataclasses.replace(section, train=dataclasses.replace(section.train, progress=False)) if hasattr(section, "train") else section


def run_seeded(config: PipelineConfig, section: Any) -> Any:
    """A method's config whose training seed is offset by the run's ``seed``, so that changing
    the run's seed changes every stage (a method's own ``train.seed`` stays an offset)."""
    return dataclasses.replace(section, train=dataclasses.replace(section.train, seed=section.train.seed + config.seed))


def forward_transform(adapter: Adapter, features: Features) -> np.ndarray:
    """h(φ_old[, ψ]) for the forward-mode adapters."""
    if isinstance(adapter, (FCTAdapter, ResidualAdapter)):
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


# --- stage 3: evaluation -----------------------------------------------------------------


@dataclasses.dataclass
class Evaluator:
    """Evaluates query/gallery embeddings of one :class:`EvalSet` with its relevance."""

    config: EvaluationConfig
    data: EvalSet

    def __call__(self, query: np.ndarray, gallery: np.ndarray) -> RetrievalResult:
        n = min(query.shape[1], gallery.shape[1])  # differing dims: compare the first n (λ-orth truncation)
        return evaluate_retrieval(
            query[:, :n], gallery=gallery[:, :n], **self.data.relevance, distance=self.config.distance,
            topk=self.config.topk, leave_one_out=self.data.leave_one_out, chunk_size=self.config.chunk_size,
        )

    @classmethod
    def labelled(cls, labels: np.ndarray, config: EvaluationConfig) -> Evaluator:
        """Query = gallery = one labelled set, leave-one-out (the papers' protocol)."""
        items = np.zeros((len(labels), 0), np.float32)
        return cls(config, EvalSet.labelled(Features(items, items, items, labels)))


def evaluate_methods(config: PipelineConfig, data: EvalSet, adapters: dict[str, Adapter], report: Report,
                     metric: str = "top1") -> dict[str, Any]:
    """Add every case and verdict to ``report``; return the gate (cases + ECC per method, judged
    on ``metric``, the task's primary metric)."""
    evaluate = Evaluator(config.evaluation, data)
    queries, gallery = data.queries, data.gallery
    old_old = evaluate(queries.old, gallery.old)
    new_new = evaluate(queries.new, gallery.new)
    report.add_case("old/old", old_old)
    report.add_case("new/new", new_new)
    report.add_case("new/old", evaluate(queries.new, gallery.old), note="no adapter")
    gate: dict[str, Any] = {"cases": {}, "ecc": {}, "metric": metric}
    baseline, ceiling = metric_value(old_old, metric), metric_value(new_new, metric)

    for method, adapter in adapters.items():
        label = method_label(method)
        if isinstance(adapter, Hubness):
            adapted = Evaluator(dataclasses.replace(config.evaluation, distance="l2"), data)(*hubness_retrieval(adapter, data))
            report.add_case(f"{_searched_as(adapter.base)} − β·r [{label}]", adapted, method=method, beta=adapter.beta)
            gate.setdefault("hubness_beta", {})[method] = adapter.beta
        elif isinstance(adapter, Transition):
            adapted = evaluate(*fused_retrieval(adapter.base, data, adapter.weight))
            report.add_case(f"w·cos(old, old) + (1−w)·{_searched_as(adapter.base)} [{label}]", adapted, method=method,
                            weight=adapter.weight)
            gate.setdefault("transition_weight", {})[method] = adapter.weight
        elif isinstance(adapter, WithQueryMap):
            queries_mapped, adapted_gallery = adapted_retrieval(adapter, data)
            adapted = evaluate(queries_mapped, adapted_gallery)
            report.add_case(f"Q(new)/h(old) [{label}]", adapted, method=method)
            report.add_case(f"Q(new)/new [{label}]", evaluate(queries_mapped, gallery.new), method=method)
        elif isinstance(adapter, LambdaOrthAdapter):
            cases = _unified_cases(adapter, data, evaluate, report, label)
            adapted = cases["B(new)/F(old)"]
            backward = metric_value(cases["B(new)/old"], metric)
            report.add_verdict(f"backward compatible [{label}]", backward >= baseline,
                               f"B(new)/old {metric} {backward:.4f} vs old/old {baseline:.4f}")
        else:
            adapted_gallery = forward_transform(adapter, gallery)
            adapted = evaluate(queries.new, adapted_gallery)
            report.add_case(f"new/h(old) [{label}]", adapted, method=method)
            if method == "fct" and data.leave_one_out:
                report.add_case(f"h(old)/h(old) [{label}]", evaluate(adapted_gallery, adapted_gallery), method=method)
        passed = ecc(adapted, old_old, metric)
        value = metric_value(adapted, metric)
        report.add_verdict(f"ECC [{label}]" if metric == "top1" else f"ECC ({metric}) [{label}]", passed, f"{metric} {value:.4f} vs old/old {baseline:.4f}; "
                           f"{value / max(ceiling, 1e-12):.3f} of new/new")
        if adapted.relevance == "explicit" and metric != "recall@10":
            report.add_verdict(f"ECC (recall@10) [{label}]", ecc(adapted, old_old, "recall@10"),
                               f"recall@10 {adapted.recall[10]:.4f} vs old/old {old_old.recall[10]:.4f}")
        gate["ecc"][method] = passed
        gate["cases"][method] = _metrics(adapted)
    gate["cases"]["old/old"] = _metrics(old_old)
    gate["cases"]["new/new"] = _metrics(new_new)
    if gallery.side.shape[1]:
        report.add_fact("CKA(φ_old, ψ)", round(linear_cka(gallery.old, gallery.side), 4))
    return gate


def _searched_as(adapter: Adapter | WithQueryMap) -> str:
    return "cos(Q(new), h(old))" if isinstance(adapter, WithQueryMap) else "cos(new, h(old))"


def method_label(method: str) -> str:
    base, *extras = method.split("+")
    names = {"query-map": " + query map", "transition": " + transition scoring", "hubness": " + hubness offset"}
    return METHOD_LABELS[base] + "".join(names[e] for e in extras)


def _unified_cases(adapter: LambdaOrthAdapter, data: EvalSet, evaluate: Evaluator, report: Report, label: str) -> dict[str, RetrievalResult]:
    """λ-orth cases in the unified space: queries B(φ_new) (F(φ_old) for old queries); gallery
    φ_old, F(φ_old) or B(φ_new)."""
    backward_new = adapter.transform_new(data.queries.new)
    cases = {
        "B(new)/old": evaluate(backward_new, adapter.unified_old(data.gallery.old)),
        "B(new)/F(old)": evaluate(backward_new, adapter.transform(data.gallery.old)),
        "F(old)/old": evaluate(adapter.transform(data.queries.old), adapter.unified_old(data.gallery.old)),
        "B(new)/B(new)": evaluate(backward_new, adapter.transform_new(data.gallery.new)),
    }
    for name, result in cases.items():
        report.add_case(f"{name} [{label}]", result, method=label)
    report.add_fact(f"‖WWᵀ−I‖_F [{label}]", round(adapter.orthogonality_error(), 6))
    return cases


def _metrics(result: RetrievalResult) -> dict[str, float]:
    metrics = {f"top{k}": v for k, v in result.cmc.items()} | {"mAP": result.mean_ap}
    if result.relevance == "explicit":
        metrics |= {f"recall@{k}": v for k, v in result.recall.items()} | {"mrr": result.mrr, "ndcg@10": result.ndcg10}
    return metrics


def evaluate_backfill(config: PipelineConfig, data: EvalSet, adapters: dict[str, Adapter], report: Report,
                      metric: str = "top1") -> dict[str, float]:
    """Backfill curves in forward mode: the gallery starts as h(old) and rows turn into φ_new
    in each ordering's order. Uses FastFill's h when fitted (so σ orders its own rows), else
    the residual adapter's, else FCT's. Orderings by class mean need class labels. With a
    hubness offset for that adapter, each curve is drawn once more with the offset on every row
    (adapted and backfilled rows alike, from the same reference queries)."""
    name = next((m for m in ("fastfill", "residual", "fct", "fct-no-side-info") if m in adapters), None)
    if name is None or not config.backfill.orderings:
        return {}
    adapter = adapters[name]
    gallery = data.gallery
    adapted = forward_transform(adapter, gallery)
    sigma = adapter.uncertainty(gallery.old, gallery.side if adapter.d_side else None) if isinstance(adapter, FastFillAdapter) else None
    areas: dict[str, float] = {}
    for kind in config.backfill.orderings:
        if (kind == "uncertainty" and sigma is None) or (kind.startswith("class-mean") and gallery.labels is None):
            continue
        order = backfill_order(kind, adapted, None if kind == "kmeans" else gallery.labels, sigma, seed=config.seed)
        searches = {kind: (data.queries.new, adapted, gallery.new, config.evaluation.distance)}
        if f"{name}+hubness" in adapters:
            searches[f"{kind} + hubness offset"] = (*_offset_galleries(adapters[f"{name}+hubness"], data.queries.new,
                                                                       adapted, gallery.new), "l2")
        for label, (queries, adapted_rows, backfilled_rows, distance) in searches.items():
            curve = backfill_curve(query=queries, adapted_gallery=adapted_rows, backfilled_gallery=backfilled_rows, order=order,
                                   **data.relevance, steps=config.backfill.steps, distance=distance,
                                   leave_one_out=data.leave_one_out, metric=metric)
            report.add_backfill_curve(label, curve)
            areas[label] = curve.area
    return areas


def _offset_galleries(hub: Hubness, queries: np.ndarray, adapted: np.ndarray,
                      backfilled: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Queries, adapted rows and backfilled rows with hubness offsets on a common floor."""
    offsets = [hubness_offsets(rows, hub.reference, hub.k) for rows in (adapted, backfilled)]
    floor = min(o.min() for o in offsets)
    query, adapted_rows = offset_vectors(queries, adapted, offsets[0], hub.beta, floor)
    return query, adapted_rows, offset_vectors(queries, backfilled, offsets[1], hub.beta, floor)[1]


# --- the run -----------------------------------------------------------------------------


@dataclasses.dataclass
class PipelineResult:
    report: Report
    gate: dict[str, Any]
    adapters: dict[str, Adapter]
    train: Features
    evaluation: EvalSet
    files: dict[str, Path]
    seconds: float


def run_pipeline(config: PipelineConfig, out: str | Path, log: Callable[[str], None] = print) -> PipelineResult:
    """Run every stage and write the outputs to ``out`` (created)."""
    start = time.perf_counter()
    out = Path(out)
    task = load_run_task(config)  # a bad task file fails here, before anything is written
    (out / "adapters").mkdir(parents=True, exist_ok=True)
    (out / "features").mkdir(exist_ok=True)
    _quiet_progress(config)

    report = Report(f"fctkit train: {task.name if task is not None else config.data.name}")
    if task is not None:
        train, data = task_features(task.train.gallery), EvalSet.of_task(task.evaluation)
        report.add_fact("task", f"{task.name}: {task.level}-level, {len(task.evaluation.query)} evaluation queries x "
                                f"{len(task.evaluation.gallery)} gallery items, primary metric {task.primary_metric}")
    elif config.data.name == "features":
        train, evaluation = npz_features(config)
        data = EvalSet.labelled(evaluation)
    else:
        train, evaluation = image_features(config, out, log)
        data = EvalSet.labelled(evaluation)
    adapters = fit_adapters(config, train, log, task, report)
    for method, adapter in adapters.items():
        if not isinstance(adapter, (Transition, Hubness)):  # their settings are in gate.json; adapters saved under their own names
            adapter.save(out / "adapters" / f"{method}.pt")

    log("evaluating")
    gate = evaluate_methods(config, data, adapters, report, task.primary_metric if task is not None else "top1")
    gate["backfill_area"] = evaluate_backfill(config, data, adapters, report, gate["metric"])
    if config.chain.enabled:
        from .chains import run_chain

        log(f"chain over classes {config.chain.classes}")
        gate["chain"] = run_chain(config, out, report, log)

    gallery = data.gallery
    labels = {} if gallery.labels is None else {"labels": gallery.labels}
    np.savez(out / "features" / "eval.npz", old=gallery.old, side=gallery.side, new=gallery.new, **labels)
    files = report.save(out)
    files["gate"] = _write_json(out / "gate.json", gate)
    files["config"] = _write_json(out / "config.json", to_mapping(config))
    seconds = time.perf_counter() - start
    log(f"done in {seconds:.1f} s; report in {files['markdown'] if 'markdown' in files else out}")
    return PipelineResult(report, gate, adapters, train, data, files, seconds)


def _quiet_progress(config: PipelineConfig) -> None:
    if config.progress:
        return
    for section in (config.old_backbone, config.new_backbone, config.side_info):
        section.progress = False
    for section in (config.fct, config.fastfill, config.residual, config.lambda_orth, config.lambda_orth_relaxed):
        section.train.progress = False


def _write_json(path: Path, data: Any) -> Path:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, default=float) + "\n")
    return path

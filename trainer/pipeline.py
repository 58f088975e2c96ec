"""`fctkit train`: one run from data to a gated report, readable top to bottom.

1. **features** — for image data, train the old backbone on the old classes, the new backbone
   on all classes and the side-info model ψ on the old data (no labels); extract φ_old, ψ,
   φ_new for the training split and the evaluation split. For pre-extracted features, load
   the ``.npz`` files and split them.
2. **adapters** — fit every enabled method on the training split's features.
3. **evaluation** — every case of the papers' tables on the evaluation split (query = gallery,
   leave-one-out), the ECC verdicts, CKA(φ_old, ψ), backfill curves per ordering with M̃.
4. **chain** (image data, optional) — v1 → v2 → v3 hop by hop and direct (FCT Table 5).
5. **outputs** — models, adapters, evaluation features, ``report.{md,json,png}`` and
   ``gate.json`` (the gate results that `fctkit bundle build` records in a manifest).
"""

from __future__ import annotations

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
from .evaluation import Distance, RetrievalResult, backfill_curve, ecc, evaluate_retrieval
from .lambda_orth import LambdaOrthAdapter, LambdaOrthConfig
from .report import Report
from .side_info import SideInfoConfig, extract_side_info, save_side_info, train_side_info

ForwardMethod = Literal["fct", "fct-no-side-info", "fastfill", "least-squares", "procrustes"]
UnifiedMethod = Literal["lambda-orth", "lambda-orth-relaxed"]
METHOD_LABELS = {
    "fct": "FCT, side-info ψ",
    "fct-no-side-info": "FCT, no side-info",
    "fastfill": "FastFill, side-info ψ",
    "least-squares": "least squares",
    "procrustes": "Procrustes",
    "lambda-orth": "λ-orth, B⊥",
    "lambda-orth-relaxed": "λ-orth, B_λ",
}


# --- configuration -----------------------------------------------------------------------


@dataclasses.dataclass
class DataConfig:
    """``digits`` / ``fashion-mnist`` (images) or ``features`` (your own .npz per version)."""

    name: Literal["digits", "fashion-mnist", "features"] = "digits"
    old_class_fraction: float = 0.5  # FCT protocol: the old model sees only the first half of the classes
    train_fraction: float = 0.6  # the rest is the evaluation set (query = gallery, leave-one-out)
    max_items: int = 0  # 0 = all; otherwise a stratified subsample (e.g. to keep fashion-mnist runs short)
    old_features: str = ""  # features mode: .npz with `embeddings`, `labels` (and optional `side_info`)
    new_features: str = ""
    side_features: str = ""  # features mode: optional .npz with ψ; else `side_info` inside old_features, else none

    def __post_init__(self) -> None:
        if self.name == "features" and not (self.old_features and self.new_features):
            raise ConfigError("data.name = 'features' needs data.old_features and data.new_features (.npz paths)")
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
class PipelineConfig:
    seed: int = 0
    device: str = "auto"
    progress: bool = True
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    old_backbone: BackboneConfig = dataclasses.field(default_factory=lambda: BackboneConfig(architecture="small"))
    new_backbone: BackboneConfig = dataclasses.field(default_factory=lambda: BackboneConfig(architecture="wide", embedding_dim=64))
    side_info: SideInfoConfig = dataclasses.field(default_factory=SideInfoConfig)
    methods: tuple[str, ...] = tuple(METHOD_LABELS)
    fct: FCTConfig = dataclasses.field(default_factory=FCTConfig)
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
        if self.chain.enabled and self.data.name == "features":
            raise ConfigError("chain needs image data (it trains v1/v2/v3 backbones); disable chain for features")


def load_pipeline_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> PipelineConfig:
    """A config from a TOML file (unknown keys are errors) with optional dotted-key overrides."""
    return load_config(PipelineConfig, path, overrides)


# --- stage 1: features -------------------------------------------------------------------


@dataclasses.dataclass
class Features:
    """φ_old, ψ (possibly (N, 0)), φ_new and labels, for one split."""

    old: np.ndarray
    side: np.ndarray
    new: np.ndarray
    labels: np.ndarray

    def subset(self, index: np.ndarray) -> Features:
        return Features(self.old[index], self.side[index], self.new[index], self.labels[index])


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


def _subsample(items: np.ndarray, labels: np.ndarray, max_items: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    if not max_items or max_items >= len(labels):
        return items, labels
    keep = make_splits(labels, seed, train_fraction=max_items / len(labels), query_fraction=0.0).train
    return items[keep], labels[keep]


# --- stage 2: adapters -------------------------------------------------------------------


def fit_adapters(config: PipelineConfig, train: Features, log: Callable[[str], None]) -> dict[str, Adapter]:
    """Every enabled method, fitted on the training split (all classes, like FCT)."""
    fitted: dict[str, Adapter] = {}
    has_side = train.side.shape[1] > 0
    for method in config.methods:
        log(f"fitting {METHOD_LABELS[method]}")
        if method in ("fct", "fct-no-side-info"):
            use_side = has_side and method == "fct"
            fct_config = dataclasses.replace(run_seeded(config, config.fct), side_info=use_side)
            fitted[method], _ = FCTAdapter.fit(train.old, train.new, train.side if use_side else None, fct_config)
        elif method == "fastfill":
            ff_config = dataclasses.replace(run_seeded(config, config.fastfill), side_info=has_side)
            fitted[method], _ = FastFillAdapter.fit(train.old, train.new, train.side if has_side else None, ff_config)
        elif method in ("least-squares", "procrustes"):
            cf_config = ClosedFormConfig(method=method.replace("-", "_"))
            fitted[method], _ = ClosedFormAdapter.fit(train.old, train.new, cf_config)
        else:
            lo_config = config.lambda_orth if method == "lambda-orth" else config.lambda_orth_relaxed
            fitted[method], _ = LambdaOrthAdapter.fit(train.old, train.new, train.labels, run_seeded(config, lo_config))
    return fitted


def run_seeded(config: PipelineConfig, section: Any) -> Any:
    """A method's config whose training seed is offset by the run's ``seed``, so that changing
    the run's seed changes every stage (a method's own ``train.seed`` stays an offset)."""
    return dataclasses.replace(section, train=dataclasses.replace(section.train, seed=section.train.seed + config.seed))


def forward_transform(adapter: Adapter, features: Features) -> np.ndarray:
    """h(φ_old[, ψ]) for the forward-mode adapters."""
    if isinstance(adapter, FCTAdapter):
        return adapter.transform(features.old, features.side if adapter.d_side else None)
    return adapter.transform(features.old)


# --- stage 3: evaluation -----------------------------------------------------------------


@dataclasses.dataclass
class Evaluator:
    """Evaluates query/gallery pairs on one labelled set with leave-one-out."""

    labels: np.ndarray
    config: EvaluationConfig

    def __call__(self, query: np.ndarray, gallery: np.ndarray) -> RetrievalResult:
        n = min(query.shape[1], gallery.shape[1])  # differing dims: compare the first n (λ-orth truncation)
        return evaluate_retrieval(
            query[:, :n], self.labels, gallery[:, :n], self.labels, distance=self.config.distance,
            topk=self.config.topk, leave_one_out=True, chunk_size=self.config.chunk_size,
        )


def evaluate_methods(config: PipelineConfig, features: Features, adapters: dict[str, Adapter], report: Report) -> dict[str, Any]:
    """Add every case and verdict to ``report``; return the gate (cases + ECC per method)."""
    evaluate = Evaluator(features.labels, config.evaluation)
    old_old = evaluate(features.old, features.old)
    new_new = evaluate(features.new, features.new)
    report.add_case("old/old", old_old)
    report.add_case("new/new", new_new)
    report.add_case("new/old", evaluate(features.new, features.old), note="no adapter")
    gate: dict[str, Any] = {"cases": {}, "ecc": {}}

    for method, adapter in adapters.items():
        label = METHOD_LABELS[method]
        if isinstance(adapter, LambdaOrthAdapter):
            cases = _unified_cases(adapter, features, evaluate, report, label)
            adapted = cases["B(new)/F(old)"]
            report.add_verdict(f"backward compatible [{label}]", cases["B(new)/old"].top1 >= old_old.top1,
                               f"B(new)/old {cases['B(new)/old'].top1:.4f} vs old/old {old_old.top1:.4f}")
        else:
            adapted_gallery = forward_transform(adapter, features)
            adapted = evaluate(features.new, adapted_gallery)
            report.add_case(f"new/h(old) [{label}]", adapted, method=method)
            if method == "fct":
                report.add_case(f"h(old)/h(old) [{label}]", evaluate(adapted_gallery, adapted_gallery), method=method)
        passed = ecc(adapted, old_old)
        report.add_verdict(f"ECC [{label}]", passed, f"top-1 {adapted.top1:.4f} vs old/old {old_old.top1:.4f}; "
                           f"{adapted.top1 / max(new_new.top1, 1e-12):.3f} of new/new")
        gate["ecc"][method] = passed
        gate["cases"][method] = _metrics(adapted)
    gate["cases"]["old/old"] = _metrics(old_old)
    gate["cases"]["new/new"] = _metrics(new_new)
    if features.side.shape[1]:
        report.add_fact("CKA(φ_old, ψ)", round(linear_cka(features.old, features.side), 4))
    return gate


def _unified_cases(adapter: LambdaOrthAdapter, features: Features, evaluate: Evaluator, report: Report, label: str) -> dict[str, RetrievalResult]:
    """λ-orth cases in the unified space: queries B(φ_new); gallery φ_old, F(φ_old) or B(φ_new)."""
    backward_new = adapter.transform_new(features.new)
    forward_old = adapter.transform(features.old)
    old_rows = adapter.unified_old(features.old)
    cases = {
        "B(new)/old": evaluate(backward_new, old_rows),
        "B(new)/F(old)": evaluate(backward_new, forward_old),
        "F(old)/old": evaluate(forward_old, old_rows),
        "B(new)/B(new)": evaluate(backward_new, backward_new),
    }
    for name, result in cases.items():
        report.add_case(f"{name} [{label}]", result, method=label)
    report.add_fact(f"‖WWᵀ−I‖_F [{label}]", round(adapter.orthogonality_error(), 6))
    return cases


def _metrics(result: RetrievalResult) -> dict[str, float]:
    return {f"top{k}": v for k, v in result.cmc.items()} | {"mAP": result.mean_ap}


def evaluate_backfill(config: PipelineConfig, features: Features, adapters: dict[str, Adapter], report: Report) -> dict[str, float]:
    """Backfill curves in forward mode: the gallery starts as h(old) and rows turn into φ_new
    in each ordering's order. Uses FastFill's h when fitted (so σ orders its own rows), else FCT's."""
    adapter = adapters.get("fastfill") or adapters.get("fct") or adapters.get("fct-no-side-info")
    if adapter is None or not config.backfill.orderings:
        return {}
    adapted = forward_transform(adapter, features)
    sigma = adapter.uncertainty(features.old, features.side if adapter.d_side else None) if isinstance(adapter, FastFillAdapter) else None
    areas: dict[str, float] = {}
    for kind in config.backfill.orderings:
        if kind == "uncertainty" and sigma is None:
            continue
        order = backfill_order(kind, adapted, None if kind == "kmeans" else features.labels, sigma, seed=config.seed)
        curve = backfill_curve(features.new, features.labels, adapted, features.new, features.labels, order,
                               steps=config.backfill.steps, distance=config.evaluation.distance, leave_one_out=True)
        report.add_backfill_curve(kind, curve)
        areas[kind] = curve.area
    return areas


# --- the run -----------------------------------------------------------------------------


@dataclasses.dataclass
class PipelineResult:
    report: Report
    gate: dict[str, Any]
    adapters: dict[str, Adapter]
    train: Features
    evaluation: Features
    files: dict[str, Path]
    seconds: float


def run_pipeline(config: PipelineConfig, out: str | Path, log: Callable[[str], None] = print) -> PipelineResult:
    """Run every stage and write the outputs to ``out`` (created)."""
    start = time.perf_counter()
    out = Path(out)
    (out / "adapters").mkdir(parents=True, exist_ok=True)
    (out / "features").mkdir(exist_ok=True)
    _quiet_progress(config)

    if config.data.name == "features":
        train, evaluation = npz_features(config)
    else:
        train, evaluation = image_features(config, out, log)
    adapters = fit_adapters(config, train, log)
    for method, adapter in adapters.items():
        adapter.save(out / "adapters" / f"{method}.pt")

    log("evaluating")
    report = Report(f"fctkit train: {config.data.name}")
    gate = evaluate_methods(config, evaluation, adapters, report)
    gate["backfill_area"] = evaluate_backfill(config, evaluation, adapters, report)
    if config.chain.enabled:
        from .chains import run_chain

        log(f"chain over classes {config.chain.classes}")
        gate["chain"] = run_chain(config, out, report, log)

    for split, features in (("eval", evaluation),):
        np.savez(out / "features" / f"{split}.npz", old=features.old, side=features.side, new=features.new, labels=features.labels)
    files = report.save(out)
    files["gate"] = _write_json(out / "gate.json", gate)
    files["config"] = _write_json(out / "config.json", to_mapping(config))
    seconds = time.perf_counter() - start
    log(f"done in {seconds:.1f} s; report in {files['markdown'] if 'markdown' in files else out}")
    return PipelineResult(report, gate, adapters, train, evaluation, files, seconds)


def _quiet_progress(config: PipelineConfig) -> None:
    if config.progress:
        return
    for section in (config.old_backbone, config.new_backbone, config.side_info):
        section.progress = False
    for section in (config.fct, config.fastfill, config.lambda_orth, config.lambda_orth_relaxed):
        section.train.progress = False


def _write_json(path: Path, data: Any) -> Path:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, default=float) + "\n")
    return path

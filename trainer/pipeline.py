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

The pieces live beside it, below it (none of them imports this module):
:mod:`.pipeline_config` (the run's config), :mod:`.run_data` (loading its data),
:mod:`.methods` (the methods and how each is fitted), :mod:`.searches` (what a device searches
with, as arrays the evaluation ranks), :mod:`.tuning` (choices made on held-out training data)
and :mod:`.chains` (the v1 → v2 → v3 chain).
"""

from __future__ import annotations

import copy
import dataclasses
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, cast

import numpy as np
from tqdm.auto import tqdm

from fctkit.backfill_order import OrderingKind, backfill_order
from fctkit.config import to_mapping

from .adapter_base import Adapter
from .adapters import FastFillAdapter
from .backbones import extract_features, save_backbone, train_backbone
from .backfill_curves import backfill_curve
from .chains import run_chain
from .cka import linear_cka
from .compatibility import ecc
from .datasets import old_class_subset
from .gate_advice import transition_only_advice
from .lambda_orth import LambdaOrthAdapter
from .method_names import JOINT_FITS, METHOD_LABELS, QUERY_MAP_METHODS, method_label
from .methods import fit_method, method_config, run_methods
from .pipeline_config import PipelineConfig
from .report import Report
from .retrieval_result import RetrievalResult, metric_label, metric_value
from .run_data import load_image_splits, load_run_task, npz_features
from .run_outputs import StageClock, quiet_progress, write_json
from .searches import (
    EvalSet,
    Evaluator,
    Features,
    Hubness,
    Transition,
    WithQueryMap,
    adapted_retrieval,
    forward_transform,
    gate_metrics,
    hubness_of,
    offset_galleries,
    scored_retrieval,
    searched_as,
    task_features,
)
from .selection import holdout_split, knobs_for
from .side_info import extract_side_info, save_side_info, train_side_info
from .tasks import RetrievalTask
from .tuning import (
    HeldOutFit,
    choose_hubness,
    choose_transition,
    fit_on_fit_part,
    fit_on_holdout,
    fit_on_positives,
    held_out_scores,
    joint_section,
    pair_count,
    recommended,
    select_joint_settings,
    select_settings,
)

# what fit_adapters gives each method key: the method's adapter, one jointly fitted with the
# query positives (and a query map), or a scoring variant of either
Fitted = Adapter | WithQueryMap | Hubness | Transition

# --- stage 1: features -------------------------------------------------------------------


def image_features(config: PipelineConfig, out: Path, log: Callable[[str], None]) -> tuple[Features, Features]:
    data = load_image_splits(config)
    images, labels = data.images, data.labels
    train_images, train_labels = images[data.train], labels[data.train]
    old_items = old_class_subset(train_labels, config.data.old_class_fraction)

    log(f"old backbone on {len(old_items)} images of classes {sorted(set(train_labels[old_items].tolist()))}")
    old_model = train_backbone(
        train_images[old_items], train_labels[old_items], config.old_backbone, config.seed, config.device
    )
    log(f"new backbone on {len(train_images)} images of all {data.n_classes} classes")
    new_model = train_backbone(train_images, train_labels, config.new_backbone, config.seed + 1, config.device)
    log(f"side-info model ψ ({config.side_info.kind}) on the old data")
    side_model = train_side_info(
        train_images[old_items], train_labels[old_items], config.side_info, config.seed + 2, config.device
    )

    models = out / "models"
    save_backbone(old_model, models / "old_backbone.pt")
    save_backbone(new_model, models / "new_backbone.pt")
    save_side_info(side_model, models / "side_info.pt")

    def embed(index: np.ndarray) -> Features:
        x = images[index]
        side = (
            extract_side_info(side_model, x) if config.side_info.kind != "none" else np.zeros((len(x), 0), np.float32)
        )
        return Features(extract_features(old_model, x), side, extract_features(new_model, x), labels[index])

    return embed(data.train), embed(data.evaluation)


# --- stage 2: adapters -------------------------------------------------------------------


def fit_adapters(
    config: PipelineConfig,
    train: Features,
    log: Callable[[str], None],
    task: RetrievalTask | None = None,
    report: Report | None = None,
    clock: StageClock | None = None,
    searches: dict[str, dict[str, Any]] | None = None,
) -> dict[str, Fitted]:
    """Every enabled method, fitted on the training split (all classes, like FCT); on a task,
    with the settings chosen on held-out training data (recorded as report facts, and each
    search's record in ``searches`` by method or variant)."""
    clock = clock or StageClock(log)
    fitted: dict[str, Fitted] = {}
    searches = {} if searches is None else searches
    level = task.level if task is not None else "class"
    scoring = config.transition.enabled or config.hubness.enabled
    selecting = task is not None and config.selection.enabled
    # One cut of the training split serves every choice on held-out data (same seed, same cut).
    holdout = (
        holdout_split(task.train, config.selection.holdout_fraction, config.seed)
        if task is not None and (selecting or scoring)
        else None
    )
    for method in run_methods(config, task):
        section = method_config(config, method, train.side.shape[1] > 0, level)
        knobs = knobs_for(method, section, config.selection, None if holdout is None else len(holdout.fit_rows))
        fit_part_adapter = None  # the method fitted on the holdout's fit part, once
        if selecting and knobs:
            assert task is not None and holdout is not None  # cut above for a task with the selection on
            with clock.stage(
                f"choosing settings of {METHOD_LABELS[method]} on held-out training data ({task.primary_metric})"
            ):
                section, fit_part_adapter, searches[method] = select_settings(
                    config, method, section, knobs, task, holdout, report
                )
        # this method's fits before scoring (also in `fitted`): the scoring variants build on them
        variants: dict[str, Adapter | WithQueryMap] = {}
        held_out_fits: dict[str, HeldOutFit] = {}  # joint fits on the fit part the search already made
        with clock.stage(f"fitting {METHOD_LABELS[method]}"):
            fitted[method] = variants[method] = adapter = fit_method(method, section, train)
        for joint in JOINT_FITS:
            joint_config = joint_section(config, joint)
            if task is None or not joint_config.enabled or method not in QUERY_MAP_METHODS:
                continue
            variant = f"{method}+{joint}"
            if selecting:
                assert holdout is not None  # cut above for a task with the selection on
                with clock.stage(f"choosing settings of {method_label(variant)} on held-out training data"):
                    if fit_part_adapter is None:
                        fit_part_adapter = fit_on_fit_part(method, section, holdout)
                    joint_config, joint_fit, searches[variant] = select_joint_settings(
                        config, variant, joint_config, fit_part_adapter, task, holdout, report
                    )
                    held_out_fits[variant] = HeldOutFit(joint_fit, holdout)
            with clock.stage(f"fitting {method_label(variant)} on the task's query positives"):
                fitted[variant] = variants[variant] = fit_on_positives(
                    config, joint_config, copy.deepcopy(adapter), task.train
                )
        if task is None or not scoring:
            continue
        assert holdout is not None  # cut above for a task with scoring on
        with clock.stage(
            f"choosing the transition weight / hubness offset of {METHOD_LABELS[method]} on held-out training data"
        ):
            if fit_part_adapter is None:
                fit_part_adapter = fit_on_fit_part(method, section, holdout)
            for variant in [v for v in (method, *(f"{method}+{joint}" for joint in JOINT_FITS)) if v in variants]:
                refit = held_out_fits.get(variant) or fit_on_holdout(config, fit_part_adapter, holdout, variant)
                fitted |= scoring_variants(config, task, variant, variants[variant], refit, report)
    return fitted


def scoring_variants(
    config: PipelineConfig,
    task: RetrievalTask,
    variant: str,
    adapter: Adapter | WithQueryMap,
    refit: HeldOutFit,
    report: Report | None,
) -> dict[str, Transition | Hubness]:
    """``variant`` with transition scoring, with the hubness offset, and with both (the weight
    chosen again with the offset in the adapted score), as the config enables them."""
    scored: dict[str, Transition | Hubness] = {}
    if config.transition.enabled:
        scored[f"{variant}+transition"] = choose_transition(config, task, variant, adapter, refit, report)
    if config.hubness.enabled:
        hub = scored[f"{variant}+hubness"] = choose_hubness(config, task, variant, adapter, refit, report)
        if config.transition.enabled:
            scored[f"{variant}+hubness+transition"] = choose_transition(
                config, task, f"{variant}+hubness", hub, refit, report
            )
    return scored


# --- stage 3: evaluation -----------------------------------------------------------------


def evaluate_methods(
    config: PipelineConfig, data: EvalSet, adapters: Mapping[str, Fitted], report: Report, metric: str = "top1"
) -> dict[str, Any]:
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

    for method, adapter in tqdm(
        adapters.items(), desc="evaluating", unit="method", disable=not config.progress, leave=False
    ):
        label = method_label(method)
        if isinstance(adapter, (Hubness, Transition)):
            adapted = evaluate(*scored_retrieval(adapter, data))
            hub = hubness_of(adapter)
            if hub is not None:
                gate.setdefault("hubness_beta", {})[method] = hub.beta
                gate["hubness_k"] = hub.k
            if isinstance(adapter, Transition):
                gate.setdefault("transition_weight", {})[method] = adapter.weight
                report.add_case(
                    f"w·cos(old, old) + (1−w)·{searched_as(adapter.base)} [{label}]",
                    adapted,
                    method=method,
                    weight=adapter.weight,
                    **({"beta": hub.beta} if hub is not None else {}),
                )
            else:
                report.add_case(
                    f"{searched_as(adapter.base)} − β·r [{label}]", adapted, method=method, beta=adapter.beta
                )
        elif isinstance(adapter, WithQueryMap):
            queries_mapped, adapted_gallery = adapted_retrieval(adapter, data)
            adapted = evaluate(queries_mapped, adapted_gallery)
            report.add_case(f"Q(new)/h(old) [{label}]", adapted, method=method)
            report.add_case(f"Q(new)/new [{label}]", evaluate(queries_mapped, gallery.new), method=method)
        elif isinstance(adapter, LambdaOrthAdapter):
            cases = _unified_cases(adapter, data, evaluate, report, label)
            adapted = cases["B(new)/F(old)"]
            backward = metric_value(cases["B(new)/old"], metric)
            report.add_verdict(
                f"backward compatible [{label}]",
                backward >= baseline,
                f"B(new)/old {metric_label(metric)} {backward:.4f} vs old/old {baseline:.4f}",
            )
        else:
            adapted_gallery = forward_transform(adapter, gallery)
            adapted = evaluate(queries.new, adapted_gallery)
            report.add_case(f"new/h(old) [{label}]", adapted, method=method)
            if method == "fct" and data.leave_one_out:
                report.add_case(f"h(old)/h(old) [{label}]", evaluate(adapted_gallery, adapted_gallery), method=method)
        passed = ecc(adapted, old_old, metric)
        value = metric_value(adapted, metric)
        report.add_verdict(
            f"ECC [{label}]" if metric == "top1" else f"ECC ({metric}) [{label}]",
            passed,
            f"{metric_label(metric)} {value:.4f} vs old/old {baseline:.4f}; "
            f"{value / max(ceiling, 1e-12):.3f} of new/new",
        )
        if adapted.relevance == "explicit" and metric != "recall@10":
            report.add_verdict(
                f"ECC (recall@10) [{label}]",
                ecc(adapted, old_old, "recall@10"),
                f"R@10 {adapted.recall[10]:.4f} vs old/old {old_old.recall[10]:.4f}",
            )
        gate["ecc"][method] = passed
        gate["cases"][method] = gate_metrics(adapted)
    gate["cases"]["old/old"] = gate_metrics(old_old)
    gate["cases"]["new/new"] = gate_metrics(new_new)
    held_out = held_out_scores(adapters)
    if held_out:
        gate["held_out"], gate["recommended"] = held_out, recommended(held_out)
        report.add_fact(
            f"recommended (by {metric_label(metric)} on held-out training data)",
            "; ".join(f"{name}: {key} ({held_out[key]:.4f})" for name, key in gate["recommended"].items()),
        )
    if gallery.side.shape[1]:
        report.add_fact("CKA(φ_old, ψ)", round(linear_cka(gallery.old, gallery.side), 4))
    return gate


def _unified_cases(
    adapter: LambdaOrthAdapter, data: EvalSet, evaluate: Evaluator, report: Report, label: str
) -> dict[str, RetrievalResult]:
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


def evaluate_backfill(
    config: PipelineConfig, data: EvalSet, adapters: Mapping[str, Fitted], report: Report, metric: str = "top1"
) -> dict[str, float]:
    """Backfill curves in forward mode: the gallery starts as h(old) and rows turn into φ_new
    in each ordering's order. Uses FastFill's h when fitted (so σ orders its own rows), else
    the residual adapter's, else FCT's. Orderings by class mean need class labels. With a
    hubness offset for that adapter, each curve is drawn once more with the offset on every row
    (adapted and backfilled rows alike, from the same reference queries)."""
    name = next((m for m in ("fastfill", "residual", "fct", "fct-no-side-info") if m in adapters), None)
    if name is None or not config.backfill.orderings:
        return {}
    adapter = adapters[name]
    assert isinstance(adapter, Adapter)  # the forward methods' own fits (their variants have other names)
    gallery = data.gallery
    adapted = forward_transform(adapter, gallery)
    sigma = (
        adapter.uncertainty(gallery.old, gallery.side if adapter.d_side else None)
        if isinstance(adapter, FastFillAdapter)
        else None
    )
    areas: dict[str, float] = {}
    for kind in config.backfill.orderings:
        if (kind == "uncertainty" and sigma is None) or (kind.startswith("class-mean") and gallery.labels is None):
            continue
        # backfill_order checks the name against ORDERING_KINDS
        order = backfill_order(
            cast(OrderingKind, kind), adapted, None if kind == "kmeans" else gallery.labels, sigma, seed=config.seed
        )
        searches = {kind: (data.queries.new, adapted, gallery.new, config.evaluation.distance)}
        if f"{name}+hubness" in adapters:
            hub = adapters[f"{name}+hubness"]
            assert isinstance(hub, Hubness)  # what choose_hubness fitted
            searches[f"{kind} + hubness offset"] = (
                *offset_galleries(hub, data.queries.new, adapted, gallery.new),
                "l2",
            )
        for label, (queries, adapted_rows, backfilled_rows, distance) in searches.items():
            curve = backfill_curve(
                query=queries,
                adapted_gallery=adapted_rows,
                backfilled_gallery=backfilled_rows,
                order=order,
                **data.relevance,
                steps=config.backfill.steps,
                distance=distance,
                leave_one_out=data.leave_one_out,
                metric=metric,
            )
            report.add_backfill_curve(label, curve)
            areas[label] = curve.area
    return areas


# --- the run -----------------------------------------------------------------------------


@dataclasses.dataclass
class PipelineResult:
    report: Report
    gate: dict[str, Any]
    adapters: dict[str, Fitted]
    train: Features
    evaluation: EvalSet
    files: dict[str, Path]
    seconds: float


def run_pipeline(config: PipelineConfig, out: str | Path, log: Callable[[str], None] = print) -> PipelineResult:
    """Run every stage and write the outputs to ``out`` (created)."""
    start = time.perf_counter()
    out = Path(out)
    task = load_run_task(config)  # a bad task file fails here, before anything is written
    if task is not None:
        config = config.for_task(task.level, len(task.train.gallery), pair_count(task.train))
    else:
        config = config.for_task(None)
    clock = StageClock(log)
    (out / "adapters").mkdir(parents=True, exist_ok=True)
    (out / "features").mkdir(exist_ok=True)
    quiet_progress(config)

    report = Report(f"fctkit train: {task.name if task is not None else config.data.name}")
    if task is not None:
        train, data = task_features(task.train.gallery), EvalSet.of_task(task.evaluation)
        report.add_fact(
            "task",
            f"{task.name}: {task.level}-level, {len(task.evaluation.query)} evaluation queries x "
            f"{len(task.evaluation.gallery)} gallery items, primary metric {task.primary_metric}",
        )
    elif config.data.name == "features":
        train, evaluation = npz_features(config)
        data = EvalSet.labelled(evaluation)
    else:
        with clock.stage("features: backbones and side-info model"):
            train, evaluation = image_features(config, out, log)
        data = EvalSet.labelled(evaluation)
    searches: dict[str, dict[str, Any]] = {}
    adapters = fit_adapters(config, train, log, task, report, clock, searches)
    for method, adapter in adapters.items():
        hub = hubness_of(adapter)
        if hub is not None:  # β goes to gate.json; the reference queries are what a bundle's hubness graph holds
            np.save(out / "adapters" / f"{method}.reference.npy", hub.reference.astype(np.float32))
        # a Transition's weight is in gate.json, its adapter is saved under its own name (a Hubness is handled above)
        elif not isinstance(adapter, (Transition, Hubness)):
            adapter.save(out / "adapters" / f"{method}.pt")

    with clock.stage("evaluating"):
        gate = evaluate_methods(config, data, adapters, report, task.primary_metric if task is not None else "top1")
    if searches:
        gate["selection"] = searches
    if task is not None:
        advice = transition_only_advice(gate, len(task.train.gallery), train.old.shape[1] + train.side.shape[1])
        if advice is not None:
            gate["advice"] = advice
            report.add_fact("why the gate fails", advice)
    with clock.stage("backfill curves"):
        gate["backfill_area"] = evaluate_backfill(config, data, adapters, report, gate["metric"])
    if config.chain.enabled:
        with clock.stage(f"chain over classes {config.chain.classes}"):
            gate["chain"] = run_chain(config, out, report, log)
    clock.report_to(report)

    gallery = data.gallery
    # as Any: numpy's stubs would let a ** mapping fill savez's allow_pickle keyword, a bool
    labels: dict[str, Any] = {} if gallery.labels is None else {"labels": gallery.labels}
    np.savez(out / "features" / "eval.npz", old=gallery.old, side=gallery.side, new=gallery.new, **labels)
    files = report.save(out)
    files["gate"] = write_json(out / "gate.json", gate)
    files["config"] = write_json(out / "config.json", to_mapping(config))
    seconds = time.perf_counter() - start
    log(f"done in {seconds:.1f} s; report in {files.get('markdown', out)}")
    return PipelineResult(report, gate, adapters, train, data, files, seconds)

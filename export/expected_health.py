"""A release's health expectation: what its devices should report after upgrading to it.

The exporter runs the bundle's own forward graph (the bytes devices will run) over the evaluation
split's old-model embeddings, and measures the adapted gallery against the same items' new-model
embeddings exactly as a device measures its own after an upgrade
(:func:`fctkit.upgrade_health.expected_health`: samples of the device's default size, at several
gallery sizes, repeated). The result goes into the signed manifest
(:class:`~fctkit.protos.health_expectation.HealthExpectation`), where the server's guard reads it.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from fctkit.errors import InputError
from fctkit.protos.health_expectation import HealthExpectation, gate_level
from fctkit.upgrade_health import DEFAULT_SAMPLE_SIZE, expected_health

from .onnx_export import run_onnx
from .onnx_graph import load_onnx_model
from .trained_run import TrainedRun

DRAWS = 16


def measured_expectation(run: TrainedRun, forward_graph: Path, cases: dict[str, Any]) -> HealthExpectation:
    """The expectation of a release whose forward adapter is ``forward_graph`` (the bundled ONNX
    file) and whose gate recorded ``cases``, measured on ``run``'s evaluation split."""
    features = run.eval_features
    inputs = len(load_onnx_model(forward_graph).graph.input)
    arrays = [np.asarray(features["old"], np.float32), np.asarray(features["side"], np.float32)][:inputs]
    adapted = run_onnx(forward_graph, arrays)[0]
    sample = min(DEFAULT_SAMPLE_SIZE, len(adapted))
    sizes, measures = expected_health(adapted, features["new"], run.distance, sample_size=sample, draws=DRAWS)
    level = gate_level(cases)
    return HealthExpectation(level, sample, DRAWS, sizes, measures, sized_break_even(run, adapted, sizes, level))


def sized_break_even(run: TrainedRun, adapted: np.ndarray, sizes: tuple[int, ...], level: str) -> tuple[float, ...]:
    """Per gallery size: not upgrading's figure over the release's (recall@1 at instance level,
    top-1 at class level), each the mean over :data:`DRAWS` galleries of that size cut from the
    evaluation split (instance level: the queries whose positive is in the cut). Plain nearest
    neighbours by the run's distance, new-model queries against the adapted gallery: how the device
    measures its health, not the transition or hubness scoring a variant may add."""
    from fctkit.trainer.evaluation import evaluate_retrieval
    from fctkit.trainer.run_data import load_run_task
    from fctkit.trainer.searches import gate_metrics

    metric = "recall@1" if level == "instance" else "top1"
    task = load_run_task(run.config) if run.config.data.name == "task" else None
    features, rng = run.eval_features, np.random.default_rng(0)

    def figure(query: np.ndarray, gallery: np.ndarray, **relevance: Any) -> float:
        result = evaluate_retrieval(query, gallery=gallery, distance=run.distance, topk=(1,), **relevance)
        return float(gate_metrics(result)[metric])

    ratios = []
    for size in sizes:
        baseline, release = [], []
        for _ in range(DRAWS):
            rows = np.sort(rng.choice(len(adapted), size, replace=False))
            if task is None:  # the labelled split, searched leave-one-out within the cut
                labels = features["labels"][rows]
                relevance = {"query_labels": labels, "gallery_labels": labels, "leave_one_out": True}
                queries = {"old": features["old"][rows], "new": features["new"][rows]}
            else:
                split, kept = task.evaluation, set(rows.tolist())
                positives = split.positives
                if positives is None:
                    raise InputError(f"{run.root}: the run's task has no positives; an instance-level gate needs them")
                asked = [q for q in range(len(split.query)) if kept.intersection(positives.of(q)[0].tolist())]
                cut = split.subset(np.array(asked, dtype=np.int64), rows)
                relevance = {"query_labels": None, "gallery_labels": None, "positives": cut.positives}
                queries = {"old": cut.query.old, "new": cut.query.new}
            baseline.append(figure(queries["old"], features["old"][rows], **relevance))
            release.append(figure(queries["new"], adapted[rows], **relevance))
        ratios.append(float(np.mean(baseline)) / max(float(np.mean(release)), 1e-3))
    return tuple(ratios)

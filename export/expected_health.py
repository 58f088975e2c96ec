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

from fctkit.protos.health_expectation import HealthExpectation
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
    sizes, measures = expected_health(
        adapted, features["new"], run.distance, sample_size=min(DEFAULT_SAMPLE_SIZE, len(adapted)), draws=DRAWS
    )
    return HealthExpectation.measured(cases, sizes, measures, min(DEFAULT_SAMPLE_SIZE, len(adapted)), DRAWS)

"""Quantised forward adapters (``fctkit export --quantize int8|fp16``) and the gate that judges them.

The forward adapter is the graph every stored row passes through when a device upgrades, so
its speed is the upgrade's; only it is quantised, the other roles stay as exported. ``int8``:
ONNX Runtime's dynamic quantisation (int8 weights per output channel, activations quantised
per batch as the graph runs); ``fp16``: float16 weights, float32 inputs and outputs.

Quantising changes what devices compute, so the release is judged again: the run's evaluation
split is searched as devices will search it (with the variant's query map, hubness offset or
transition scoring), the forward transform computed by ONNX Runtime from the quantised graph.
ECC must hold on the run's primary metric, else the export is refused unless forced. The
manifest's gate then holds the quantised path's figures under the adapted case, the run's fp32
figures under ``<case> [fp32]``, and ``gate.quantization`` what quantising cost.
"""

from __future__ import annotations

import time
from dataclasses import replace
from pathlib import Path
from typing import Any

import numpy as np

from fctkit.errors import DataUnavailableError, GateError, InputError, require

from .onnx_export import check_parity, describe_export, quiet_third_party, run_onnx, to_fp16
from .onnx_graph import load_onnx_model
from .roles import RoleExport
from .trained_run import TrainedRun

QUANTIZATIONS = ("int8", "fp16")
SCHEMES = {"int8": "onnxruntime dynamic, int8 weights per channel", "fp16": "float16 weights, float32 inputs/outputs"}


def quantized_forward(export: RoleExport, module: Any, real: list[np.ndarray], precision: str) -> RoleExport:
    """The forward role ``export`` written again in ``precision`` beside it, parity-checked
    against the torch ``module`` on the real batch ``real`` (within that precision's tolerance)."""
    source = export.export.path
    start = time.perf_counter()
    path = quantize_graph(source, source.with_name(f"{source.stem}-{precision}.onnx"), precision)
    result = describe_export(path, load_onnx_model(path), export.export.export_seconds + time.perf_counter() - start)
    return replace(export, export=result, parity=check_parity(module, path, real))


def check_quantization(precision: str) -> None:
    """:class:`InputError` unless ``precision`` is one of :data:`QUANTIZATIONS`."""
    if precision not in QUANTIZATIONS:
        raise InputError(f"unknown quantisation {precision!r}; choose from {', '.join(QUANTIZATIONS)}")


def quantize_graph(source: Path, path: Path, precision: str) -> Path:
    """The ONNX graph ``source`` written to ``path`` in ``precision`` (see the module's doc)."""
    check_quantization(precision)
    if precision == "int8":
        quantization = require("onnxruntime.quantization", "cpu")
        # reduce_range: 7-bit weights, so the u8 x s8 products cannot saturate on x86 CPUs without
        # VNNI (AVX2 only, as ours): full-range weights failed parity there (max error 6.0 at scale 13)
        with quiet_third_party(""):  # it advises, on the root logger, a pre-processing step for CNNs
            quantization.quantize_dynamic(
                str(source), str(path), per_channel=True, reduce_range=True, weight_type=quantization.QuantType.QInt8
            )
    else:
        require("onnx", "train").save(to_fp16(load_onnx_model(source)), str(path))
    return path


def judged_gate(
    run: TrainedRun, method: str, gate: dict[str, Any], quantized: RoleExport, force: bool
) -> dict[str, Any]:
    """The version's ``gate`` ({"cases", "ecc"}) judged again with its forward transform served
    by the ``quantized`` graph; :class:`GateError` when ECC fails and ``force`` is not given."""
    graph, precision = quantized.export.path, quantized.export.precision
    case = next(c for c in gate["cases"] if c not in ("old/old", "new/new"))
    metrics, holds = quantized_metrics(run, method, graph)
    metric = run.gate["metric"]
    fp32, value, baseline = gate["cases"][case][metric], metrics[metric], gate["cases"]["old/old"][metric]
    if not holds and not force:
        raise GateError(
            f"publishing refused: with the {precision} forward adapter ECC does not hold on {metric} "
            f"({value:.4f} vs old/old {baseline:.4f}; fp32 {fp32:.4f}); export without --quantize, or pass "
            "--force --reason '...' to override on the record"
        )
    return {
        "cases": {**gate["cases"], case: metrics, f"{case} [fp32]": gate["cases"][case]},
        "ecc": dict.fromkeys(gate["ecc"], holds),
        "quantization": {
            "precision": precision,
            "scheme": SCHEMES[precision],
            "artifacts": [quantized.artifact.artifact_name],
            "metric": metric,
            "fp32": fp32,
            "quantized": value,
        },
    }


def quantized_metrics(run: TrainedRun, method: str, graph: Path) -> tuple[dict[str, Any], bool]:
    """The gate's metrics and ECC verdict of the run's ``method`` (a variant key) with its
    forward transform computed by ONNX Runtime from ``graph``, on the run's evaluation split."""
    from fctkit.trainer.pipeline import evaluate_methods
    from fctkit.trainer.report import Report

    searched = _variant(run, method, graph)
    gate = evaluate_methods(
        run.config, _evaluation_set(run), {method: searched}, Report("quantised"), run.gate["metric"]
    )
    return gate["cases"][method], bool(gate["ecc"][method])


def _variant(run: TrainedRun, method: str, graph: Path) -> Any:
    """The trained variant with the forward adapter's ``transform`` computed from ``graph``."""
    inputs = len(load_onnx_model(graph).graph.input)

    def transform(old: np.ndarray, side: np.ndarray | None = None) -> np.ndarray:
        arrays = [old, side][:inputs]
        return run_onnx(graph, [np.asarray(a, np.float32) for a in arrays])[0]

    return run.variant(method, forward_transform=transform)


def _evaluation_set(run: TrainedRun) -> Any:
    """The run's evaluation split as its gate judged it: the task's own sets, else the labelled
    evaluation features searched leave-one-out."""
    from fctkit.trainer.run_data import load_run_task
    from fctkit.trainer.searches import EvalSet, Features

    if run.config.data.name == "task":
        try:
            task = load_run_task(run.config)
            assert task is not None  # a run on a task has one
            return EvalSet.of_task(task.evaluation)
        except DataUnavailableError as exc:
            raise DataUnavailableError(f"judging a quantised adapter searches the run's task again: {exc}") from exc
    features = run.eval_features
    return EvalSet.labelled(Features(features["old"], features["side"], features["new"], features.get("labels")))


__all__ = [
    "QUANTIZATIONS",
    "check_quantization",
    "judged_gate",
    "quantize_graph",
    "quantized_forward",
    "quantized_metrics",
]

"""torch module -> one self-contained ONNX file, with a parity check against torch.

:func:`export_onnx` exports in eval mode (BatchNorm folded by the exporter) with a dynamic
batch axis and ``external_data=False``, checks the file with ``onnx.checker`` and records
its input/output names and dims; ``fp16=True`` stores the weights in float16 while the
graph keeps float32 inputs and outputs, so a device feeds both precisions the same way.

:func:`check_parity` runs the ONNX file in ONNX Runtime and the torch module on the same
inputs (batches of 1, 7 and 1000 drawn to match the real batch's statistics, plus the
held-out real batch itself) and fails when the largest absolute difference exceeds the
tolerance: ``FP32_TOLERANCE`` for fp32, ``FP16_RELATIVE_TOLERANCE`` for fp16 and
``INT8_RELATIVE_TOLERANCE`` for int8, each times the output scale (max |output|, at least 1).
"""

from __future__ import annotations

import contextlib
import logging
import os
import tempfile
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, cast

import numpy as np

from fctkit.errors import ExportError, InputError, require
from fctkit.protos.bundle import TensorSpec

from .onnx_graph import graph_io_specs, graph_precision, load_onnx_model

#: fp32 keeps ~24 bits: a graph whose outputs reach 2e7 (an ill-conditioned least-squares
#: adapter on random inputs, off the features' subspace) differs from torch by ~1 in rounding alone.
FP32_TOLERANCE = 1e-4
#: fp16 keeps ~11 significant bits. Measured on every role trained on digits (FCT widths
#: 256/2048, benchmarks/export_roles.py) the fp16 error stays below 6e-4 of the output scale
#: (max |output|, at least 1); 1e-2 of it leaves margin without hiding a real export bug.
FP16_RELATIVE_TOLERANCE = 1e-2
#: int8 (dynamic quantisation) keeps ~8 bits per weight and per activation batch. Measured on the
#: digits FCT mixer the error is ~2% of the output scale; 1e-1 of it catches a broken graph, and
#: the quantised release's gate (export/quantize.py) judges what the rest costs in retrieval.
INT8_RELATIVE_TOLERANCE = 1e-1
RELATIVE_TOLERANCES = {"fp16": FP16_RELATIVE_TOLERANCE, "int8": INT8_RELATIVE_TOLERANCE}
PARITY_BATCH_SIZES = (1, 7, 1000)


@dataclass(frozen=True)
class InputSpec:
    """One input of the module: its name and its shape without the batch axis."""

    name: str
    shape: tuple[int, ...]
    dtype: str = "float32"


@dataclass(frozen=True)
class ExportResult:
    """What :func:`export_onnx` wrote."""

    path: Path
    opset: int
    precision: str
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    size_bytes: int
    export_seconds: float


@dataclass(frozen=True)
class ParityReport:
    """ONNX Runtime vs a reference (torch, by default) on the same inputs; errors are max absolute differences."""

    path: Path
    precision: str
    tolerance: float
    max_abs_error: float
    max_abs_reference: float
    per_batch: dict[str, float] = field(default_factory=dict)
    against: str = "torch"  # what the graph's outputs were compared with

    @property
    def passed(self) -> bool:
        return self.max_abs_error <= self.tolerance

    def summary(self) -> str:
        batches = ", ".join(f"{name}: {err:.2e}" for name, err in self.per_batch.items())
        verdict = "ok" if self.passed else "FAILED"
        return (
            f"parity {verdict} for {self.path.name} ({self.precision}): max abs error {self.max_abs_error:.2e} "
            f"(tolerance {self.tolerance:.1e}, output scale {self.max_abs_reference:.3g}; {batches})"
        )


def export_onnx(
    module: Any,
    input_specs: Sequence[InputSpec],
    output_names: Sequence[str],
    path: str | os.PathLike[str],
    *,
    opset: int | None = None,
    fp16: bool = False,
) -> ExportResult:
    """Export ``module`` (called as ``module(*inputs)``) to ``path``; see the module docstring.

    The file is written to a temporary name and renamed, so ``path`` never holds a partial
    export. Raises :class:`ExportError` with the exporter's reason when export fails."""
    torch = require("torch", "train")
    path = Path(path)
    _check_names([s.name for s in input_specs], "input")
    _check_names(list(output_names), "output")
    generator = torch.Generator().manual_seed(0)
    # Batch 3: torch.export would specialise a batch of 1 (or 2) into the graph.
    example = tuple(
        torch.randn((3, *s.shape), generator=generator).to(_torch_dtype(torch, s.dtype)) for s in input_specs
    )
    batch = torch.export.Dim("batch")
    path.parent.mkdir(parents=True, exist_ok=True)
    with _temporary_sibling(path) as staging, _eval_mode(module), quiet_third_party("torch.onnx", "onnxscript"):
        start = time.perf_counter()
        try:
            torch.onnx.export(
                module,
                example,
                str(staging),
                input_names=[s.name for s in input_specs],
                output_names=list(output_names),
                dynamic_shapes=tuple({0: batch} for _ in input_specs),
                opset_version=opset,
                external_data=False,
                verbose=False,
            )
        except Exception as exc:  # the exporter raises many unrelated types; all mean "not exportable"
            raise ExportError(
                f"torch could not export {type(module).__name__} to ONNX: {str(exc).splitlines()[0]}; materialise "
                "non-exportable ops (e.g. matrix_exp) into plain weights before exporting"
            ) from exc
        model = load_onnx_model(staging)
        if fp16:
            model = to_fp16(model)
            onnx = require("onnx", "train")
            onnx.save(model, str(staging))
            model = load_onnx_model(staging)
        seconds = time.perf_counter() - start
        inputs, outputs = graph_io_specs(model)
        _check_graph_names(inputs, [s.name for s in input_specs], "input", path)
        _check_graph_names(outputs, list(output_names), "output", path)
        os.replace(staging, path)
    return describe_export(path, model, seconds)


def describe_export(path: Path, model: Any, seconds: float) -> ExportResult:
    """The :class:`ExportResult` of the graph ``model`` written at ``path`` in ``seconds``."""
    inputs, outputs = graph_io_specs(model)
    return ExportResult(
        path=path,
        opset=_opset(model),
        precision=graph_precision(model),
        inputs=inputs,
        outputs=outputs,
        size_bytes=path.stat().st_size,
        export_seconds=seconds,
    )


def check_parity(
    module: Any,
    onnx_path: str | os.PathLike[str],
    inputs_list: Sequence[np.ndarray],
    *,
    tolerance: float | None = None,
    batch_sizes: Sequence[int] = PARITY_BATCH_SIZES,
    seed: int = 0,
) -> ParityReport:
    """Compare ONNX Runtime with torch on ``batch_sizes`` random batches and on the held-out
    real batch ``inputs_list`` (one array per graph input, same number of rows).

    Raises :class:`ExportError` (carrying the report as ``.report``) when the largest
    absolute difference exceeds ``tolerance`` (default: fp32 1e-4, fp16 relative)."""
    onnx_path = Path(onnx_path)
    real = _check_real_batch(inputs_list)
    session = onnx_session(onnx_path)
    graph_inputs = session.get_inputs()
    if len(graph_inputs) != len(real):
        raise InputError(f"{onnx_path.name} takes {len(graph_inputs)} input(s), {len(real)} array(s) were given")
    for node, array in zip(graph_inputs, real):
        if list(array.shape[1:]) != list(node.shape[1:]):
            raise InputError(
                f"input {node.name!r} of {onnx_path.name} needs rows of shape {node.shape[1:]}, got {array.shape[1:]}"
            )
    names = [node.name for node in graph_inputs]
    precision = graph_precision(load_onnx_model(onnx_path))
    return compare_with_torch(
        module,
        lambda arrays: session.run(None, dict(zip(names, arrays))),
        real,
        path=onnx_path,
        precision=precision,
        tolerance=tolerance,
        batch_sizes=batch_sizes,
        seed=seed,
    )


def compare_with_torch(
    module: Any,
    run: Callable[[list[np.ndarray]], Sequence[np.ndarray]],
    inputs_list: Sequence[np.ndarray],
    *,
    path: Path,
    precision: str,
    tolerance: float | None = None,
    batch_sizes: Sequence[int] = PARITY_BATCH_SIZES,
    seed: int = 0,
) -> ParityReport:
    """The parity check behind :func:`check_parity` for any runner (ONNX Runtime, TensorRT):
    ``run(arrays)`` returns the graph's outputs for one batch."""
    real = _check_real_batch(inputs_list)
    rng = np.random.default_rng(seed)
    batches = {f"batch_{n}": [_like(rng, a, n) for a in real] for n in batch_sizes}
    batches[f"real_{len(real[0])}"] = real
    errors, scale = {}, 0.0
    for label, arrays in batches.items():
        expected = run_torch(module, arrays)
        actual = run(arrays)
        if len(expected) != len(actual):
            raise ExportError(f"{path.name} has {len(actual)} output(s), the module returns {len(expected)}")
        errors[label] = max(float(np.max(np.abs(e - np.asarray(a, np.float64)))) for e, a in zip(expected, actual))
        scale = max(scale, max(float(np.max(np.abs(e))) for e in expected))
    if tolerance is None:
        tolerance = RELATIVE_TOLERANCES.get(precision, FP32_TOLERANCE) * max(1.0, scale)
    report = ParityReport(
        path=path,
        precision=precision,
        tolerance=tolerance,
        max_abs_error=max(errors.values()),
        max_abs_reference=scale,
        per_batch=errors,
    )
    if not report.passed:
        error = ExportError(report.summary() + ": the graph does not compute what the torch module computes")
        error.report = report  # type: ignore[attr-defined]  # ExportError has no field for it: the parity figures ride on this one
        raise error
    return report


def run_torch(module: Any, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    """The module's outputs (float64 numpy) in eval mode, without gradients."""
    torch = require("torch", "train")
    with _eval_mode(module), torch.no_grad():
        out = module(*(torch.from_numpy(np.ascontiguousarray(a)) for a in arrays))
    outputs = out if isinstance(out, (tuple, list)) else (out,)
    return [o.detach().cpu().double().numpy() for o in outputs]


def onnx_session(onnx_path: str | os.PathLike[str] | bytes) -> Any:
    """An ONNX Runtime session on the CPU execution provider (from a path or the file bytes)."""
    ort = require("onnxruntime", "cpu")
    source = onnx_path if isinstance(onnx_path, bytes) else str(onnx_path)
    return ort.InferenceSession(source, providers=["CPUExecutionProvider"])


def run_onnx(
    onnx_path: str | os.PathLike[str], arrays: Sequence[np.ndarray], *, batch_size: int = 4096
) -> list[np.ndarray]:
    """Run an ONNX graph over arrays (one per input) in batches; returns its outputs."""
    session = onnx_session(onnx_path)
    names = [node.name for node in session.get_inputs()]
    chunks = [
        session.run(None, {n: a[i : i + batch_size] for n, a in zip(names, arrays)})
        for i in range(0, len(arrays[0]), batch_size)
    ]
    return [np.concatenate([c[k] for c in chunks]) for k in range(len(chunks[0]))]


# --------------------------------------------------------------------------- helpers


@contextlib.contextmanager
def quiet_third_party(*loggers: str) -> Iterator[None]:
    """Inside: no Python warnings, and the named libraries' loggers ("" is the root logger) pass only
    errors. What they say otherwise speaks to their own developers, not to ours (the ONNX exporter's
    "torchvision is not installed. Skipping torchvision::nms", once per operator it looks up);
    an export that fails still raises with the exporter's reason."""
    named = [logging.getLogger(name) for name in loggers]
    levels = [logger.level for logger in named]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for logger in named:
            logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            for logger, level in zip(named, levels):
                logger.setLevel(level)


def to_fp16(model: Any) -> Any:
    """float16 weights, float32 graph inputs/outputs (Casts at the boundary)."""
    float16 = require("onnxruntime.transformers.float16", "cpu")
    with quiet_third_party():
        converted = float16.convert_float_to_float16(model, keep_io_types=True)
    _topological_sort(converted.graph)  # the converter appends its boundary Casts out of order
    return converted


def _topological_sort(graph: Any) -> None:
    available = {v.name for v in graph.input} | {t.name for t in graph.initializer} | {""}
    pending, ordered = list(graph.node), []
    while pending:
        ready = [n for n in pending if all(i in available for i in n.input)]
        if not ready:
            raise ExportError("the fp16 graph has a node whose inputs are never produced")
        for node in ready:
            available.update(node.output)
        ordered += ready
        pending = [n for n in pending if n not in ready]
    del graph.node[:]
    graph.node.extend(ordered)


def _opset(model: Any) -> int:
    return cast(int, max(o.version for o in model.opset_import if o.domain in ("", "ai.onnx")))


def _check_names(names: list[str], kind: str) -> None:
    if not names or len(set(names)) != len(names) or not all(isinstance(n, str) and n for n in names):
        raise InputError(f"{kind} names must be non-empty and unique, got {names}")


def _check_graph_names(specs: tuple[TensorSpec, ...], names: list[str], kind: str, path: Path) -> None:
    if [s.name for s in specs] != names:
        raise ExportError(f"{path.name}: the exported graph's {kind}s are {[s.name for s in specs]}, expected {names}")


def _check_real_batch(arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
    if not arrays:
        raise InputError("check_parity needs the held-out real batch: one array per graph input")
    real = [np.ascontiguousarray(a) for a in arrays]
    rows = {len(a) for a in real}
    if len(rows) != 1 or 0 in rows:
        raise InputError(f"the real batch's arrays must share a positive number of rows, got {sorted(rows)}")
    for i, array in enumerate(real):
        if array.dtype.kind == "f" and not np.all(np.isfinite(array)):
            raise InputError(f"real batch input {i} holds NaN or inf")
    return real


def _like(rng: np.random.Generator, real: np.ndarray, rows: int) -> np.ndarray:
    """Random rows with the real batch's per-feature mean and spread."""
    mean, std = real.mean(axis=0), real.std(axis=0) + 1e-3
    return rng.normal(mean, std, size=(rows, *real.shape[1:])).astype(real.dtype)


def _torch_dtype(torch: Any, name: str) -> Any:
    try:
        return getattr(torch, name)
    except AttributeError as exc:
        raise InputError(f"unknown input dtype {name!r}") from exc


@contextlib.contextmanager
def _eval_mode(module: Any) -> Iterator[None]:
    """Eval mode for the duration, then every submodule's own train/eval state back."""
    states = [(m, m.training) for m in module.modules()]
    module.eval()
    try:
        yield
    finally:
        for submodule, training in states:
            submodule.train(training)


@contextlib.contextmanager
def _temporary_sibling(path: Path) -> Iterator[Path]:
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".partial", dir=path.parent)
    os.close(fd)
    try:
        yield Path(name)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name)


__all__ = [
    "FP16_RELATIVE_TOLERANCE",
    "FP32_TOLERANCE",
    "INT8_RELATIVE_TOLERANCE",
    "PARITY_BATCH_SIZES",
    "ExportResult",
    "InputSpec",
    "ParityReport",
    "check_parity",
    "compare_with_torch",
    "describe_export",
    "export_onnx",
    "onnx_session",
    "run_onnx",
    "run_torch",
    "to_fp16",
]

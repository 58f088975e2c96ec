"""The ``hubness`` bundle role: an ONNX graph a device runs on its rows to get their offsets.

``r(row)`` = the mean of the row's ``k`` largest cosines to reference queries (CSLS-style;
:mod:`fctkit.trainer.hubness` is the same computation in numpy). The reference queries are
constants of the graph, unit-normalised here, so the device needs nothing but the bundle.
Built with the ``onnx`` helper directly (no torch): Normalise → MatMul → TopK → ReduceMean.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from fctkit.errors import ExportError, require

OPSET = 17


def hubness_onnx(reference_queries: np.ndarray, k: int, path: str | os.PathLike[str]) -> Path:
    """Write the graph ``embedding (batch, d) -> offset (batch, 1)`` to ``path``."""
    onnx = require("onnx", "train")
    from onnx import TensorProto, helper, numpy_helper

    reference = np.asarray(reference_queries, dtype=np.float64)
    if reference.ndim != 2 or not len(reference) or not np.isfinite(reference).all():
        raise ExportError(
            f"hubness reference queries must be a finite, non-empty (N, d) array, got shape {reference.shape}"
        )
    norms = np.linalg.norm(reference, axis=1, keepdims=True)
    if np.any(norms == 0):
        raise ExportError("a hubness reference query is all zeros: it has no direction for cosine")
    if not 1 <= k <= len(reference):
        raise ExportError(f"hubness k must be in 1..{len(reference)} (the reference queries), got {k}")
    unit_t = (reference / norms).T.astype(np.float32)
    nodes = [
        helper.make_node("ReduceL2", ["embedding"], ["norm"], keepdims=1, axes=[1]),  # attribute axes: opset < 18
        helper.make_node("Max", ["norm", "tiny"], ["safe_norm"]),
        helper.make_node("Div", ["embedding", "safe_norm"], ["unit"]),
        helper.make_node("MatMul", ["unit", "reference_t"], ["cosines"]),
        helper.make_node("TopK", ["cosines", "k"], ["top", "top_index"], axis=1, largest=1, sorted=0),
        helper.make_node("ReduceMean", ["top"], ["offset"], keepdims=1, axes=[1]),
    ]
    graph = helper.make_graph(
        nodes,
        "hubness_offset",
        [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["batch", unit_t.shape[0]])],
        [helper.make_tensor_value_info("offset", TensorProto.FLOAT, ["batch", 1])],
        initializer=[
            numpy_helper.from_array(unit_t, "reference_t"),
            numpy_helper.from_array(np.array([k], np.int64), "k"),
            numpy_helper.from_array(np.array(1e-12, np.float32), "tiny"),
        ],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)], producer_name="fctkit")
    model.ir_version = 8
    onnx.checker.check_model(model)
    path = Path(path)
    onnx.save(model, str(path))
    return path

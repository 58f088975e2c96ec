"""Reading what an ONNX file computes: input/output names, dims, dtypes, precision.

Uses the ``onnx`` package (imported lazily; torch is not needed)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from fctkit.errors import ExportError, require
from fctkit.protos.bundle import TensorSpec


def load_onnx_model(path: str | os.PathLike) -> Any:
    """Load and check an ONNX file that must be self-contained (no external data files)."""
    onnx = require("onnx", "train")
    path = Path(path)
    try:
        model = onnx.load(str(path), load_external_data=False)
    except FileNotFoundError as exc:
        raise ExportError(f"ONNX file {path} does not exist") from exc
    except Exception as exc:  # onnx raises DecodeError / RuntimeError variants for bad bytes
        raise ExportError(f"{path} is not a readable ONNX model: {exc}") from exc
    external = [t.name for t in model.graph.initializer if t.data_location == onnx.TensorProto.EXTERNAL]
    if external:
        raise ExportError(
            f"{path} keeps weights in external files ({', '.join(external[:3])}…): re-export with "
            "external_data=False so the bundle hashes and signs one self-contained file"
        )
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as exc:
        raise ExportError(f"{path} fails onnx.checker: {exc}") from exc
    return model


def graph_io_specs(model: Any) -> tuple[tuple[TensorSpec, ...], tuple[TensorSpec, ...]]:
    """The graph's real inputs (initializers excluded) and outputs as :class:`TensorSpec`.

    A symbolic axis becomes ``None``: the first is the dynamic batch; others (a text graph's
    tokens) are allowed by the manifest only where a text preprocessing declaration feeds them."""
    initializers = {t.name for t in model.graph.initializer}
    inputs = tuple(_spec(v) for v in model.graph.input if v.name not in initializers)
    outputs = tuple(_spec(v) for v in model.graph.output)
    return inputs, outputs


def graph_precision(model: Any) -> str:
    """``"int8"`` when the graph's weights are stored as 8-bit integers (quantised), ``"fp16"``
    when in float16, else ``"fp32"``."""
    onnx = require("onnx", "train")
    types = {t.data_type for t in model.graph.initializer}
    if types & {onnx.TensorProto.INT8, onnx.TensorProto.UINT8}:
        return "int8"
    if onnx.TensorProto.FLOAT16 in types:
        return "fp16"
    return "fp32"


def _spec(value_info: Any) -> TensorSpec:
    onnx = require("onnx", "train")
    tensor_type = value_info.type.tensor_type
    dtype = onnx.helper.tensor_dtype_to_np_dtype(tensor_type.elem_type).name
    dims = list(tensor_type.shape.dim)
    shape: list[int | None] = []
    for dim in dims:
        shape.append(int(dim.dim_value) if dim.HasField("dim_value") else None)
    if not shape or shape[0] is not None:
        raise ExportError(
            f"graph tensor {value_info.name!r} has shape {shape}: its first axis must be the dynamic batch axis; "
            "export with a dynamic batch dimension"
        )
    return TensorSpec(name=value_info.name, shape=tuple(shape), dtype=dtype)

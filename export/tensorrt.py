"""TensorRT engines from the exported ONNX files (TensorRT 10 Python API), with the same
parity check as the ONNX export. Needs ``tensorrt`` and a CUDA GPU (GPU buffers are torch
CUDA tensors); elsewhere :func:`tensorrt_unavailable_reason` says in one line why not.

Not executed on the machines this kit was developed on (no GPU, and ``pip install
tensorrt`` cannot complete there): the GPU tests skip with that reason.
"""

from __future__ import annotations

import os
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import numpy as np

from fctkit.errors import DependencyError, ExportError, InputError

from .onnx_export import PARITY_BATCH_SIZES, ParityReport, compare_with_torch

Precision = Literal["fp32", "fp16"]
DEFAULT_MAX_BATCH = 4096
DEFAULT_OPT_BATCH = 256
DEFAULT_WORKSPACE_BYTES = 1 << 30


def tensorrt_unavailable_reason() -> str | None:
    """``None`` when TensorRT engines can be built and run here, else a one-line reason."""
    try:
        import tensorrt  # noqa: F401
    except ImportError:
        return (
            "tensorrt is not installed: on a machine with an NVIDIA GPU run "
            "pip install 'fctkit[trt]' -c constraints.txt (NVIDIA's wheels)"
        )
    try:
        import torch
    except ImportError:
        return "torch is not installed: TensorRT engines here run with torch CUDA buffers (pip install 'fctkit[train]')"
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible (torch.cuda.is_available() is False), so TensorRT cannot run"
    return None


def _require_tensorrt() -> Any:
    reason = tensorrt_unavailable_reason()
    if reason is not None:
        raise DependencyError(reason)
    import tensorrt as trt

    return trt


@dataclass(frozen=True)
class EngineResult:
    """A serialized TensorRT engine built from one ONNX file."""

    path: Path
    onnx_path: Path
    precision: Precision
    max_batch: int
    size_bytes: int
    build_seconds: float


def build_engine(
    onnx_path: str | os.PathLike[str],
    precision: Precision = "fp32",
    *,
    engine_path: str | os.PathLike[str] | None = None,
    max_batch: int = DEFAULT_MAX_BATCH,
    opt_batch: int = DEFAULT_OPT_BATCH,
    workspace_bytes: int = DEFAULT_WORKSPACE_BYTES,
) -> EngineResult:
    """Parse ``onnx_path`` and build a serialized engine for batches 1..``max_batch``.

    fp32 disables TF32 so the engine meets the fp32 parity tolerance; fp16 lets TensorRT
    pick half-precision kernels. The engine is written next to the ONNX file
    (``<name>.<precision>.engine``) unless ``engine_path`` is given."""
    if precision not in ("fp32", "fp16"):
        raise InputError(f"precision must be 'fp32' or 'fp16', got {precision!r}")
    if not 1 <= opt_batch <= max_batch:
        raise InputError(f"need 1 <= opt_batch <= max_batch, got {opt_batch} and {max_batch}")
    trt = _require_tensorrt()
    onnx_path = Path(onnx_path)
    engine_path = Path(engine_path) if engine_path else onnx_path.with_suffix(f".{precision}.engine")
    logger = trt.Logger(trt.Logger.WARNING)
    start = time.perf_counter()
    builder = trt.Builder(logger)
    network = builder.create_network(0)  # TensorRT 10: networks are always explicit-batch
    parser = trt.OnnxParser(network, logger)
    if not parser.parse(onnx_path.read_bytes()):
        errors = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise ExportError(f"TensorRT cannot parse {onnx_path.name}: {errors}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, workspace_bytes)
    if precision == "fp16":
        config.set_flag(trt.BuilderFlag.FP16)
    else:
        config.clear_flag(trt.BuilderFlag.TF32)
    profile = builder.create_optimization_profile()
    for i in range(network.num_inputs):
        tensor = network.get_input(i)
        rest = tuple(tensor.shape)[1:]
        if any(d < 0 for d in rest):
            raise ExportError(f"{onnx_path.name}: input {tensor.name!r} has dynamic feature dims {tuple(tensor.shape)}")
        profile.set_shape(tensor.name, (1, *rest), (opt_batch, *rest), (max_batch, *rest))
    config.add_optimization_profile(profile)
    serialized = builder.build_serialized_network(network, config)
    if serialized is None:
        raise ExportError(f"TensorRT failed to build an engine from {onnx_path.name} (see the TensorRT log above)")
    engine_path.write_bytes(bytes(serialized))
    return EngineResult(
        path=engine_path,
        onnx_path=onnx_path,
        precision=precision,
        max_batch=max_batch,
        size_bytes=engine_path.stat().st_size,
        build_seconds=time.perf_counter() - start,
    )


class TensorRTRunner:
    """Runs a serialized engine on numpy batches (inputs in the engine's I/O order)."""

    def __init__(self, engine_path: str | os.PathLike[str]) -> None:
        trt = _require_tensorrt()
        import torch

        self._trt, self._torch = trt, torch
        self._runtime = trt.Runtime(trt.Logger(trt.Logger.WARNING))
        self._engine = self._runtime.deserialize_cuda_engine(Path(engine_path).read_bytes())
        if self._engine is None:
            raise ExportError(f"{engine_path} is not a TensorRT engine for this TensorRT version and GPU")
        self._context = self._engine.create_execution_context()
        names = [self._engine.get_tensor_name(i) for i in range(self._engine.num_io_tensors)]
        self.input_names = [n for n in names if self._engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.output_names = [n for n in names if self._engine.get_tensor_mode(n) == trt.TensorIOMode.OUTPUT]

    def __call__(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        trt, torch = self._trt, self._torch
        if len(arrays) != len(self.input_names):
            raise InputError(f"the engine takes {len(self.input_names)} input(s), got {len(arrays)}")
        keep = []  # the device buffers must outlive the asynchronous execution
        for name, array in zip(self.input_names, arrays):
            dtype = trt.nptype(self._engine.get_tensor_dtype(name))
            tensor = torch.from_numpy(np.ascontiguousarray(array, dtype=dtype)).cuda()
            if not self._context.set_input_shape(name, tuple(tensor.shape)):
                raise InputError(f"input {name!r} shape {tuple(tensor.shape)} is outside the engine's profile")
            self._context.set_tensor_address(name, tensor.data_ptr())
            keep.append(tensor)
        outputs = []
        for name in self.output_names:
            shape = tuple(self._context.get_tensor_shape(name))
            dtype = torch.from_numpy(np.zeros(0, trt.nptype(self._engine.get_tensor_dtype(name)))).dtype
            tensor = torch.empty(shape, dtype=dtype, device="cuda")
            self._context.set_tensor_address(name, tensor.data_ptr())
            outputs.append(tensor)
        stream = torch.cuda.current_stream()
        if not self._context.execute_async_v3(stream.cuda_stream):
            raise ExportError("TensorRT execution failed (see the TensorRT log)")
        stream.synchronize()
        del keep
        return [t.cpu().numpy() for t in outputs]


def check_engine_parity(
    module: Any,
    engine: EngineResult,
    inputs_list: Sequence[np.ndarray],
    *,
    tolerance: float | None = None,
    batch_sizes: Sequence[int] = PARITY_BATCH_SIZES,
) -> ParityReport:
    """The ONNX export's parity check, run through the TensorRT engine."""
    runner = TensorRTRunner(engine.path)
    return compare_with_torch(
        module,
        runner,
        inputs_list,
        path=engine.path,
        precision=engine.precision,
        tolerance=tolerance,
        batch_sizes=[b for b in batch_sizes if b <= engine.max_batch],
    )


__all__ = ["EngineResult", "TensorRTRunner", "build_engine", "check_engine_parity", "tensorrt_unavailable_reason"]

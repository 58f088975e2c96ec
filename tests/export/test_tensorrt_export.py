"""TensorRT engines (fp32, fp16) with parity through the engine; skipped without TensorRT + GPU."""

from __future__ import annotations

import numpy as np
import pytest

from fctkit.errors import DependencyError
from fctkit.export.tensorrt import build_engine, check_engine_parity, tensorrt_unavailable_reason

REASON = tensorrt_unavailable_reason()


def test_the_unavailable_reason_is_one_actionable_line():
    if REASON is None:
        pytest.skip("TensorRT and a GPU are present")
    assert "\n" not in REASON and ("pip install" in REASON or "GPU" in REASON)
    with pytest.raises(DependencyError, match=REASON.split(":")[0]):
        build_engine("missing.onnx")


@pytest.mark.gpu
@pytest.mark.skipif(REASON is not None, reason=REASON or "")
@pytest.mark.parametrize("precision", ["fp32", "fp16"])
def test_engine_matches_torch(tmp_path, precision):
    import torch

    from fctkit.export.onnx_export import InputSpec, export_onnx

    torch.manual_seed(0)
    module = torch.nn.Sequential(
        torch.nn.Linear(24, 64), torch.nn.BatchNorm1d(64), torch.nn.ReLU(), torch.nn.Linear(64, 16)
    ).eval()
    onnx_file = export_onnx(module, [InputSpec("embedding", (24,))], ["out"], tmp_path / "m.onnx").path
    engine = build_engine(onnx_file, precision)
    assert engine.path.exists() and engine.size_bytes > 0
    real = [np.random.default_rng(0).standard_normal((300, 24)).astype(np.float32)]
    report = check_engine_parity(module, engine, real)
    assert report.passed and set(report.per_batch) == {"batch_1", "batch_7", "batch_1000", "real_300"}

"""Generic torch -> ONNX export: self-contained file, dynamic batch, BN folded, parity, fp16."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
onnx = pytest.importorskip("onnx")

from fctkit.errors import ExportError, InputError  # noqa: E402
from fctkit.export.onnx_export import (  # noqa: E402
    FP32_TOLERANCE,
    InputSpec,
    check_parity,
    export_onnx,
    run_onnx,
    run_torch,
)


class TwoBranch(torch.nn.Module):
    """Two inputs -> Linear-BN-ReLU branches -> concat -> Linear, like an FCT adapter in miniature."""

    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Sequential(torch.nn.Linear(12, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU())
        self.b = torch.nn.Sequential(torch.nn.Linear(5, 32), torch.nn.BatchNorm1d(32), torch.nn.ReLU())
        self.mix = torch.nn.Linear(64, 6)

    def forward(self, old, side):
        return self.mix(torch.cat([self.a(old), self.b(side)], dim=1))


def _module() -> TwoBranch:
    torch.manual_seed(0)
    module = TwoBranch()
    for bn in (module.a[1], module.b[1]):  # non-trivial running statistics, so folding matters
        bn.running_mean.uniform_(-1, 1)
        bn.running_var.uniform_(0.5, 2.0)
    return module.train()


SPECS = [InputSpec("old_embedding", (12,)), InputSpec("old_side_info", (5,))]


@pytest.fixture(scope="module")
def real_batch():
    rng = np.random.default_rng(1)
    return [rng.normal(0.3, 1.2, (50, 12)).astype(np.float32), rng.normal(0, 1, (50, 5)).astype(np.float32)]


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    module = _module()
    result = export_onnx(module, SPECS, ["new_embedding"], tmp_path_factory.mktemp("onnx") / "h.onnx")
    return module, result


def test_export_writes_one_checked_file_with_dynamic_batch(exported):
    module, result = exported
    assert module.training and module.a[1].training, "the caller's train/eval state must be restored"
    model = onnx.load(str(result.path))
    onnx.checker.check_model(model, full_check=True)
    assert not list(result.path.parent.glob("*.data")) and not list(result.path.parent.glob(".*partial"))
    assert "BatchNormalization" not in {n.op_type for n in model.graph.node}, "BN must be folded in eval mode"
    assert [(s.name, s.shape, s.dtype) for s in result.inputs] == [
        ("old_embedding", (None, 12), "float32"),
        ("old_side_info", (None, 5), "float32"),
    ]
    assert [(s.name, s.shape) for s in result.outputs] == [("new_embedding", (None, 6))]
    assert result.precision == "fp32" and result.opset >= 17
    assert result.size_bytes == result.path.stat().st_size > 0 and result.export_seconds > 0


def test_parity_holds_on_all_batch_sizes_and_the_real_batch(exported, real_batch):
    module, result = exported
    report = check_parity(module, result.path, real_batch)
    assert list(report.per_batch) == ["batch_1", "batch_7", "batch_1000", "real_50"]
    assert (
        report.passed
        and report.max_abs_error <= FP32_TOLERANCE
        and report.tolerance == FP32_TOLERANCE * max(1.0, report.max_abs_reference)
    )
    assert report.max_abs_reference > 0.1
    assert module.training, "check_parity must not leave the module in eval mode"
    onnx_out = run_onnx(result.path, real_batch, batch_size=16)[0]
    np.testing.assert_allclose(onnx_out, run_torch(module, real_batch)[0], atol=FP32_TOLERANCE)


def test_parity_fails_loudly_when_the_graph_differs(exported, real_batch):
    _, result = exported
    changed = _module()
    with torch.no_grad():
        changed.mix.bias.add_(1e-3)
    with pytest.raises(ExportError, match="parity FAILED") as caught:
        check_parity(changed, result.path, real_batch)
    report = caught.value.report
    assert 5e-4 < report.max_abs_error < 2e-3 and not report.passed


def test_parity_rejects_bad_real_batches(exported, real_batch):
    module, result = exported
    nan = [real_batch[0].copy(), real_batch[1]]
    nan[0][3, 2] = np.nan
    with pytest.raises(InputError, match="NaN"):
        check_parity(module, result.path, nan)
    with pytest.raises(InputError, match="rows of shape"):
        check_parity(module, result.path, [real_batch[0][:, :11], real_batch[1]])
    with pytest.raises(InputError, match="takes 2 input"):
        check_parity(module, result.path, real_batch[:1])
    with pytest.raises(InputError, match="share a positive number of rows"):
        check_parity(module, result.path, [real_batch[0], real_batch[1][:10]])


def test_fp16_export_keeps_float32_io_and_meets_its_own_tolerance(tmp_path, real_batch):
    module = _module()
    fp32 = export_onnx(module, SPECS, ["new_embedding"], tmp_path / "h32.onnx")
    fp16 = export_onnx(module, SPECS, ["new_embedding"], tmp_path / "h16.onnx", fp16=True)
    assert fp16.precision == "fp16" and [s.dtype for s in fp16.inputs + fp16.outputs] == ["float32"] * 3
    weight_bytes = [sum(len(t.raw_data) for t in onnx.load(str(r.path)).graph.initializer) for r in (fp32, fp16)]
    assert weight_bytes[1] * 2 == pytest.approx(weight_bytes[0], rel=0.02)
    report = check_parity(module, fp16.path, real_batch)
    assert report.precision == "fp16" and report.passed
    assert report.max_abs_error > FP32_TOLERANCE, "fp16 rounding should be visible at the fp32 tolerance"
    with pytest.raises(ExportError):
        check_parity(module, fp16.path, real_batch, tolerance=FP32_TOLERANCE)


def test_matrix_exp_must_be_materialised_before_export(tmp_path):
    class Orthogonal(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.u = torch.nn.Parameter(torch.randn(4, 4))

        def forward(self, x):
            return x @ torch.linalg.matrix_exp(self.u - self.u.T)

    with pytest.raises(ExportError, match="materialise"):
        export_onnx(Orthogonal(), [InputSpec("x", (4,))], ["y"], tmp_path / "o.onnx")
    assert not (tmp_path / "o.onnx").exists()


def test_names_must_be_unique(tmp_path):
    with pytest.raises(InputError, match="unique"):
        export_onnx(_module(), [InputSpec("x", (12,)), InputSpec("x", (5,))], ["y"], tmp_path / "x.onnx")


def test_export_prints_nothing(tmp_path, capfd):
    """The exporter's own chatter (e.g. "torchvision is not installed. Skipping torchvision::nms",
    four times per export) is held back: what a user sees during `fctkit export` is ours alone."""
    export_onnx(_module(), SPECS, ["new_embedding"], tmp_path / "h.onnx")
    captured = capfd.readouterr()
    assert (captured.out, captured.err) == ("", "")

"""Every bundle role exported from real trainer objects fitted on digits, with parity on real
digits features, and retrieval metrics from the ONNX graphs equal to those from torch."""

from __future__ import annotations

import dataclasses
import logging

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("onnx")
pytest.importorskip("sklearn")

from fctkit.errors import InputError  # noqa: E402
from fctkit.export.bundle_builder import build_bundle, check_graphs_load  # noqa: E402
from fctkit.export.onnx_export import FP32_TOLERANCE, run_onnx  # noqa: E402
from fctkit.export.roles import export_role, role_module, write_role_table  # noqa: E402
from fctkit.protos.bundle import verify_bundle  # noqa: E402
from fctkit.trainer import evaluate_retrieval, load_dataset, make_splits, old_class_subset  # noqa: E402
from fctkit.trainer.adapters import FastFillAdapter, FastFillConfig, FCTAdapter, FCTConfig  # noqa: E402
from fctkit.trainer.backbones import BackboneConfig, extract_features, train_backbone  # noqa: E402
from fctkit.trainer.closed_form import ClosedFormAdapter  # noqa: E402
from fctkit.trainer.fitting import TrainConfig  # noqa: E402
from fctkit.trainer.lambda_orth import LambdaOrthAdapter, LambdaOrthConfig  # noqa: E402
from fctkit.trainer.query_map import fit_jointly  # noqa: E402
from fctkit.trainer.residual import ResidualAdapter  # noqa: E402
from fctkit.trainer.side_info import SideInfoConfig, train_side_info  # noqa: E402

pytestmark = pytest.mark.slow


@dataclasses.dataclass
class Digits:
    models: dict
    query_images: np.ndarray
    query_labels: np.ndarray
    gallery_images: np.ndarray
    gallery_labels: np.ndarray
    real: dict  # role key -> held-out real input arrays


@pytest.fixture(scope="module")
def digits():
    """Small but really trained old/new backbones, SimCLR side-info and every adapter kind."""
    logging.getLogger("torch").setLevel(logging.ERROR)
    data = load_dataset("digits")
    splits = make_splits(data.labels, seed=0)
    train, query, gallery = (data.subset(s) for s in (splits.train, splits.query, splits.gallery))
    old_rows = old_class_subset(train.labels)
    quick = {"epochs": 3, "width": 8, "progress": False}
    old = train_backbone(
        train.images[old_rows],
        train.labels[old_rows],
        BackboneConfig("small", embedding_dim=16, **quick),
        seed=0,
        device="cpu",
    )
    new = train_backbone(
        train.images, train.labels, BackboneConfig("wide", embedding_dim=24, **quick), seed=1, device="cpu"
    )
    side = train_side_info(
        train.images[old_rows],
        config=SideInfoConfig(kind="simclr", dim=8, width=8, epochs=2, progress=False),
        seed=2,
        device="cpu",
    )
    f_old, f_new, f_side = (extract_features(m, train.images) for m in (old, new, side))
    adapter_train = TrainConfig(epochs=10, warmup_epochs=1, lr=3e-3, batch_size=128, progress=False, device="cpu")
    widths = {"branch_width": 32, "mixer_width": 64, "train": adapter_train}
    models = {
        "old": old,
        "new": new,
        "side": side,
        "h": FCTAdapter.fit(f_old, f_new, f_side, FCTConfig(**widths))[0],
        "g": FCTAdapter.fit(f_old, f_side, f_side, FCTConfig(**widths))[0],
        "fastfill": FastFillAdapter.fit(f_old, f_new, f_side, FastFillConfig(**widths))[0],
        "lambda": LambdaOrthAdapter.fit(
            f_old, f_new, train.labels, LambdaOrthConfig(forward="mlp", hidden_width=32, train=adapter_train)
        )[0],
        "closed": ClosedFormAdapter.fit(f_old, f_new)[0],
        "residual": ResidualAdapter.fit(
            f_old, f_new, f_side, {"form": "mlp", "width": 32, "train": dataclasses.asdict(adapter_train)}
        )[0],
    }
    joint = ResidualAdapter.fit(f_old, f_new, f_side, {"form": "linear", "train": dataclasses.asdict(adapter_train)})[0]
    models["query_map"] = fit_jointly(
        joint, f_new, f_old, f_side, f_new, {"width": 16, "train": dataclasses.asdict(adapter_train)}
    )[0]
    q_old, q_new, q_side = (extract_features(models[k], query.images) for k in ("old", "new", "side"))
    real = {"images": [query.images], "old+side": [q_old, q_side], "old": [q_old], "new": [q_new]}
    return Digits(models, query.images, query.labels, gallery.images, gallery.labels, real)


# key -> (role, model key, real inputs key, source, target)
CASES = {
    "embed_v1": ("embed", "old", "images", None, None),
    "embed_v2": ("embed", "new", "images", None, None),
    "side_info": ("side_info", "side", "images", None, None),
    "forward_fct": ("forward", "h", "old+side", 1, 2),
    "side_forward_fct": ("side_forward", "g", "old+side", 1, 2),
    "forward_fastfill": ("forward", "fastfill", "old+side", 1, 2),
    "uncertainty_fastfill": ("uncertainty", "fastfill", "old+side", 1, 2),
    "forward_lambda_orth": ("forward", "lambda", "old", 1, 2),
    "backward_lambda_orth": ("backward", "lambda", "new", 2, 1),
    "forward_closed_form": ("forward", "closed", "old", 1, 2),
    "forward_residual": ("forward", "residual", "old+side", 1, 2),
    "query_map": ("query_map", "query_map", "new", None, None),
}


@pytest.fixture(scope="module")
def exports(digits, tmp_path_factory):
    folder = tmp_path_factory.mktemp("roles")
    return {
        key: export_role(
            role,
            digits.models[model],
            folder / f"{key}.onnx",
            digits.real[real],
            source_version=source,
            target_version=target,
        )
        for key, (role, model, real, source, target) in CASES.items()
    }


@pytest.mark.parametrize("key", list(CASES))
def test_every_role_exports_with_parity_on_real_digits(exports, digits, key):
    role, model, real, _, _ = CASES[key]
    result = exports[key]
    assert result.role == role and result.export.precision == "fp32" and result.export.opset >= 17
    assert result.parity.passed and result.parity.max_abs_error <= FP32_TOLERANCE
    assert f"real_{len(digits.query_labels)}" in result.parity.per_batch and "batch_1000" in result.parity.per_batch
    assert all(spec.shape[0] is None for spec in result.export.inputs + result.export.outputs)
    assert [s.name for s in result.export.inputs] == list(role_module(role, digits.models[model])[1])
    # The graph's outputs on the real batch are what the trainer object itself computes.
    onnx_out = run_onnx(result.export.path, digits.real[real])[0]
    expected = {
        "embed": lambda m, x: extract_features(m, *x),
        "side_info": lambda m, x: extract_features(m, *x),
        "forward": lambda m, x: m.transform(*x),
        "side_forward": lambda m, x: m.transform(*x),
        "backward": lambda m, x: m.transform_new(*x),
        "uncertainty": lambda m, x: m.uncertainty(*x),
        "query_map": lambda m, x: m.transform(*x),
    }[role](digits.models[model], digits.real[real])
    np.testing.assert_allclose(onnx_out, expected, atol=FP32_TOLERANCE)


def test_the_backward_graph_is_one_materialised_orthogonal_matrix(exports):
    import onnx

    model = onnx.load(str(exports["backward_lambda_orth"].export.path))
    ops = {node.op_type for node in model.graph.node}
    assert not ops & {"MatrixExp", "Loop", "If"}, ops
    (weight,) = [onnx.numpy_helper.to_array(t) for t in model.graph.initializer if t.dims and len(t.dims) == 2]
    square = weight[:, : min(weight.shape)] if weight.shape[0] <= weight.shape[1] else weight[: min(weight.shape)]
    np.testing.assert_allclose(square @ square.T, np.eye(len(square)), atol=1e-5)


def _retrieval_cases(run_embed, run_side, run_h, run_f, run_b, digits):
    q_new = run_embed("new", digits.query_images)
    g_old = run_embed("old", digits.gallery_images)
    g_side = run_side(digits.gallery_images)
    labels = {"query_labels": digits.query_labels, "gallery_labels": digits.gallery_labels}
    return {
        "new/h(old)": evaluate_retrieval(
            q_new, labels["query_labels"], run_h(g_old, g_side), labels["gallery_labels"], distance="cosine"
        ),
        "B(new)/F(old)": evaluate_retrieval(
            run_b(q_new), labels["query_labels"], run_f(g_old), labels["gallery_labels"], distance="cosine"
        ),
    }


def _torch_cases(digits):
    m = digits.models
    return _retrieval_cases(
        lambda k, x: extract_features(m[k], x),
        lambda x: extract_features(m["side"], x),
        m["h"].transform,
        m["lambda"].transform,
        m["lambda"].transform_new,
        digits,
    )


def _onnx_cases(files, digits):
    return _retrieval_cases(
        lambda k, x: run_onnx(files[f"embed_{'v1' if k == 'old' else 'v2'}"], [x])[0],
        lambda x: run_onnx(files["side_info"], [x])[0],
        lambda old, side: run_onnx(files["forward_fct"], [old, side])[0],
        lambda old: run_onnx(files["forward_lambda_orth"], [old])[0],
        lambda new: run_onnx(files["backward_lambda_orth"], [new])[0],
        digits,
    )


def test_retrieval_metrics_from_onnx_equal_those_from_torch(exports, digits):
    files = {key: e.export.path for key, e in exports.items()}
    torch_cases, onnx_cases = _torch_cases(digits), _onnx_cases(files, digits)
    for case, expected in torch_cases.items():
        got = onnx_cases[case]
        assert abs(got.top1 - expected.top1) <= 0.001, (case, got.top1, expected.top1)
        assert abs(got.cmc[5] - expected.cmc[5]) <= 0.001 and abs(got.mean_ap - expected.mean_ap) <= 0.001, case
    assert torch_cases["new/h(old)"].top1 > 0.3, (
        "the adapters must have learnt something for this test to mean anything"
    )


def test_fp16_graphs_keep_top1_within_half_a_point(digits, exports, tmp_path):
    files = {key: e.export.path for key, e in exports.items()}
    for key in ("embed_v1", "embed_v2", "side_info", "forward_fct"):  # the new/h(old) chain
        role, model, real, source, target = CASES[key]
        half = export_role(
            role,
            digits.models[model],
            tmp_path / f"{key}.fp16.onnx",
            digits.real[real],
            source_version=source,
            target_version=target,
            fp16=True,
        )
        assert half.export.precision == "fp16" and half.parity.passed
        assert half.export.size_bytes < exports[key].export.size_bytes
        files[key] = half.export.path
    expected = _torch_cases(digits)["new/h(old)"].top1
    got = _onnx_cases(files, digits)["new/h(old)"].top1
    assert abs(got - expected) <= 0.005, (got, expected)


def test_role_exports_build_a_verified_bundle_gated_by_real_metrics(exports, digits, tmp_path, publisher_key):
    cases = _torch_cases(digits)
    old_old = evaluate_retrieval(
        extract_features(digits.models["old"], digits.query_images),
        digits.query_labels,
        extract_features(digits.models["old"], digits.gallery_images),
        digits.gallery_labels,
        distance="cosine",
    )
    ecc_holds = cases["new/h(old)"].top1 > old_old.top1
    gate = {
        "cases": {
            name: {"top1": r.top1, "top5": r.cmc[5], "mAP": r.mean_ap}
            for name, r in {**cases, "old/old": old_old}.items()
        },
        "ecc": {"forward_1_to_2": ecc_holds},
    }
    keys = ("embed_v2", "side_info", "forward_fct", "uncertainty_fastfill", "side_forward_fct")
    bundle = build_bundle(
        tmp_path / "v2",
        version=2,
        parents=(1,),
        mode="forward",
        distance="cosine",
        normalize=True,
        artifacts=[exports[k].artifact for k in keys],
        gate=gate,
        private_key=publisher_key,
        force=not ecc_holds,
        force_reason=None if ecc_holds else "tiny test models",
    )
    verified = verify_bundle(bundle.root, publisher_key.public_key(), installed_version=1)
    m = verified.manifest
    assert (m.embedding_dim, m.side_info_dim) == (24, 8)
    assert m.gate["cases"]["new/h(old)"]["top1"] == cases["new/h(old)"].top1
    assert m.gate["forced"] is (not ecc_holds)
    assert m.artifact("uncertainty").outputs[0].shape == (None,)
    assert set(check_graphs_load(verified)) == {
        "embed",
        "side_info",
        "forward_1_to_2",
        "uncertainty_1_to_2",
        "side_forward_1_to_2",
    }
    table = write_role_table([exports[k] for k in keys], tmp_path / "roles.md").read_text()
    assert table.count("\n") == 2 + len(keys) and "| uncertainty | v1→v2 | fp32 |" in table


def test_roles_refuse_objects_that_cannot_play_them(digits, tmp_path):
    with pytest.raises(InputError, match="cannot be exported as role 'backward'"):
        role_module("backward", digits.models["h"])
    with pytest.raises(InputError, match="unknown role"):
        role_module("decoder", digits.models["h"])
    with pytest.raises(InputError, match="source_version= and target_version="):
        export_role("forward", digits.models["h"], tmp_path / "h.onnx", digits.real["old+side"])
    with pytest.raises(InputError, match="takes 2 input"):
        export_role(
            "forward", digits.models["h"], tmp_path / "h.onnx", digits.real["old"], source_version=1, target_version=2
        )

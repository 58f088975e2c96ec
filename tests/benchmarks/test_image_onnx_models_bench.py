"""The photo models' export (benchmarks/image_onnx_models.py) on a tiny EfficientNet-Lite the test
makes (random weights, 32 px) and on the real ImageNet Lite0: each graph, fed by the kit's
Preprocessor and ONNX Runtime, must match the PyTorch pipeline on JPEG and PNG files of odd,
non-square sizes (the resize and the centre crop round there). A declaration that differs from
the pipeline, or a graph exported in training mode, must fail that parity. No download."""

from __future__ import annotations

import json
import warnings

import numpy as np
import pytest

from tests.support.benchmark_scripts import benchmark_script
from tests.support.tiny_lite import encoded, textured_picture, tiny_lite

pytest.importorskip("efficientnet_lite_pytorch")
pytest.importorskip("onnxruntime")

SIZE = 32
#: (width, height): 71×59 resizes to 38.5→38 px wide (int, not round); 99×40 to 79 wide, a crop
#: offset of 23.5 (round: 24, floor: 23); 37×61 is portrait; 32×32 needs neither resize nor crop.
PICTURE_SIZES = [(71, 59), (99, 40), (37, 61), (32, 32), (45, 37), (33, 80), (120, 97), (50, 50)]


@pytest.fixture(scope="module")
def bench():
    with benchmark_script("image_onnx_models.py") as module:
        yield module


@pytest.fixture(scope="module")
def files() -> list[bytes]:
    """JPEG and PNG files by turns, at PICTURE_SIZES."""
    rng = np.random.default_rng(3)
    return [encoded(textured_picture(rng, w, h), "PNG" if i % 2 else "JPEG") for i, (w, h) in enumerate(PICTURE_SIZES)]


@pytest.fixture(scope="module")
def tiny(bench, tmp_path_factory):
    """The tiny Lite wrapped as the benchmark wraps Lite0, its graph, its PyTorch features."""
    module = bench.pooled_features_class()(tiny_lite(SIZE, 0.05, seed=1))
    graph = bench.export_graph(module, SIZE, tmp_path_factory.mktemp("tiny") / "model.onnx")
    return module, bench.ExportedImageModel("tiny", graph, bench.lite_declaration(SIZE))


def test_a_tiny_lite_graph_with_the_kits_preprocessing_matches_the_pytorch_pipeline(bench, tiny, files):
    from fctkit.export.onnx_graph import graph_io_specs, load_onnx_model

    module, model = tiny
    (image,), (features,) = graph_io_specs(load_onnx_model(model.graph))
    assert (image.name, image.shape[1:], features.name, features.shape[1:]) == (
        "image",
        (3, SIZE, SIZE),
        "features",
        (64,),
    )
    reference = bench.torch_reference(module, model.declaration, files)
    apart = np.abs(reference[:, None] - reference[None]).max(axis=2)
    assert apart[~np.eye(len(files), dtype=bool)].min() > 0.5  # any two pictures differ 5,000× the tolerance
    kit = bench.kit_embedder(model, threads=1, batch_size=3)(files)
    np.testing.assert_allclose(kit, reference, atol=1e-4, rtol=0)
    parity = bench.check_parity(module, model, files)
    assert parity["images"] == len(files) and parity["max_abs_error"] < 1e-4 < 0.1 < parity["max_abs_feature"]


@pytest.mark.parametrize(
    "wrong",
    [
        {"mean": [120.0] * 3},
        {"std": [100.0] * 3},
        {"resize": 40},
        {"resample": "bicubic"},
        {"mode": "BGR"},
        {"scale": 1 / 255},
    ],
    ids=lambda w: next(iter(w)),
)
def test_a_declaration_other_than_the_pipelines_fails_parity(bench, tiny, files, wrong):
    module, model = tiny
    shipped = bench.ExportedImageModel("wrong", model.graph, {**model.declaration, **wrong})
    gap = np.abs(
        bench.kit_embedder(shipped, threads=1)(files) - bench.torch_reference(module, model.declaration, files)
    ).max()
    assert gap > 0.01, (
        f"a device fed with {wrong} would embed as PyTorch does: the declaration is not what the graph sees"
    )


def test_a_declaration_whose_crop_is_not_the_graphs_input_is_refused(bench, tiny):
    from fctkit.errors import BundleFormatError
    from fctkit.export.onnx_graph import graph_io_specs, load_onnx_model
    from fctkit.protos.bundle import Artifact, file_sha256
    from fctkit.protos.preprocessing_spec import check_declared_graph, parse_declaration

    _, model = tiny
    artifact = Artifact(
        "embed",
        "embed",
        "embed.onnx",
        *file_sha256(model.graph),
        *graph_io_specs(load_onnx_model(model.graph)),
        None,
        None,
    )
    check_declared_graph(parse_declaration(bench.lite_declaration(SIZE), "lite"), artifact, (artifact,))
    with pytest.raises(BundleFormatError, match=r"input 'image' is float32 .*\(3, 28, 28\)"):
        check_declared_graph(
            parse_declaration({**bench.lite_declaration(SIZE), "crop": [28, 28]}, "lite"), artifact, (artifact,)
        )


def test_a_graph_exported_in_training_mode_fails_parity_and_export_graph_leaves_eval_mode(bench, files, tmp_path):
    import torch

    module = bench.pooled_features_class()(tiny_lite(SIZE, 0.05, seed=2))
    declaration = bench.lite_declaration(SIZE)
    module.train()
    pixels = torch.from_numpy(np.random.default_rng(0).standard_normal((4, 3, SIZE, SIZE)).astype(np.float32))
    with torch.no_grad():
        trained_mode, eval_mode = module(pixels).numpy(), module.eval()(pixels).numpy()
    assert np.abs(trained_mode - eval_mode).max() > 0.1  # BatchNorm on batch statistics (and updating its running ones)

    module.train()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module,
            torch.zeros(2, 3, SIZE, SIZE),
            str(tmp_path / "training.onnx"),
            input_names=[bench.INPUT],
            output_names=[bench.OUTPUT],
            dynamic_axes={bench.INPUT: {0: "batch"}, bench.OUTPUT: {0: "batch"}},
            opset_version=bench.OPSET,
            dynamo=False,
            training=torch.onnx.TrainingMode.TRAINING,
        )
    in_training = bench.ExportedImageModel("training", tmp_path / "training.onnx", declaration)
    assert bench.check_parity(module, in_training, files)["max_abs_error"] > 0.1

    module.train()
    graph = bench.export_graph(module, SIZE, tmp_path / "eval" / "model.onnx")
    assert not any(m.training for m in module.modules()), "export_graph must hand the module back in eval mode"
    kit = bench.kit_embedder(bench.ExportedImageModel("eval", graph, declaration), threads=1)(files)
    np.testing.assert_allclose(kit, bench.torch_reference(module, declaration, files), atol=1e-4, rtol=0)


@pytest.mark.parametrize("name", ["lite0", "lite1", "lite2"])
def test_the_lite_declarations_are_the_manifests_strict_form(bench, name):
    from fctkit.protos.preprocessing_spec import parse_declaration

    size = bench.LITE_SIZES[name]
    declared = bench.lite_declaration(size)
    parsed = parse_declaration(
        json.loads(json.dumps(declared)), name, strict=True
    )  # every key, as the signed manifest holds
    assert parsed.to_json() == declared
    assert (parsed.input_shape, parsed.scale, parsed.mean, parsed.std) == (
        (3, size, size),
        1.0,
        (127.0,) * 3,
        (128.0,) * 3,
    )


def test_the_real_lite0_exports_and_matches_pytorch_on_jpeg_files(bench, tmp_path):
    import torch

    try:
        network = bench.lite_network("lite0")
    except bench.BenchmarkSetupError as missing:
        pytest.skip(f"the Lite0 weights are not installed (they are in the dev extras): {missing}")
    assert isinstance(network._swish, torch.nn.ReLU6) and not network.training  # set_swish() would give wrong features
    rng = np.random.default_rng(7)
    jpegs = [
        encoded(textured_picture(rng, w, h), "JPEG", quality=85)
        for w, h in [(300, 260), (250, 331), (224, 224), (401, 233)]
    ]
    model = bench.export_lite("lite0", network, tmp_path)
    assert (model.graph, model.declaration) == (tmp_path / "lite0" / "model.onnx", bench.lite_declaration(224))
    parity = bench.check_parity(bench.pooled_features_class()(network), model, jpegs)
    assert parity["max_abs_error"] < 1e-4 and parity["max_abs_feature"] > 1.0, parity
    assert bench.kit_embedder(model, threads=1)(jpegs[:1]).shape == (1, 1280)

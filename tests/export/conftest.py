"""Fixtures for the export tests: tiny real ONNX graphs (built with onnx.helper, no torch),
a publisher key, a helper that builds a signed bundle from them, and the tiny digits chain
release with its key (for the modules that export a trained run)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fctkit.export.bundle_builder import ArtifactSource, build_bundle
from fctkit.export.keys import load_private_key
from tests.support.releases import digits_release, shared_folder

EMBED_DIM, SIDE_DIM, IMAGE_DIM = 8, 4, 16
PASSING_GATE = {
    "cases": {
        "old/old": {"top1": 0.94, "top5": 0.99, "mAP": 0.81},
        "new/h(old)": {"top1": 0.95, "top5": 0.99, "mAP": 0.83},
    },
    "ecc": {"forward_1_to_2": True, "backward_2_to_1": True},
}


def linear_onnx(path: Path, inputs: dict[str, int], out_dim: int, *, seed: int, output: str = "y") -> Path:
    """A real ONNX graph: concat the inputs along features, multiply by a seeded matrix."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(seed)
    in_dim = sum(inputs.values())
    weight = numpy_helper.from_array(rng.standard_normal((in_dim, out_dim)).astype(np.float32), "W")
    graph_inputs = [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", d]) for n, d in inputs.items()]
    nodes = []
    joined = next(iter(inputs))
    if len(inputs) > 1:
        nodes.append(helper.make_node("Concat", list(inputs), ["joined"], axis=1))
        joined = "joined"
    nodes.append(helper.make_node("MatMul", [joined, "W"], [output]))
    graph = helper.make_graph(
        nodes,
        "tiny",
        graph_inputs,
        [helper.make_tensor_value_info(output, TensorProto.FLOAT, ["batch", out_dim])],
        initializer=[weight],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    onnx.save(model, str(path))
    return path


def _tiny_sources(folder: Path, *, seed: int = 0) -> list[ArtifactSource]:
    """embed, side_info, forward 1->2 and backward 2->1 graphs for a v2 bundle."""
    folder.mkdir(parents=True, exist_ok=True)
    return [
        ArtifactSource(
            linear_onnx(folder / "embed.onnx", {"image": IMAGE_DIM}, EMBED_DIM, seed=seed, output="embedding"), "embed"
        ),
        ArtifactSource(
            linear_onnx(folder / "side.onnx", {"image": IMAGE_DIM}, SIDE_DIM, seed=seed + 1, output="side_info"),
            "side_info",
        ),
        ArtifactSource(
            linear_onnx(
                folder / "h.onnx",
                {"old_embedding": EMBED_DIM, "old_side_info": SIDE_DIM},
                EMBED_DIM,
                seed=seed + 2,
                output="new_embedding",
            ),
            "forward",
            source_version=1,
            target_version=2,
        ),
        ArtifactSource(
            linear_onnx(
                folder / "b.onnx", {"new_embedding": EMBED_DIM}, EMBED_DIM, seed=seed + 3, output="old_embedding"
            ),
            "backward",
            source_version=2,
            target_version=1,
        ),
    ]


@pytest.fixture(scope="session")
def publisher_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(bytes(range(32)))


@pytest.fixture(scope="session")
def other_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.from_private_bytes(bytes(range(1, 33)))


def _make_bundle(
    out: Path, key: Ed25519PrivateKey, *, version: int = 2, seed: int = 0, gate: dict | None = None, **kwargs
):
    sources = _tiny_sources(out.parent / f"{out.name}-sources", seed=seed)
    return build_bundle(
        out,
        version=version,
        parents=(version - 1,),
        mode="forward",
        distance="cosine",
        normalize=True,
        artifacts=sources,
        gate=PASSING_GATE if gate is None else gate,
        private_key=key,
        **kwargs,
    )


@pytest.fixture(scope="session")
def make_bundle():
    """``make_bundle(out_dir, private_key, *, version=2, seed=0, gate=None, **build_kwargs)``:
    a signed v2 bundle of tiny graphs (embed, side_info, forward 1->2, backward 2->1)."""
    return _make_bundle


@pytest.fixture(scope="session")
def passing_gate() -> dict:
    return PASSING_GATE


@pytest.fixture(scope="session")
def tiny_graph():
    """``tiny_graph(path, {input: dim}, out_dim, seed=, output=)``: write a real ONNX graph."""
    return linear_onnx


@pytest.fixture(scope="session")
def tiny_sources():
    """``tiny_sources(folder, seed=0)``: embed, side_info, forward 1->2, backward 2->1 graphs."""
    return _tiny_sources


@pytest.fixture(scope="module")
def release(tmp_path_factory):
    """The tiny digits chain release (:func:`tests.support.releases.digits_release`), built once."""
    return digits_release(shared_folder(tmp_path_factory))


@pytest.fixture(scope="module")
def private_key(release):
    """The key that signed :func:`release`."""
    return load_private_key(release.private_key_path)

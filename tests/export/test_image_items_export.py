"""A team's own image models, end to end: two small CNNs the test trains nothing into but
exports itself with torch (v1 NCHW RGB, v2 NHWC BGR with another resize and mean/std), images
written as PNG and JPEG by the test, a features-mode run on the features torch computed from
the reference pixels, `fctkit export --preprocessing` (JSON) with a JSONL sample of image
files, and a device (torch blocked) that adds a folder with v1, upgrades to v2 and answers
image queries as the torch / ONNX reference does. Corrupt and truncated files are refused
or skipped by id, nothing stored touched. Bundles hold ONNX graphs only: no TensorRT engines."""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from fctkit.cli import cli
from fctkit.edge_runtime import Device
from tests.support.raw_items import device_cli, device_ok, features_run, onnx_forward, unit

DECLARATION = {
    "old": {
        "kind": "image",
        "input": "pixels",
        "crop": [16, 16],
        "resize": 16,
        "mean": [0.5, 0.5, 0.5],
        "std": [0.25, 0.25, 0.25],
    },
    "new": {
        "kind": "image",
        "input": "image",
        "crop": [16, 16],
        "resize": 18,
        "mode": "BGR",
        "layout": "NHWC",
        "resample": "bicubic",
        "mean": [0.4, 0.45, 0.5],
        "std": [0.2, 0.3, 0.25],
    },
}
RESAMPLE = {"bilinear": 2, "bicubic": 3}


def cnn(dim: int, *, channels_last: bool):
    import torch

    class Net(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = torch.nn.Sequential(
                torch.nn.Conv2d(3, 6, 3, padding=1),
                torch.nn.ReLU(),
                torch.nn.Conv2d(6, 8, 3, stride=2),
                torch.nn.ReLU(),
                torch.nn.AdaptiveAvgPool2d(1),
                torch.nn.Flatten(),
                torch.nn.Linear(8, dim),
            )

        def forward(self, x):
            return self.body(x.permute(0, 3, 1, 2) if channels_last else x)

    torch.manual_seed(dim)
    return Net().eval()


def reference_pixels(data: bytes, declaration: dict) -> np.ndarray:
    """The declared preprocessing written out: PIL decodes and resizes, numpy does the rest."""
    import io

    from PIL import Image

    image = Image.open(io.BytesIO(data)).convert("RGB")
    width, height = image.size
    short = min(width, height)
    size = declaration["resize"]
    target = (size, int(size * height / short)) if width <= height else (int(size * width / short), size)
    pixels = np.asarray(image.resize(target, resample=RESAMPLE[declaration.get("resample", "bilinear")]), np.float32)
    top, left = round((pixels.shape[0] - 16) / 2), round((pixels.shape[1] - 16) / 2)
    pixels = pixels[top : top + 16, left : left + 16]
    if declaration.get("mode") == "BGR":
        pixels = pixels[..., ::-1]
    pixels = (pixels / 255 - np.array(declaration["mean"], np.float32)) / np.array(declaration["std"], np.float32)
    return pixels if declaration.get("layout") == "NHWC" else pixels.transpose(2, 0, 1)


def torch_features(model, files: list[bytes], declaration: dict) -> np.ndarray:
    import torch

    with torch.no_grad():
        return model(
            torch.from_numpy(np.stack([reference_pixels(f, declaration) for f in files]).astype(np.float32))
        ).numpy()


def write_images(folder, n: int, rng) -> list[bytes]:
    """Class-coloured noisy pictures of varied sizes, PNG and JPEG by turns; their bytes."""
    from PIL import Image

    folder.mkdir(parents=True)
    colours = rng.uniform(30, 220, size=(6, 3))
    files = []
    for i in range(n):
        height, width = rng.integers(18, 30, size=2)
        pixels = np.clip(colours[i % 6] + rng.normal(0, 25, size=(height, width, 3)), 0, 255).astype(np.uint8)
        name = folder / (f"img{i:03d}.png" if i % 2 else f"img{i:03d}.jpg")
        Image.fromarray(pixels).save(name)
        files.append(name.read_bytes())
    return files


@pytest.fixture(scope="module")
def image_release(tmp_path_factory):
    from fctkit.export.keys import generate_keys
    from fctkit.export.onnx_export import InputSpec, export_onnx

    root = tmp_path_factory.mktemp("image-release")
    rng = np.random.default_rng(5)
    files = write_images(root / "gallery", 120, rng)
    old_model, new_model = cnn(8, channels_last=False), cnn(10, channels_last=True)
    old, new = (
        torch_features(old_model, files, DECLARATION["old"]),
        torch_features(new_model, files, DECLARATION["new"]),
    )
    run = features_run(root / "train", old, new, np.arange(120) % 6)
    export_onnx(old_model, [InputSpec("pixels", (3, 16, 16))], ["embedding"], root / "old.onnx")
    export_onnx(new_model, [InputSpec("image", (16, 16, 3))], ["embedding"], root / "new.onnx")
    names = sorted(p.name for p in (root / "gallery").iterdir())
    (root / "sample.jsonl").write_text(
        "".join(
            json.dumps({"image": f"gallery/{n}", "old": old[i].tolist(), "new": new[i].tolist()}) + "\n"
            for i, n in enumerate(names[:20])
        )
    )
    (root / "preprocessing.json").write_text(json.dumps(DECLARATION))
    private, public = generate_keys(root / "keys", None)
    done = CliRunner().invoke(
        cli,
        [
            "export",
            str(run),
            "--key",
            str(private),
            "--out",
            str(root / "out"),
            "--method",
            "least-squares",
            "--old-graph",
            str(root / "old.onnx"),
            "--new-graph",
            str(root / "new.onnx"),
            "--sample",
            str(root / "sample.jsonl"),
            "--preprocessing",
            str(root / "preprocessing.json"),
            "--force",
            "--reason",
            "test: random CNNs",
            "--no-progress",
        ],
    )
    assert done.exit_code == 0, done.output
    queries = write_images(root / "queries", 6, rng)
    return {"root": root, "files": files, "old": old, "queries": queries, "new_model": new_model, "public": public}


def test_a_device_adds_a_folder_upgrades_and_answers_image_queries_as_the_reference(image_release, tmp_path):
    root, folder = image_release["root"], str(tmp_path / "device")
    v2 = json.loads((root / "out" / "v2" / "manifest.json").read_text())
    assert sorted(p.suffix for p in (root / "out" / "v2").iterdir()) == [
        ".json",
        ".onnx",
        ".onnx",
        ".sig",
    ]  # no engines
    assert v2["preprocessing"]["embed"]["layout"] == "NHWC" and "raw items" in v2["parity"]["embed"]["against"]
    device_ok("init", "--dir", folder, "--publisher-key", str(image_release["public"]))
    device_ok("upgrade", "--dir", folder, "--bundle", str(root / "out" / "v1"), "--quiet")
    added = json.loads(device_ok("add", "--dir", folder, str(root / "gallery"), "--no-upload", "--quiet"))
    assert added["added"] == 120 and added["rows"] == 120
    device_ok("upgrade", "--dir", folder, "--bundle", str(root / "out" / "v2.tar"), "--quiet")
    query_files = sorted(str(p) for p in (root / "queries").iterdir())
    answers = [json.loads(line) for line in device_ok("query", "--dir", folder, *query_files, "-k", "2").splitlines()]

    rows = onnx_forward(root / "out" / "v2", image_release["old"])
    wanted = torch_features(image_release["new_model"], image_release["queries"], DECLARATION["new"])
    with Device.open(folder) as device:
        stored = device.gallery.load()
        assert stored.item_ids == sorted(stored.item_ids) and stored.item_ids[0] == "img000.jpg"
        np.testing.assert_allclose(np.stack(stored.embeddings), rows, atol=1e-4)
        np.testing.assert_allclose(device.query_vectors(image_release["queries"]), wanted, atol=1e-4)
        assert device.engine().provider == "CPUExecutionProvider"
    similarity = unit(wanted) @ unit(rows).T
    assert [a["id"] for a in answers] == [f"img{i:03d}.{'png' if i % 2 else 'jpg'}" for i in range(6)]
    for q, answer in enumerate(answers):
        top = [int(m["item_id"][3:6]) for m in answer["matches"]]
        np.testing.assert_allclose(similarity[q, top], np.sort(similarity[q])[::-1][:2], atol=1e-4)


def test_corrupt_and_truncated_images_are_refused_or_skipped_by_id(image_release, tmp_path):
    root, folder = image_release["root"], str(tmp_path / "device")
    device_ok("init", "--dir", folder, "--publisher-key", str(image_release["public"]))
    device_ok("upgrade", "--dir", folder, "--bundle", str(root / "out" / "v1"), "--quiet")
    device_ok("add", "--dir", folder, str(root / "gallery" / "img001.png"), "--no-upload")
    batch = tmp_path / "batch"
    batch.mkdir()
    (batch / "good.png").write_bytes(image_release["files"][3])
    (batch / "junk.png").write_bytes(b"not an image at all")
    (batch / "cut.jpg").write_bytes(image_release["files"][2][:200])
    (batch / "notes.txt").write_text("left alone")
    refused = device_cli("add", "--dir", folder, str(batch), "--no-upload")
    assert refused.returncode == 2 and "'junk.png' is not a readable JPEG/PNG image" in refused.stderr
    assert "'cut.jpg' is not a readable JPEG/PNG image" in refused.stderr and "nothing was added" in refused.stderr
    with Device.open(folder) as device:
        assert device.gallery.load().item_ids == ["img001.png"]
    skipped = json.loads(device_ok("add", "--dir", folder, str(batch), "--no-upload", "--on-bad-item", "skip"))
    assert skipped["added"] == 1 and sorted(s["id"] for s in skipped["skipped"]) == ["cut.jpg", "junk.png"]
    with Device.open(folder) as device:
        assert sorted(device.gallery.load().item_ids) == ["good.png", "img001.png"]
        original = device.open_original("good.png", dict(device.gallery.replica_log.outbox())["good.png"])
        assert original.tobytes() == image_release["files"][3]  # the vault keeps the file as it came

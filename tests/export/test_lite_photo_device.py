"""Issue 37's flow end to end at test size: JPEG files in, the upgrade, JPEG queries out, on a real
device (the `fctkit device` CLI with torch blocked) and a real `fctkit serve` on loopback.

v1 and v2 are tiny networks of the real EfficientNet-Lite architecture the test makes (32 px and
64-d, 40 px and 96-d, random weights), exported and declared as benchmarks/image_onnx_models.py
exports Lite0 and Lite2 (`export_graph`, `lite_declaration`). Their PyTorch pipeline's features
of the photos train a features-mode run; `fctkit export --preprocessing --sample` checks the
graphs on the JPEG files; the server publishes v1 then v2. The device adds the photo folder at
v1 (sealed originals uploaded), syncs to v2 (adapted rows; its health check fetches a sample
of originals from the vault and embeds them with v2), and answers edited copies of the photos
as the reference does: torch's v2 features of the queries against the rows the reference
expects (the bundle's forward adapter on torch's v1 features, torch's v2 features for the
re-embedded sample)."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
from click.testing import CliRunner

from fctkit.cli import cli
from fctkit.edge_runtime import Device
from tests.edge.conftest import enrolment_code, publish
from tests.server.conftest import ServerProcess, admin_token_file  # noqa: F401 (a fixture)
from tests.support.benchmark_scripts import benchmark_script
from tests.support.raw_items import device_ok, features_run, onnx_forward, unit
from tests.support.tiny_lite import encoded, textured_picture, tiny_lite

pytest.importorskip("efficientnet_lite_pytorch")

PHOTOS, QUERIES, HEALTH_SAMPLE = 40, 6, 10
MODELS = {"old": (32, 0.05, 1), "new": (40, 0.075, 2)}  # input px, width (64-d, 96-d features), seed


@pytest.fixture(scope="module")
def bench():
    with benchmark_script("image_onnx_models.py") as module:
        yield module


@pytest.fixture(scope="module")
def release(bench, tmp_path_factory) -> SimpleNamespace:
    """The photos (JPEG files of odd sizes), both models and their features, the signed v1 and v2."""
    from fctkit.export.keys import generate_keys

    root = tmp_path_factory.mktemp("lite-photos")
    rng = np.random.default_rng(37)
    pictures = [textured_picture(rng, *rng.integers(48, 96, size=2)) for _ in range(PHOTOS)]
    (root / "photos").mkdir()
    for i, picture in enumerate(pictures):
        (root / "photos" / f"photo{i:03d}.jpg").write_bytes(encoded(picture, "JPEG", quality=int(rng.integers(70, 95))))
    files = [(root / "photos" / f"photo{i:03d}.jpg").read_bytes() for i in range(PHOTOS)]
    modules, features = {}, {}
    for name, (size, width, seed) in MODELS.items():
        modules[name] = bench.pooled_features_class()(tiny_lite(size, width, seed))
        bench.export_graph(modules[name], size, root / f"{name}.onnx")
        features[name] = bench.torch_reference(modules[name], bench.lite_declaration(size), files)
    run = features_run(root / "train", features["old"], features["new"], np.arange(PHOTOS) % 5)
    (root / "sample.jsonl").write_text(
        "".join(
            json.dumps(
                {
                    "image": f"photos/photo{i:03d}.jpg",
                    "old": features["old"][i].tolist(),
                    "new": features["new"][i].tolist(),
                }
            )
            + "\n"
            for i in range(0, PHOTOS, 2)
        )
    )
    (root / "preprocessing.json").write_text(
        json.dumps({n: bench.lite_declaration(size) for n, (size, _, _) in MODELS.items()})
    )
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
            "test: random tiny Lites",
            "--no-progress",
        ],
    )
    assert done.exit_code == 0, done.output
    return SimpleNamespace(root=root, pictures=pictures, files=files, modules=modules, features=features, public=public)


@pytest.fixture
def server(release, tmp_path, admin_token_file):  # noqa: F811 (a pytest fixture, imported from tests/server/conftest.py)
    process = ServerProcess(tmp_path / "server", release.public, admin_token_file).start()
    yield process
    if process.alive():
        process.stop()


def test_jpeg_files_in_the_upgrade_and_jpeg_queries_out_on_a_device_and_a_server(bench, release, server, tmp_path):
    out, device = release.root / "out", str(tmp_path / "device")
    manifest = json.loads((out / "v2" / "manifest.json").read_text())
    assert manifest["preprocessing"]["embed"] == bench.lite_declaration(40)
    assert "raw items" in manifest["parity"]["embed"]["against"]
    publish(server, out / "v1", tmp_path)
    device_ok("init", "--dir", device, "--publisher-key", str(release.public))
    settings = Path(device) / "device.json"
    settings.write_text(json.dumps({**json.loads(settings.read_text()), "health_sample": HEALTH_SAMPLE}))
    device_ok("enrol", "--dir", device, "--server", server.target, "--code", enrolment_code(server), "--name", "photos")
    assert json.loads(device_ok("sync", "--dir", device, "--quiet"))["installed_after"] == 1
    added = json.loads(device_ok("add", "--dir", device, str(release.root / "photos"), "--quiet"))
    assert (added["added"], added["rows"], added["skipped"]) == (PHOTOS, PHOTOS, [])

    publish(server, out / "v2", tmp_path)
    synced = json.loads(device_ok("sync", "--dir", device, "--quiet"))
    assert (synced["installed_after"], synced["hops"], synced["rows_upgraded"], synced["still_queued"]) == (
        2,
        "v1 -> v2",
        PHOTOS,
        0,
    )
    assert synced["upgrade_health"]["sample_size"] == HEALTH_SAMPLE, synced["upgrade_health"]
    stored_on_server = b"".join(p.read_bytes() for p in server.data_dir.rglob("*") if p.is_file())
    assert not any(f[-80:-16] in stored_on_server for f in release.files)  # the vault holds sealed originals only

    rng = np.random.default_rng(5)
    with benchmark_script("photo_data.py") as photo_data:  # crop, rotation, rescale, colour, JPEG quality 30-75
        queries = [photo_data.edited_copy(release.pictures[i], rng) for i in range(QUERIES)]
    for i, query in enumerate(queries):
        (tmp_path / f"query{i}.jpg").write_bytes(query)
    answers = [
        json.loads(line)
        for line in device_ok(
            "query", "--dir", device, *(str(tmp_path / f"query{i}.jpg") for i in range(QUERIES)), "-k", "3"
        ).splitlines()
    ]

    adapted = onnx_forward(out / "v2", release.features["old"])
    asked = bench.torch_reference(release.modules["new"], bench.lite_declaration(40), queries)
    with Device.open(device) as opened:
        stored = opened.gallery.load()
        np.testing.assert_allclose(opened.query_vectors(queries), asked, atol=1e-4)
    order = [int(item[5:8]) for item in stored.item_ids]
    spaces = [str(tag) for tag in stored.tags]
    assert sorted(order) == list(range(PHOTOS)) and sorted(set(spaces)) == ["v1->v2 (forward)", "v2"]
    assert spaces.count("v2") == HEALTH_SAMPLE
    wanted_rows = np.stack(
        [release.features["new"][i] if s == "v2" else adapted[i] for i, s in zip(order, spaces, strict=True)]
    )
    np.testing.assert_allclose(np.stack(stored.embeddings), wanted_rows, atol=1e-4)
    similarity = unit(asked) @ unit(wanted_rows).T
    assert [a["id"] for a in answers] == [f"query{i}.jpg" for i in range(QUERIES)]
    for q, answer in enumerate(answers):
        top = [order.index(int(m["item_id"][5:8])) for m in answer["matches"]]
        np.testing.assert_allclose(similarity[q, top], np.sort(similarity[q])[::-1][:3], atol=1e-4)
        np.testing.assert_allclose([m["distance"] for m in answer["matches"]], 1 - similarity[q, top], atol=1e-4)

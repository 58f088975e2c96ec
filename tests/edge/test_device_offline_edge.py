"""Device flows without a server: install a bundle, add, query, upgrade (hop and direct),
zero-downtime queries in forward mode, resumption, and the engine's provider choice."""

from __future__ import annotations

import numpy as np
import pytest

from fctkit.edge_runtime import Engine, EngineConfig, select_providers
from fctkit.edge_runtime.upgrade import run_upgrade
from fctkit.edge_runtime.upgrade_plan import Hop, UpgradePlan
from fctkit.errors import ConfigError, DeviceError, InputError
from fctkit.protos.bundle import verify_bundle


def _reference_upgrade(bundle_dir, publisher_pub, embeddings, side_infos, source):
    """h and g of one hop run straight through onnxruntime, outside the device code."""
    import onnxruntime as ort

    bundle = verify_bundle(bundle_dir, publisher_pub)
    outputs = []
    for role in ("forward", "side_forward"):
        artifact = bundle.manifest.artifact(role, source_version=source)
        session = ort.InferenceSession(str(bundle.artifact_path(artifact)), providers=["CPUExecutionProvider"])
        feed = dict(zip([i.name for i in artifact.inputs], [embeddings, side_infos]))
        outputs.append(session.run(None, feed)[0])
    return outputs


def test_add_query_and_upgrade_match_the_graphs(make_device, tiny_bundles, images, publisher_pub):
    device = make_device(batch_size=7)
    assert device.install_bundle(tiny_bundles[1]) == 1
    device.gallery.set_meta({"query_version": "1"})
    pictures = images(40, seed=1)
    ids = device.add(pictures, labels=[str(i % 4) for i in range(40)])
    assert device.status()["queued_uploads"] == 40  # not enrolled: kept for later
    top = device.query(pictures[:5], k=1)
    assert [m[0].item_id for m in top] == ids[:5]  # each image finds itself
    before = device.gallery.load()
    assert device.upgrade(tiny_bundles[2]) == 40
    after = device.gallery.load()
    assert device.version == 2 and {str(t) for t in after.tags} == {"v1->v2 (forward)"}
    expected_h, expected_g = _reference_upgrade(tiny_bundles[2], publisher_pub, before.embeddings, before.side_infos, 1)
    np.testing.assert_allclose(after.embeddings, expected_h, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(after.side_infos, expected_g, rtol=1e-5, atol=1e-5)
    assert after.labels == before.labels
    # rows embedded by a process that still ran v1 when the switch committed are refused
    from fctkit.edge_runtime import NewRow, VersionTag
    from fctkit.errors import GalleryError

    stale = [NewRow("stale", before.embeddings[0], before.side_infos[0])]
    with pytest.raises(GalleryError, match="switched to v2"):
        device.gallery.add_rows(stale, VersionTag(1, 1, "native"), query_version=1)
    # new items are embedded natively at v2 and sit next to adapted ones
    device.add(images(3, seed=9), item_ids=["n1", "n2", "n3"])
    assert device.status()["rows_by_space"] == {"v1->v2 (forward)": 40, "v2": 3}
    assert device.query(images(3, seed=9), k=1)[2][0].item_id == "n3"


def test_direct_adapter_and_hop_by_hop_both_land_in_v3(make_device, tiny_bundles, images):
    direct, hops = make_device("direct"), make_device("hops")
    for device in (direct, hops):
        device.upgrade(tiny_bundles[1])
        device.add(images(10, seed=2), item_ids=[f"i{k}" for k in range(10)])
    direct.upgrade(tiny_bundles[3])  # v3 carries forward_1_to_3
    assert set(direct.status()["rows_by_space"]) == {"v1->v3 (forward)"}
    hops.upgrade(tiny_bundles[2])
    hops.upgrade(tiny_bundles[3])
    assert set(hops.status()["rows_by_space"]) == {"v1->v3 (forward)"}
    # the two paths use different adapters: the vectors differ
    assert not np.allclose(direct.gallery.load().embeddings, hops.gallery.load().embeddings)


def test_forward_mode_queries_stay_complete_until_the_switch(make_device, tiny_bundles, images):
    device = make_device(batch_size=4)
    device.upgrade(tiny_bundles[1])
    pictures = images(12, seed=3)
    ids = device.add(pictures)
    device.install_bundle(tiny_bundles[2])
    engines = {2: device.engine(2)}
    plan = UpgradePlan(2, "forward", (Hop(1, 2, 2, "forward_1_to_2", "side_forward_1_to_2"),))
    device.gallery.set_meta({"upgrade": plan.to_json()})
    batches = []

    def stop_after_one(done):
        batches.append(device.gallery.remaining(2))
        # mid-upgrade: the old model still answers, over every row
        assert [m[0].item_id for m in device.query(pictures, k=1)] == ids
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        run_upgrade(device.gallery, plan, engines, batch_size=4, on_batch=stop_after_one)
    assert batches == [8] and device.version == 1
    assert device.status()["upgrade"]["rows_left"] == 8
    assert device.upgrade() == 8  # resumes the stored plan
    assert device.version == 2 and device.status()["rows_by_space"] == {"v1->v2 (forward)": 12}


def test_no_model_installed_and_missing_adapter_are_clear_errors(make_device, tiny_bundles, images):
    device = make_device()
    with pytest.raises(DeviceError, match="no model is installed"):
        device.add(images(2))
    device.upgrade(tiny_bundles[1])
    with pytest.raises(InputError, match="expects items of shape"):
        device.add(np.zeros((2, 5), np.float32))
    with pytest.raises(InputError, match="NaN"):
        device.add(np.full((2, 16), np.nan, np.float32))
    device.add(images(2), item_ids=["a", "b"])
    with pytest.raises(InputError, match="already in the gallery"):
        device.add(images(1), item_ids=["a"])
    assert len(device.gallery) == 2


def test_engine_reports_its_provider_and_batches(tiny_bundles, publisher_pub, images):
    bundle = verify_bundle(tiny_bundles[1], publisher_pub)
    small = Engine(bundle, EngineConfig(providers=("cpu",), batch_size=3, threads=1))
    large = Engine(bundle, EngineConfig(batch_size=1000))
    pictures = images(10)
    np.testing.assert_allclose(small.embed(pictures), large.embed(pictures), rtol=1e-5, atol=1e-6)
    assert small.provider == "CPUExecutionProvider"
    assert select_providers(("tensorrt", "cuda", "cpu"), ["CUDAExecutionProvider", "CPUExecutionProvider"]) == [
        "CUDAExecutionProvider",
        "CPUExecutionProvider",
    ]
    assert select_providers(("cuda",), ["TensorrtExecutionProvider", "CPUExecutionProvider"]) == [
        "CPUExecutionProvider"
    ]
    with pytest.raises(ConfigError):
        EngineConfig(providers=("tpu",))


def test_engine_runs_on_cuda_when_onnxruntime_gpu_is_installed(tiny_bundles, publisher_pub, images):
    import onnxruntime as ort

    if "CUDAExecutionProvider" not in ort.get_available_providers():
        pytest.skip("onnxruntime-gpu with CUDA is not installed here (the CPU package only)")
    engine = Engine(verify_bundle(tiny_bundles[1], publisher_pub), EngineConfig(providers=("cuda", "cpu")))
    cpu = Engine(verify_bundle(tiny_bundles[1], publisher_pub), EngineConfig(providers=("cpu",)))
    pictures = images(64)
    np.testing.assert_allclose(engine.embed(pictures), cpu.embed(pictures), rtol=1e-3, atol=1e-3)
    assert engine.provider == "CUDAExecutionProvider", "onnxruntime fell back to CPU silently"


def test_unified_mode_switches_queries_first(tmp_path, make_device, publisher_key, images):
    from fctkit.export.bundle_builder import ArtifactSource, build_bundle
    from tests.edge.conftest import make_tiny_bundle
    from tests.server.conftest import EMBED_DIM, linear_onnx

    v1 = make_tiny_bundle(tmp_path / "u1", publisher_key, 1, ())
    src = tmp_path / "u2-src"
    src.mkdir()
    sources = [
        ArtifactSource(linear_onnx(src / "embed.onnx", {"image": 16}, 12, seed=5, output="embedding"), "embed"),
        ArtifactSource(
            linear_onnx(src / "b.onnx", {"new": 12}, EMBED_DIM, seed=6, output="embedding"), "backward", 2, 1
        ),
    ]
    v2 = build_bundle(
        tmp_path / "u2",
        version=2,
        parents=(1,),
        mode="unified",
        distance="cosine",
        normalize=True,
        artifacts=sources,
        gate={"cases": {}, "ecc": {"backward_2_to_1": True}},
        private_key=publisher_key,
    ).root
    device = make_device()
    device.upgrade(v1)
    old_ids = device.add(images(5, seed=4))
    assert device.upgrade(v2) == 0  # no F: rows stay, queries become B(φ_2)
    assert device.version == 2 and device.query_vectors(images(1)).shape == (1, EMBED_DIM)
    new_ids = device.add(images(3, seed=5))
    assert device.status()["rows_by_space"] == {"v1": 5, "v2 (backward)": 3}
    found = {m.item_id for m in device.query(images(1, seed=5), k=8)[0]}
    assert found == set(old_ids) | set(new_ids)  # every row answers, old and new

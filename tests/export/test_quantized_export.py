"""`fctkit export --quantize int8|fp16`: the forward adapter in a lower precision, the release
judged again on the run's evaluation data with the quantised graph, and what it cost recorded
in the signed manifest. The run is the tiny digits run of :mod:`tests.support.releases`; the
figures are recomputed here from the bundle's own graph, and a device upgrades with it."""

from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
from click.testing import CliRunner

from fctkit.cli import cli
from fctkit.edge_runtime import Device
from fctkit.errors import BundleFormatError, GateError, InputError
from fctkit.export.onnx_export import run_onnx
from fctkit.export.quantize import judged_gate, quantized_metrics
from fctkit.export.release import build_release, export_release
from fctkit.export.trained_run import TrainedRun
from fctkit.protos.bundle import verify_bundle
from fctkit.trainer.evaluation import evaluate_retrieval

pytestmark = pytest.mark.slow  # shares the tiny digits run and exports real graphs


@pytest.fixture(scope="module")
def int8_release(release, private_key, tmp_path_factory):
    out = tmp_path_factory.mktemp("int8")
    return build_release(release.run_dir, out, private_key=private_key, method="fct", quantize="int8")


def leave_one_out_top1(query: np.ndarray, gallery: np.ndarray, labels: np.ndarray) -> float:
    return evaluate_retrieval(query, labels, gallery, labels, distance="l2", leave_one_out=True).top1


def test_the_int8_forward_adapter_is_judged_on_its_own_outputs(release, int8_release):
    run = TrainedRun.open(release.run_dir)
    v1, v2 = (r.bundle for r in int8_release)
    forward = v2.manifest.artifact("forward", source_version=1, target_version=2)
    assert forward.precision == "int8" and {a.precision for a in v2.manifest.artifacts if a is not forward} == {"fp32"}
    assert {a.precision for a in v1.manifest.artifacts} == {"fp32"}
    gate, record = v2.manifest.gate, v2.manifest.gate["quantization"]
    assert record["artifacts"] == ["forward_1_to_2"] and (record["precision"], record["metric"]) == ("int8", "top1")
    assert record["fp32"] == pytest.approx(run.gate["cases"]["fct"]["top1"])
    assert gate["cases"]["new/h(old) [fp32]"] == pytest.approx(run.gate["cases"]["fct"])
    # the recorded figure is the bundle's own int8 graph searched as the trainer searches
    features = run.eval_features
    adapted = run_onnx(v2.artifact_path("forward_1_to_2"), [features["old"], features["side"]])[0]
    top1 = leave_one_out_top1(features["new"], adapted, features["labels"])
    assert record["quantized"] == pytest.approx(top1) and gate["cases"]["new/h(old)"]["top1"] == pytest.approx(top1)
    assert gate["ecc"] == {"forward_1_to_2": top1 > run.gate["cases"]["old/old"]["top1"]}
    assert abs(record["quantized"] - record["fp32"]) < 0.05  # int8 costs little here (the gate would say otherwise)


def test_a_device_upgrades_through_the_int8_graph(release, int8_release, tmp_path):
    run = TrainedRun.open(release.run_dir)
    v1, v2 = (r.bundle for r in int8_release)
    images, labels = run.eval_images[:60], run.eval_features["labels"][:60]
    device = Device.init(tmp_path / "device", publisher_key=release.public_key_path)
    device.progress = False
    device.upgrade(v1.root)
    device.add(images, item_ids=[f"i{k}" for k in range(60)], labels=[str(x) for x in labels], upload=False)
    old = device.gallery.load()
    assert device.upgrade(v2.root) == 60
    rows = device.gallery.load()
    expected = run_onnx(v2.artifact_path("forward_1_to_2"), [np.stack(old.embeddings), np.stack(old.side_infos)])[0]
    np.testing.assert_allclose(np.stack(rows.embeddings), expected, atol=1e-5)
    device.close()


def test_the_gate_reproduces_the_runs_figures_with_the_fp32_graph(release, private_key, tmp_path):
    """The rebuilt search is the trainer's: served by the fp32 graph it gives the run's own figures."""
    run = TrainedRun.open(release.run_dir)
    _, v2 = export_release(release.run_dir, tmp_path, private_key=private_key, method="fct")
    metrics, holds = quantized_metrics(run, "fct", v2.artifact_path("forward_1_to_2"))
    assert metrics == pytest.approx(run.gate["cases"]["fct"], abs=2e-3) and holds is run.gate["ecc"]["fct"]


def test_a_quantised_graph_that_breaks_retrieval_is_refused_unless_forced(release, int8_release, tmp_path):
    import onnx
    from onnx import numpy_helper

    run = TrainedRun.open(release.run_dir)
    (forward,) = [e for p, e in int8_release[1].exports if p.role == "forward"]
    model = onnx.load(str(int8_release[1].bundle.artifact_path("forward_1_to_2")))
    for tensor in model.graph.initializer:  # every int8 weight zeroed: h(old) is its biases alone
        if tensor.data_type == onnx.TensorProto.INT8:
            tensor.CopyFrom(numpy_helper.from_array(np.zeros_like(numpy_helper.to_array(tensor)), tensor.name))
    broken = tmp_path / "broken-int8.onnx"
    onnx.save(model, str(broken))
    bad = dataclasses.replace(forward, export=dataclasses.replace(forward.export, path=broken))
    gate = {
        "cases": {
            c: run.gate["cases"][k] for c, k in (("old/old", "old/old"), ("new/new", "new/new"), ("new/h(old)", "fct"))
        },
        "ecc": {"forward_1_to_2": True},
    }
    with pytest.raises(GateError, match="with the int8 forward adapter ECC does not hold on top1"):
        judged_gate(run, "fct", gate, bad, force=False)
    forced = judged_gate(run, "fct", gate, bad, force=True)
    assert (
        forced["ecc"] == {"forward_1_to_2": False}
        and forced["quantization"]["quantized"] < gate["cases"]["old/old"]["top1"]
    )


def test_fp16_and_bad_combinations(release, private_key, tmp_path):
    _v1, v2 = export_release(
        release.run_dir, tmp_path / "fp16", private_key=private_key, method="fastfill", quantize="fp16"
    )
    assert v2.manifest.artifact("forward", source_version=1, target_version=2).precision == "fp16"
    assert v2.manifest.artifact("uncertainty", source_version=1, target_version=2).precision == "fp32"
    assert v2.manifest.gate["quantization"]["precision"] == "fp16"
    for options, message in (
        ({"quantize": "int4"}, "unknown quantisation 'int4'"),
        ({"quantize": "int8", "fp16": True}, "give --fp16 or --quantize, not both"),
        ({"quantize": "int8", "chain": True}, "chain releases are exported in fp32 only"),
    ):
        with pytest.raises(InputError, match=message):
            build_release(release.run_dir, tmp_path / "bad", private_key=private_key, **options)
        assert not (tmp_path / "bad").exists()


def test_the_cli_says_what_quantising_cost(release, tmp_path):
    done = CliRunner().invoke(
        cli,
        [
            "export",
            str(release.run_dir),
            "--key",
            str(release.private_key_path),
            "--out",
            str(tmp_path / "out"),
            "--method",
            "fct",
            "--quantize",
            "int8",
            "--no-progress",
        ],
    )
    assert done.exit_code == 0, done.output
    manifest = json.loads((tmp_path / "out" / "v2" / "manifest.json").read_text())
    record = manifest["gate"]["quantization"]
    assert f"int8 forward adapter: top1 {record['quantized']:.4f} (fp32 {record['fp32']:.4f}" in done.output


def test_a_manifest_whose_quantization_record_names_an_fp32_graph_is_refused(int8_release, tmp_path, private_key):
    from fctkit.export.bundle_builder import ArtifactSource, build_bundle

    v2 = int8_release[1].bundle
    sources = [
        ArtifactSource(v2.artifact_path(a.name), a.role, a.source_version, a.target_version)
        for a in v2.manifest.artifacts
    ]
    gate = {k: v2.manifest.gate[k] for k in ("cases", "ecc")}
    record = dict(v2.manifest.gate["quantization"], artifacts=["embed"])
    with pytest.raises(BundleFormatError, match="must name this bundle's int8 artifacts"):
        build_bundle(
            tmp_path / "b",
            version=2,
            parents=(1,),
            mode="forward",
            distance="l2",
            normalize=False,
            artifacts=sources,
            gate={**gate, "quantization": record},
            private_key=private_key,
        )
    verify_bundle(v2.root, private_key.public_key())

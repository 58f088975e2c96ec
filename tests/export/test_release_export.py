"""`fctkit export`: a digits train run becomes signed, versioned bundles (forward and unified
modes, the v1→v2→v3 chain with its direct 1→3 adapter), gated by the run's ECC verdicts.

The run is the tiny digits chain run of :mod:`tests.support.releases` (shared, cached); the
figures recomputed from the bundles' ONNX graphs must reproduce the run's own figures."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from fctkit.cli import cli
from fctkit.errors import DataUnavailableError, GateError, InputError, PublisherKeyError
from fctkit.export.bundle_builder import check_graphs_load
from fctkit.export.onnx_export import run_onnx
from fctkit.export.release import export_release
from fctkit.export.release_plan import plan_release
from fctkit.export.trained_run import TrainedRun
from fctkit.protos.bundle import VerifiedBundle, unpack_bundle, verify_bundle
from fctkit.trainer.evaluation import evaluate_retrieval
from fctkit.upgrade_health import expected_health
from tests.support.releases import UNIFIED_METHOD, unified_override

pytestmark = pytest.mark.slow  # shares a tiny training run (tens of seconds) and exports real graphs


@pytest.fixture(scope="module")
def run(release) -> TrainedRun:
    return TrainedRun.open(release.run_dir)


def top1(query: np.ndarray, gallery: np.ndarray, labels: np.ndarray) -> float:
    """Leave-one-out top-1 as the trainer measures it (l2; the larger dim truncated)."""
    n = min(query.shape[1], gallery.shape[1])
    return evaluate_retrieval(query[:, :n], labels, gallery[:, :n], labels, distance="l2", leave_one_out=True).top1


def onnx(bundle: VerifiedBundle, name: str, *inputs: np.ndarray) -> np.ndarray:
    return run_onnx(bundle.artifact_path(name), [np.asarray(a, np.float32) for a in inputs])[0]


def hops(bundle: VerifiedBundle) -> set[tuple[str, int | None, int | None]]:
    return {(a.role, a.source_version, a.target_version) for a in bundle.manifest.artifacts}


def test_forward_release_reproduces_the_runs_figures(release, run, private_key, tmp_path):
    v1, v2 = export_release(release.run_dir, tmp_path, private_key=private_key, method="fastfill")
    for bundle in (v1, v2):
        verify_bundle(bundle.root, release.public_key_path)
        check_graphs_load(bundle)
        assert (tmp_path / f"v{bundle.manifest.version}.tar").is_file()
    assert (v1.manifest.version, v1.manifest.parents, v2.manifest.version, v2.manifest.parents) == (1, (), 2, (1,))
    assert hops(v1) == {("embed", None, None), ("side_info", None, None)}
    assert hops(v2) == {("embed", None, None), ("side_info", None, None), ("forward", 1, 2), ("uncertainty", 1, 2)}
    assert {v1.manifest.mode, v2.manifest.mode} == {"forward"}
    assert (v2.manifest.distance, v2.manifest.normalize) == ("l2", False)
    features = run.eval_features
    assert (v1.manifest.embedding_dim, v2.manifest.embedding_dim) == (
        features["old"].shape[1],
        features["new"].shape[1],
    )
    assert v2.manifest.side_info_dim == features["side"].shape[1]
    # ψ is the same model in both versions: the same graph bytes.
    assert v1.manifest.artifact("side_info").sha256 == v2.manifest.artifact("side_info").sha256
    assert v1.manifest.artifact("embed").sha256 != v2.manifest.artifact("embed").sha256

    gate = run.gate
    assert v2.manifest.gate["ecc"] == {"forward_1_to_2": True} and gate["ecc"]["fastfill"] is True
    assert v2.manifest.gate["cases"]["new/h(old)"] == pytest.approx(gate["cases"]["fastfill"])
    assert v2.manifest.gate["forced"] is False

    # The graphs reproduce the run: φ_old from images, then new/h(old) top-1 through h.
    old = onnx(v1, "embed", run.eval_images)
    np.testing.assert_allclose(old, features["old"], atol=1e-4)
    adapted = onnx(v2, "forward_1_to_2", features["old"], features["side"])
    assert top1(features["new"], adapted, features["labels"]) == pytest.approx(
        gate["cases"]["fastfill"]["top1"], abs=1e-3
    )
    sigma = onnx(v2, "uncertainty_1_to_2", features["old"], features["side"])
    assert sigma.shape == (len(old),) and np.all(sigma > 0)

    # What devices should report after upgrading: measured on the evaluation split through the bundled graph.
    expectation = v2.manifest.health_expectation
    assert v1.manifest.health_expectation is None  # v1 adapts nothing
    assert (expectation.level, expectation.sample_size, expectation.gallery_rows[-1]) == ("class", 32, len(adapted))
    sizes, measures = expected_health(adapted, features["new"], "l2", sample_size=32, draws=expectation.draws)
    assert sizes == expectation.gallery_rows
    assert expectation.measures["mean_cosine"][0] == pytest.approx(measures["mean_cosine"][0], abs=1e-4)
    gate_cases = v2.manifest.gate["cases"]
    # at the split's own size the break-even is the gate's old/old over its new/h(old); smaller cuts have their own
    assert len(expectation.break_even) == len(sizes)
    assert expectation.break_even[-1] == pytest.approx(gate_cases["old/old"]["top1"] / gate_cases["new/h(old)"]["top1"])


def test_unified_fp16_release_carries_forward_and_backward(release, run, private_key, tmp_path):
    override = unified_override(release.run_dir)
    v1, v2 = export_release(
        release.run_dir,
        tmp_path,
        private_key=private_key,
        method=UNIFIED_METHOD,
        first_version=4,
        fp16=True,
        **override,
    )
    assert {a.precision for b in (v1, v2) for a in b.manifest.artifacts} == {"fp16"}
    assert (v1.manifest.version, v2.manifest.version, v2.manifest.parents) == (4, 5, (4,))
    assert {v1.manifest.mode, v2.manifest.mode} == {"unified"}
    assert hops(v2) == {("embed", None, None), ("side_info", None, None), ("forward", 4, 5), ("backward", 5, 4)}
    passed = run.gate["ecc"][UNIFIED_METHOD]
    assert v2.manifest.gate["ecc"] == {"forward_4_to_5": passed, "backward_5_to_4": passed}
    assert v2.manifest.gate["forced"] is bool(override)
    check_graphs_load(v2)
    assert v2.manifest.health_expectation is None  # the adapted rows live in the shared space, not the new model's

    features = run.eval_features
    unified_new = onnx(v2, "backward_5_to_4", features["new"])
    unified_old = onnx(v2, "forward_4_to_5", features["old"])
    expected = run.gate["cases"][UNIFIED_METHOD]["top1"]
    assert v2.manifest.gate["cases"]["B(new)/F(old)"]["top1"] == pytest.approx(expected)
    assert top1(unified_new, unified_old, features["labels"]) == pytest.approx(expected, abs=5e-3)  # fp16: 0.5 point


def test_chain_release_has_every_hop_and_the_direct_adapter(release, tmp_path):
    bundles = {v: verify_bundle(release.bundle_dirs[v], release.public_key_path) for v in (1, 2, 3)}
    for v, bundle in bundles.items():
        unpacked = verify_bundle(unpack_bundle(release.bundle_archives[v], tmp_path / f"v{v}"), release.public_key_path)
        assert unpacked.manifest_bytes == bundle.manifest_bytes
    v1, v2, v3 = bundles[1], bundles[2], bundles[3]
    assert hops(v1) == {("embed", None, None), ("side_info", None, None)}
    assert hops(v2) == {("embed", None, None), ("side_info", None, None), ("forward", 1, 2), ("side_forward", 1, 2)}
    assert hops(v3) == {("embed", None, None), ("side_info", None, None), ("forward", 2, 3), ("forward", 1, 3)}
    assert [b.manifest.parents for b in (v1, v2, v3)] == [(), (1,), (1, 2)]
    assert len({b.manifest.artifact("side_info").sha256 for b in (v1, v2, v3)}) == 3  # each version its own ψ_v
    assert v3.manifest.gate["ecc"] == {"forward_2_to_3": True, "forward_1_to_3": True}
    assert all(b.manifest.health_expectation is None for b in (v1, v2, v3))  # a chain's hops: not measured

    f, gate = release.eval_features, release.chain_gate
    for v, bundle in bundles.items():
        np.testing.assert_allclose(onnx(bundle, "embed", f["images"]), f[f"v{v}_embedding"], atol=1e-4)
        np.testing.assert_allclose(onnx(bundle, "side_info", f["images"]), f[f"v{v}_side"], atol=1e-4)
    direct = onnx(v3, "forward_1_to_3", f["v1_embedding"], f["v1_side"])
    hop_embedding = onnx(v2, "forward_1_to_2", f["v1_embedding"], f["v1_side"])
    hop_side = onnx(v2, "side_forward_1_to_2", f["v1_embedding"], f["v1_side"])
    hop_by_hop = onnx(v3, "forward_2_to_3", hop_embedding, hop_side)
    assert top1(f["v3_embedding"], direct, f["labels"]) == pytest.approx(gate["direct"]["top1"], abs=1e-3)
    assert top1(f["v3_embedding"], hop_by_hop, f["labels"]) == pytest.approx(gate["hop_by_hop"]["top1"], abs=1e-3)
    assert gate["direct"]["top1"] > gate["v1/v1"]["top1"] and gate["hop_by_hop"]["top1"] > gate["v1/v1"]["top1"]


def _run_with_failing_fct_gate(release, folder: Path) -> Path:
    """A copy of the run whose gate records FCT's ECC as failing (the real models, a real refusal)."""
    copy = folder / "run"
    shutil.copytree(release.run_dir, copy)
    gate = json.loads((copy / "gate.json").read_text())
    gate["ecc"]["fct"] = False
    (copy / "gate.json").write_text(json.dumps(gate))
    return copy


def test_cli_refuses_a_failing_gate_and_records_a_forced_release(release, tmp_path):
    run_dir = _run_with_failing_fct_gate(release, tmp_path)
    out = tmp_path / "release"
    passphrase = tmp_path / "passphrase"
    passphrase.write_text("correct horse battery staple\n")
    made = CliRunner().invoke(
        cli, ["keys", "generate", "--out", str(tmp_path / "keys"), "--passphrase-file", str(passphrase)]
    )
    assert made.exit_code == 0, made.output
    key, public_key = tmp_path / "keys" / "publisher.key", tmp_path / "keys" / "publisher.pub"
    base = ["export", str(run_dir), "--key", str(key), "--out", str(out), "--no-progress"]
    no_passphrase = CliRunner().invoke(cli, base)
    assert isinstance(no_passphrase.exception, PublisherKeyError) and "passphrase" in str(no_passphrase.exception)
    base += ["--passphrase-file", str(passphrase)]
    refused = CliRunner().invoke(cli, base)
    assert isinstance(refused.exception, GateError) and "forward_1_to_2" in str(refused.exception)
    assert not out.exists()  # refused before anything was exported
    no_reason = CliRunner().invoke(cli, [*base, "--force"])
    assert isinstance(no_reason.exception, GateError) and "reason" in str(no_reason.exception)

    forced = CliRunner().invoke(cli, [*base, "--force", "--reason", "test: tiny run, override on the record"])
    assert forced.exit_code == 0, forced.output
    for line in (
        "bundle v1 (parents none, mode forward)",
        "bundle v2 (parents v1, mode forward)",
        "forward_1_to_2",
        "adapters/fct.pt",
        "(same graph as v1)",
        "ECC gate: forward_1_to_2 FAILS",
        "WARNING gate overridden (forced, recorded in the manifest): test: tiny run",
    ):
        assert line in forced.output, line
    verified = CliRunner().invoke(cli, ["bundle", "verify", str(out / "v2.tar"), "--public-key", str(public_key)])
    assert verified.exit_code == 0, verified.output
    assert "WARNING gate overridden" in verified.output
    v1, v2 = (verify_bundle(out / f"v{v}", public_key) for v in (1, 2))
    assert v2.manifest.gate["forced"] is True and v2.manifest.gate["ecc"] == {"forward_1_to_2": False}
    assert v2.manifest.gate["force_reason"] == "test: tiny run, override on the record"
    assert v1.manifest.gate["forced"] is False  # v1 has nothing to gate

    again = CliRunner().invoke(cli, base)
    assert isinstance(again.exception, InputError) and "already exists" in str(again.exception)


def test_bad_runs_and_options_are_refused_clearly(release, run, private_key, tmp_path):
    with pytest.raises(DataUnavailableError, match="fctkit train"):
        export_release(tmp_path / "nothing", tmp_path / "out", private_key=private_key)
    with pytest.raises(InputError, match="did not train 'procrustes'"):
        plan_release(run, method="procrustes")
    with pytest.raises(InputError, match="unknown method"):
        plan_release(run, method="ridge")
    with pytest.raises(InputError, match="chain releases use the chain's FCT adapters"):
        plan_release(run, method="fastfill", chain=True)
    with pytest.raises(InputError, match="first_version"):
        plan_release(run, first_version=0)
    with pytest.raises(GateError, match="reason"):
        export_release(release.run_dir, tmp_path / "out", private_key=private_key, force=True)
    no_chain = tmp_path / "no-chain"
    shutil.copytree(release.run_dir, no_chain)
    gate = json.loads((no_chain / "gate.json").read_text())
    # A method whose ECC failed in the run is refused for every artifact it gates.
    failing = json.loads(json.dumps(gate))
    failing["ecc"]["lambda-orth"] = False
    (no_chain / "gate.json").write_text(json.dumps(failing))
    with pytest.raises(GateError, match="v2 forward_1_to_2, v2 backward_2_to_1"):
        export_release(no_chain, tmp_path / "out", private_key=private_key, method="lambda-orth")
    del gate["chain"]
    (no_chain / "gate.json").write_text(json.dumps(gate))
    with pytest.raises(InputError, match=r"\[chain\] enabled = true"):
        plan_release(TrainedRun.open(no_chain), chain=True)
    del gate["cases"]["old/old"]
    (no_chain / "gate.json").write_text(json.dumps(gate))
    with pytest.raises(InputError, match="lacks the entry 'old/old'"):
        plan_release(TrainedRun.open(no_chain), method="fct")
    assert not (tmp_path / "out").exists()


def test_plan_numbers_versions_and_names_sources(run):
    v5, v6 = plan_release(run, method="fct", first_version=5)
    assert (v5.version, v5.parents, v6.version, v6.parents) == (5, (), 6, (5,))
    assert {r.name: r.source for r in v6.roles} == {
        "embed": "models/new_backbone.pt",
        "side_info": "models/side_info.pt",
        "forward_5_to_6": "adapters/fct.pt",
    }
    assert v5.gate == {"cases": {"old/old": run.gate["cases"]["old/old"]}, "ecc": {}}
    chain = plan_release(run, chain=True, first_version=2)
    assert [p.version for p in chain] == [2, 3, 4]
    assert {r.name: r.source for r in chain[2].roles} == {
        "embed": "models/chain_v3_backbone.pt",
        "side_info": "models/chain_v3_side_info.pt",
        "forward_3_to_4": "adapters/chain_h3.pt",
        "forward_2_to_4": "adapters/chain_h13.pt",
    }

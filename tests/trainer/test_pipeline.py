"""`fctkit train` on digits: the acceptance effects of the trainer issue, measured on real data."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from fctkit.cli import cli
from fctkit.errors import ConfigError
from fctkit.trainer.pipeline import run_pipeline
from fctkit.trainer.pipeline_config import load_pipeline_config
from tests.support.seeds import seed

REPO = Path(__file__).resolve().parents[2]
DIGITS = REPO / "configs" / "digits.toml"


@pytest.fixture(scope="module")
def digits_run(tmp_path_factory):
    config = load_pipeline_config(DIGITS, {"progress": False, "device": "cpu", "seed": seed()})
    out = tmp_path_factory.mktemp("digits-run")
    return run_pipeline(config, out, log=lambda _: None), out


def top1(run, case: str) -> float:
    return run.report.cases[case].result.top1


@pytest.mark.slow
def test_fct_is_compatible_and_close_to_the_new_model(digits_run):
    run, _ = digits_run
    adapted = top1(run, "new/h(old) [FCT, side-info ψ]")
    assert adapted > top1(run, "old/old")  # ECC
    assert adapted >= 0.93 * top1(run, "new/new")
    assert top1(run, "new/old") < top1(run, "old/old")  # without an adapter the spaces do not match
    assert run.gate["ecc"]["fct"] is True


@pytest.mark.slow
def test_side_info_helps(digits_run):
    run, _ = digits_run
    assert top1(run, "new/h(old) [FCT, side-info ψ]") > top1(run, "new/h(old) [FCT, no side-info]")


@pytest.mark.slow
def test_lambda_orth_is_backward_compatible(digits_run):
    run, _ = digits_run
    old_old = top1(run, "old/old")
    assert top1(run, "B(new)/old [λ-orth, B⊥]") >= old_old
    assert top1(run, "F(old)/old [λ-orth, B⊥]") >= old_old
    assert top1(run, "B(new)/F(old) [λ-orth, B⊥]") > old_old
    assert run.report.facts["‖WWᵀ−I‖_F [λ-orth, B⊥]"] < 1e-4


@pytest.mark.slow
def test_class_mean_backfill_beats_random(digits_run):
    run, _ = digits_run
    areas = run.gate["backfill_area"]
    assert areas["class-mean-l2"] >= areas["random"]
    assert set(areas) >= {"random", "uncertainty", "class-mean-l2", "class-mean-cosine", "kmeans"}


@pytest.mark.slow
def test_chain_hop_by_hop_and_direct_are_compatible(digits_run):
    run, _ = digits_run
    chain = run.gate["chain"]
    assert chain["hop_by_hop"]["top1"] > chain["v1/v1"]["top1"]
    assert chain["direct"]["top1"] > chain["v1/v1"]["top1"]


@pytest.mark.slow
def test_outputs_are_written_and_reloadable(digits_run):
    from fctkit.trainer import load_adapter

    run, out = digits_run
    for name in ("report.md", "report.json", "report.png", "gate.json", "config.json", "features/eval.npz"):
        assert (out / name).is_file(), name
    gate = json.loads((out / "gate.json").read_text())
    assert set(gate["ecc"]) == set(run.adapters)
    markdown = (out / "report.md").read_text()
    for case in (
        "old/old",
        "new/old",
        "new/new",
        "h(old)/h(old)",
        "new/h(old)",
        "B(new)/old",
        "B(new)/F(old)",
        "F(old)/old",
    ):
        assert case in markdown
    reloaded = load_adapter(out / "adapters" / "fct.pt")
    features = np.load(out / "features" / "eval.npz")
    np.testing.assert_allclose(
        reloaded.transform(features["old"], features["side"]),
        run.adapters["fct"].transform(features["old"], features["side"]),
        rtol=0,
        atol=1e-6,
    )


def _write_features(tmp_path: Path) -> tuple[Path, Path]:
    rng = np.random.default_rng(0)
    labels = np.repeat(np.arange(6), 60)
    centres = rng.normal(size=(6, 24)).astype(np.float32) * 3
    new = centres[labels] + rng.normal(size=(len(labels), 24)).astype(np.float32)
    old = np.tanh(new[:, :16] @ rng.normal(size=(16, 12)).astype(np.float32) * 0.3) + 0.05 * rng.normal(
        size=(len(labels), 12)
    )
    np.savez(tmp_path / "old.npz", embeddings=old.astype(np.float32), labels=labels)
    np.savez(tmp_path / "new.npz", embeddings=new, labels=labels)
    return tmp_path / "old.npz", tmp_path / "new.npz"


def test_bring_your_own_features_through_the_cli(tmp_path):
    old, new = _write_features(tmp_path)
    config = tmp_path / "features.toml"
    config.write_text(
        f'methods = ["least-squares", "fct-no-side-info", "lambda-orth"]\nprogress = false\ndevice = "cpu"\n'
        f'[data]\nname = "features"\nold_features = "{old}"\nnew_features = "{new}"\n'
        "[fct]\nbranch_width = 16\nmixer_width = 32\ntrain = { epochs = 5 }\n"
        "[lambda_orth]\ntrain = { epochs = 5 }\n"
    )
    result = CliRunner().invoke(
        cli, ["train", "--config", str(config), "--out", str(tmp_path / "out"), "--set", "backfill.steps=4"]
    )
    assert result.exit_code == 0, result.output
    assert "new/h(old) [least squares]" in result.output
    assert (tmp_path / "out" / "adapters" / "least-squares.pt").is_file()
    gate = json.loads((tmp_path / "out" / "gate.json").read_text())
    assert gate["ecc"]["least-squares"] is True


def test_unknown_config_keys_are_errors(tmp_path):
    config = tmp_path / "typo.toml"
    config.write_text("[fct]\nbranch_widht = 3\n")
    with pytest.raises(ConfigError, match="branch_widht"):
        load_pipeline_config(config)
    with pytest.raises(ConfigError, match="unknown"):
        load_pipeline_config(None, {"methods": ["fct", "magic"]})
    with pytest.raises(ConfigError, match="chain needs image data"):
        load_pipeline_config(
            None,
            {
                "data.name": "features",
                "data.old_features": "a.npz",
                "data.new_features": "b.npz",
                "chain.enabled": True,
            },
        )

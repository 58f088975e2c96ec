"""`fctkit train` on a retrieval task: the task's own queries and relevance, settings chosen on
held-out training data, ECC judged on the task's primary metric."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import numpy as np
import pytest
from click.testing import CliRunner

from fctkit.cli import cli
from fctkit.errors import ConfigError, InputError
from fctkit.trainer import save_task, synthetic_instance_task
from fctkit.trainer.pipeline import run_pipeline
from fctkit.trainer.pipeline_config import load_pipeline_config
from tests.support.seeds import seed
from tests.support.task_runs import synthetic_task_run

REPO = Path(__file__).resolve().parents[2]
SMALL_SEARCH = {
    "selection.temperatures": [0.05, 0.1],
    "selection.learning_rates": [1e-3, 3e-3],
    "selection.widths": [256],
    "selection.weight_decays": [1e-4],
}


@pytest.fixture(scope="module")
def task_run(tmp_path_factory):
    return synthetic_task_run(tmp_path_factory.mktemp("task-run"), n_train=2000, n_eval=800, **SMALL_SEARCH)


def test_the_mse_baseline_fails_ecc_on_recall_at_1_and_the_contrastive_adapter_holds_it(task_run):
    gate = task_run.gate
    assert gate["metric"] == "recall@1"
    assert (gate["ecc"]["residual"], gate["ecc"]["least-squares"]) == (True, False)
    cases = gate["cases"]
    assert cases["residual"]["recall@1"] > cases["old/old"]["recall@1"] > cases["least-squares"]["recall@1"]
    assert cases["residual"]["recall@10"] > cases["old/old"]["recall@10"]
    assert {"recall@5", "mrr", "ndcg@10", "mAP"} <= set(cases["old/old"])


def test_transition_scoring_is_judged_with_a_weight_chosen_on_training_data(task_run):
    gate = task_run.gate
    weights = gate["transition_weight"]
    scored = {"residual", "least-squares", "residual+query-positives"}
    assert set(weights) == {f"{v}+transition" for v in scored} | {f"{v}+hubness+transition" for v in scored}
    assert weights["least-squares+transition"] > 0  # the old space rescues the failing baseline
    # Fusing with the old space never loses to the adapter alone by much, and lifts the baseline over old/old.
    cases = gate["cases"]
    assert cases["residual+transition"]["recall@1"] > cases["residual"]["recall@1"] - 0.02
    assert gate["ecc"]["least-squares+transition"] is True
    assert "transition weight [least squares]" in task_run.report.facts


def test_hubness_offsets_are_chosen_on_training_data_and_keep_a_backfilling_gallery_searchable(task_run):
    gate, cases = task_run.gate, task_run.gate["cases"]
    scored = {"residual", "least-squares", "residual+query-positives"}
    assert set(gate["hubness_beta"]) == {f"{v}+hubness" for v in scored} | {f"{v}+hubness+transition" for v in scored}
    assert cases["residual+hubness"]["recall@1"] > cases["residual"]["recall@1"] - 0.02
    curves = task_run.report.backfill_curves
    plain, offset = curves["random"], curves["random + hubness offset"]
    assert offset.area > plain.area + 0.1  # measured 0.75 vs 0.51: backfilled rows no longer crowd out adapted ones
    assert "hubness β [residual adapter]" in task_run.report.facts


def test_transition_over_the_hubness_offset_ranks_by_the_fused_score(task_run):
    """w·cos_old + (1 − w)·(cos_adapted − β·r), recomputed here from the run's adapter, gives the
    R@1 the gate recorded for the combined variant."""
    from fctkit.trainer.hubness import hubness_offsets
    from fctkit.trainer.searches import forward_transform

    key = "residual+query-positives+hubness+transition"
    fused = task_run.adapters[key]
    hub, weight = fused.base, fused.weight
    assert (task_run.gate["transition_weight"][key], task_run.gate["hubness_beta"][key]) == (weight, hub.beta)
    queries, gallery = task_run.evaluation.queries, task_run.evaluation.gallery
    adapted = forward_transform(hub.base, gallery)

    def unit(x):
        return x / np.linalg.norm(x, axis=1, keepdims=True)

    offsets = hubness_offsets(adapted, hub.reference, hub.k)
    scores = weight * unit(queries.old) @ unit(gallery.old).T + (1 - weight) * (
        unit(queries.new) @ unit(adapted).T - hub.beta * offsets
    )
    positives = task_run.evaluation.relevance["positives"]
    top = scores.argmax(axis=1)
    hits = [top[q] in positives.indices[positives.indptr[q] : positives.indptr[q + 1]] for q in range(len(top))]
    assert np.mean(hits) == pytest.approx(task_run.gate["cases"][key]["recall@1"], abs=1 / 800)
    assert "transition weight [residual adapter + query positives + hubness offset]" in task_run.report.facts


def test_the_report_shows_instance_metrics_and_the_settings_chosen_on_training_data(task_run):
    markdown = task_run.files["markdown"].read_text()
    assert "| case | top-1 | top-5 | mAP@1.0 | R@1 | R@5 | R@10 | MRR | nDCG@10 |" in markdown
    assert "ECC (recall@1) [residual adapter] | PASS" in markdown
    assert "ECC (recall@1) [least squares] | FAIL" in markdown
    selected = task_run.report.facts["selected [residual adapter]"]
    assert "on held-out training data" in selected and "objective.temperature" in selected
    report = json.loads(task_run.files["json"].read_text())
    residual = next(c for c in report["cases"] if c["name"] == "new/h(old) [residual adapter]")
    assert residual["result"]["relevance"] == "explicit" and residual["result"]["mrr"] > 0


def test_selection_never_reads_the_evaluation_split(tmp_path, monkeypatch):
    # Poison the evaluation split's *gallery* vectors: if selection looked at them the
    # chosen settings would change; they must be identical to a run on a clean task.
    from fctkit.trainer import tuning

    task = synthetic_instance_task(n_train=600, n_eval=200, seed=seed())
    seen: list[int] = []
    original = tuning.coordinate_search

    def spy(config, knobs, score, **options):
        result = original(config, knobs, score, **options)
        seen.append(result.tried)
        return result

    monkeypatch.setattr(tuning, "coordinate_search", spy)
    chosen = []
    for poison in (False, True):
        evaluation = task.evaluation
        if poison:
            gallery = evaluation.gallery.__class__(
                evaluation.gallery.ids, -evaluation.gallery.old, -evaluation.gallery.new, evaluation.gallery.side
            )
            evaluation = evaluation.__class__(evaluation.query, gallery, evaluation.positives)
        path = save_task(
            tmp_path / f"task-{poison}.npz",
            task.__class__(task.name, task.level, task.primary_metric, task.train, evaluation),
        )
        config = load_pipeline_config(
            None,
            {
                "data.name": "task",
                "data.task": str(path),
                "progress": False,
                "device": "cpu",
                "methods": ["residual"],
                "residual.train.epochs": 5,
                "backfill.orderings": [],
                **SMALL_SEARCH,
            },
        )
        run = run_pipeline(config, tmp_path / f"run-{poison}", log=lambda _: None)
        chosen.append({key: (record["chosen"], record["score"]) for key, record in run.gate["selection"].items()})
    assert chosen[0] == chosen[1] and seen[: len(seen) // 2] == seen[len(seen) // 2 :] and seen[0] > 1


def test_the_example_config_names_a_task_and_defaults_to_the_instance_methods():
    config = load_pipeline_config(REPO / "configs" / "synthetic-instance.toml")
    assert config.data.name == "task" and config.methods == ()
    from fctkit.trainer.method_names import INSTANCE_METHODS
    from fctkit.trainer.methods import run_methods
    from fctkit.trainer.run_data import load_run_task

    task = load_run_task(load_pipeline_config(None, {"data.name": "task", "data.task": str(REPO / config.data.task)}))
    assert run_methods(config, task) == INSTANCE_METHODS


def test_an_instance_task_with_the_defaults_trains_only_what_the_readme_recommends(tmp_path):
    """No `methods`, no options: the residual adapter (alone, on query positives, with the hubness
    offset, transition scoring and both) and the least-squares baseline; never FCT's MLP or
    λ-orth, which fail ECC on instance-level tasks. The report says how long each stage took."""
    task = save_task(tmp_path / "task.npz", synthetic_instance_task(n_train=600, n_eval=200, seed=seed()))
    settings = {
        "data.name": "task",
        "data.task": str(task),
        "progress": False,
        "device": "cpu",
        "evaluation.distance": "cosine",
        "residual.train.epochs": 3,
        "query_positives.train.epochs": 3,
        "backfill.orderings": [],
        **SMALL_SEARCH,
    }
    config = load_pipeline_config(None, settings)
    run = run_pipeline(config, tmp_path / "run", log=lambda _: None)
    residual = ["residual", "residual+query-positives"]
    scored = [*residual, "least-squares"]
    assert set(run.gate["ecc"]) == {
        *scored,
        *(f"{v}+{s}" for v in scored for s in ("transition", "hubness", "hubness+transition")),
    }
    resolved = json.loads(run.files["config"].read_text())
    assert [resolved[s]["enabled"] for s in ("query_positives", "hubness", "transition", "query_map")] == [
        True,
        True,
        True,
        False,
    ]
    # 600 training items leave 540 rows a fit: neither 256 nor 1,024 gives 4 steps an epoch, so 128
    assert resolved["residual"]["train"]["batch_size"] == resolved["query_positives"]["train"]["batch_size"] == 128
    search = run.gate["selection"]  # what each searched setting gained on held-out training data
    assert set(search) == {"residual", "residual+query-positives"}
    assert set(search["residual+query-positives"]["gains"]) == {"hard_negatives"}
    assert "train.batch_size" not in search["residual"]["gains"]  # one size suits the task: nothing to search
    assert all(gain >= 0 for record in search.values() for gain in record["gains"].values())
    held_out = run.gate["held_out"]  # every variant scored on held-out training data, none on the evaluation split
    assert set(held_out) == set(run.gate["ecc"])
    recommended = run.gate["recommended"]
    assert recommended["gallery side"] == max((k for k in held_out if "transition" not in k), key=held_out.get)
    assert held_out[recommended["during the transition"]] == max(held_out.values())
    assert "recommended (by R@1 on held-out training data)" in run.report.facts
    stages = [name for name in run.report.facts if name.startswith("time: ")]
    assert {"time: fitting residual adapter", "time: evaluating", "time: all stages above"} <= set(stages)
    assert any(name.startswith("time: choosing settings of residual adapter") for name in stages)
    # the same defaults with l2 distance: no cosine scores to fuse or offset, so no scoring variants
    l2 = dataclasses.replace(config, evaluation=dataclasses.replace(config.evaluation, distance="l2")).for_task(
        "instance"
    )
    assert (l2.hubness.enabled, l2.transition.enabled, l2.query_positives.enabled) == (False, False, True)
    class_level = config.for_task("class", rows=6000)
    assert (class_level.query_positives.enabled, class_level.residual.train.batch_size) == (False, 256)
    chosen = load_pipeline_config(None, {**settings, "residual.train.batch_size": 64}).for_task("instance", 6000, 6000)
    assert chosen.residual.train.batch_size == 64  # a size the user set is kept


@pytest.mark.parametrize(
    ("rows", "sizes", "expected"),
    [
        (6000, (256, 1024), (256, 1024)),  # 5,400 trained rows: 21 and 5 steps an epoch
        (2000, (256, 1024), (256,)),  # 1,800 rows: 1,024 would be one or two steps an epoch
        (600, (256, 1024), (128,)),  # neither fits: the largest power of two leaving 4 steps
        (40, (256, 1024), (32,)),  # never below 32
    ],
)
def test_batch_sizes_follow_the_number_of_training_rows(rows, sizes, expected):
    from fctkit.trainer.selection import SelectionConfig, batch_candidates, knobs_for

    assert batch_candidates(rows, sizes) == expected
    config = load_pipeline_config(None, {"data.name": "task", "data.task": "t.npz"}).for_task("instance", rows, rows)
    assert config.residual.train.batch_size == config.query_positives.train.batch_size == expected[0]
    knobs = {k.path: k.values for k in knobs_for("residual", config.residual, SelectionConfig(), rows)}
    assert knobs.get("train.batch_size") == (expected if len(expected) > 1 else None)
    with pytest.raises(ConfigError, match=r"selection\.batch_sizes"):
        SelectionConfig(batch_sizes=())


def test_the_coordinate_search_reports_what_each_setting_gained():
    from fctkit.trainer.selection import Knob, coordinate_search

    @dataclasses.dataclass
    class Settings:
        a: int = 0
        b: int = 0

    scores = {(0, 0): 0.5, (1, 0): 0.7, (2, 0): 0.6, (1, 1): 0.65}
    chosen = coordinate_search(
        Settings(), [Knob("a", (0, 1, 2)), Knob("b", (0, 1))], lambda s: (scores[s.a, s.b], None)
    )
    assert (chosen.config, chosen.tried) == (Settings(1, 0), 4)
    assert chosen.gains == pytest.approx({"a": 0.2, "b": 0.0})


def test_the_recommendation_prefers_the_simpler_variant_on_a_tie():
    from fctkit.trainer.tuning import recommended

    scores = {
        "residual": 0.4,
        "residual+hubness": 0.5,
        "residual+query-positives+hubness": 0.5,
        "residual+transition": 0.5,
    }
    assert recommended(scores) == {"gallery side": "residual+hubness", "during the transition": "residual+hubness"}
    assert recommended({"residual": 0.4, "residual+transition": 0.45})["during the transition"] == "residual+transition"
    assert recommended({}) == {}


def test_a_bad_task_file_fails_before_anything_is_written(tmp_path):
    bad = tmp_path / "bad.npz"
    np.savez(bad, format=np.array("fctkit-task/1"), level=np.array("instance"))
    result = CliRunner().invoke(
        cli, ["train", "--out", str(tmp_path / "out"), "--set", "data.name=task", "--set", f"data.task={bad}"]
    )
    assert isinstance(result.exception, InputError) and "missing key 'train.query.ids'" in str(result.exception)
    assert not (tmp_path / "out").exists()


def test_task_settings_are_checked():
    with pytest.raises(ConfigError, match=r"data.name = 'task' needs data.task"):
        load_pipeline_config(None, {"data.name": "task"})
    with pytest.raises(ConfigError, match="transition works on cosine scores of a retrieval task"):
        load_pipeline_config(None, {"data.name": "task", "data.task": "t.npz", "transition.enabled": True})
    with pytest.raises(ConfigError, match="hubness works on cosine scores of a retrieval task"):
        load_pipeline_config(None, {"hubness.enabled": True})
    with pytest.raises(ConfigError, match="query_map needs a retrieval task"):
        load_pipeline_config(None, {"query_map.enabled": True})
    with pytest.raises(ConfigError, match="query_positives needs a retrieval task"):
        load_pipeline_config(None, {"query_positives.enabled": True})
    with pytest.raises(
        ConfigError, match="query_positives: task_weight, hard_negatives and distill_weight must be >= 0"
    ):
        load_pipeline_config(None, {"query_positives.task_weight": -1})
    with pytest.raises(ConfigError, match="FastFill trains with its own"):
        load_pipeline_config(None, {"fastfill.objective.kind": "infonce"})
    with pytest.raises(ConfigError, match="triplet"):
        load_pipeline_config(None, {"residual.objective.kind": "triplet"})


def test_the_residual_adapters_ridge_is_searched_only_when_asked_and_must_be_positive(tmp_path):
    from fctkit.trainer.residual import ResidualConfig
    from fctkit.trainer.selection import Knob, SelectionConfig, knobs_for

    assert all(k.path != "ridge" for k in knobs_for("residual", ResidualConfig(), SelectionConfig()))
    assert Knob("ridge", (1e-3, 1.0)) in knobs_for("residual", ResidualConfig(), SelectionConfig(ridges=(1e-3, 1.0)))
    with pytest.raises(ConfigError, match=r"selection.ridges must be > 0"):
        SelectionConfig(ridges=(0.0,))
    # In a run, the chosen ridge is reported with the other settings chosen on held-out training data.
    path = save_task(tmp_path / "task.npz", synthetic_instance_task(n_train=300, n_eval=100, seed=seed()))
    config = load_pipeline_config(
        None,
        {
            "data.name": "task",
            "data.task": str(path),
            "progress": False,
            "device": "cpu",
            "methods": ["residual"],
            "residual.train.epochs": 2,
            "backfill.orderings": [],
            **SMALL_SEARCH,
            "selection.ridges": [1e-3, 1.0],
        },
    )
    run = run_pipeline(config, tmp_path / "run", log=lambda _: None)
    assert "ridge = " in run.report.facts["selected [residual adapter]"]


def test_a_method_reads_side_information_only_when_the_data_has_it_and_its_config_allows_it():
    from fctkit.trainer.methods import method_config

    default, turned_off = load_pipeline_config(), load_pipeline_config(None, {"residual.side_info": False})
    assert method_config(default, "residual", has_side=True, level="instance").side_info is True
    assert method_config(default, "residual", has_side=False, level="instance").side_info is False
    assert method_config(turned_off, "residual", has_side=True, level="instance").side_info is False
    assert method_config(default, "fct-no-side-info", has_side=True, level="class").side_info is False

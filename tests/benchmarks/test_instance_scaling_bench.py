"""benchmarks/instance_scaling.py on the synthetic task: a real `fctkit train` run searched in
smaller and larger galleries (distractors from another draw of the task's distribution)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fctkit.trainer import synthetic_instance_task
from tests.support.benchmark_scripts import benchmark_script
from tests.support.task_runs import synthetic_task_run

N_EVAL = 300
SEARCH = {
    "selection.temperatures": [0.05],
    "selection.learning_rates": [3e-3],
    "selection.widths": [256],
    "selection.weight_decays": [1e-4],
}


@pytest.fixture(scope="module")
def scaled(tmp_path_factory):
    root = tmp_path_factory.mktemp("scaling")
    synthetic_task_run(
        root, n_train=800, n_eval=N_EVAL, **SEARCH, **{"query_positives.enabled": True, "backfill.orderings": []}
    )
    other = synthetic_instance_task(n_train=10, n_eval=500, seed=123).evaluation.gallery
    np.savez(
        root / "distractors.npz",
        ids=np.array([f"d{i}" for i in range(len(other))]),
        old=other.old,
        new=other.new,
        side=other.side,
    )
    with benchmark_script("instance_scaling.py") as bench:
        status = bench.main(
            [
                str(root / "task.npz"),
                "--run",
                str(root / "run"),
                "--distractors",
                str(root / "distractors.npz"),
                "--sizes",
                "150",
                str(N_EVAL),
                "500",
                "800",
                "5000",
                "--out",
                str(root / "out"),
            ]
        )
        assert status == 0
        yield json.loads((root / "out" / "scaling.json").read_text()), root, bench


def test_each_size_reports_every_variant_as_a_share_of_new_new(scaled):
    summary, root, _ = scaled
    assert sorted(summary["sizes"], key=int) == ["150", str(N_EVAL), "500", "800"]  # 5000 > 300 + 500 available
    assert "residual+query-positives+hubness+transition" in summary["variants"]
    for entry in summary["sizes"].values():
        assert entry["share"]["new/new"] == {"R@1": 1.0, "R@10": 1.0, "MRR": 1.0}
        assert set(entry["results"]) == {"old/old", "new/new", *summary["variants"]}
    markdown = (root / "out" / "scaling.md").read_text()
    assert "not measured" in markdown and (root / "out" / "scaling.png").stat().st_size > 0


def test_the_full_size_reproduces_the_runs_gate_and_distractors_only_push_positives_down(scaled):
    summary, root, _ = scaled
    gate = json.loads((root / "run" / "gate.json").read_text())
    at_task_size = summary["sizes"][str(N_EVAL)]["results"]
    for name in summary["variants"]:
        assert at_task_size[name]["R@1"] == pytest.approx(gate["cases"][name]["recall@1"], abs=1e-9)
        growing = [summary["sizes"][s]["results"][name]["R@1"] for s in (str(N_EVAL), "500", "800")]
        assert growing == sorted(growing, reverse=True)
    assert summary["sizes"]["800"]["results"]["new/new"]["R@1"] < at_task_size["new/new"]["R@1"]


def test_a_smaller_gallery_keeps_the_positives_of_the_queries_it_keeps(scaled):
    summary, root, bench = scaled
    from fctkit.trainer.tasks import load_task

    split = load_task(root / "task.npz").evaluation
    smaller = bench.gallery_of_size(split, None, 150, seed=0)
    assert (
        len(smaller.gallery) == 150 and summary["sizes"]["150"]["queries"] == len(smaller.query) == 150
    )  # one positive each
    position = {str(i): q for q, i in enumerate(split.query.ids)}
    for q, query_id in enumerate(smaller.query.ids):
        originals = split.gallery.ids[split.positives.of(position[str(query_id)])[0]]
        assert {str(i) for i in smaller.gallery.ids[smaller.positives.of(q)[0]]} == {str(i) for i in originals}


def test_several_runs_give_their_mean_and_spread(scaled):
    _, root, bench = scaled
    run = str(root / "run")
    assert (
        bench.main([str(root / "task.npz"), "--run", run, run, "--sizes", str(N_EVAL), "--out", str(root / "twice")])
        == 0
    )
    entry = json.loads((root / "twice" / "scaling.json").read_text())["sizes"][str(N_EVAL)]
    first, second = (
        {case: {k: v for k, v in m.items() if k != "seconds"} for case, m in run.items()} for run in entry["per_run"]
    )
    assert len(entry["per_run"]) == 2 and first == second
    assert all(v == 0.0 for case in entry["share_sd"].values() for v in case.values())
    assert "(± 0.000)" in (root / "twice" / "scaling.md").read_text()

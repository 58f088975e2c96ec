"""The quality suite guards the trainer's defaults: its stored figures must have been measured
with today's defaults, and the small tier must hold them within the seeds' spread."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest

from tests.support.benchmark_scripts import benchmark_script

REFRESH = (
    "run `python benchmarks/quality_suite.py run --tier small --out runs/quality` (and `--tier full`, see "
    "its docstring), then `python benchmarks/quality_suite.py save --out runs/quality`, and commit "
    "benchmarks/quality_figures.json"
)


@pytest.fixture(scope="module")
def suite():
    with benchmark_script("quality_suite.py") as module:
        yield module


def test_every_task_of_the_suite_has_figures_measured_with_todays_defaults(suite):
    figures = suite.load_figures()
    current = suite.current_defaults()
    stale = {
        name: row["defaults_sha256"]
        for name, row in figures["by_defaults"]["current"].items()
        if row["defaults_sha256"] != suite.defaults_fingerprint(current)
    }
    assert not stale, (
        f"the trainer's defaults changed since the quality suite measured {', '.join(sorted(stale))}: "
        f"{'; '.join(suite.changed_defaults(figures['defaults'], current)) or 'see git log'}. To change a "
        f"default, {REFRESH}"
    )
    small = {task.name for task in suite.TASKS if task.tier == "small"}
    missing = small - set(figures["by_defaults"]["current"])
    assert not missing, f"no stored figures for {', '.join(sorted(missing))}: {REFRESH}"
    assert all(row["seeds"] == len(suite.SEEDS) for row in figures["by_defaults"]["current"].values())


def test_a_changed_default_no_longer_matches_the_fingerprint(suite):
    defaults = suite.current_defaults()
    assert defaults["residual.train.batch_size"] is None  # derived from the task's size at run time
    changed = copy.deepcopy(defaults) | {"selection.batch_sizes": [1024]}
    assert suite.defaults_fingerprint(changed) != suite.defaults_fingerprint(defaults)
    assert suite.changed_defaults(defaults, changed) == ["selection.batch_sizes: [256, 1024] -> [1024]"]


def test_a_drop_beyond_the_seed_spread_is_a_regression_and_one_within_it_is_not(suite):
    def row(mean: float, spread: float) -> dict:
        return {suite.GALLERY_SIDE: {"mean": mean, "range": spread}}

    stored = {"a": row(0.95, 0.01), "b": row(0.95, 0.0)}
    assert suite.regressions(stored, {"a": row(0.945, 0.004), "b": row(0.946, 0.0)}) == []
    found = suite.regressions(stored, {"a": row(0.93, 0.004), "b": row(0.94, 0.002)})
    assert [line.split(":")[0] for line in found] == ["a", "b"]


def test_the_small_tier_holds_its_stored_figures(suite, tmp_path: Path):
    """`fctkit train` with its pure defaults on the small tier's tasks, 3 seeds each."""
    stored = suite.load_figures()["by_defaults"]["current"]
    measured = suite.run_tier("small", "current", suite.SEEDS, tmp_path)
    assert set(measured) == {t.name for t in suite.TASKS if t.tier == "small"}
    assert suite.regressions(stored, measured) == []
    for name, row in measured.items():  # the run recorded what each searched setting gained
        assert row["gains"] and all(gain >= 0 for gain in row["gains"].values()), name

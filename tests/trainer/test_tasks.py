"""Retrieval task files: round trip, the example file, and a clear error for each bad input."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fctkit.errors import DataUnavailableError, InputError
from fctkit.trainer.synthetic import synthetic_instance_task
from fctkit.trainer.tasks import load_task, save_task, task_arrays, task_from_arrays

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tasks" / "synthetic-instance.npz"


@pytest.fixture(scope="module")
def task():
    return synthetic_instance_task(n_train=60, n_eval=40, seed=1)


def test_a_task_round_trips_through_its_file(task, tmp_path):
    path = save_task(tmp_path / "task.npz", task)
    loaded = load_task(path)
    assert (loaded.name, loaded.level, loaded.primary_metric) == ("synthetic-instance", "instance", "recall@1")
    for split in ("train", "evaluation"):
        ours, theirs = getattr(task, split), getattr(loaded, split)
        for name in ("query", "gallery"):
            np.testing.assert_array_equal(getattr(ours, name).new, getattr(theirs, name).new)
            np.testing.assert_array_equal(getattr(ours, name).ids, getattr(theirs, name).ids)
        np.testing.assert_array_equal(ours.positives.indices, theirs.positives.indices)
    assert not list(tmp_path.glob("*.partial"))


def test_the_example_file_in_the_repo_loads():
    example = load_task(EXAMPLE)
    assert example.level == "instance" and len(example.evaluation.query) > 0


def test_class_level_tasks_take_labels(task):
    arrays = _without(task_arrays(task), ".positives.")
    arrays["level"] = np.array("class")
    del arrays["primary_metric"]
    for split in ("train", "eval"):
        for name in ("query", "gallery"):
            arrays[f"{split}.{name}.labels"] = arrays[f"{split}.{name}.ids"] % 3
    loaded = task_from_arrays(arrays)
    assert loaded.primary_metric == "top1" and loaded.evaluation.positives is None
    assert set(loaded.evaluation.relevance()) == {"query_labels", "gallery_labels"}


def test_graded_positives_survive_the_round_trip(task, tmp_path):
    arrays = task_arrays(task)
    arrays["eval.positives.grade"] = np.linspace(1, 3, len(arrays["eval.positives.query"]))
    loaded = task_from_arrays(arrays)
    assert loaded.evaluation.positives.graded
    again = load_task(save_task(tmp_path / "graded.npz", loaded))
    np.testing.assert_allclose(np.sort(again.evaluation.positives.grades), np.sort(arrays["eval.positives.grade"]))


def _without(arrays, fragment):
    return {k: v for k, v in arrays.items() if fragment not in k}


def _nan_at(arrays, key, row):
    bad = arrays[key].copy()
    bad[row, 0] = np.nan
    return {**arrays, key: bad}


def _duplicate_id(arrays):
    ids = arrays["train.gallery.ids"].copy()
    ids[5] = ids[4]
    return {**arrays, "train.gallery.ids": ids}


def _overlap(arrays):
    ids = arrays["eval.query.ids"].copy()
    ids[0] = arrays["train.query.ids"][0]
    positives = arrays["eval.positives.query"].copy()
    positives[positives == arrays["eval.query.ids"][0]] = ids[0]
    return {**arrays, "eval.query.ids": ids, "eval.positives.query": positives}


def _orphan_query(arrays):
    keep = arrays["eval.positives.query"] != arrays["eval.query.ids"][3]
    return {
        **arrays,
        "eval.positives.query": arrays["eval.positives.query"][keep],
        "eval.positives.gallery": arrays["eval.positives.gallery"][keep],
    }


BAD_TASKS = {
    "missing key": (lambda a: _without(a, "eval.gallery.new"), "missing key 'eval.gallery.new'"),
    "dimension mismatch": (
        lambda a: {**a, "eval.query.new": a["eval.query.new"][:, :-1]},
        "the new embeddings differ in dimension",
    ),
    "rows do not match ids": (
        lambda a: {**a, "train.query.old": a["train.query.old"][:-1]},
        "train.query.old: has 59 rows but the set has 60 ids",
    ),
    "a query without a positive": (_orphan_query, "query 63 has no positive"),
    "duplicate ids": (_duplicate_id, "train.gallery.ids: id 4 appears 2 times"),
    "NaN row": (lambda a: _nan_at(a, "train.gallery.old", 7), "train.gallery.old: row 7 holds NaN or inf"),
    "inf row": (
        lambda a: {**a, "eval.query.new": np.where(np.arange(40)[:, None] == 2, np.inf, a["eval.query.new"])},
        "eval.query.new: row 2 holds NaN or inf",
    ),
    "train/eval overlap": (_overlap, "query id\\(s\\) are in both train and eval"),
    "unknown key": (
        lambda a: {**a, "eval.gallery.sideinfo": a["eval.gallery.new"]},
        "unknown key\\(s\\) eval.gallery.sideinfo",
    ),
    "positive not in the gallery": (
        lambda a: {**a, "eval.positives.gallery": a["eval.positives.gallery"] + 1000},
        "eval.positives.gallery: id 1060 is not in eval.gallery.ids",
    ),
    "unknown metric": (lambda a: {**a, "primary_metric": np.array("R@1")}, "unknown metric 'R@1'"),
    "wrong format": (lambda a: {**a, "format": np.array("fctkit-task/9")}, "this fctkit reads 'fctkit-task/1'"),
}


@pytest.mark.parametrize("case", BAD_TASKS)
def test_bad_task_files_get_an_error_naming_the_key_or_row(task, tmp_path, case):
    damage, message = BAD_TASKS[case]
    path = tmp_path / "bad.npz"
    np.savez(path, **damage(task_arrays(task)))
    with pytest.raises(InputError, match=message):
        load_task(path)


def test_a_truncated_or_absent_file_is_refused(task, tmp_path):
    path = save_task(tmp_path / "task.npz", task)
    path.write_bytes(path.read_bytes()[:500])
    with pytest.raises(InputError, match=r"not a readable task .npz"):
        load_task(path)
    with pytest.raises(DataUnavailableError, match="task file not found"):
        load_task(tmp_path / "absent.npz")


def test_saving_an_invalid_task_writes_nothing_and_keeps_the_old_file(task, tmp_path):
    path = save_task(tmp_path / "task.npz", task)
    before = path.read_bytes()
    broken = task.__class__(task.name, task.level, "not-a-metric", task.train, task.evaluation)
    with pytest.raises(InputError):
        save_task(path, broken)
    assert path.read_bytes() == before and sorted(p.name for p in tmp_path.iterdir()) == ["task.npz"]

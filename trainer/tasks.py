"""Retrieval tasks as data: query and gallery sets embedded by each model version, with the
relevance that says which gallery items answer which query (numpy only, no torch).

A task file is one ``.npz`` (no pickles) with these keys; ``SPLIT`` is ``train`` (what adapters
are fitted and tuned on) or ``eval`` (what the report judges; nothing else touches it), ``SET``
is ``query`` or ``gallery``:

=============================  ===============================================================
key                            value
=============================  ===============================================================
``format``                     ``"fctkit-task/1"``
``name``                       a short name for reports (optional)
``level``                      ``"instance"`` (explicit positives) or ``"class"`` (labels)
``primary_metric``             what the gate judges (optional): ``recall@1`` (instance default),
                               ``recall@10``, ``mrr``, ``ndcg@10``, ``mean_ap``, ``top1`` (class
                               default), …
``SPLIT.SET.ids``              (N,) integer or string ids, unique within the split's set
``SPLIT.SET.old``              (N, d_old) the old model's embeddings
``SPLIT.SET.new``              (N, d_new) the new model's embeddings
``SPLIT.gallery.side``         (N, d_side) side-info ψ of the gallery items (optional)
``SPLIT.SET.labels``           (N,) class labels — class-level tasks only
``SPLIT.positives.query``      (M,) query ids — instance-level tasks only: one row per
``SPLIT.positives.gallery``    (M,) gallery ids   (query, relevant gallery item) pair
``SPLIT.positives.grade``      (M,) grades > 0 (optional; 1 when absent)
=============================  ===============================================================

Every query of an instance-level task needs at least one positive, and ids may not repeat
between the splits (the evaluation split must be items nothing was fitted on). Any other key
is an error, so a misspelt key is never silently ignored. :func:`load_task` names the key and
the first bad row of anything wrong; :func:`save_task` validates before it writes and writes
atomically.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import secrets
import zipfile
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal, cast, overload

import numpy as np

from fctkit.errors import DataUnavailableError, InputError

from .relevance import Positives
from .retrieval_result import parse_metric

TASK_FORMAT = "fctkit-task/1"
SPLITS = ("train", "eval")
SETS = ("query", "gallery")
Level = Literal["instance", "class"]
DEFAULT_PRIMARY_METRIC = {"instance": "recall@1", "class": "top1"}


@dataclasses.dataclass(frozen=True)
class TaskSet:
    """One set of items (queries or gallery) embedded by both versions; ``side`` is (N, 0)
    without side-info; ``labels`` only in class-level tasks."""

    ids: np.ndarray
    old: np.ndarray
    new: np.ndarray
    side: np.ndarray
    labels: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.ids)

    def subset(self, rows: np.ndarray) -> TaskSet:
        return TaskSet(
            self.ids[rows],
            self.old[rows],
            self.new[rows],
            self.side[rows],
            None if self.labels is None else self.labels[rows],
        )


@dataclasses.dataclass(frozen=True)
class TaskSplit:
    """Queries, gallery and their relevance (``positives`` for instance level, else labels)."""

    query: TaskSet
    gallery: TaskSet
    positives: Positives | None = None

    def relevance(self) -> dict[str, Any]:
        """Keyword arguments for :func:`~fctkit.trainer.evaluation.evaluate_retrieval`."""
        if self.positives is not None:
            return {"query_labels": None, "gallery_labels": None, "positives": self.positives}
        return {"query_labels": self.query.labels, "gallery_labels": self.gallery.labels}

    def subset(self, query_rows: np.ndarray, gallery_rows: np.ndarray) -> TaskSplit:
        """The queries ``query_rows`` against the gallery items ``gallery_rows`` (positives
        outside the kept gallery are dropped)."""
        positives = None
        if self.positives is not None:
            new_index = np.full(len(self.gallery), -1)
            new_index[gallery_rows] = np.arange(len(gallery_rows))
            lists = [[int(new_index[j]) for j in self.positives.of(int(i))[0] if new_index[j] >= 0] for i in query_rows]
            grades = [[float(g) for j, g in zip(*self.positives.of(int(i))) if new_index[j] >= 0] for i in query_rows]
            positives = Positives.from_lists(lists, len(gallery_rows), grades)
        return TaskSplit(self.query.subset(query_rows), self.gallery.subset(gallery_rows), positives)


@dataclasses.dataclass(frozen=True)
class RetrievalTask:
    name: str
    level: Level
    primary_metric: str
    train: TaskSplit
    evaluation: TaskSplit
    source: str = ""

    @property
    def has_side_info(self) -> bool:
        return self.train.gallery.side.shape[1] > 0


# --------------------------------------------------------------------------- reading


def load_task(path: str | os.PathLike[str]) -> RetrievalTask:
    """Read and validate a task file (see the module docstring)."""
    path = Path(path)
    if not path.is_file():
        raise DataUnavailableError(f"task file not found: {path}")
    try:
        with np.load(path, allow_pickle=False) as npz:
            arrays = {key: npz[key] for key in npz.files}
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise InputError(
            f"{path}: not a readable task .npz ({exc}); the file is truncated, damaged, or holds "
            f"pickled objects (not allowed)"
        ) from exc
    return task_from_arrays(arrays, str(path))


def task_from_arrays(arrays: dict[str, np.ndarray], source: str = "task") -> RetrievalTask:
    """Validate the arrays of a task file and build the task."""
    reader = _Reader(arrays, source)
    fmt = reader.text("format")
    if fmt != TASK_FORMAT:
        raise InputError(f"{source}: format is {fmt!r}; this fctkit reads {TASK_FORMAT!r}")
    level = reader.text("level")
    if level not in DEFAULT_PRIMARY_METRIC:
        raise InputError(f"{source}: level must be 'instance' or 'class', got {level!r}")
    primary = reader.text("primary_metric", DEFAULT_PRIMARY_METRIC[level])
    parse_metric(primary)
    name = reader.text("name", Path(source).stem)
    splits = {split: reader.split(split, level) for split in SPLITS}
    reader.check_dims(splits)
    reader.check_disjoint(splits)
    reader.check_no_unknown_keys()
    return RetrievalTask(name, cast(Level, level), primary, splits["train"], splits["eval"], source)  # checked above


class _Reader:
    """Reads keys of one task file, remembering which it used, with errors naming key and row."""

    def __init__(self, arrays: dict[str, np.ndarray], source: str) -> None:
        self.arrays, self.source, self.used = arrays, source, set[str]()

    def _not_in(self, key: str, ids_key: str, bad: object) -> InputError:
        return self.error(key, f"id {_show(bad)} is not in {ids_key}")

    def error(self, key: str, message: str) -> InputError:
        return InputError(f"{self.source}: {key}: {message}")

    @overload
    def get(self, key: str, required: Literal[True] = True) -> np.ndarray: ...
    @overload
    def get(self, key: str, required: bool) -> np.ndarray | None: ...
    def get(self, key: str, required: bool = True) -> np.ndarray | None:
        if key not in self.arrays:
            if required:
                raise InputError(f"{self.source}: missing key {key!r} (see the task format in the README)")
            return None
        self.used.add(key)
        return self.arrays[key]

    def text(self, key: str, default: str | None = None) -> str:
        value = self.get(key, required=default is None)
        if value is None:
            assert default is not None  # get() raised for a required key
            return default
        if value.ndim != 0 or value.dtype.kind != "U":
            raise self.error(key, f"expected one string, got an array of shape {value.shape} and dtype {value.dtype}")
        return str(value)

    @overload
    def matrix(self, key: str, rows: int, required: Literal[True] = True) -> np.ndarray: ...
    @overload
    def matrix(self, key: str, rows: int, required: bool) -> np.ndarray | None: ...
    def matrix(self, key: str, rows: int, required: bool = True) -> np.ndarray | None:
        value = self.get(key, required)
        if value is None:
            return None
        if value.ndim != 2 or value.dtype.kind not in "iuf":
            raise self.error(
                key, f"expected a 2-D array of numbers (rows x dims), got shape {value.shape}, dtype {value.dtype}"
            )
        if len(value) != rows:
            raise self.error(key, f"has {len(value)} rows but the set has {rows} ids; rows must align with the ids")
        bad = ~np.isfinite(value).all(axis=1)
        if bad.any():
            raise self.error(key, f"row {int(np.flatnonzero(bad)[0])} holds NaN or inf ({int(bad.sum())} bad row(s))")
        return np.ascontiguousarray(value, dtype=np.float32)

    def ids(self, key: str) -> np.ndarray:
        ids = self.get(key)
        if ids.ndim != 1 or len(ids) == 0 or ids.dtype.kind not in "iuU":
            raise self.error(
                key,
                f"expected a non-empty 1-D array of integer or string ids, got shape {ids.shape}, dtype {ids.dtype}",
            )
        unique, counts = np.unique(ids, return_counts=True)
        if (counts > 1).any():
            raise self.error(
                key, f"id {_show(unique[counts > 1][0])} appears {counts[counts > 1][0]} times; ids must be unique"
            )
        return ids

    def task_set(self, split: str, name: str, level: str) -> TaskSet:
        prefix = f"{split}.{name}"
        ids = self.ids(f"{prefix}.ids")
        old, new = self.matrix(f"{prefix}.old", len(ids)), self.matrix(f"{prefix}.new", len(ids))
        side = self.matrix(f"{prefix}.side", len(ids), required=False) if name == "gallery" else None
        labels = None
        if level == "class":
            labels = self.get(f"{prefix}.labels")
            if labels.shape != ids.shape or labels.dtype.kind not in "iuU":
                raise self.error(
                    f"{prefix}.labels",
                    f"expected {len(ids)} integer or string labels, got shape {labels.shape}, dtype {labels.dtype}",
                )
        side = np.zeros((len(ids), 0), np.float32) if side is None else side
        return TaskSet(ids, old, new, side, labels)

    def split(self, split: str, level: str) -> TaskSplit:
        query, gallery = (self.task_set(split, name, level) for name in SETS)
        if level == "class":
            assert query.labels is not None and gallery.labels is not None  # class-level sets have labels
            missing = ~np.isin(query.labels, gallery.labels)
            if missing.any():
                row = int(np.flatnonzero(missing)[0])
                raise self.error(
                    f"{split}.query.labels",
                    f"query {_show(query.ids[row])} (row {row}) has class "
                    f"{_show(query.labels[row])}, which no gallery item of the {split} split has",
                )
            return TaskSplit(query, gallery)
        return TaskSplit(query, gallery, self.positives(split, query.ids, gallery.ids))

    def positives(self, split: str, query_ids: np.ndarray, gallery_ids: np.ndarray) -> Positives:
        prefix = f"{split}.positives"
        pairs = {part: self.get(f"{prefix}.{part}") for part in SETS}
        grade = self.get(f"{prefix}.grade", required=False)
        rows = {}
        for part, ids in (("query", query_ids), ("gallery", gallery_ids)):
            listed = pairs[part]
            if listed.ndim != 1 or len(listed) != len(pairs["query"]):
                raise self.error(
                    f"{prefix}.{part}", "positives.query and positives.gallery must be 1-D and of equal length"
                )
            rows[part] = _rows_of(
                ids, listed, functools.partial(self._not_in, f"{prefix}.{part}", f"{split}.{part}.ids")
            )
        if grade is not None and (grade.shape != pairs["query"].shape or grade.dtype.kind not in "iuf"):
            raise self.error(
                f"{prefix}.grade", f"expected {len(pairs['query'])} numeric grades, got shape {grade.shape}"
            )
        without = np.setdiff1d(np.arange(len(query_ids)), rows["query"])
        if without.size:
            raise self.error(
                f"{prefix}.query",
                f"query {_show(query_ids[without[0]])} has no positive ({without.size} such "
                f"queries); list at least one relevant gallery item per query or drop the query",
            )
        try:
            return Positives.from_pairs(rows["query"], rows["gallery"], len(query_ids), len(gallery_ids), grade)
        except InputError as exc:
            raise self.error(prefix, str(exc).removeprefix("positives: ")) from exc

    def check_dims(self, splits: dict[str, TaskSplit]) -> None:
        for field in ("old", "new", "side"):
            dims = {
                f"{s}.{n}.{field}": getattr(getattr(split, n), field).shape[1]
                for s, split in splits.items()
                for n in SETS
                if field != "side" or n == "gallery"
            }
            if len(set(dims.values())) > 1:
                listing = ", ".join(f"{k} {d}" for k, d in dims.items())
                raise InputError(
                    f"{self.source}: the {field} embeddings differ in dimension ({listing}); "
                    f"every set must be embedded by the same model"
                )

    def check_disjoint(self, splits: dict[str, TaskSplit]) -> None:
        for name in SETS:
            train_ids, eval_ids = (getattr(splits[s], name).ids for s in SPLITS)
            shared: Any = np.intersect1d(train_ids, eval_ids) if train_ids.dtype.kind == eval_ids.dtype.kind else []
            if len(shared):
                raise InputError(
                    f"{self.source}: {len(shared)} {name} id(s) are in both train and eval (first "
                    f"{_show(shared[0])}); the evaluation split must hold items nothing is fitted on"
                )

    def check_no_unknown_keys(self) -> None:
        unknown = sorted(set(self.arrays) - self.used)
        if unknown:
            raise InputError(f"{self.source}: unknown key(s) {', '.join(unknown)} (see the task format in the README)")


def _show(value: object) -> str:
    """An id or label as the user wrote it: 63, 'n:02084071' (not np.int64(63))."""
    return repr(value.item() if isinstance(value, np.generic) else value)


def _rows_of(ids: np.ndarray, listed: np.ndarray, error: Callable[[object], InputError]) -> np.ndarray:
    order = np.argsort(ids)
    if listed.dtype.kind != ids.dtype.kind and not (listed.dtype.kind in "iu" and ids.dtype.kind in "iu"):
        raise error(listed[0] if len(listed) else "?")
    at = np.clip(np.searchsorted(ids, listed, sorter=order), 0, len(ids) - 1)
    rows = order[at]
    missing = ids[rows] != listed
    if missing.any():
        raise error(listed[np.flatnonzero(missing)[0]])
    return rows.astype(np.int64)


# --------------------------------------------------------------------------- writing


def task_arrays(task: RetrievalTask) -> dict[str, np.ndarray]:
    """The arrays of a task file for ``task`` (inverse of :func:`task_from_arrays`)."""
    arrays: dict[str, np.ndarray] = {
        "format": np.array(TASK_FORMAT),
        "name": np.array(task.name),
        "level": np.array(task.level),
        "primary_metric": np.array(task.primary_metric),
    }
    for split_name, split in zip(SPLITS, (task.train, task.evaluation)):
        for set_name in SETS:
            items: TaskSet = getattr(split, set_name)
            prefix = f"{split_name}.{set_name}"
            arrays |= {f"{prefix}.ids": items.ids, f"{prefix}.old": items.old, f"{prefix}.new": items.new}
            if set_name == "gallery" and items.side.shape[1]:
                arrays[f"{prefix}.side"] = items.side
            if items.labels is not None:
                arrays[f"{prefix}.labels"] = items.labels
        if split.positives is not None:
            counts = np.diff(split.positives.indptr)
            prefix = f"{split_name}.positives"
            arrays[f"{prefix}.query"] = np.repeat(split.query.ids, counts)
            arrays[f"{prefix}.gallery"] = split.gallery.ids[split.positives.indices]
            if split.positives.graded:
                arrays[f"{prefix}.grade"] = split.positives.grades
    return arrays


def save_task(path: str | os.PathLike[str], task: RetrievalTask) -> Path:
    """Validate ``task`` and write it to ``path`` atomically (a crash leaves the old file or none)."""
    arrays = task_arrays(task)
    task_from_arrays(arrays, str(path))
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    scratch = path.with_name(f".{path.name}.{secrets.token_hex(4)}.partial")
    try:
        with os.fdopen(os.open(scratch, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666), "wb") as sink:
            np.savez(sink, **cast(dict[str, Any], arrays))  # as Any: the stubs' allow_pickle keyword takes a bool
            sink.flush()
            os.fsync(sink.fileno())
        os.replace(scratch, path)
    except BaseException:
        Path(scratch).unlink(missing_ok=True)
        raise
    return path

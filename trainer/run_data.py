"""What a training run reads: the ``data`` section of its config (shared by `fctkit train` and
`fctkit train-compatible`) and the loaders that turn it into splits — image datasets, your own
pre-extracted ``.npz`` features, or a retrieval task (:mod:`.tasks`)."""

from __future__ import annotations

import dataclasses
from typing import Literal, Protocol

import numpy as np

from fctkit.errors import ConfigError

from .datasets import load_dataset, load_feature_versions, make_splits
from .searches import Features
from .tasks import RetrievalTask, load_task


@dataclasses.dataclass
class DataConfig:
    """``digits`` / ``fashion-mnist`` (images) or ``features`` (your own .npz per version)."""

    name: Literal["digits", "fashion-mnist", "features", "task"] = "digits"
    old_class_fraction: float = 0.5  # FCT protocol: the old model sees only the first half of the classes
    train_fraction: float = 0.6  # the rest is the evaluation set (query = gallery, leave-one-out)
    max_items: int = 0  # 0 = all; otherwise a stratified subsample (e.g. to keep fashion-mnist runs short)
    old_features: str = ""  # features mode: .npz with `embeddings`, `labels` (and optional `side_info`)
    new_features: str = ""
    side_features: str = ""  # features mode: optional .npz with ψ; else `side_info` inside old_features, else none
    task: str = ""  # task mode: a retrieval task file (fctkit-task/1 .npz; see the README)

    def __post_init__(self) -> None:
        if self.name == "features" and not (self.old_features and self.new_features):
            raise ConfigError("data.name = 'features' needs data.old_features and data.new_features (.npz paths)")
        if (self.name == "task") != bool(self.task):
            raise ConfigError(
                "data.name = 'task' needs data.task (a task .npz path), and data.task needs data.name = 'task'"
            )
        if not 0 < self.old_class_fraction <= 1 or not 0 < self.train_fraction < 1:
            raise ConfigError("data.old_class_fraction must be in (0, 1] and data.train_fraction in (0, 1)")


class RunWithData(Protocol):
    """Any run config these loaders read: its ``data`` section and the ``seed`` of its splits."""

    seed: int
    data: DataConfig


@dataclasses.dataclass
class ImageSplits:
    images: np.ndarray
    labels: np.ndarray
    n_classes: int
    train: np.ndarray  # indices
    evaluation: np.ndarray


def load_image_splits(config: RunWithData) -> ImageSplits:
    """The run's images, subsampled and split deterministically from ``config.seed``."""
    dataset = load_dataset(config.data.name)
    images, labels = _subsample(dataset.images, dataset.labels, config.data.max_items, config.seed)
    splits = make_splits(labels, config.seed, train_fraction=config.data.train_fraction, query_fraction=0.0)
    return ImageSplits(images, labels, dataset.n_classes, splits.train, splits.gallery)


def npz_features(config: RunWithData) -> tuple[Features, Features]:
    data = config.data
    paths = [data.old_features, data.new_features] + ([data.side_features] if data.side_features else [])
    versions = load_feature_versions(paths)
    old, new = versions[0], versions[1]
    if data.side_features:
        side = versions[2].embeddings
    elif old.side_info is not None:
        side = old.side_info
    else:
        side = np.zeros((len(old), 0), np.float32)
    everything = Features(old.embeddings, side, new.embeddings, old.labels)
    index = _subsample(np.arange(len(old)), old.labels, data.max_items, config.seed)[0]
    labels = old.labels[index]
    splits = make_splits(labels, config.seed, train_fraction=data.train_fraction, query_fraction=0.0)
    return everything.subset(index[splits.train]), everything.subset(index[splits.gallery])


def load_run_task(config: RunWithData) -> RetrievalTask | None:
    return load_task(config.data.task) if config.data.name == "task" else None


def _subsample(items: np.ndarray, labels: np.ndarray, max_items: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    if not max_items or max_items >= len(labels):
        return items, labels
    keep = make_splits(labels, seed, train_fraction=max_items / len(labels), query_fraction=0.0).train
    return items[keep], labels[keep]

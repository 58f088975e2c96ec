"""Training one version of a compatible method: what it is trained on (:class:`VersionTraining`),
the one loop behind every method (:func:`train_model`) and CoReS's checkpoint selection under
ECC (:class:`EccSelector`)."""

from __future__ import annotations

import copy
import dataclasses
from typing import Any, TypeVar

import numpy as np
import torch
from torch import nn

from fctkit.errors import InputError

from .backbones import BackboneConfig, extract_features, random_shift
from .compatible_losses import LossFn, cross_entropy
from .compatible_models import CompatibleModel
from .fitting import History, fit
from .searches import EvaluationConfig, Evaluator

VersionModel = TypeVar("VersionModel", bound=CompatibleModel)


@dataclasses.dataclass
class VersionTraining:
    """What one version is trained on and how (filled by :class:`~.compatible_sequence.SequenceRun`)."""

    images: np.ndarray
    labels: np.ndarray
    backbone: BackboneConfig
    seed: int
    device: str


def _class_targets(labels: np.ndarray, classes: tuple[int, ...]) -> np.ndarray:
    """Index of each label in ``classes``; −1 where the label is not one of them."""
    order = np.asarray(classes)
    index = np.searchsorted(order, labels).clip(0, len(order) - 1)
    return np.where(order[index] == labels, index, -1).astype(np.int64)


def train_model(
    model: VersionModel,
    job: VersionTraining,
    loss: LossFn[VersionModel] = cross_entropy,
    *,
    description: str,
    selector: EccSelector | None = None,
) -> History:
    """Train ``model`` (anything with ``classify`` and ``classes``) on ``job`` with
    ``loss(model, x, targets, labels)`` (targets: indices into ``model.classes``; x shifted
    randomly while training) — the one loop behind every method.

    Without ``selector``: early stopping on the validation loss (as :func:`train_backbone`).
    With one: the whole training set is used with no early stopping; the selector evaluates
    every epoch on its own held-out images and restores the epoch it picks.
    """
    targets = _class_targets(job.labels, model.classes)
    if (targets < 0).any():
        raise InputError(
            f"{description}: labels {sorted(set(job.labels[targets < 0].tolist()))} are not among the model's classes"
        )
    shift = job.backbone.shift_augment

    def loss_fn(net: VersionModel, x: torch.Tensor, y: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return loss(net, random_shift(x, shift) if net.training else x, y, labels)

    train_config = job.backbone.train_config(job.seed, job.device)
    if selector is not None:
        train_config = dataclasses.replace(train_config, val_fraction=0.0)
    history = fit(
        model,
        [job.images, targets, job.labels],
        loss_fn,
        train_config,
        description=description,
        on_epoch_start=selector,
    )
    if selector is not None:
        selector.finish(model, len(history.train_loss))
    model.history = history
    return history


class EccSelector:
    """CoReS's checkpoint selection (:mod:`.compatible_config`). Called by :func:`fit` at the start of
    every epoch (so it sees the weights after the previous one) and by :meth:`finish`."""

    def __init__(
        self, images: np.ndarray, labels: np.ndarray, previous: list[np.ndarray], evaluation: EvaluationConfig
    ) -> None:
        self.images = images
        self.evaluate = Evaluator.labelled(labels, evaluation)
        self.previous = previous  # earlier versions' embeddings of these validation images
        self.previous_self = [self.evaluate(p, p).top1 for p in previous]
        self.log: list[dict[str, Any]] = []
        self._best: tuple[tuple, int, dict] | None = None

    def __call__(self, model: nn.Module, epoch: int) -> None:
        if epoch > 0:
            self._record(model, epoch - 1)

    def _record(self, model: nn.Module, epoch: int) -> None:
        embedding = extract_features(model, self.images)
        new_new = self.evaluate(embedding, embedding).top1
        margins = [self.evaluate(embedding, p).top1 - base for p, base in zip(self.previous, self.previous_self)]
        passes = all(m > 0 for m in margins)
        self.log.append({"epoch": epoch, "new/new": new_new, "margins": margins, "ecc": passes})
        key = (True, new_new) if passes else (False, min(margins), new_new)
        if self._best is None or key >= self._best[0]:  # ties: the later, longer-trained epoch
            self._best = (key, epoch, copy.deepcopy(model.state_dict()))

    def finish(self, model: nn.Module, epochs: int) -> dict[str, Any]:
        """Evaluate the last epoch, restore the chosen weights, return the choice."""
        self._record(model, epochs - 1)
        assert self._best is not None  # _record has just set it
        key, epoch, state = self._best
        model.load_state_dict(state)
        model.eval()
        self.choice = {"epoch": epoch, "ecc_on_validation": key[0], "epochs": len(self.log)}
        return self.choice


__all__ = ["EccSelector", "train_model"]

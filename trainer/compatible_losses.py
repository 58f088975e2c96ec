"""The training losses of the compatible methods (:mod:`.compatible_config`): plain
cross-entropy, BCT's influence loss (with its synthesised classifier), BT²'s loss and CoReS +
HOC's; each is a :data:`LossFn` of ``(model, images, targets, labels)``."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from .backbones import Backbone, extract_features
from .compatible_config import BT2Config
from .compatible_models import BT2Backbone, CompatibleModel

ModelT = TypeVar("ModelT", bound=nn.Module)
# a loss of the model it trains (LossFn[Backbone], LossFn[BT2Backbone]): (model, images, targets, labels) -> loss
LossFn = Callable[[ModelT, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy(net: CompatibleModel, x: torch.Tensor, targets: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The plain loss: cross-entropy of ``net.classify`` over the model's classes."""
    return F.cross_entropy(net.classify(x), targets)


def frozen(model: ModelT, device: torch.device) -> ModelT:
    """``model`` on ``device`` in eval mode, its weights no longer trained (a previous version as a teacher)."""
    model = model.to(device).eval()
    model.requires_grad_(False)
    return model


def _known(classes: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index of each label in sorted ``classes``, mask of the labels that are among them)."""
    index = torch.searchsorted(classes, labels).clamp(max=len(classes) - 1)
    return index, classes[index] == labels


def bct_loss(
    previous: Backbone, weight: float, classifier: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
) -> LossFn[Backbone]:
    """BCT: cross-entropy on the new classes plus the *influence loss*, the cross-entropy of the
    new feature through ``previous``'s frozen classifier, on the items of the classes that
    classifier knows. ``classifier`` = (classes, weight, bias) replaces ``previous``'s own head
    (e.g. :func:`synthesised_classifier`, which also knows the new classes)."""
    classes, w, b = classifier or (
        torch.as_tensor(previous.classes),
        previous.classifier.weight.detach(),
        # a linear head: CompatibleConfig refuses bct with a cosine one (which has no bias)
        previous.classifier.bias.detach(),  # type: ignore[operator]
    )

    def loss(net: Backbone, x: torch.Tensor, targets: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        features = net.encoder.features(x)
        total = F.cross_entropy(net.classifier(features), targets)
        old_targets, known = _known(classes.to(labels.device), labels)
        if known.any():
            logits = features[known] @ w.to(x.device).T + b.to(x.device)
            total = total + weight * F.cross_entropy(logits, old_targets[known])
        return total

    return loss


def hoc_loss(previous: Backbone, weight: float, scale: float) -> LossFn[Backbone]:
    """CoReS + HOC (Biondi et al., "Stationary Representations", CVPR 2024, Eq. 3–4):
    ``(1 − weight)``·cross-entropy through the fixed simplex + ``weight``·InfoNCE between the
    previous version's and the new unit features of the batch — for each image, its previous
    feature is the anchor, its new feature the positive and the new features of the *other
    classes'* images the negatives (same-class pairs are left out), logits = ``scale``·cosine.
    Unlike the authors' code, which zeroes the same-class logits, they are dropped from the softmax."""

    def loss(net: Backbone, x: torch.Tensor, targets: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        features = net.encoder.features(x)
        cross_entropy = F.cross_entropy(net.classifier(features), targets)
        with torch.no_grad():
            anchors = F.normalize(previous.encoder.features(x), dim=1)
        logits = scale * anchors @ F.normalize(features, dim=1).T
        other_class = labels[:, None] != labels[None, :]
        logits = logits.masked_fill(
            ~(other_class | torch.eye(len(x), dtype=torch.bool, device=x.device)), float("-inf")
        )
        contrastive = F.cross_entropy(logits, torch.arange(len(x), device=x.device))
        return (1 - weight) * cross_entropy + weight * contrastive

    return loss


def synthesised_classifier(
    previous: Backbone, images: np.ndarray, labels: np.ndarray
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``previous``'s frozen classifier extended to the classes of ``labels`` it does not know:
    their rows are the class means of ``previous``'s raw features, scaled to the mean norm of
    its trained rows, with the mean of its biases (BCT's synthesised classifier)."""
    # a linear head: CompatibleConfig refuses bct with a cosine one (which has no bias)
    weight, bias = previous.classifier.weight.detach().cpu(), previous.classifier.bias.detach().cpu()  # type: ignore[operator]
    new = sorted(set(np.unique(labels).tolist()) - set(previous.classes))
    if not new:
        return torch.as_tensor(previous.classes), weight, bias
    features = extract_features(_Features(previous), images[np.isin(labels, new)])
    _, means = class_mean_classifier(features, labels[np.isin(labels, new)])
    rows = torch.from_numpy(means) * weight.norm(dim=1).mean()
    classes = torch.as_tensor(list(previous.classes) + new)
    order = torch.argsort(classes)
    return classes[order], torch.cat([weight, rows])[order], torch.cat([bias, bias.mean().repeat(len(new))])[order]


class _Features(nn.Module):
    """A backbone's raw (never normalised) feature, the input of its classifier."""

    def __init__(self, backbone: Backbone) -> None:
        super().__init__()
        self.backbone = backbone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone.encoder.features(x)


def class_mean_classifier(embeddings: np.ndarray, labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(classes, unit class means) of ``embeddings``: the pseudo classifier of an old model."""
    classes = np.unique(labels)
    means = np.stack([embeddings[labels == c].mean(axis=0) for c in classes])
    return classes, (means / np.maximum(np.linalg.norm(means, axis=1, keepdims=True), 1e-12)).astype(np.float32)


def bt2_loss(
    old: nn.Module, reference: nn.Module, pseudo: tuple[np.ndarray, np.ndarray], config: BT2Config, device: torch.device
) -> LossFn[BT2Backbone]:
    """BT²'s loss (:mod:`.compatible_config`): CE on f, cosine of the old-compatible block to φ_old and
    of f to φ_new', class-mean influence on the block."""
    old, reference = frozen(old, device), frozen(reference, device)
    classes = torch.as_tensor(pseudo[0], device=device)
    centres = torch.as_tensor(pseudo[1], device=device)

    def loss(net: BT2Backbone, x: torch.Tensor, targets: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        f, phi = net.parts(x)
        block = phi[:, : net.old_dim]
        with torch.no_grad():
            old_feature, new_feature = old(x), reference(x)
        total = F.cross_entropy(net.classifier(f), targets)
        total = total + config.old_weight * (1 - F.cosine_similarity(block, old_feature, dim=1)).mean()
        total = total + config.new_weight * (1 - F.cosine_similarity(f, new_feature, dim=1)).mean()
        old_targets, known = _known(classes, labels)
        if known.any() and config.influence_weight:
            logits = F.normalize(block[known], dim=1) @ centres.T / config.influence_temperature
            total = total + config.influence_weight * F.cross_entropy(logits, old_targets[known])
        return total

    return loss


__all__ = ["hoc_loss"]

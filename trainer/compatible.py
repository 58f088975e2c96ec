"""Compatible backbone training: new models whose embeddings can be compared with the old
model's *directly* (no adapter on the device, no change to the gallery). Three methods, next
to independent training and the adapter methods (FCT, λ-orth) on the same data:

- **BCT** (Shen et al., CVPR 2020): the new backbone is trained with cross-entropy on its
  classes plus the *influence loss*: its feature goes through the frozen classifier of the
  previous version, cross-entropy on the items of the previous version's classes and (with
  ``bct.new_classes = "class-means"``, the default) on the new classes' items too, through
  rows synthesised from the previous model's class means (the paper's §3.2). The new
  embedding has the previous one's dimension.
- **BT²** (Zhou et al., ICCV 2023), Algorithm 1: from the trunk, a feature f (n dims, matched
  by cosine to an independently trained new model φ_new' of dim n, and classified with
  cross-entropy) and an extra head g (e dims); with the learnt basis transformations B1 (n×n)
  and B2 (d×d), both expm of skew-symmetric matrices (:class:`~.lambda_orth.OrthogonalMap`)::

      z     = [g/‖g‖ ; C·B1·(f/‖f‖)]                      (e + n dims)
      φ_new = [B2·z[:d] ; z[d:]]                            (e + n dims)

  With n = d this is the paper's φ_new = [B2·[g/‖g‖ ; (C·B1·f)[:n−e]] ; (C·B1·f)[n−e:]];
  for n ≠ d (the kit's old and new demo models differ in width) the same rule splits z after
  the d old-compatible dims (d ≤ e + n is required). The old-compatible block φ_new[:d] is
  compared with φ_old by prefix truncation; it is trained with the cosine loss to φ_old and
  the BCT influence loss. Since the block is a cosine-space feature, the influence classifier
  is, as in the authors' code, the previous version's class-mean ("pseudo") classifier
  (unit class means of φ_old, logits = cosine / temperature), not its trained linear head.
  Losses: CE(f) + w_old·(1 − cos(φ_new[:d], φ_old)) + w_new·(1 − cos(f, φ_new')) + w_infl·CE_old.
- **CoReS** (Biondi et al., TPAMI 2023): every version is trained with the same *fixed*
  d-simplex classifier (K vertices for K reserved classes in K−1 dims, centred and
  unit-normalised, pairwise cosine −1/(K−1)); K covers the classes of all future versions, so
  the classes a version does not know yet are already reserved (their logits are negatives
  in its softmax). The classifier is a deterministic matrix, identical across upgrades (the
  "same initialisation"). As in CoReS's sequential fine-tuning, each version starts from the
  previous version's weights (``cores.warm_start``; every version then has ``old_backbone``'s
  architecture, optionally a lower ``cores.finetune_lr``). Checkpoints are
  selected under ECC: after every epoch the model is evaluated on a validation split of the
  training data that no CoReS version trains on (so old/old there is not measured on the
  previous version's training images); the chosen epoch is the best new/new among those whose new/old beats
  old/old against *every* previous version (when none does, the one with the largest
  smallest margin, and the run records that ECC did not hold on validation).
  As in the paper, the classifier is the plain fixed linear map on *unnormalised* features
  (zero bias, no scale or temperature), and version 1 already has every reserved vertex in its
  softmax, so the future classes' vertices are negatives while it trains.
  What this buys in the kit's protocol (measured, ``benchmarks/cores_variants.py``): on
  digits the classes the old model knew stay where they were (a from-scratch v2 beats v1 on
  them), but ECC on the evaluation of *all* classes fails for every variant tried (fine-tuning
  or from scratch, K = 10 or 33, with or without the selection): v1 never saw the new classes
  and maps their images next to the vertices of the classes it knows (the negatives push no
  input anywhere), while v2 puts them at their own reserved vertices, so new-class queries
  find next to nothing in the old gallery. Fine-tuning keeps them findable only while v2 has
  barely moved, which is what the ECC selection then picks (new/new ≈ old/old). The same holds
  in the authors' own protocol (``evaluation_classes = "held-out"``): features of classes no
  version trained on drift as v2 trains (new/old 0.38–0.58 vs old/old 0.81–0.88 at v2's last epoch).
- **CoReS + HOC** (method ``cores-hoc``; Biondi et al., "Stationary Representations", CVPR
  2024): CoReS's v1, and a v2 fine-tuned with ``(1 − w)``·CE through the fixed simplex +
  ``w``·InfoNCE aligning v2's features with v1's (:func:`hoc_loss`), the authors' fix for
  sequential fine-tuning. Measured on digits: with a *full* simplex (K = the classes) it
  satisfies ECC on a data-growth upgrade (``first_version_items``; 3 of 3 seeds, plain CoReS 1
  of 3); with spare vertices its negatives push v2's features into the unused vertex directions,
  away from v1's; on class growth it keeps the old classes' queries findable, not the others.

Protocol: a *sequence* of versions, each trained on the training split's items of the first
``n_k`` classes (``upgrade = [5, 10]``: one upgrade, the FCT protocol; ``sequence =
[4, 6, 8, 10]``: three upgrades). Version 1 uses ``old_backbone``, later versions
``new_backbone``. Every method is evaluated on the evaluation split restricted to the last
version's classes (``evaluation_classes = "trained"``), or to the classes no version trains on
(``"held-out"``, the open-set protocol of the CoReS authors' code), query = gallery, leave-one-out.
With ``first_version_items < 1`` version 1 sees only that fraction of its classes' items, and
``upgrade = [10, 10]`` is a data-growth upgrade (same classes, more images). Results:
C[i, j] = M(query model i, gallery model j) for j ≤ i, with AC and AM
(:func:`~.evaluation.compatibility_matrix`); embeddings of different dims are compared on the
shorter prefix (BT²'s old-compatible block). The adapter
methods fill C[i, j] for i > j with their own transformation between the independently
trained models (FCT: new/h(old, ψ), a direct h_{j→i} per pair, ψ = SimCLR on version 1's
data; λ-orth: B(new)/old, the backward-compatible case), and C[i, i] with the independent
model's own retrieval.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fctkit.config import from_mapping, load_config, to_mapping
from fctkit.errors import ConfigError, InputError

from .adapters import FCTAdapter, FCTConfig
from .backbones import Backbone, BackboneConfig, Encoder, extract_features, random_shift, save_backbone
from .datasets import class_subset, make_splits, validate_images
from fctkit.feature_checks import validate_labels
from .evaluation import CompatibilityMatrix, RetrievalResult, compatibility_matrix, ecc
from .fitting import History, fit, split_validation
from .lambda_orth import LambdaOrthAdapter, LambdaOrthConfig, OrthogonalMap
from .pipeline import DataConfig, load_image_splits
from .searches import EvaluationConfig, Evaluator
from .report import Report
from .side_info import SideInfoConfig, extract_side_info, train_side_info
from .torch_utils import load_model, resolve_device, save_model, set_seed

BackboneMethod = Literal["independent", "bct", "bt2", "cores", "cores-hoc"]
AdapterMethod = Literal["fct", "lambda-orth"]
BACKBONE_METHODS: tuple[str, ...] = ("independent", "bct", "bt2", "cores", "cores-hoc")
ADAPTER_METHODS: tuple[str, ...] = ("fct", "lambda-orth")
METHOD_LABELS = {
    "independent": "independent (no adapter)",
    "bct": "BCT",
    "bt2": "BT²",
    "cores": "CoReS",
    "cores-hoc": "CoReS + HOC",
    "fct": "FCT h(old, ψ)",
    "lambda-orth": "λ-orth B⊥(new)/old",
}


# --- configuration -----------------------------------------------------------------------


@dataclasses.dataclass
class BCTConfig:
    influence_weight: float = 1.0  # weight of the cross-entropy through the previous version's frozen classifier
    # Items of classes the previous version did not know: "class-means" extends its frozen
    # classifier with their class means under the previous model (BCT's synthesised
    # classifier, section 3.2 of the paper), so the influence loss covers every item;
    # "ignore" applies it to the previous version's classes only.
    new_classes: Literal["class-means", "ignore"] = "class-means"

    def __post_init__(self) -> None:
        if self.influence_weight < 0:
            raise ConfigError("bct.influence_weight must be >= 0")


@dataclasses.dataclass
class BT2Config:
    extra_dims: int = 32  # e: the extra head g
    scale: float = 3.0  # C, the weight of the new' part in φ_new
    old_weight: float = 10.0  # cosine matching of the old-compatible block to φ_old
    new_weight: float = 1.0  # cosine matching of f to the independently trained new model
    influence_weight: float = 1.0  # BCT influence on the old-compatible block
    influence_temperature: float = 0.1  # of the class-mean classifier's cosine logits

    def __post_init__(self) -> None:
        if self.extra_dims < 1 or self.scale <= 0 or self.influence_temperature <= 0:
            raise ConfigError("bt2: extra_dims must be >= 1, scale and influence_temperature > 0")
        if min(self.old_weight, self.new_weight, self.influence_weight) < 0:
            raise ConfigError("bt2: old_weight, new_weight and influence_weight must be >= 0")


@dataclasses.dataclass
class CoReSConfig:
    reserved_classes: int = 0  # K simplex vertices (embedding dim K − 1); 0 = the dataset's classes
    ecc_selection: bool = True  # pick the checkpoint under ECC on a validation split (else the last epoch)
    warm_start: bool = True  # each version starts from the previous one's weights (all use old_backbone's architecture)
    finetune_lr: float = 0.0  # learning rate of the warm-started versions; 0 = old_backbone's lr
    # method "cores-hoc" only: loss = (1 − w)·CE + w·HOC, HOC the InfoNCE between the new and
    # previous version's unit features with logits scaled by hoc_scale (the authors' w = 0.9, μ = 10)
    hoc_weight: float = 0.9
    hoc_scale: float = 10.0

    def __post_init__(self) -> None:
        if self.reserved_classes == 1 or self.reserved_classes < 0:
            raise ConfigError("cores.reserved_classes must be 0 (the dataset's classes) or >= 2")
        if self.finetune_lr < 0:
            raise ConfigError("cores.finetune_lr must be >= 0 (0: old_backbone's lr)")
        if not 0 <= self.hoc_weight <= 1 or self.hoc_scale <= 0:
            raise ConfigError("cores: hoc_weight must be in [0, 1] and hoc_scale > 0")


@dataclasses.dataclass
class CompatibleConfig:
    """A `fctkit train-compatible` run (see the module docstring). ``data`` is the pipeline's
    section: ``name``, ``max_items`` and ``train_fraction`` apply; the classes each version sees
    come from ``upgrade`` / ``sequence`` (not ``data.old_class_fraction``)."""

    seed: int = 0
    device: str = "auto"
    progress: bool = True
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    upgrade: tuple[int, ...] = (5, 10)  # classes seen by each version of the one-upgrade comparison
    sequence: tuple[int, ...] = ()  # multi-step sequence (e.g. [4, 6, 8, 10]); empty: skipped
    # Which evaluation items every case is measured on: "trained", the last version's classes
    # (the FCT / BCT protocol: v1 never saw some of them); "held-out", the classes no version
    # trains on (the CoReS / CL²R open-set protocol, whose code trains on CIFAR-100 and
    # evaluates on CIFAR-10), which needs the last version to leave some of the dataset's classes out.
    evaluation_classes: Literal["trained", "held-out"] = "trained"
    # Fraction of each class's training items version 1 trains on (a stratified subset drawn
    # with the run's seed; later versions train on all). Below 1 the first step may keep the
    # class count (upgrade = [10, 10]): a *data-growth* upgrade, same classes, more images.
    first_version_items: float = 1.0
    methods: tuple[str, ...] = BACKBONE_METHODS
    adapters: tuple[str, ...] = ADAPTER_METHODS
    old_backbone: BackboneConfig = dataclasses.field(default_factory=lambda: BackboneConfig(architecture="small"))
    new_backbone: BackboneConfig = dataclasses.field(default_factory=lambda: BackboneConfig(architecture="wide", embedding_dim=64))
    bct: BCTConfig = dataclasses.field(default_factory=BCTConfig)
    bt2: BT2Config = dataclasses.field(default_factory=BT2Config)
    cores: CoReSConfig = dataclasses.field(default_factory=CoReSConfig)
    side_info: SideInfoConfig = dataclasses.field(default_factory=SideInfoConfig)
    fct: FCTConfig = dataclasses.field(default_factory=FCTConfig)
    lambda_orth: LambdaOrthConfig = dataclasses.field(default_factory=LambdaOrthConfig)
    evaluation: EvaluationConfig = dataclasses.field(default_factory=lambda: EvaluationConfig(distance="cosine"))

    def __post_init__(self) -> None:
        if self.data.name == "features":
            raise ConfigError("train-compatible trains backbones: data.name must be an image dataset (digits, fashion-mnist)")
        for name, allowed in (("methods", BACKBONE_METHODS), ("adapters", ADAPTER_METHODS)):
            unknown = sorted(set(getattr(self, name)) - set(allowed))
            if unknown:
                raise ConfigError(f"{name}: unknown {', '.join(unknown)}; choose from {', '.join(allowed)}")
        if not 0 < self.first_version_items <= 1:
            raise ConfigError(f"first_version_items must be in (0, 1], got {self.first_version_items}")
        for name in ("upgrade", "sequence"):
            counts = list(getattr(self, name))
            if not counts:
                continue
            steps = counts[1:] if self.first_version_items < 1 and counts[:1] == counts[1:2] else counts
            if len(counts) < 2 or min(counts) < 2 or steps != sorted(set(steps)):
                raise ConfigError(f"{name}: expected >= 2 strictly growing class counts (each >= 2; the first two may be "
                                  f"equal when first_version_items < 1), got {list(counts)}")
        if not self.upgrade and not self.sequence:
            raise ConfigError("nothing to run: set upgrade and/or sequence")
        if self.evaluation_classes not in ("trained", "held-out"):
            raise ConfigError(f"evaluation_classes: expected \"trained\" or \"held-out\", got {self.evaluation_classes!r}")


def load_compatible_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> CompatibleConfig:
    """A config from a TOML file (unknown keys are errors) with optional dotted-key overrides."""
    return load_config(CompatibleConfig, path, overrides)


# --- models --------------------------------------------------------------------------------


def simplex_vertices(n_classes: int) -> np.ndarray:
    """The fixed d-simplex classifier: ``n_classes`` unit vectors in ``n_classes − 1`` dims,
    centred, pairwise cosine −1/(K−1). Deterministic (no seed), so every version gets the same."""
    if n_classes < 2:
        raise InputError(f"a simplex classifier needs at least 2 classes, got {n_classes}")
    centred = np.eye(n_classes) - 1.0 / n_classes
    # Rows of `centred` span the (K−1)-dim subspace orthogonal to the all-ones vector: express
    # them in an orthonormal basis of it (the first K−1 right singular vectors).
    _, _, vt = np.linalg.svd(centred)
    vertices = centred @ vt[: n_classes - 1].T
    return (vertices / np.linalg.norm(vertices, axis=1, keepdims=True)).astype(np.float32)


def cores_backbone(config: BackboneConfig, reserved_classes: int, in_channels: int) -> Backbone:
    """A :class:`Backbone` over classes ``0..K−1`` whose classifier is the fixed simplex
    (no bias, not trained); its embedding has K − 1 dims. The simplex *is* CoReS's classifier,
    so ``config.classifier`` (e.g. "cosine") and ``embedding_dim`` are replaced."""
    config = dataclasses.replace(config, embedding_dim=reserved_classes - 1, classifier="linear")
    backbone = Backbone(config, tuple(range(reserved_classes)), in_channels)
    with torch.no_grad():
        backbone.classifier.weight.copy_(torch.from_numpy(simplex_vertices(reserved_classes)))
        backbone.classifier.bias.zero_()
    backbone.classifier.requires_grad_(False)
    return backbone


class BT2Backbone(nn.Module):
    """The BT² new model (module docstring): ``forward(x)`` is φ_new (e + n dims), whose first
    ``old_dim`` dims are the old-compatible block; ``classify(x)`` gives logits over ``classes``."""

    def __init__(self, config: BackboneConfig, classes: tuple[int, ...], in_channels: int, old_dim: int,
                 extra_dims: int, scale: float) -> None:
        super().__init__()
        n = config.embedding_dim
        if not 1 <= old_dim <= extra_dims + n:
            raise ConfigError(f"bt2: the old dim {old_dim} must be at most extra_dims + the new' dim = {extra_dims + n}")
        self.config, self.classes = config, tuple(int(c) for c in classes)
        self.old_dim, self.extra_dims, self.scale = old_dim, extra_dims, float(scale)
        self.encoder = Encoder(config.architecture, config.width, n, in_channels, False, config.pool_grid)
        self.extra_head = nn.Linear(self.encoder.projection.in_features, extra_dims)
        self.classifier = nn.Linear(n, len(self.classes))
        self.new_basis = OrthogonalMap(n)  # B1
        self.old_basis = OrthogonalMap(old_dim)  # B2

    @property
    def embedding_dim(self) -> int:
        return self.extra_dims + self.config.embedding_dim

    @property
    def in_channels(self) -> int:
        return self.encoder.in_channels

    def parts(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(f, φ_new): the new' feature (raw) and the final embedding."""
        trunk = self.encoder.trunk(_checked_images(x, self.in_channels))
        f = self.encoder.projection(trunk)
        z = torch.cat([F.normalize(self.extra_head(trunk), dim=1), self.scale * self.new_basis(F.normalize(f, dim=1))], dim=1)
        return f, torch.cat([self.old_basis(z[:, : self.old_dim]), z[:, self.old_dim :]], dim=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.parts(x)[1]

    def classify(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.parts(x)[0])

    def bases(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The materialised (B1, B2)."""
        return self.new_basis.weight.detach(), self.old_basis.weight.detach()

    def export_module(self) -> nn.Module:
        """The embedding with B1, B2 materialised as plain matrices (``matrix_exp`` does not
        export to ONNX); computes the same φ_new."""
        return _MaterialisedBT2(copy.deepcopy(self).cpu().eval())


class _MaterialisedBT2(nn.Module):
    def __init__(self, model: BT2Backbone) -> None:
        super().__init__()
        self.encoder, self.extra_head = model.encoder, model.extra_head
        b1, b2 = model.bases()
        self.register_buffer("b1", b1.clone())
        self.register_buffer("b2", b2.clone())
        self.old_dim, self.scale = model.old_dim, model.scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        trunk = self.encoder.trunk(x)
        f = F.normalize(self.encoder.projection(trunk), dim=1)
        z = torch.cat([F.normalize(self.extra_head(trunk), dim=1), self.scale * (f @ self.b1.T)], dim=1)
        return torch.cat([z[:, : self.old_dim] @ self.b2.T, z[:, self.old_dim :]], dim=1)


def _checked_images(x: torch.Tensor, in_channels: int) -> torch.Tensor:
    if x.ndim != 4 or x.shape[1] != in_channels:
        raise InputError(f"expected images of shape (N, {in_channels}, H, W), got {tuple(x.shape)}")
    return x


BT2_FORMAT = "fctkit.bt2_backbone"


def save_bt2(model: BT2Backbone, path: str | Path) -> Path:
    """Save a BT² model (weights, config, classes, dims) in one file."""
    return save_model(path, BT2_FORMAT, model, old_dim=model.old_dim, extra_dims=model.extra_dims, scale=model.scale)


def load_compatible_model(path: str | Path, device: str = "cpu") -> nn.Module:
    """Load a version written by this module: a :class:`Backbone` (independent, BCT, CoReS) or
    a :class:`BT2Backbone`, in eval mode."""
    from .backbones import BACKBONE_FORMAT, backbone_from_meta

    return load_model(path, {BT2_FORMAT: _bt2_from_meta, BACKBONE_FORMAT: backbone_from_meta}, device)


def _bt2_from_meta(meta: dict[str, Any], where: str) -> BT2Backbone:
    config = from_mapping(BackboneConfig, meta["config"], where=f"{where}: config")
    return BT2Backbone(config, tuple(meta["classes"]), int(meta["in_channels"]), int(meta["old_dim"]),
                       int(meta["extra_dims"]), float(meta["scale"]))


def save_compatible_model(model: nn.Module, path: str | Path) -> Path:
    return save_bt2(model, path) if isinstance(model, BT2Backbone) else save_backbone(model, path)


# --- training one version -------------------------------------------------------------------


@dataclasses.dataclass
class VersionTraining:
    """What one version is trained on and how (filled by :class:`SequenceRun`)."""

    images: np.ndarray
    labels: np.ndarray
    backbone: BackboneConfig
    seed: int
    device: str


LossFn = Callable[[nn.Module, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


def cross_entropy(net: nn.Module, x: torch.Tensor, targets: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The plain loss: cross-entropy of ``net.classify`` over the model's classes."""
    return F.cross_entropy(net.classify(x), targets)


def _class_targets(labels: np.ndarray, classes: tuple[int, ...]) -> np.ndarray:
    """Index of each label in ``classes``; −1 where the label is not one of them."""
    order = np.asarray(classes)
    index = np.searchsorted(order, labels).clip(0, len(order) - 1)
    return np.where(order[index] == labels, index, -1).astype(np.int64)


def _frozen(model: nn.Module, device: torch.device) -> nn.Module:
    model = model.to(device).eval()
    model.requires_grad_(False)
    return model


def train_model(model: nn.Module, job: VersionTraining, loss: LossFn = cross_entropy, *, description: str,
                selector: EccSelector | None = None) -> History:
    """Train ``model`` (anything with ``classify`` and ``classes``) on ``job`` with
    ``loss(model, x, targets, labels)`` (targets: indices into ``model.classes``; x shifted
    randomly while training) — the one loop behind every method.

    Without ``selector``: early stopping on the validation loss (as :func:`train_backbone`).
    With one: the whole training set is used with no early stopping; the selector evaluates
    every epoch on its own held-out images and restores the epoch it picks.
    """
    targets = _class_targets(job.labels, model.classes)
    if (targets < 0).any():
        raise InputError(f"{description}: labels {sorted(set(job.labels[targets < 0].tolist()))} are not among the model's classes")
    shift = job.backbone.shift_augment

    def loss_fn(net: nn.Module, x: torch.Tensor, y: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return loss(net, random_shift(x, shift) if net.training else x, y, labels)

    train_config = job.backbone.train_config(job.seed, job.device)
    if selector is not None:
        train_config = dataclasses.replace(train_config, val_fraction=0.0)
    history = fit(model, [job.images, targets, job.labels], loss_fn, train_config, description=description,
                  on_epoch_start=selector)
    if selector is not None:
        selector.finish(model, len(history.train_loss))
    model.history = history
    return history


def _known(classes: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(index of each label in sorted ``classes``, mask of the labels that are among them)."""
    index = torch.searchsorted(classes, labels).clamp(max=len(classes) - 1)
    return index, classes[index] == labels


def bct_loss(previous: Backbone, weight: float, classifier: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None) -> LossFn:
    """BCT: cross-entropy on the new classes plus the *influence loss*, the cross-entropy of the
    new feature through ``previous``'s frozen classifier, on the items of the classes that
    classifier knows. ``classifier`` = (classes, weight, bias) replaces ``previous``'s own head
    (e.g. :func:`synthesised_classifier`, which also knows the new classes)."""
    classes, w, b = classifier or (torch.as_tensor(previous.classes), previous.classifier.weight.detach(), previous.classifier.bias.detach())

    def loss(net: Backbone, x: torch.Tensor, targets: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        features = net.encoder.features(x)
        total = F.cross_entropy(net.classifier(features), targets)
        old_targets, known = _known(classes.to(labels.device), labels)
        if known.any():
            logits = features[known] @ w.to(x.device).T + b.to(x.device)
            total = total + weight * F.cross_entropy(logits, old_targets[known])
        return total

    return loss


def hoc_loss(previous: Backbone, weight: float, scale: float) -> LossFn:
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
        logits = logits.masked_fill(~(other_class | torch.eye(len(x), dtype=torch.bool, device=x.device)), float("-inf"))
        contrastive = F.cross_entropy(logits, torch.arange(len(x), device=x.device))
        return (1 - weight) * cross_entropy + weight * contrastive

    return loss


def synthesised_classifier(previous: Backbone, images: np.ndarray, labels: np.ndarray) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``previous``'s frozen classifier extended to the classes of ``labels`` it does not know:
    their rows are the class means of ``previous``'s raw features, scaled to the mean norm of
    its trained rows, with the mean of its biases (BCT's synthesised classifier)."""
    weight, bias = previous.classifier.weight.detach().cpu(), previous.classifier.bias.detach().cpu()
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


def bt2_loss(old: nn.Module, reference: nn.Module, pseudo: tuple[np.ndarray, np.ndarray], config: BT2Config,
             device: torch.device) -> LossFn:
    """BT²'s loss (module docstring): CE on f, cosine of the old-compatible block to φ_old and
    of f to φ_new', class-mean influence on the block."""
    old, reference = _frozen(old, device), _frozen(reference, device)
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


class EccSelector:
    """CoReS's checkpoint selection (module docstring). Called by :func:`fit` at the start of
    every epoch (so it sees the weights after the previous one) and by :meth:`finish`."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, previous: list[np.ndarray],
                 evaluation: EvaluationConfig) -> None:
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
        key, epoch, state = self._best
        model.load_state_dict(state)
        model.eval()
        self.choice = {"epoch": epoch, "ecc_on_validation": key[0], "epochs": len(self.log)}
        return self.choice


# --- one sequence of versions -----------------------------------------------------------------


Pairs = dict[tuple[int, int], tuple[np.ndarray, np.ndarray]]  # (i, j) -> (query rows, gallery rows)


@dataclasses.dataclass
class SequenceResult:
    """Per method: C[i, j] retrieval results on all evaluation classes and (``known``) on the
    classes gallery version j was trained on (empty when the evaluation classes are held out),
    the compatibility matrix, embedding dims."""

    name: str
    class_counts: tuple[int, ...]
    results: dict[str, dict[tuple[int, int], RetrievalResult]]
    known: dict[str, dict[tuple[int, int], RetrievalResult]]
    matrices: dict[str, CompatibilityMatrix]
    dims: dict[str, list[int]]
    facts: dict[str, Any]

    def ecc(self, method: str, i: int, j: int, known: bool = False, metric: str = "top1") -> bool:
        """ECC for query version i against gallery version j: M(i, j) > M(j, j) (``known``: on
        the classes of version j only; ``metric``: see :func:`~.evaluation.metric_value`)."""
        cases = (self.known if known else self.results)[method]
        return ecc(cases[(i, j)], cases[(j, j)], metric)

    def to_dict(self) -> dict[str, Any]:
        return {
            "class_counts": list(self.class_counts),
            "matrices": {m: c.to_dict() for m, c in self.matrices.items()},
            "cases": {m: {f"v{i + 1}/v{j + 1}": r.to_dict() for (i, j), r in cases.items()} for m, cases in self.results.items()},
            "ecc": {m: {f"v{i + 1}/v{j + 1}": self.ecc(m, i, j) for (i, j) in cases if i > j} for m, cases in self.results.items()},
            "cases_on_gallery_classes": {m: {f"v{i + 1}/v{j + 1}": r.to_dict() for (i, j), r in cases.items()} for m, cases in self.known.items()},
            "ecc_on_gallery_classes": {m: {f"v{i + 1}/v{j + 1}": self.ecc(m, i, j, True) for (i, j) in cases if i > j} for m, cases in self.known.items()},
            "dims": self.dims,
            "facts": self.facts,
        }


def evaluation_items(labels: np.ndarray, train: np.ndarray, evaluation: np.ndarray, last_classes: int,
                     evaluation_classes: str) -> np.ndarray:
    """The ``evaluation`` items every case is measured on: those of the first ``last_classes``
    training classes ("trained") or of the other classes ("held-out"; see
    :attr:`CompatibleConfig.evaluation_classes`)."""
    trained = np.isin(labels[evaluation], np.unique(labels[train])[:last_classes])
    return evaluation[~trained if evaluation_classes == "held-out" else trained]


class SequenceRun:
    """Trains every method's versions over one class sequence and evaluates them."""

    def __init__(self, config: CompatibleConfig, name: str, class_counts: tuple[int, ...], images: np.ndarray,
                 labels: np.ndarray, train: np.ndarray, evaluation: np.ndarray, n_classes: int, out: Path,
                 log: Callable[[str], None]) -> None:
        self.config, self.name, self.counts, self.log = config, name, tuple(class_counts), log
        if self.counts[-1] > n_classes:
            raise ConfigError(f"{name}: {self.counts[-1]} classes asked for, the dataset has {n_classes}")
        self.images, self.labels = validate_images(images), validate_labels(labels)
        self.train = train[np.isin(labels[train], np.unique(labels[train])[: self.counts[-1]])]
        self.held_out = config.evaluation_classes == "held-out"
        self.eval_index = evaluation_items(labels, train, evaluation, self.counts[-1], config.evaluation_classes)
        if len(np.unique(labels[self.eval_index])) < 2:
            raise ConfigError(f"{name}: evaluation_classes = {config.evaluation_classes!r} leaves fewer than 2 evaluation "
                              f"classes (the last version trains on {self.counts[-1]} of {n_classes}); "
                              "train the last version on fewer classes")
        self.facts: dict[str, Any] = {}
        self.version_items = [self.train[class_subset(labels[self.train], c)] for c in self.counts]
        if config.first_version_items < 1:
            self.version_items[0] = self._first_version_subset(config.first_version_items)
            self.facts["first_version_items"] = config.first_version_items
        self.reserved = config.cores.reserved_classes or n_classes
        self.out = out / "models" / name
        self.evaluate = Evaluator.labelled(labels[self.eval_index], config.evaluation)
        self._cores_first: nn.Module | None = None  # CoReS's v1, shared by "cores" and "cores-hoc"

    def _first_version_subset(self, fraction: float) -> np.ndarray:
        """``fraction`` of each class's items of version 1, the stratified draw of :func:`make_splits`."""
        items = self.version_items[0]
        kept = items[make_splits(self.labels[items], self.config.seed, train_fraction=fraction, query_fraction=0.0).train]
        classes, counts = np.unique(self.labels[kept], return_counts=True)
        if len(classes) < len(np.unique(self.labels[items])) or counts.min() < 2:
            raise ConfigError(f"first_version_items = {fraction} leaves version 1 fewer than 2 images of some class; raise it")
        return kept

    # each version's job: its items, its backbone config and seed
    def job(self, k: int, backbone: BackboneConfig | None = None, items: np.ndarray | None = None) -> VersionTraining:
        items = self.version_items[k] if items is None else items
        config = backbone or (self.config.old_backbone if k == 0 else self.config.new_backbone)
        return VersionTraining(self.images[items], self.labels[items], config, self.config.seed + 10 * k, self.config.device)

    def run(self) -> SequenceResult:
        versions: dict[str, list[nn.Module]] = {"independent": self._independent()}
        for method in self.config.methods:
            if method != "independent":
                versions[method] = getattr(self, f"_{method.replace('-', '_')}")(versions["independent"])
        pairs: dict[str, Pairs] = {}
        for method in self.config.methods:
            embeddings = [extract_features(m, self.images[self.eval_index]) for m in versions[method]]
            pairs[method] = {(i, j): (embeddings[i], embeddings[j]) for i in range(len(self.counts)) for j in range(i + 1)}
            for k, model in enumerate(versions[method]):
                save_compatible_model(model, self.out / method / f"v{k + 1}.pt")
        for adapter in self.config.adapters:
            pairs[adapter] = self._adapter_pairs(adapter, versions["independent"])
        results = {m: {key: self.evaluate(q, g) for key, (q, g) in p.items()} for m, p in pairs.items()}
        known = {} if self.held_out else {m: {key: self._evaluate_known(key[1], q, g) for key, (q, g) in p.items()}
                                          for m, p in pairs.items()}
        dims = {m: [int(p[(k, k)][0].shape[1]) for k in range(len(self.counts))] for m, p in pairs.items()}
        matrices = {m: compatibility_matrix(lambda i, j, m=m: results[m][(i, j)].top1, len(self.counts)) for m in results}
        return SequenceResult(self.name, self.counts, results, known, matrices, dims, self.facts)

    def _evaluate_known(self, j: int, query: np.ndarray, gallery: np.ndarray) -> RetrievalResult:
        """The case on the evaluation items of the classes gallery version j was trained on."""
        mask = np.isin(self.labels[self.eval_index], np.unique(self.labels[self.version_items[j]]))
        return Evaluator.labelled(self.labels[self.eval_index][mask], self.config.evaluation)(query[mask], gallery[mask])

    def _independent(self) -> list[nn.Module]:
        models = []
        for k in range(len(self.counts)):
            job = self.job(k)
            self.log(f"{self.name}: independent v{k + 1} ({job.backbone.architecture}, {self.counts[k]} classes, {len(job.labels)} images)")
            set_seed(job.seed)
            model = Backbone(job.backbone, tuple(np.unique(job.labels).tolist()), job.images.shape[1])
            train_model(model, job, description=f"independent v{k + 1}")
            models.append(model)
        return models

    def _bct(self, independent: list[nn.Module]) -> list[nn.Module]:
        models = [independent[0]]
        for k in range(1, len(self.counts)):
            previous = models[-1]
            job = self.job(k, dataclasses.replace(self.config.new_backbone, embedding_dim=previous.embedding_dim))
            self.log(f"{self.name}: BCT v{k + 1} (influence of v{k}'s classifier)")
            set_seed(job.seed)
            model = Backbone(job.backbone, tuple(np.unique(job.labels).tolist()), job.images.shape[1])
            previous = _frozen(previous, resolve_device(job.device))
            head = synthesised_classifier(previous, job.images, job.labels) if self.config.bct.new_classes == "class-means" else None
            loss = bct_loss(previous, self.config.bct.influence_weight, head)
            train_model(model, job, loss, description=f"BCT v{k + 1}")
            models.append(model)
        return models

    def _bt2(self, independent: list[nn.Module]) -> list[nn.Module]:
        models, bt2 = [independent[0]], self.config.bt2
        for k in range(1, len(self.counts)):
            previous, reference = models[-1], independent[k]
            job = self.job(k)
            old_items = self.version_items[k - 1]
            old_embeddings = extract_features(previous, self.images[old_items])
            pseudo = class_mean_classifier(old_embeddings, self.labels[old_items])
            self.log(f"{self.name}: BT² v{k + 1} (old block {old_embeddings.shape[1]} dims, +{bt2.extra_dims} extra)")
            set_seed(job.seed)
            new_dim = reference.embedding_dim
            model = BT2Backbone(dataclasses.replace(job.backbone, embedding_dim=new_dim), tuple(np.unique(job.labels).tolist()),
                                job.images.shape[1], old_embeddings.shape[1], bt2.extra_dims, bt2.scale)
            loss = bt2_loss(previous, reference, pseudo, bt2, resolve_device(job.device))
            train_model(model, job, loss, description=f"BT² v{k + 1}")
            models.append(model)
        return models

    def _cores_hoc(self, independent: list[nn.Module]) -> list[nn.Module]:
        return self._cores(independent, hoc=True)

    def _cores(self, _independent: list[nn.Module], hoc: bool = False) -> list[nn.Module]:
        """CoReS's versions (with ``hoc``: CoReS + HOC from v2 on; v1, trained with the
        cross-entropy alone, is the same model for both and trained once)."""
        models: list[nn.Module] = []
        if self.counts[-1] > self.reserved:
            raise ConfigError(f"cores.reserved_classes = {self.reserved} leaves no room for the {self.counts[-1]} classes of the last version")
        choices = []
        held_out = self._cores_validation_items()
        for k in range(len(self.counts)):
            if k == 0 and self._cores_first is not None:
                models.append(self._cores_first)
                continue
            items = self.version_items[k]
            job = self.job(k, self._cores_backbone(k), items[~np.isin(items, held_out)])
            if job.labels.max() >= self.reserved or job.labels.min() < 0:
                raise InputError(f"CoReS needs class labels 0..{self.reserved - 1} (the simplex's vertices); got {job.labels.min()}..{job.labels.max()}")
            self.log(f"{self.name}: CoReS v{k + 1} (fixed {self.reserved}-vertex simplex, {self.reserved - 1} dims)")
            set_seed(job.seed)
            model = cores_backbone(job.backbone, self.reserved, job.images.shape[1])
            if models and self.config.cores.warm_start:
                model.load_state_dict(models[-1].state_dict())
            selector = None
            if self.config.cores.ecc_selection:
                val_items = items[np.isin(items, held_out)]
                val_images = self.images[val_items]
                selector = EccSelector(val_images, self.labels[val_items], [extract_features(m, val_images) for m in models],
                                       self.config.evaluation)
            loss = cross_entropy
            if hoc and models:
                loss = hoc_loss(_frozen(models[-1], resolve_device(job.device)), self.config.cores.hoc_weight, self.config.cores.hoc_scale)
            train_model(model, job, loss, description=f"CoReS{' + HOC' if hoc else ''} v{k + 1}", selector=selector)
            if selector is not None:
                choices.append({"version": k + 1, **selector.choice})
            models.append(model)
        self._cores_first = models[0]
        self.facts["cores-hoc_checkpoints" if hoc else "cores_checkpoints"] = choices
        return models

    def _cores_validation_items(self) -> np.ndarray:
        """The ECC selection's validation items: one split of the whole sequence's training items
        that no CoReS version trains on, so that old/old on validation is not measured on
        images the previous version was trained on (empty without the selection)."""
        if not self.config.cores.ecc_selection:
            return np.empty(0, dtype=self.version_items[-1].dtype)
        fraction = self.config.old_backbone.val_fraction
        if not 0 < fraction < 1:
            raise ConfigError("cores.ecc_selection needs a validation split: set old_backbone.val_fraction in (0, 1)")
        _, val_pos = split_validation(len(self.version_items[-1]), fraction, self.config.seed)
        return self.version_items[-1][val_pos]

    def _cores_backbone(self, k: int) -> BackboneConfig | None:
        cores = self.config.cores
        if not cores.warm_start:
            return None
        if k == 0 or not cores.finetune_lr:
            return self.config.old_backbone
        return dataclasses.replace(self.config.old_backbone, lr=cores.finetune_lr)

    def _adapter_pairs(self, method: str, independent: list[nn.Module]) -> Pairs:
        """(query, gallery) of C[i, j] for an adapter method between the independent versions
        (module docstring)."""
        train_images, eval_images = self.images[self.train], self.images[self.eval_index]
        train_features = [extract_features(m, train_images) for m in independent]
        eval_features = [extract_features(m, eval_images) for m in independent]
        side_train = side_eval = None
        if method == "fct" and self.config.side_info.kind != "none":
            self.log(f"{self.name}: side-info ψ ({self.config.side_info.kind}) on v1's data")
            first = self.version_items[0]
            side_model = train_side_info(self.images[first], self.labels[first], self.config.side_info, self.config.seed + 2, self.config.device)
            side_train, side_eval = extract_side_info(side_model, train_images), extract_side_info(side_model, eval_images)
        position = {int(item): p for p, item in enumerate(self.train)}
        cases: Pairs = {(i, i): (eval_features[i], eval_features[i]) for i in range(len(self.counts))}
        for i in range(1, len(self.counts)):
            rows = np.asarray([position[int(item)] for item in self.version_items[i]])
            for j in range(i):
                self.log(f"{self.name}: {METHOD_LABELS[method]} v{j + 1} → v{i + 1}")
                seed = self.config.seed + 100 * i + j
                if method == "fct":
                    use_side = side_train is not None
                    fct = dataclasses.replace(self.config.fct, side_info=use_side, train=dataclasses.replace(self.config.fct.train, seed=seed))
                    adapter, _ = FCTAdapter.fit(train_features[j][rows], train_features[i][rows],
                                                side_train[rows] if use_side else None, fct)
                    cases[(i, j)] = (eval_features[i], adapter.transform(eval_features[j], side_eval if use_side else None))
                else:
                    lo = dataclasses.replace(self.config.lambda_orth, train=dataclasses.replace(self.config.lambda_orth.train, seed=seed))
                    adapter, _ = LambdaOrthAdapter.fit(train_features[j][rows], train_features[i][rows], self.labels[self.version_items[i]], lo)
                    cases[(i, j)] = (adapter.transform_new(eval_features[i]), adapter.unified_old(eval_features[j]))
        return cases


# --- the run -----------------------------------------------------------------------------------


@dataclasses.dataclass
class CompatibleResult:
    upgrade: SequenceResult | None
    sequence: SequenceResult | None
    files: dict[str, Path]
    seconds: float


def run_compatible(config: CompatibleConfig, out: str | Path, log: Callable[[str], None] = print) -> CompatibleResult:
    """Run the one-upgrade comparison and the multi-step sequence; write models, results and
    ``report.{md,json,png}`` to ``out``."""
    start = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    _quiet_progress(config)
    splits = load_image_splits(config)
    runs: dict[str, SequenceResult | None] = {"upgrade": None, "sequence": None}
    for name in runs:
        counts = getattr(config, name)
        if counts:
            runs[name] = SequenceRun(config, name, counts, splits.images, splits.labels, splits.train, splits.evaluation,
                                     splits.n_classes, out, log).run()
    report = upgrade_report(config, runs["upgrade"]) if runs["upgrade"] else Report(f"fctkit train-compatible: {config.data.name}")
    files = report.save(out)
    markdown = report.to_markdown() + "\n" + results_markdown(runs["upgrade"], runs["sequence"])
    files["markdown"].write_text(markdown, encoding="utf-8")
    files["results"] = _write_json(out / "results.json", {k: v.to_dict() for k, v in runs.items() if v is not None})
    files["gate"] = _write_json(out / "gate.json", compatible_gate(runs["upgrade"], config.evaluation_classes)) if runs["upgrade"] else None
    files["config"] = _write_json(out / "config.json", to_mapping(config))
    files = {k: v for k, v in files.items() if v is not None}
    seconds = time.perf_counter() - start
    log(f"done in {seconds:.1f} s; report in {files['markdown']}")
    return CompatibleResult(runs["upgrade"], runs["sequence"], files, seconds)


def upgrade_report(config: CompatibleConfig, result: SequenceResult) -> Report:
    """The one upgrade as a report: cases per method and their ECC verdicts."""
    report = Report(f"fctkit train-compatible: {config.data.name}, classes {result.class_counts[0]} → {result.class_counts[1]}")
    for method, cases in result.results.items():
        label = METHOD_LABELS[method]
        names = {(0, 0): "old/old", (1, 1): "new/new",
                 (1, 0): {"fct": "new/h(old)", "lambda-orth": "B(new)/old"}.get(method, "new/old")}
        for key, case in names.items():
            report.add_case(f"{case} [{label}]", cases[key], method=method)
        report.add_verdict(f"ECC [{label}]", result.ecc(method, 1, 0),
                           f"{names[(1, 0)]} {cases[(1, 0)].top1:.4f} vs old/old {cases[(0, 0)].top1:.4f}")
    return report


def compatible_gate(result: SequenceResult, evaluation_classes: str) -> dict[str, Any]:
    """Per backbone method of the one upgrade: the cases and ECC a compatible bundle records,
    and which evaluation classes they were measured on."""
    gate: dict[str, Any] = {"cases": {}, "ecc": {}, "dims": {}, "evaluation_classes": evaluation_classes}
    for method in result.results:
        cases = result.results[method]
        gate["cases"][method] = {name: _metrics(cases[key]) for name, key in (("old/old", (0, 0)), ("new/old", (1, 0)), ("new/new", (1, 1)))}
        gate["ecc"][method] = result.ecc(method, 1, 0)
        gate["dims"][method] = result.dims[method]
    return gate


def results_markdown(upgrade: SequenceResult | None, sequence: SequenceResult | None) -> str:
    """The figures' tables: one upgrade (new/old, new/new, ECC per method) and the multi-step
    sequence (AC, AM and C per method)."""
    lines: list[str] = []
    if upgrade is not None:
        old_classes = upgrade.class_counts[0]
        fraction = upgrade.facts.get("first_version_items")
        images = f", v1 on {fraction:.0%} of the training images" if fraction else ""
        lines += [f"## One upgrade: classes {old_classes} → {upgrade.class_counts[1]}{images} (top-1)", "",
                  ("Evaluation classes held out from every version's training (the CoReS protocol)"
                   if not upgrade.known else "All evaluation classes")
                  + " (ECC on top-1, and on mAP@1.0 with both mAPs); the last three columns on the old model's classes only.", "",
                  "| method | old/old | new/old | new/new | ECC | mAP old/old → new/old, ECC | dims (old → new) "
                  "| old/old, old classes | new/old, old classes | ECC, old classes |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for method, cases in upgrade.results.items():
            dims = upgrade.dims[method]
            on_old_classes = ["—"] * 3  # held-out evaluation classes: none of them is an old class
            if upgrade.known:
                known = upgrade.known[method]
                on_old_classes = [f"{known[(0, 0)].top1:.4f}", f"{known[(1, 0)].top1:.4f}", _yes(upgrade.ecc(method, 1, 0, True))]
            lines.append(f"| {METHOD_LABELS[method]} | {cases[(0, 0)].top1:.4f} | {cases[(1, 0)].top1:.4f} | "
                         f"{cases[(1, 1)].top1:.4f} | {_yes(upgrade.ecc(method, 1, 0))} | {cases[(0, 0)].mean_ap:.4f} → "
                         f"{cases[(1, 0)].mean_ap:.4f}, {_yes(upgrade.ecc(method, 1, 0, metric='mean_ap'))} | {dims[0]} → {dims[1]} | "
                         + " | ".join(on_old_classes) + " |")
        lines.append("")
    if sequence is not None:
        counts = " → ".join(map(str, sequence.class_counts))
        lines += [f"## Multi-step sequence: classes {counts} (top-1)", "", "| method | AC | AM |", "|---|---|---|"]
        lines += [f"| {METHOD_LABELS[m]} | {c.ac:.4f} | {c.am:.4f} |" for m, c in sequence.matrices.items()]
        names = [f"v{k + 1}" for k in range(len(sequence.class_counts))]
        for method, matrix in sequence.matrices.items():
            lines += ["", f"### {METHOD_LABELS[method]}", "", matrix.to_markdown(names)]
        lines.append("")
    return "\n".join(lines)


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _metrics(result: RetrievalResult) -> dict[str, float]:
    return {f"top{k}": v for k, v in result.cmc.items()} | {"mAP": result.mean_ap}


def _quiet_progress(config: CompatibleConfig) -> None:
    if config.progress:
        return
    for section in (config.old_backbone, config.new_backbone, config.side_info):
        section.progress = False
    for section in (config.fct, config.lambda_orth):
        section.train.progress = False


def _write_json(path: Path, data: Any) -> Path:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, default=float) + "\n")
    return path


def orthogonality_errors(model: BT2Backbone) -> tuple[float, float]:
    """max |BᵀB − I| of B1 and B2 (in float64)."""
    return tuple(float(torch.max(torch.abs(b.double().T @ b.double() - torch.eye(len(b), dtype=torch.float64)))) for b in model.bases())  # type: ignore[return-value]


__all__ = [
    "BCTConfig", "BT2Config", "CoReSConfig", "CompatibleConfig", "BT2Backbone", "EccSelector", "SequenceResult",
    "CompatibleResult", "simplex_vertices", "cores_backbone", "load_compatible_config", "load_compatible_model",
    "save_compatible_model", "run_compatible", "train_model", "evaluation_items", "hoc_loss",
]

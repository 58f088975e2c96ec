"""`fctkit train-compatible`: its methods, its protocol and its configuration.

Compatible backbone training: new models whose embeddings can be compared with the old
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
(:func:`~.compatibility.compatibility_matrix`); embeddings of different dims are compared on the
shorter prefix (BT²'s old-compatible block). The adapter
methods fill C[i, j] for i > j with their own transformation between the independently
trained models (FCT: new/h(old, ψ), a direct h_{j→i} per pair, ψ = SimCLR on version 1's
data; λ-orth: B(new)/old, the backward-compatible case), and C[i, i] with the independent
model's own retrieval.

The code, one module each, below the run: :mod:`.compatible_models`, :mod:`.compatible_losses`,
:mod:`.compatible_training` (one version), :mod:`.compatible_sequence` (one sequence) and
:mod:`.compatible_comparison` (the run and its outputs).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal

from fctkit.config import load_config
from fctkit.errors import ConfigError

from .adapters import FCTConfig
from .backbones import BackboneConfig
from .lambda_orth import LambdaOrthConfig
from .run_data import DataConfig
from .searches import EvaluationConfig
from .side_info import SideInfoConfig

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
    new_backbone: BackboneConfig = dataclasses.field(
        default_factory=lambda: BackboneConfig(architecture="wide", embedding_dim=64)
    )
    bct: BCTConfig = dataclasses.field(default_factory=BCTConfig)
    bt2: BT2Config = dataclasses.field(default_factory=BT2Config)
    cores: CoReSConfig = dataclasses.field(default_factory=CoReSConfig)
    side_info: SideInfoConfig = dataclasses.field(default_factory=SideInfoConfig)
    fct: FCTConfig = dataclasses.field(default_factory=FCTConfig)
    lambda_orth: LambdaOrthConfig = dataclasses.field(default_factory=LambdaOrthConfig)
    evaluation: EvaluationConfig = dataclasses.field(default_factory=lambda: EvaluationConfig(distance="cosine"))

    def __post_init__(self) -> None:
        if self.data.name == "features":
            raise ConfigError(
                "train-compatible trains backbones: data.name must be an image dataset (digits, fashion-mnist)"
            )
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
                raise ConfigError(
                    f"{name}: expected >= 2 strictly growing class counts (each >= 2; the first two may be "
                    f"equal when first_version_items < 1), got {list(counts)}"
                )
        if not self.upgrade and not self.sequence:
            raise ConfigError("nothing to run: set upgrade and/or sequence")
        cosine_heads = [
            f"{name}.classifier"
            for name in ("old_backbone", "new_backbone")
            if getattr(self, name).classifier == "cosine"
        ]
        if "bct" in self.methods and cosine_heads:
            raise ConfigError(
                f"bct trains through the previous version's linear classifier (its weights and biases), but "
                f"{' and '.join(cosine_heads)} = 'cosine': set it to 'linear', or leave bct out of methods"
            )
        if self.evaluation_classes not in ("trained", "held-out"):
            raise ConfigError(f'evaluation_classes: expected "trained" or "held-out", got {self.evaluation_classes!r}')


def load_compatible_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> CompatibleConfig:
    """A config from a TOML file (unknown keys are errors) with optional dotted-key overrides."""
    return load_config(CompatibleConfig, path, overrides)


__all__ = ["BCTConfig", "BT2Config", "CoReSConfig", "CompatibleConfig", "load_compatible_config"]

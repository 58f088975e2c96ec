"""Demo image backbones: a small "old" CNN and a wider "new" CNN, trained with cross-entropy
on their class subsets. Both work for any grey image size (8x8 digits, 28x28 fashion-mnist)
thanks to adaptive pooling to a small grid (2x2 by default: unlike global pooling it keeps
the coarse layout, which the shallow old CNN's small receptive field needs on 28x28 images).

The retrieval embedding (``Backbone.embed``, also ``forward`` so that ONNX export of the
module gives the embedding) is the feature *before* the classifier, as in the FCT paper.
It is not L2-normalised unless ``BackboneConfig.normalize_embedding`` is set: adapters
regress raw features, and the evaluation normalises (cosine) when asked to.
``classifier = "cosine"`` trains with a normalised-softmax head instead of a linear one
(logits = scale · cos(feature, class weight)), which puts the features' class structure on the
unit sphere (the setting of the λ-orth paper).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fctkit.config import from_mapping
from fctkit.errors import ConfigError, InputError
from fctkit.feature_checks import validate_labels

from .datasets import validate_images
from .fitting import History, TrainConfig, fit
from .torch_utils import load_model, predict, resolve_device, save_model, set_seed

Architecture = Literal["small", "wide"]
ClassifierKind = Literal["linear", "cosine"]

# Channels per stage as multiples of ``width``; the first conv of every stage after the first
# has stride 2. "small" is the old model, "wide" the new one (wider and deeper).
_STAGES: dict[str, tuple[tuple[int, int], ...]] = {
    "small": ((1, 1), (2, 1)),  # (channel multiplier, convs in the stage)
    "wide": ((2, 2), (4, 2), (8, 1)),
}


@dataclasses.dataclass
class BackboneConfig:
    """A demo backbone and how it is trained (Adam, warm-up cosine, early stopping on a
    validation split of the training data)."""

    architecture: Architecture = "small"
    embedding_dim: int = 32
    width: int = 16
    pool_grid: int = 2  # adaptive average pooling to pool_grid x pool_grid before the projection
    normalize_embedding: bool = False
    classifier: ClassifierKind = "linear"
    classifier_scale: float = 16.0  # logit scale of the cosine classifier (its softmax temperature is 1/scale)
    epochs: int = 40
    lr: float = 3e-3
    weight_decay: float = 5e-4
    batch_size: int = 64
    warmup_epochs: int = 2
    val_fraction: float = 0.1
    patience: int = 10
    shift_augment: int = 1  # random translation by up to this many pixels while training; 0 = off
    progress: bool = True

    def __post_init__(self) -> None:
        if self.architecture not in _STAGES:
            raise ConfigError(f"architecture must be one of {', '.join(_STAGES)}, got {self.architecture!r}")
        if self.embedding_dim < 1 or self.width < 1 or self.pool_grid < 1:
            raise ConfigError("embedding_dim, width and pool_grid must be >= 1")
        if self.shift_augment < 0:
            raise ConfigError("shift_augment must be >= 0")
        if self.classifier not in ("linear", "cosine"):
            raise ConfigError(f"classifier must be 'linear' or 'cosine', got {self.classifier!r}")
        if self.classifier_scale <= 0:
            raise ConfigError("classifier_scale must be > 0")

    def train_config(self, seed: int, device: str) -> TrainConfig:
        return TrainConfig(
            epochs=self.epochs,
            batch_size=self.batch_size,
            lr=self.lr,
            weight_decay=self.weight_decay,
            warmup_epochs=self.warmup_epochs,
            val_fraction=self.val_fraction,
            patience=self.patience,
            seed=seed,
            device=device,
            progress=self.progress,
        )


def conv_trunk(architecture: str, width: int, in_channels: int = 1, pool_grid: int = 2) -> tuple[nn.Sequential, int]:
    """Conv-BN-ReLU stages ending in adaptive average pooling to a ``pool_grid`` square,
    flattened; returns (trunk, output features)."""
    layers: list[nn.Module] = []
    channels = in_channels
    for stage, (multiplier, n_convs) in enumerate(_STAGES[architecture]):
        out = width * multiplier
        for index in range(n_convs):
            stride = 2 if stage > 0 and index == 0 else 1
            layers += [
                nn.Conv2d(channels, out, 3, stride=stride, padding=1, bias=False),
                nn.BatchNorm2d(out),
                nn.ReLU(),
            ]
            channels = out
    layers += [nn.AdaptiveAvgPool2d(pool_grid), nn.Flatten()]
    return nn.Sequential(*layers), channels * pool_grid * pool_grid


class Encoder(nn.Module):
    """Conv trunk + linear projection to ``dim``: the image encoder shared by backbones and
    the SimCLR side-information model. ``forward`` returns the (optionally L2-normalised) feature."""

    def __init__(
        self, architecture: str, width: int, dim: int, in_channels: int = 1, normalize: bool = False, pool_grid: int = 2
    ):
        super().__init__()
        self.trunk, channels = conv_trunk(architecture, width, in_channels, pool_grid)
        self.projection = nn.Linear(channels, dim)
        self.normalize = normalize
        self.in_channels = in_channels

    def features(self, x: torch.Tensor) -> torch.Tensor:
        """The raw (never normalised) feature."""
        if x.ndim != 4 or x.shape[1] != self.in_channels:
            raise InputError(f"expected images of shape (N, {self.in_channels}, H, W), got {tuple(x.shape)}")
        return self.projection(self.trunk(x))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        feature = self.features(x)
        return F.normalize(feature, dim=1) if self.normalize else feature


class CosineClassifier(nn.Module):
    """Normalised-softmax head: ``scale · cos(x, w_c)`` for every class weight ``w_c`` (no bias)."""

    def __init__(self, dim: int, n_classes: int, scale: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_classes, dim))
        nn.init.normal_(self.weight)
        self.scale = scale

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.scale * F.normalize(x, dim=1) @ F.normalize(self.weight, dim=1).T


class Backbone(nn.Module):
    """An embedding model with a classifier head over ``classes`` (the class values it was
    trained on). ``forward(x)`` = ``embed(x)``; ``classify(x)`` gives logits over ``classes``."""

    def __init__(self, config: BackboneConfig, classes: tuple[int, ...], in_channels: int = 1):
        super().__init__()
        if len(classes) < 2:
            raise InputError(f"a backbone needs at least 2 classes to train on, got {list(classes)}")
        self.config = config
        self.classes = tuple(int(c) for c in classes)
        self.encoder = Encoder(
            config.architecture,
            config.width,
            config.embedding_dim,
            in_channels,
            config.normalize_embedding,
            config.pool_grid,
        )
        self.classifier: CosineClassifier | nn.Linear = (
            CosineClassifier(config.embedding_dim, len(self.classes), config.classifier_scale)
            if config.classifier == "cosine"
            else nn.Linear(config.embedding_dim, len(self.classes))
        )
        self.history: History | None = None  # set by train_backbone

    @property
    def embedding_dim(self) -> int:
        return self.config.embedding_dim

    @property
    def in_channels(self) -> int:
        return self.encoder.in_channels

    def embed(self, x: torch.Tensor) -> torch.Tensor:
        return self.encoder(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.embed(x)

    def classify(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier(self.encoder.features(x))

    def predict_labels(self, images: np.ndarray, batch_size: int = 1024) -> np.ndarray:
        """Predicted class values (from ``classes``) for numpy images."""
        logits = predict(_Classify(self), validate_images(images), batch_size=batch_size, device=_device_of(self))
        return np.asarray(self.classes, dtype=np.int64)[logits.argmax(axis=1)]


class _Classify(nn.Module):
    def __init__(self, backbone: Backbone):
        super().__init__()
        self.backbone = backbone

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.backbone.classify(x)


def random_shift(x: torch.Tensor, max_shift: int) -> torch.Tensor:
    """Translate each image by up to ``max_shift`` pixels (zero fill), using torch's global RNG."""
    if max_shift <= 0:
        return x
    n, _, h, w = x.shape
    padded = F.pad(x, (max_shift,) * 4)
    dy = torch.randint(0, 2 * max_shift + 1, (n,), device=x.device)
    dx = torch.randint(0, 2 * max_shift + 1, (n,), device=x.device)
    rows = (dy[:, None] + torch.arange(h, device=x.device)[None, :])[:, None, :, None]
    cols = (dx[:, None] + torch.arange(w, device=x.device)[None, :])[:, None, None, :]
    batch = torch.arange(n, device=x.device)[:, None, None, None]
    channel = torch.arange(x.shape[1], device=x.device)[None, :, None, None]
    return padded[batch, channel, rows, cols]


def train_backbone(
    images: np.ndarray,
    labels: np.ndarray,
    config: BackboneConfig | None = None,
    seed: int = 0,
    device: str = "auto",
    *,
    checkpoint: str | Path | None = None,
) -> Backbone:
    """Train a backbone with cross-entropy on ``images`` (N, C, H, W) and their ``labels``.

    The classes are those present in ``labels`` (pass only the old classes' items for an old
    model). Same seed, data and device → identical weights. The training history is kept on
    the returned model as ``history``. ``checkpoint``: resumable training (see :func:`fit`).
    """
    config = config or BackboneConfig()
    images = validate_images(images)
    labels = validate_labels(labels, len(images))
    classes = tuple(int(c) for c in np.unique(labels))
    set_seed(seed)
    backbone = Backbone(config, classes, in_channels=images.shape[1])
    targets = np.searchsorted(np.asarray(classes), labels).astype(np.int64)

    def loss_fn(model: Backbone, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        if model.training:
            x = random_shift(x, config.shift_augment)
        return F.cross_entropy(model.classify(x), y)

    history = fit(
        backbone,
        [images, targets],
        loss_fn,
        config.train_config(seed, device),
        description=f"{config.architecture} backbone",
        checkpoint=checkpoint,
    )
    backbone.history = history
    return backbone


def extract_features(
    model: nn.Module, images: np.ndarray, batch_size: int = 512, device: str | None = None, progress: bool = False
) -> np.ndarray:
    """Run ``model`` (a :class:`Backbone`, side-info model or any embedding module) over numpy
    images in batches; return float32 (N, d). Runs on the model's own device unless ``device`` is given."""
    images = validate_images(images)
    target = resolve_device(device) if device is not None else _device_of(model)
    return predict(model, images, batch_size=batch_size, device=target, progress=progress)


def _device_of(model: nn.Module) -> torch.device:
    parameter = next(model.parameters(), None)
    return parameter.device if parameter is not None else torch.device("cpu")


BACKBONE_FORMAT = "fctkit.backbone"


def save_backbone(backbone: Backbone, path: str | Path) -> Path:
    """Save weights, config and class subset in one file (readable with ``weights_only`` loading)."""
    return save_model(path, BACKBONE_FORMAT, backbone)


def load_backbone(path: str | Path, device: str = "cpu") -> Backbone:
    """Load a backbone written by :func:`save_backbone` (in eval mode)."""
    return cast(Backbone, load_model(path, {BACKBONE_FORMAT: backbone_from_meta}, device))  # the format's model


def backbone_from_meta(meta: dict[str, Any], where: str) -> Backbone:
    """The untrained :class:`Backbone` a :func:`save_backbone` file's metadata describes."""
    config = from_mapping(BackboneConfig, meta["config"], where=f"{where}: config")
    return Backbone(config, tuple(meta["classes"]), int(meta["in_channels"]))

"""Side-information models ψ (FCT paper §3.4, App. D.4): what a device stores next to each
embedding so that a later adapter h(φ_old, ψ) can recover what the old model discarded.

- ``simclr``: a small image encoder trained with SimCLR's NT-Xent loss on the *old* data
  only, without labels, using augmentations for small grey images (random resized crop,
  shift, rotation, contrast/brightness jitter, gaussian noise; torch ops only).
- ``none``: the zero vector of the configured dim (FCT without side-info); still a module
  with the same interface so it exports like the others.
- ``alternate``: a second old-style backbone trained on the old classes with another seed.

Every kind is an ``nn.Module`` whose ``forward(images)`` returns ψ, shape (N, dim).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fctkit.config import from_mapping
from fctkit.errors import ConfigError, InputError
from fctkit.feature_checks import validate_labels

from .backbones import Architecture, Backbone, BackboneConfig, Encoder, extract_features, train_backbone
from .cka import linear_cka
from .datasets import validate_images
from .fitting import History, TrainConfig, fit
from .torch_utils import load_model, save_model, set_seed

__all__ = [
    "AugmentationConfig",
    "SideInfoConfig",
    "SideInfoModel",
    "augment",
    "extract_side_info",
    "linear_cka",
    "load_side_info",
    "nt_xent",
    "save_side_info",
    "train_side_info",
]

SideInfoKind = Literal["simclr", "none", "alternate"]


@dataclasses.dataclass
class AugmentationConfig:
    """SimCLR views of small grey images; every transform is drawn per image."""

    crop_scale: float = 0.6  # random resized crop keeps an area fraction in [crop_scale, 1]
    max_shift: float = 0.1  # extra translation, as a fraction of the image side
    max_rotation: float = 15.0  # degrees, either direction
    contrast: float = 0.4  # contrast factor drawn in [1 - contrast, 1 + contrast]
    brightness: float = 0.2  # added offset drawn in [-brightness, brightness]
    noise_std: float = 0.05  # gaussian pixel noise

    def __post_init__(self) -> None:
        if not 0 < self.crop_scale <= 1:
            raise ConfigError("augmentation.crop_scale must be in (0, 1]")
        if min(self.max_shift, self.max_rotation, self.contrast, self.brightness, self.noise_std) < 0:
            raise ConfigError("augmentation strengths must be >= 0")
        if self.contrast >= 1:
            raise ConfigError("augmentation.contrast must be < 1 (a factor of 0 would blank the image)")


@dataclasses.dataclass
class SideInfoConfig:
    """Which side-information model, its size and how it is trained.

    ``dim`` is ψ's width. ``architecture``/``width`` pick the encoder (``simclr``) or the
    second backbone (``alternate``); the training fields apply to both; ``temperature``,
    ``projection_dim`` and ``augmentation`` to ``simclr`` only.
    """

    kind: SideInfoKind = "simclr"
    dim: int = 32
    architecture: Architecture = "small"
    width: int = 16
    pool_grid: int = 2
    projection_dim: int = 64
    temperature: float = 0.2
    epochs: int = 60
    lr: float = 3e-3
    weight_decay: float = 1e-4
    batch_size: int = 256
    warmup_epochs: int = 3
    val_fraction: float = 0.1
    patience: int = 15
    augmentation: AugmentationConfig = dataclasses.field(default_factory=AugmentationConfig)
    progress: bool = True

    def __post_init__(self) -> None:
        if self.kind not in ("simclr", "none", "alternate"):
            raise ConfigError(f"side-info kind must be 'simclr', 'none' or 'alternate', got {self.kind!r}")
        if min(self.dim, self.width, self.pool_grid, self.projection_dim) < 1:
            raise ConfigError("dim, width, pool_grid and projection_dim must be >= 1")
        if self.temperature <= 0:
            raise ConfigError("temperature must be > 0")

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

    def backbone_config(self) -> BackboneConfig:
        """The second old model of kind ``alternate``."""
        return BackboneConfig(
            architecture=self.architecture,
            embedding_dim=self.dim,
            width=self.width,
            pool_grid=self.pool_grid,
            epochs=self.epochs,
            lr=self.lr,
            weight_decay=self.weight_decay,
            batch_size=self.batch_size,
            warmup_epochs=self.warmup_epochs,
            val_fraction=self.val_fraction,
            patience=self.patience,
            progress=self.progress,
        )


class SideInfoModel(nn.Module):
    """ψ as a module: ``forward(images (N, C, H, W)) -> (N, dim)``.

    ``simclr`` holds ``encoder`` (ψ) and ``head`` (the projection used only for training);
    ``alternate`` holds ``encoder``, a :class:`Backbone`; ``none`` holds no weights.
    """

    def __init__(self, config: SideInfoConfig, in_channels: int = 1, classes: tuple[int, ...] = ()):
        super().__init__()
        self.config = config
        self.in_channels = in_channels
        self.encoder: nn.Module | None = None
        self.head: nn.Module | None = None
        self.history: History | None = None  # set by train_side_info
        if config.kind == "simclr":
            self.encoder = Encoder(
                config.architecture, config.width, config.dim, in_channels, pool_grid=config.pool_grid
            )
            self.head = nn.Sequential(
                nn.Linear(config.dim, config.dim), nn.ReLU(), nn.Linear(config.dim, config.projection_dim)
            )
        elif config.kind == "alternate":
            self.encoder = Backbone(config.backbone_config(), classes, in_channels)

    @property
    def kind(self) -> str:
        return self.config.kind

    @property
    def dim(self) -> int:
        return self.config.dim

    @property
    def classes(self) -> tuple[int, ...]:
        return self.encoder.classes if isinstance(self.encoder, Backbone) else ()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.ndim != 4 or x.shape[1] != self.in_channels:
            raise InputError(f"expected images of shape (N, {self.in_channels}, H, W), got {tuple(x.shape)}")
        if self.encoder is None:
            return x.new_zeros((x.shape[0], self.config.dim))
        return self.encoder(x)

    def project(self, x: torch.Tensor) -> torch.Tensor:
        """SimCLR's projection z = head(ψ(x)), the space NT-Xent is computed in."""
        if self.head is None:
            raise InputError(f"side-info kind {self.kind!r} has no projection head; only 'simclr' does")
        return self.head(self(x))


def augment(x: torch.Tensor, config: AugmentationConfig, generator: torch.Generator | None = None) -> torch.Tensor:
    """One random view per image of a (N, C, H, W) batch in [0, 1]: a random resized crop,
    shift and rotation in one affine resampling (zero fill), then contrast, brightness and
    noise, clipped to [0, 1]. Draws from ``generator`` (on x's device; torch's global RNG when None)."""
    n = x.shape[0]

    def uniform(low: float, high: float, *shape: int) -> torch.Tensor:
        return low + (high - low) * torch.rand(*shape, generator=generator, device=x.device)

    side = uniform(config.crop_scale, 1.0, n).sqrt()  # crop side as a fraction of the image side
    angle = uniform(-1.0, 1.0, n) * math.radians(config.max_rotation)
    reach = (1.0 - side) + 2.0 * config.max_shift  # in affine_grid units, the image spans [-1, 1]
    tx, ty = uniform(-1.0, 1.0, n) * reach, uniform(-1.0, 1.0, n) * reach
    cos, sin = torch.cos(angle) * side, torch.sin(angle) * side
    theta = torch.stack([torch.stack([cos, -sin, tx], 1), torch.stack([sin, cos, ty], 1)], 1)
    grid = F.affine_grid(theta.to(x.dtype), list(x.shape), align_corners=False)
    view = F.grid_sample(x, grid, mode="bilinear", padding_mode="zeros", align_corners=False)
    mean = view.mean(dim=(1, 2, 3), keepdim=True)
    contrast = uniform(1.0 - config.contrast, 1.0 + config.contrast, n, 1, 1, 1)
    brightness = uniform(-config.brightness, config.brightness, n, 1, 1, 1)
    view = (view - mean) * contrast + mean + brightness
    if config.noise_std > 0:
        view = view + config.noise_std * torch.randn(view.shape, generator=generator, device=x.device)
    return view.clamp(0.0, 1.0)


def nt_xent(z1: torch.Tensor, z2: torch.Tensor, temperature: float) -> torch.Tensor:
    """SimCLR's normalised-temperature cross-entropy: row i of ``z1`` and row i of ``z2`` are
    two views of one image (positives); every other row of the 2N is a negative."""
    if z1.shape != z2.shape or z1.ndim != 2:
        raise InputError(
            f"nt_xent: expected two (N, d) batches of the same shape, got {tuple(z1.shape)} and {tuple(z2.shape)}"
        )
    n = z1.shape[0]
    z = F.normalize(torch.cat([z1, z2]), dim=1)
    logits = (z @ z.T) / temperature
    self_mask = torch.eye(2 * n, dtype=torch.bool, device=z.device)
    logits = logits.masked_fill(self_mask, float("-inf"))
    targets = torch.cat([torch.arange(n, 2 * n), torch.arange(0, n)]).to(z.device)
    return F.cross_entropy(logits, targets)


def train_side_info(
    images: np.ndarray,
    labels: np.ndarray | None = None,
    config: SideInfoConfig | None = None,
    seed: int = 0,
    device: str = "auto",
    *,
    checkpoint: str | Path | None = None,
) -> SideInfoModel:
    """Train ψ on the old data ``images`` (N, C, H, W); ``checkpoint``: resumable training (see
    :func:`~fctkit.trainer.fitting.fit`).""

    ``simclr`` ignores ``labels`` (self-supervised); ``alternate`` needs them (the old
    classes) and should get a seed different from the old backbone's; ``none`` trains nothing.
    The training history is kept on the returned model as ``history`` (None for ``none``).
    """
    config = config or SideInfoConfig()
    images = validate_images(images)
    if config.kind == "none":
        return SideInfoModel(config, images.shape[1]).eval()
    if config.kind == "alternate":
        if labels is None:
            raise InputError("side-info kind 'alternate' trains a second old model and needs the old labels")
        backbone = train_backbone(
            images, validate_labels(labels, len(images)), config.backbone_config(), seed, device, checkpoint=checkpoint
        )
        model = SideInfoModel(config, images.shape[1], backbone.classes)
        model.encoder = backbone
        model.history = backbone.history
        return model.eval()
    set_seed(seed)
    model = SideInfoModel(config, images.shape[1])

    def loss_fn(net: SideInfoModel, x: torch.Tensor) -> torch.Tensor:
        views = torch.cat([augment(x, config.augmentation), augment(x, config.augmentation)])
        z1, z2 = net.project(views).chunk(2)  # both views in one pass share BatchNorm statistics
        return nt_xent(z1, z2, config.temperature)

    model.history = fit(
        model,
        [images],
        loss_fn,
        config.train_config(seed, device),
        description="SimCLR side-info",
        checkpoint=checkpoint,
    )
    return model


def extract_side_info(
    model: SideInfoModel, images: np.ndarray, batch_size: int = 512, device: str | None = None, progress: bool = False
) -> np.ndarray:
    """ψ for numpy images, float32 (N, dim)."""
    return extract_features(model, images, batch_size=batch_size, device=device, progress=progress)


SIDE_INFO_FORMAT = "fctkit.side_info"


def save_side_info(model: SideInfoModel, path: str | Path) -> Path:
    """Save ψ's weights with its config (and, for ``alternate``, its class subset)."""
    return save_model(path, SIDE_INFO_FORMAT, model)


def load_side_info(path: str | Path, device: str = "cpu") -> SideInfoModel:
    """Load a side-info model written by :func:`save_side_info` (in eval mode)."""
    return cast(SideInfoModel, load_model(path, {SIDE_INFO_FORMAT: _side_info_from_meta}, device))  # the format's


def _side_info_from_meta(meta: dict[str, Any], where: str) -> SideInfoModel:
    config = from_mapping(SideInfoConfig, meta["config"], where=f"{where}: config")
    return SideInfoModel(config, int(meta["in_channels"]), tuple(meta["classes"]))

"""The models the compatible methods train (:mod:`.compatible_config`) beyond a plain
:class:`~.backbones.Backbone`: CoReS's backbone with the fixed d-simplex classifier, BT²'s new
model with its learnt basis transformations, and how a version is saved and loaded."""

from __future__ import annotations

import copy
import dataclasses
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from fctkit.config import from_mapping
from fctkit.errors import ConfigError, InputError

from .backbones import BACKBONE_FORMAT, Backbone, BackboneConfig, Encoder, backbone_from_meta, save_backbone
from .fitting import History
from .lambda_orth import OrthogonalMap
from .torch_utils import load_model, save_model


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
    classifier = backbone.classifier
    assert isinstance(classifier, nn.Linear)  # the config's classifier is "linear" (above)
    with torch.no_grad():
        classifier.weight.copy_(torch.from_numpy(simplex_vertices(reserved_classes)))
        classifier.bias.zero_()
    classifier.requires_grad_(False)
    return backbone


class BT2Backbone(nn.Module):
    """The BT² new model (:mod:`.compatible_config`): ``forward(x)`` is φ_new (e + n dims), whose first
    ``old_dim`` dims are the old-compatible block; ``classify(x)`` gives logits over ``classes``."""

    history: History | None  # set by compatible_training.train_model (absent before)

    def __init__(
        self,
        config: BackboneConfig,
        classes: tuple[int, ...],
        in_channels: int,
        old_dim: int,
        extra_dims: int,
        scale: float,
    ) -> None:
        super().__init__()
        n = config.embedding_dim
        if not 1 <= old_dim <= extra_dims + n:
            raise ConfigError(
                f"bt2: the old dim {old_dim} must be at most extra_dims + the new' dim = {extra_dims + n}"
            )
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
        z = torch.cat(
            [F.normalize(self.extra_head(trunk), dim=1), self.scale * self.new_basis(F.normalize(f, dim=1))], dim=1
        )
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
    b1: torch.Tensor  # buffers (register_buffer below)
    b2: torch.Tensor

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
    return load_model(path, {BT2_FORMAT: _bt2_from_meta, BACKBONE_FORMAT: backbone_from_meta}, device)


def _bt2_from_meta(meta: dict[str, Any], where: str) -> BT2Backbone:
    config = from_mapping(BackboneConfig, meta["config"], where=f"{where}: config")
    return BT2Backbone(
        config,
        tuple(meta["classes"]),
        int(meta["in_channels"]),
        int(meta["old_dim"]),
        int(meta["extra_dims"]),
        float(meta["scale"]),
    )


CompatibleModel = Backbone | BT2Backbone  # a version the compatible methods train (a CoReS one is a Backbone)


def save_compatible_model(model: CompatibleModel, path: str | Path) -> Path:
    return save_bt2(model, path) if isinstance(model, BT2Backbone) else save_backbone(model, path)


def orthogonality_errors(model: BT2Backbone) -> tuple[float, float]:
    """max |BᵀB − I| of B1 and B2 (in float64)."""
    first, second = (
        float(torch.max(torch.abs(b.double().T @ b.double() - torch.eye(len(b), dtype=torch.float64))))
        for b in model.bases()
    )
    return first, second


__all__ = ["BT2Backbone", "cores_backbone", "load_compatible_model", "save_compatible_model", "simplex_vertices"]

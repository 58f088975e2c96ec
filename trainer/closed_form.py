"""Closed-form linear baselines old → new: least squares (optionally ridge) and orthogonal
Procrustes (semi-orthogonal when the dims differ). Both produce an ``nn.Linear``, so export
treats them like any affine adapter: ``forward(old) = old @ Wᵀ + b``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal, cast

import numpy as np
import torch
from torch import nn

from fctkit.errors import ConfigError, InputError
from fctkit.feature_checks import check_features

from .adapter_base import Adapter, config_of
from .fitting import History


@dataclasses.dataclass
class ClosedFormConfig:
    method: Literal["least_squares", "procrustes"] = "least_squares"
    ridge: float = 0.0  # L2 penalty on the matrix (least squares only; the bias is not penalised)
    bias: bool = True  # fit a bias: both sides are centred and b = mean_new − W mean_old

    def __post_init__(self) -> None:
        if self.ridge < 0:
            raise ConfigError("ridge must be >= 0")
        if self.method == "procrustes" and self.ridge:
            raise ConfigError("ridge applies to least squares only; set ridge = 0 for procrustes")


def least_squares_map(old: np.ndarray, new: np.ndarray, ridge: float = 0.0) -> np.ndarray:
    """``W`` (d_old × d_new) minimising ``‖old W − new‖² + ridge ‖W‖²`` (minimum-norm solution).

    Ridge is solved as plain least squares on rows augmented with ``sqrt(ridge)·I``.
    """
    if ridge:
        old = np.vstack([old, np.sqrt(ridge) * np.eye(old.shape[1])])
        new = np.vstack([new, np.zeros((old.shape[1], new.shape[1]))])
    return np.linalg.lstsq(old, new, rcond=None)[0]


def relative_ridge_map(inputs: np.ndarray, target: np.ndarray, ridge: float) -> tuple[np.ndarray, np.ndarray]:
    """``(W, b)`` of ridge least squares ``inputs W + b ≈ target`` on centred data, the ridge
    relative to the mean squared centred input norm (so one value suits any feature scale): the
    residual adapter's start (``residual.ridge``)."""
    x, y = inputs.astype(np.float64), target.astype(np.float64)
    x_mean, y_mean = x.mean(axis=0), y.mean(axis=0)
    scaled = ridge * float(np.mean(np.sum((x - x_mean) ** 2, axis=1)))
    matrix = least_squares_map(x - x_mean, y - y_mean, scaled)
    return matrix, y_mean - x_mean @ matrix


def procrustes_map(old: np.ndarray, new: np.ndarray) -> np.ndarray:
    """``W`` (d_old × d_new) minimising ``‖old W − new‖`` with ``W`` (semi-)orthogonal.

    From the SVD ``oldᵀ new = U Σ Vᵀ``: ``W = U Vᵀ`` (orthonormal columns when d_new ≤ d_old,
    orthonormal rows otherwise).
    """
    u, _, vt = np.linalg.svd(old.T @ new, full_matrices=False)
    return u @ vt


class ClosedFormAdapter(Adapter):
    """An affine map old → new fitted in closed form; ``forward(old)`` is one ``nn.Linear``."""

    kind = "closed_form"
    config_class = ClosedFormConfig

    def __init__(self, config: ClosedFormConfig, d_old: int, d_new: int) -> None:
        super().__init__(config)
        if d_old < 1 or d_new < 1:
            raise InputError(f"dims must be positive: d_old={d_old}, d_new={d_new}")
        self.d_old, self.d_new = d_old, d_new
        self.linear = nn.Linear(d_old, d_new, bias=config.bias)

    def dims(self) -> dict[str, int]:
        return {"d_old": self.d_old, "d_new": self.d_new}

    def forward(self, old: torch.Tensor) -> torch.Tensor:
        return self.linear(old)

    def as_linear(self) -> nn.Linear:
        """The fitted map as a plain ``nn.Linear(d_old → d_new)`` (export role ``forward``)."""
        return self.linear

    def transform(self, old: np.ndarray) -> np.ndarray:
        return self._run(self, check_features("old", old, dim=self.d_old))

    @classmethod
    def fit(
        cls,
        old: np.ndarray,
        new: np.ndarray,
        config: ClosedFormConfig | Mapping[str, Any] | None = None,
    ) -> tuple[ClosedFormAdapter, History]:
        """Fit in float64; the History holds the training MSE as its only epoch."""
        config = cast(ClosedFormConfig, config_of(cls.config_class, config))  # config_class is ClosedFormConfig
        old64 = check_features("old", old).astype(np.float64)
        new64 = check_features("new", new, rows=len(old64)).astype(np.float64)
        old_mean = old64.mean(axis=0) if config.bias else np.zeros(old64.shape[1])
        new_mean = new64.mean(axis=0) if config.bias else np.zeros(new64.shape[1])
        centred_old, centred_new = old64 - old_mean, new64 - new_mean
        if config.method == "least_squares":
            matrix = least_squares_map(centred_old, centred_new, config.ridge)
        else:
            matrix = procrustes_map(centred_old, centred_new)
        model = cls(config=config, d_old=old64.shape[1], d_new=new64.shape[1])
        with torch.no_grad():
            model.linear.weight.copy_(torch.from_numpy(matrix.T))
            if config.bias:
                model.linear.bias.copy_(torch.from_numpy(new_mean - old_mean @ matrix))
        train_mse = float(np.mean((old64 @ matrix + (new_mean - old_mean @ matrix) - new64) ** 2))
        model.metrics["train_mse"] = train_mse
        return model.eval(), History(train_loss=[train_mse], best_epoch=0)

"""Residual adapters h([φ_old, ψ]) → φ_new, the light-weight family of Drift-Adapter (EMNLP 2025).

Every form starts from the least-squares map of the concatenated input ``x = [φ_old, ψ]`` (ψ
only when fitted with side-info) and adds a residual that starts at zero, so training begins
at the closed-form solution and moves only where the objective gains:

=============  ==================================================================  ==============
form           h(x)                                                                 trained
=============  ==================================================================  ==============
``linear``     ``W x + b``                                                          W, b
``low_rank``   ``W₀ x + b₀ + U (V x)``, rank r                                      U, V (W₀ fixed)
``mlp``        ``W x + b + Lin(w→d_new)(GELU(Lin(d_in→w) x))``                       all
=============  ==================================================================  ==============

Trained with :class:`~fctkit.trainer.losses.ObjectiveConfig` (InfoNCE by default: these are the
adapters for instance-level tasks). ``forward(old[, side])`` is also the ONNX signature (role
``forward``), with inputs named by :attr:`ResidualAdapter.input_names` like FCT's h.
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

from .adapter_base import OldSideAdapter, config_of
from .closed_form import relative_ridge_map
from .fitting import History, TrainConfig, fit
from .losses import ObjectiveConfig, objective_loss


@dataclasses.dataclass
class ResidualConfig:
    form: Literal["linear", "low_rank", "mlp"] = "mlp"
    width: int = 512  # hidden width of the mlp residual
    rank: int = 32  # rank of the low_rank residual
    side_info: bool = True  # False: the input is φ_old alone; a given side array is ignored
    ridge: float = 1e-3  # ridge of the least-squares start, relative to the mean squared input norm
    objective: ObjectiveConfig = dataclasses.field(default_factory=lambda: ObjectiveConfig(kind="infonce"))
    # batch_size None: derived from the task's size on an instance-level task, 256 otherwise (PipelineConfig.for_task)
    train: TrainConfig = dataclasses.field(
        default_factory=lambda: TrainConfig(
            epochs=40, batch_size=None, lr=3e-3, weight_decay=1e-4, warmup_epochs=2, patience=8
        )
    )

    def __post_init__(self) -> None:
        if self.form not in ("linear", "low_rank", "mlp"):
            raise ConfigError(f"form must be 'linear', 'low_rank' or 'mlp', got {self.form!r}")
        if self.width < 1 or self.rank < 1 or self.ridge < 0:
            raise ConfigError("width and rank must be >= 1 and ridge >= 0")


class ResidualAdapter(OldSideAdapter):
    """h([φ_old, ψ]) = least-squares start + a residual (see the module docstring)."""

    kind = "residual"
    config_class = ResidualConfig

    def __init__(self, config: ResidualConfig, d_old: int, d_side: int, d_out: int) -> None:
        super().__init__(config, d_old, d_side, d_out)
        d_in = d_old + d_side
        self.base = nn.Linear(d_in, d_out)
        self.residual: nn.Module | None = None
        if config.form == "low_rank":
            self.base.requires_grad_(False)
            self.residual = nn.Sequential(
                nn.Linear(d_in, config.rank, bias=False), nn.Linear(config.rank, d_out, bias=False)
            )
        elif config.form == "mlp":
            self.residual = nn.Sequential(nn.Linear(d_in, config.width), nn.GELU(), nn.Linear(config.width, d_out))
        if self.residual is not None:
            nn.init.zeros_(cast(nn.Linear, self.residual[-1]).weight)

    def forward(self, old: torch.Tensor, side: torch.Tensor | None = None) -> torch.Tensor:
        side = self._side_or_none(side)
        x = old if side is None else torch.cat([old, side], dim=1)
        out = self.base(x)
        return out if self.residual is None else out + self.residual(x)

    @classmethod
    def fit(
        cls,
        old: np.ndarray,
        target: np.ndarray,
        side: np.ndarray | None = None,
        config: ResidualConfig | Mapping[str, Any] | None = None,
    ) -> tuple[ResidualAdapter, History]:
        """Start from ridge least squares on ``[old, side]`` → ``target``, then train with the objective."""
        config = cast(ResidualConfig, config_of(cls.config_class, config))  # config_class is ResidualConfig
        old = check_features("old", old)
        target = check_features("target", target, rows=len(old))
        arrays = [old]
        if config.side_info:
            if side is None:
                raise InputError(
                    "side_info is on but no side-info features were given; pass side=... or set side_info = false"
                )
            side = np.asarray(side)
            if side.size:
                arrays.append(check_features("side", side, rows=len(old)))
        torch.manual_seed(config.train.seed)
        model = cls(
            config, d_old=old.shape[1], d_side=arrays[1].shape[1] if len(arrays) > 1 else 0, d_out=target.shape[1]
        )
        model._start_at_least_squares(np.hstack(arrays), target)
        compare = objective_loss(config.objective)

        def loss(module: ResidualAdapter, *batch: torch.Tensor) -> torch.Tensor:
            *inputs, goal = batch
            return compare(module(*inputs), goal)

        history = fit(model, [*arrays, target], loss, config.train, description=f"fit residual {config.form}")
        model.metrics["best_val_loss"] = min(history.val_loss) if history.val_loss else history.train_loss[-1]
        return model, history

    def _start_at_least_squares(self, inputs: np.ndarray, target: np.ndarray) -> None:
        matrix, bias = relative_ridge_map(inputs, target, self.config.ridge)
        with torch.no_grad():
            self.base.weight.copy_(torch.from_numpy(matrix.T))
            self.base.bias.copy_(torch.from_numpy(bias))

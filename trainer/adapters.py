"""FCT forward adapters h(φ_old, ψ) → φ_new (and g(φ_old, ψ) → ψ_new for chains) and FastFill's
variant with a per-item uncertainty σ.

Architecture (FCT paper App. D, widths configurable)::

    old branch   Lin(d_old→w_b)-BN-ReLU-Lin(w_b→w_b)-BN-ReLU ┐
    side branch  Lin(d_side→w_b)-BN-ReLU-Lin(w_b→w_b)-BN-ReLU ┴ concat → mixer
    mixer        Lin(2w_b→w_m)-BN-ReLU-Lin(w_m→w_m)-BN-ReLU → head Lin(w_m→d_out)

Forward signature, also the ONNX signature for export: ``forward(old, side)`` with inputs
named by :attr:`FCTAdapter.input_names`. Without side-info (``side_info=False`` or
``d_side == 0``) the model has *only* the old branch (mixer input ``w_b``), its inputs are
just ``("old",)`` and ``forward(old)`` is called with one tensor; a ``side`` argument is then
accepted only when it is ``None`` or has 0 columns. One class serves both cases and both roles
(``forward`` h with ``d_out = d_new``, ``side_forward`` g with ``d_out = d_side_new``).
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Callable, Mapping
from typing import Any, Self, cast

import numpy as np
import torch
from torch import nn

from fctkit.errors import ConfigError, InputError
from fctkit.feature_checks import check_features, validate_labels

from .adapter_base import OldSideAdapter, config_of
from .fitting import History, TrainConfig, fit
from .losses import ObjectiveConfig, heteroscedastic_mse, objective_loss

EpochHook = Callable[[nn.Module, int], None]


@dataclasses.dataclass
class FCTConfig:
    branch_width: int = 256
    mixer_width: int = 2048
    side_info: bool = True  # False: the model has only the old branch; a given side array is ignored
    freeze_bn_from: float = 0.5  # fraction of the epochs after which BatchNorm statistics stop updating
    objective: ObjectiveConfig = dataclasses.field(default_factory=ObjectiveConfig)  # FastFill: always its own loss
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        if self.branch_width < 1 or self.mixer_width < 1:
            raise ConfigError("branch_width and mixer_width must be >= 1")
        if not 0.0 <= self.freeze_bn_from <= 1.0:
            raise ConfigError("freeze_bn_from must be in [0, 1] (a fraction of the epochs)")


@dataclasses.dataclass
class FastFillConfig(FCTConfig):
    # Weight of the cross-entropy of the new model's frozen classifier on h(old); used only when
    # fit() is given a classifier and labels.
    discriminative_weight: float = 1.0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.objective.kind not in ("auto", "mse"):
            raise ConfigError(
                "FastFill trains with its own heteroscedastic loss: leave fastfill.objective.kind at 'auto'"
            )


def _projection(d_in: int, width: int) -> nn.Sequential:
    return nn.Sequential(
        nn.Linear(d_in, width),
        nn.BatchNorm1d(width),
        nn.ReLU(),
        nn.Linear(width, width),
        nn.BatchNorm1d(width),
        nn.ReLU(),
    )


class FCTAdapter(OldSideAdapter):
    """h(φ_old, ψ) → φ_new (or g → ψ_new), trained with MSE; see the module docstring."""

    kind = "fct"
    config_class = FCTConfig

    def __init__(self, config: FCTConfig, d_old: int, d_side: int, d_out: int) -> None:
        super().__init__(config, d_old, d_side, d_out)
        width = config.branch_width
        self.old_branch = _projection(d_old, width)
        self.side_branch = _projection(d_side, width) if d_side else None
        mixer_in = 2 * width if d_side else width
        self.mixer = nn.Sequential(
            nn.Linear(mixer_in, config.mixer_width),
            nn.BatchNorm1d(config.mixer_width),
            nn.ReLU(),
            nn.Linear(config.mixer_width, config.mixer_width),
            nn.BatchNorm1d(config.mixer_width),
            nn.ReLU(),
        )
        self.head = nn.Linear(config.mixer_width, d_out)
        self.batchnorm_frozen = False

    def features(self, old: torch.Tensor, side: torch.Tensor | None = None) -> torch.Tensor:
        """The shared trunk: branches, concat and the mixer's hidden layers (width w_m)."""
        hidden = self.old_branch(old)
        side = self._side_or_none(side)
        if self.side_branch is not None:
            hidden = torch.cat([hidden, self.side_branch(side)], dim=1)
        return self.mixer(hidden)

    def forward(self, old: torch.Tensor, side: torch.Tensor | None = None) -> torch.Tensor:
        return self.head(self.features(old, side))

    def train(self, mode: bool = True) -> FCTAdapter:
        super().train(mode)
        if mode and self.batchnorm_frozen:
            for module in self.modules():
                if isinstance(module, nn.BatchNorm1d):
                    module.eval()
        return self

    # --- training -------------------------------------------------------------------------

    @classmethod
    def fit(
        cls,
        old: np.ndarray,
        target: np.ndarray,
        side: np.ndarray | None = None,
        config: FCTConfig | Mapping[str, Any] | None = None,
        *,
        on_epoch_start: EpochHook | None = None,
    ) -> tuple[FCTAdapter, History]:
        """Fit h(old, side) → target (φ_new for h, ψ_new for g) with ``config.objective``
        (MSE by default, as in the FCT paper; InfoNCE for instance-level tasks).

        ``config.side_info=True`` needs ``side``; with ``False`` any ``side`` is ignored.
        ``on_epoch_start(model, epoch)`` runs after the adapter's own epoch hook (e.g. to log).
        """
        config = cast(FCTConfig, config_of(cls.config_class, config))  # config_class is FCTConfig or a subclass
        model, arrays = cls._prepare(old, target, side, config)
        compare = objective_loss(config.objective)

        def loss(model: FCTAdapter, *batch: torch.Tensor) -> torch.Tensor:
            *inputs, target = batch
            return compare(model(*inputs), target)

        return model, model._train(arrays, loss, on_epoch_start)

    @classmethod
    def _prepare(cls, old: Any, target: Any, side: Any, config: FCTConfig) -> tuple[Self, list[np.ndarray]]:
        old = check_features("old", old)
        target = check_features("target", target, rows=len(old))
        arrays = [old]
        d_side = 0
        if config.side_info:
            if side is None:
                raise InputError(
                    "side_info is on but no side-info features were given; pass side=... or set side_info = false"
                )
            side = (
                check_features("side", side, rows=len(old))
                if np.asarray(side).size
                else np.zeros((len(old), 0), np.float32)
            )
            d_side = side.shape[1]
            if d_side:
                arrays.append(side)
        torch.manual_seed(config.train.seed)  # weight initialisation is part of "same seed → same weights"
        model = cls(config=config, d_old=old.shape[1], d_side=d_side, d_out=target.shape[1])
        return model, [*arrays, target]

    def _train(
        self, arrays: list[np.ndarray], loss_fn: Callable[..., torch.Tensor], extra_hook: EpochHook | None
    ) -> History:
        train_config = self.config.train
        freeze_epoch = round(self.config.freeze_bn_from * train_config.epochs)

        def epoch_hook(model: nn.Module, epoch: int) -> None:
            model.batchnorm_frozen = epoch >= freeze_epoch
            model.train()  # re-applies the BatchNorm freeze (fit sets train mode too)
            if extra_hook is not None:
                extra_hook(model, epoch)

        history = fit(self, arrays, loss_fn, train_config, description=f"fit {self.kind}", on_epoch_start=epoch_hook)
        self.metrics["best_val_loss"] = min(history.val_loss) if history.val_loss else history.train_loss[-1]
        return history


class FastFillAdapter(FCTAdapter):
    """FCT's h plus an uncertainty head: ``log σ²`` per item from the shared trunk.

    Trained with :func:`fctkit.trainer.losses.heteroscedastic_mse`, plus (optionally) the
    cross-entropy of the new model's frozen classifier applied to h(old). :meth:`uncertainty`
    gives σ per row; backfilling re-embeds the largest σ first.
    """

    kind = "fastfill"
    config_class = FastFillConfig

    def __init__(self, config: FastFillConfig, d_old: int, d_side: int, d_out: int) -> None:
        super().__init__(config, d_old, d_side, d_out)
        self.log_variance_head = nn.Linear(config.mixer_width, 1)

    def forward_with_log_variance(
        self, old: torch.Tensor, side: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.features(old, side)
        return self.head(hidden), self.log_variance_head(hidden).squeeze(1)

    def sigma(self, old: torch.Tensor, side: torch.Tensor | None = None) -> torch.Tensor:
        """σ per row (shape ``(N,)``), the standard deviation of the predicted embedding."""
        return torch.exp(0.5 * self.log_variance_head(self.features(old, side)).squeeze(1))

    def uncertainty_module(self) -> nn.Module:
        """A module ``(old[, side]) → σ`` of shape ``(N,)`` sharing these weights (export role ``uncertainty``)."""
        return _SigmaView(self)

    def uncertainty(self, old: np.ndarray, side: np.ndarray | None = None) -> np.ndarray:
        """σ per row for numpy inputs; larger means the adapted embedding is less trustworthy."""
        return self._run(self.uncertainty_module(), *self._checked_inputs(old, side))

    @classmethod
    def fit(
        cls,
        old: np.ndarray,
        target: np.ndarray,
        side: np.ndarray | None = None,
        config: FCTConfig | Mapping[str, Any] | None = None,
        *,
        classifier: nn.Module | None = None,
        labels: np.ndarray | None = None,
        on_epoch_start: EpochHook | None = None,
    ) -> tuple[FastFillAdapter, History]:
        """Fit with the heteroscedastic loss; with ``classifier`` (the new model's head mapping
        φ_new → logits; a frozen copy is used, the module itself is left untouched) and
        ``labels`` also add ``discriminative_weight · CE(classifier(h(old)), label)``.

        ``config`` is typed as in :meth:`FCTAdapter.fit` but must be a :class:`FastFillConfig` (or a
        mapping of one): a plain :class:`FCTConfig` is a :class:`~fctkit.errors.ConfigError`."""
        # config_of raises that ConfigError for any dataclass but config_class (FastFillConfig)
        config = cast(FastFillConfig, config_of(cls.config_class, config))
        if (classifier is None) != (labels is None):
            raise InputError("the discriminative term needs both classifier= and labels= (or neither)")
        model, arrays = cls._prepare(old, target, side, config)
        loss_fn: Callable[..., torch.Tensor] = model.loss
        if classifier is not None and labels is not None:  # both or neither (checked above)
            arrays.append(validate_labels(labels, len(arrays[0])))
            loss_fn = _discriminative_loss(classifier, config.discriminative_weight)
        return model, model._train(arrays, loss_fn, on_epoch_start)

    @staticmethod
    def loss(model: FastFillAdapter, *batch: torch.Tensor) -> torch.Tensor:
        *inputs, target = batch
        prediction, log_variance = model.forward_with_log_variance(*inputs)
        return heteroscedastic_mse(prediction, target, log_variance)


def _discriminative_loss(classifier: nn.Module, weight: float) -> Callable[..., torch.Tensor]:
    # A frozen private copy: the caller's module is neither trained, moved nor switched to eval.
    frozen = copy.deepcopy(classifier).eval().requires_grad_(False)

    def loss_fn(model: FastFillAdapter, *batch: torch.Tensor) -> torch.Tensor:
        *inputs, target, labels = batch
        prediction, log_variance = model.forward_with_log_variance(*inputs)
        cross_entropy = nn.functional.cross_entropy(frozen.to(prediction.device)(prediction), labels)
        return heteroscedastic_mse(prediction, target, log_variance) + weight * cross_entropy

    return loss_fn


class _SigmaView(nn.Module):
    def __init__(self, adapter: FastFillAdapter) -> None:
        super().__init__()
        self.adapter = adapter
        self.training = adapter.training  # so predict() restores the adapter's own mode

    def forward(self, old: torch.Tensor, side: torch.Tensor | None = None) -> torch.Tensor:
        return self.adapter.sigma(old, side)

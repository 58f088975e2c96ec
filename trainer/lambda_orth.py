"""λ-orthogonality (Ricci et al., NeurIPS 2025): a unified space in which old gallery rows and
new queries meet, learned jointly by a forward map F (old → unified) and a backward map B
(new → old-compatible).

- F: ``affine`` ``Lin(d_old→n)`` or ``mlp``, the residual ``x[:, :n] + (Lin(d_old→hidden)-BN-ReLU-
  Lin(hidden→n))(x)``. Both start as the identity on the first n coordinates (affine weight
  ``[I_n | 0]``, the MLP's last layer zero): the unified space is the old space, so F starts by
  leaving old rows as they are (F(old)/old = old/old) and learns only what improves them
  (on digits CNN features this init clearly beat a random one for F(old)/old and B(new)/old).
- B: ``orthogonal`` B⊥ = expm(U − Uᵀ) with U strictly upper-triangular (orthogonal by
  construction, no bias); ``lambda`` B_λ x = Wx + b trained with the gated penalty
  ``sigmoid(α(‖WWᵀ−I‖_F − λ))·‖WWᵀ−I‖_F``; ``affine`` the same map without any penalty
  (the unconstrained baseline). With ``init = "procrustes"`` (the default) B starts at the
  rotation that best maps the training set's new rows onto its old rows (orthogonal
  Procrustes restricted to det = +1, so B⊥ = expm(U − Uᵀ) can represent it); with
  ``"identity"`` at the identity. A rotation is the exact constraint of B⊥, so the
  closed-form solution is its natural starting point; gradient descent from the identity
  needs many epochs to turn far enough and may settle in a poor rotation.
- ``normalize = true`` (the default; the paper works with L2-normalised features and cosine
  similarity): input rows are scaled to unit norm before F and B (the new row after its
  truncation to n coordinates), and F's and B's outputs
  and the unified old rows are unit rows too, so every row of the unified space lies on the
  unit sphere (L2 and cosine distance then rank identically). The exported modules include
  these normalisations. Without it, B⊥ preserves the norm of φ_new, which need not match φ_old's.

Loss per batch (each ‖·‖² is the squared L2 distance of a row pair, averaged over the rows)::

    L = w1‖F(h_k) − B(h_t)‖² + w2‖B(h_t) − h_k‖² + w3·L_C + penalty
    L_C = L_contr(F(h_k), B(h_t)) + L_contr(F(h_k), h_k)

with the supervised multi-positive contrastive loss at temperature τ (same-class items are
positives; without labels only the same item is).

Dimension mismatch: the unified space has ``n = min(d_old, d_new)`` dims and the larger
embedding is truncated to its first ``n`` coordinates — the *new* embedding before B when
``d_new > d_old`` (so B is square), the *old* embedding (targets ``h_k`` and old gallery rows,
see :meth:`LambdaOrthAdapter.unified_old`) when ``d_old > d_new``.

Unified mode: gallery rows are φ_old (:meth:`unified_old`), F(φ_old) (:meth:`transform`) or
B(φ_new) (:meth:`transform_new`); queries use B(φ_new).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Literal, cast

import numpy as np
import torch
from torch import nn

from fctkit.errors import ConfigError, InputError
from fctkit.feature_checks import check_features, validate_labels

from .adapter_base import Adapter, config_of
from .fitting import History, TrainConfig, fit
from .losses import orthogonality_error, orthogonality_penalty, squared_distance, supervised_contrastive


@dataclasses.dataclass
class LambdaOrthConfig:
    forward: Literal["affine", "mlp"] = "affine"
    backward: Literal["orthogonal", "lambda", "affine"] = "orthogonal"
    lam: float = 1.0  # tolerance λ on ‖WWᵀ − I‖_F (backward = "lambda")
    alpha: float = 10.0  # sharpness α of the sigmoid gate
    tau: float = 0.1  # temperature of the contrastive loss
    w1: float = 1.0
    w2: float = 1.0
    w3: float = 1.0
    hidden_width: int = 512  # width of the MLP forward map
    normalize: bool = True  # unit rows in and out: the unified space is the unit sphere (cosine)
    init: Literal["procrustes", "identity"] = "procrustes"  # where B starts
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)

    def __post_init__(self) -> None:
        if self.tau <= 0:
            raise ConfigError("tau must be > 0")
        if self.lam < 0 or self.alpha <= 0:
            raise ConfigError("lam must be >= 0 and alpha > 0")
        if min(self.w1, self.w2, self.w3) < 0:
            raise ConfigError("loss weights w1, w2, w3 must be >= 0")
        if self.hidden_width < 1:
            raise ConfigError("hidden_width must be >= 1")


class OrthogonalMap(nn.Module):
    """x ↦ x Bᵀ with B = expm(U − Uᵀ), U the strictly upper-triangular part of a parameter.

    The exponential of a skew-symmetric matrix is a rotation, so B is orthogonal whatever the
    parameter; it starts at the identity (U = 0). Computed in float64 for accuracy.
    """

    def __init__(self, dim: int) -> None:
        super().__init__()
        self.upper = nn.Parameter(torch.zeros(dim, dim))

    @property
    def weight(self) -> torch.Tensor:
        strict = torch.triu(self.upper, diagonal=1)
        return torch.linalg.matrix_exp((strict - strict.T).double()).to(self.upper.dtype)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight.T

    def set_rotation(self, rotation: np.ndarray) -> bool:
        """Make the map equal ``rotation`` (orthogonal, det +1) via its matrix logarithm.

        Returns False and leaves the map unchanged when the logarithm does not reproduce the
        rotation (an eigenvalue at −1 makes the real logarithm ill-defined).
        """
        from scipy.linalg import expm, logm

        log = np.real(logm(np.asarray(rotation, dtype=np.float64)))
        strict = np.triu(0.5 * (log - log.T), k=1)
        if not np.allclose(expm(strict - strict.T), rotation, rtol=0, atol=1e-6):
            return False
        with torch.no_grad():
            self.upper.copy_(torch.from_numpy(strict))
        return True


class UnitRows(nn.Module):
    """Scales every row by the inverse L2 norm of its first ``dims`` coordinates (all of them
    when ``None``), so that those coordinates form a unit vector. Exports as plain ONNX arithmetic."""

    def __init__(self, dims: int | None = None) -> None:
        super().__init__()
        self.dims = dims

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        head = x if self.dims is None else x[:, : self.dims]
        return x * torch.rsqrt((head * head).sum(dim=1, keepdim=True).clamp_min(1e-24))


def rotation_between(source: np.ndarray, target: np.ndarray) -> np.ndarray:
    """The rotation ``R`` (orthogonal, det +1) minimising ``‖source Rᵀ − target‖`` (Kabsch).

    From the SVD ``sourceᵀ target = U Σ Vᵀ``: ``Rᵀ = U D Vᵀ`` with ``D = diag(1, …, 1, ±1)``
    choosing the sign that makes the determinant +1.
    """
    u, _, vt = np.linalg.svd(np.asarray(source, np.float64).T @ np.asarray(target, np.float64))
    signs = np.ones(len(u))
    signs[-1] = 1.0 if np.linalg.det(u @ vt) >= 0 else -1.0
    return ((u * signs) @ vt).T


def _identity_linear(d_in: int, d_out: int) -> nn.Linear:
    """``nn.Linear`` starting as ``x ↦ x[:, :d_out]`` (``d_out <= d_in``)."""
    linear = nn.Linear(d_in, d_out)
    with torch.no_grad():
        linear.weight.copy_(torch.eye(d_out, d_in))
        linear.bias.zero_()
    return linear


class ResidualMLP(nn.Module):
    """``x[:, :n] + Lin(d→hidden)-BN-ReLU-Lin(hidden→n)(x)``, starting as the identity (last layer zero)."""

    def __init__(self, d_in: int, n: int, hidden_width: int) -> None:
        super().__init__()
        self.n = n
        hidden, norm = nn.Linear(d_in, hidden_width), nn.BatchNorm1d(hidden_width)
        last = nn.Linear(hidden_width, n)  # built after the others, as the seeded initialisation expects
        nn.init.zeros_(last.weight)
        nn.init.zeros_(last.bias)
        self.mlp = nn.Sequential(hidden, norm, nn.ReLU(), last)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x[:, : self.n] + self.mlp(x)


class LambdaOrthAdapter(Adapter):
    """Jointly trained F (old → unified, n dims) and B (new → unified); see the module docstring."""

    kind = "lambda_orth"
    config_class = LambdaOrthConfig

    def __init__(self, config: LambdaOrthConfig, d_old: int, d_new: int) -> None:
        super().__init__(config)
        if d_old < 1 or d_new < 1:
            raise InputError(f"dims must be positive: d_old={d_old}, d_new={d_new}")
        self.d_old, self.d_new = d_old, d_new
        self.n = n = min(d_old, d_new)
        self.forward_map: nn.Module = (
            _identity_linear(d_old, n) if config.forward == "affine" else ResidualMLP(d_old, n, config.hidden_width)
        )
        self.backward_map: OrthogonalMap | nn.Linear = (
            OrthogonalMap(n) if config.backward == "orthogonal" else _identity_linear(n, n)
        )
        self.unit_rows: nn.Module = UnitRows() if config.normalize else nn.Identity()

    def dims(self) -> dict[str, int]:
        return {"d_old": self.d_old, "d_new": self.d_new}

    def forward(self, old: torch.Tensor, new: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(F(old), B(new))`` — both in the n-dim unified space."""
        unit = self.unit_rows
        return unit(self.forward_map(unit(old))), unit(self.backward_map(unit(new[:, : self.n])))

    def old_target(self, old: torch.Tensor) -> torch.Tensor:
        """φ_old as a unified-space row: its first n coordinates (unit rows when normalising)."""
        return self.unit_rows(old[:, : self.n])

    def backward_weight(self) -> torch.Tensor:
        """B's ``n × n`` matrix (for B⊥ the materialised expm)."""
        return self.backward_map.weight

    def orthogonality_error(self) -> float:
        """``‖WWᵀ − I‖_F`` of B's matrix (≈ 0 for B⊥)."""
        with torch.no_grad():
            return float(orthogonality_error(self.backward_weight().double()))

    # --- numpy surface ----------------------------------------------------------------------

    def transform(self, old: np.ndarray) -> np.ndarray:
        """F(φ_old): old gallery rows moved into the unified space."""
        return self._run(self.forward_module(), check_features("old", old, dim=self.d_old))

    def transform_new(self, new: np.ndarray) -> np.ndarray:
        """B(φ_new): new queries (and backfilled rows) in the unified space."""
        return self._run(self.materialized_backward(), check_features("new", new, dim=self.d_new))

    def unified_old(self, old: np.ndarray) -> np.ndarray:
        """φ_old as a unified-space row (its first n coordinates; unit rows when normalising)."""
        return self._run(self.unit_rows, check_features("old", old, dim=self.d_old)[:, : self.n])

    # --- export surface ---------------------------------------------------------------------

    def forward_module(self) -> nn.Module:
        """F as a module ``old (N, d_old) → (N, n)`` (export role ``forward``), with the row
        normalisations when ``normalize``."""
        return nn.Sequential(UnitRows(), self.forward_map, UnitRows()) if self.config.normalize else self.forward_map

    def materialized_backward(self) -> nn.Module:
        """B as a plain ``nn.Linear(d_new → n)`` (export role ``backward``), between the row
        normalisations when ``normalize``.

        The truncation of the new embedding is folded in as zero columns, and B⊥'s matrix
        exponential is evaluated once, so the map exports to ONNX as a single Gemm.
        """
        with torch.no_grad():
            matrix = self.backward_weight().detach()
            linear = nn.Linear(self.d_new, self.n, bias=isinstance(self.backward_map, nn.Linear))
            linear.to(matrix.device)
            linear.weight.zero_()
            linear.weight[:, : self.n] = matrix
            if isinstance(self.backward_map, nn.Linear):  # then `linear` has a bias too
                linear.bias.copy_(self.backward_map.bias)
        # UnitRows(n) normalises by the first n coordinates only: the zero columns drop the rest
        return (nn.Sequential(UnitRows(self.n), linear, UnitRows()) if self.config.normalize else linear).eval()

    def start_at_procrustes(self, old: np.ndarray, new: np.ndarray) -> None:
        """Set B to the rotation that best maps these new rows onto their old rows (after the
        normalisation and truncation the model applies); F is left as it is."""
        with torch.no_grad():
            source = self.unit_rows(torch.as_tensor(new[:, : self.n])).double().numpy()
            target = self.old_target(torch.as_tensor(old)).double().numpy()
        rotation = rotation_between(source, target)
        if isinstance(self.backward_map, OrthogonalMap):
            self.metrics["procrustes_init"] = float(self.backward_map.set_rotation(rotation))
        else:
            with torch.no_grad():
                self.backward_map.weight.copy_(torch.from_numpy(rotation))
            self.metrics["procrustes_init"] = 1.0

    # --- training ---------------------------------------------------------------------------

    @classmethod
    def fit(
        cls,
        old: np.ndarray,
        new: np.ndarray,
        labels: np.ndarray | None = None,
        config: LambdaOrthConfig | Mapping[str, Any] | None = None,
    ) -> tuple[LambdaOrthAdapter, History]:
        """Jointly train F and B on aligned old/new embeddings of the same items.

        ``labels`` (int per row) define the contrastive positives; without them only the same
        item is positive. The final ``‖WWᵀ − I‖_F`` is recorded in ``metrics``.
        """
        config = cast(LambdaOrthConfig, config_of(cls.config_class, config))  # config_class is LambdaOrthConfig
        old = check_features("old", old)
        new = check_features("new", new, rows=len(old))
        arrays = [old, new]
        if labels is not None:
            arrays.append(validate_labels(labels, len(old)))
        torch.manual_seed(config.train.seed)
        model = cls(config=config, d_old=old.shape[1], d_new=new.shape[1])
        if config.init == "procrustes":
            model.start_at_procrustes(old, new)
        history = fit(model, arrays, model.loss, config.train, description=f"fit {cls.kind}")
        model.metrics["orthogonality_error"] = model.orthogonality_error()
        model.metrics["best_val_loss"] = min(history.val_loss) if history.val_loss else history.train_loss[-1]
        return model, history

    @staticmethod
    def loss(
        model: LambdaOrthAdapter, old: torch.Tensor, new: torch.Tensor, labels: torch.Tensor | None = None
    ) -> torch.Tensor:
        config = model.config
        forward_old, backward_new = model(old, new)
        old_target = model.old_target(old)
        total = config.w1 * squared_distance(forward_old, backward_new) + config.w2 * squared_distance(
            backward_new, old_target
        )
        if config.w3:
            contrastive = supervised_contrastive(forward_old, backward_new, labels, config.tau)
            contrastive = contrastive + supervised_contrastive(forward_old, old_target, labels, config.tau)
            total = total + config.w3 * contrastive
        if config.backward == "lambda":
            total = total + orthogonality_penalty(model.backward_weight(), config.lam, config.alpha)
        return total

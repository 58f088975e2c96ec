"""Losses of the adapter methods: MSE (FCT), heteroscedastic MSE (FastFill), InfoNCE and
MSE + InfoNCE (objectives that keep item identity, for instance-level tasks), the supervised
multi-positive contrastive loss and the gated orthogonality penalty (λ-orthogonality).

All reductions are means over the batch so that the loss scale does not depend on the batch size.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F

from fctkit.errors import ConfigError


def mse_loss(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean over rows and dimensions of the squared error (FCT's transformation loss)."""
    return F.mse_loss(prediction, target)


def squared_distance(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """Mean over rows of the squared L2 distance ``‖p_i − t_i‖²`` (summed over dimensions).

    On unit rows this is ``2 − 2 cos``, bounded by 4 whatever the dimension, so it weighs
    against a contrastive loss the same way in 32 or 2048 dims (λ-orthogonality's terms).
    """
    return (prediction - target).pow(2).sum(dim=1).mean()


def heteroscedastic_mse(prediction: torch.Tensor, target: torch.Tensor, log_variance: torch.Tensor) -> torch.Tensor:
    """FastFill's Bayesian (heteroscedastic) regression loss, one variance per row.

    Per row ``i`` with ``d`` dimensions and ``s_i = log σ_i²``::

        ℓ_i = ‖h_i − φ_i‖² / (2 σ_i²) + (d / 2) · s_i

    which is the negative log-likelihood of ``φ_i ~ N(h_i, σ_i² I_d)`` up to a constant. The
    returned value is ``mean_i ℓ_i / d``: dividing by the constant ``d`` keeps the scale of
    plain MSE (so the same learning rate works) without moving the optimum, where
    ``σ_i² = ‖h_i − φ_i‖² / d`` — the per-row mean squared error.
    """
    log_variance = log_variance.reshape(-1)
    squared_error = (prediction - target).pow(2).sum(dim=1)
    dims = prediction.shape[1]
    per_row = 0.5 * squared_error * torch.exp(-log_variance) + 0.5 * dims * log_variance
    return per_row.mean() / dims


def supervised_contrastive(
    anchors: torch.Tensor,
    candidates: torch.Tensor,
    labels: torch.Tensor | None,
    temperature: float,
) -> torch.Tensor:
    """Supervised multi-positive contrastive loss between two aligned views (rows = items).

    Rows are L2-normalised; ``logits[i, j] = <a_i, c_j> / τ``. For anchor ``i`` the positives
    are every candidate ``j`` with ``labels[j] == labels[i]`` (always including ``j = i``, the
    same item in the other view); with ``labels=None`` only ``j = i`` is positive (an InfoNCE
    across the two views; unlike SimCLR's NT-Xent there are no negatives within a view). The loss is the mean over anchors of ``−mean_{j∈P(i)} log softmax_j``,
    symmetrised over the two directions (anchors→candidates and candidates→anchors).
    """
    a = F.normalize(anchors, dim=1)
    c = F.normalize(candidates, dim=1)
    logits = a @ c.T / temperature
    if labels is None:
        positives = torch.eye(len(a), dtype=torch.bool, device=a.device)
    else:
        positives = labels.reshape(-1, 1) == labels.reshape(1, -1)
    positive_weights = positives.float() / positives.sum(dim=1, keepdim=True)

    def one_direction(scores: torch.Tensor) -> torch.Tensor:
        return -(positive_weights * F.log_softmax(scores, dim=1)).sum(dim=1).mean()

    # `positives` is symmetric, so the same weights serve the transposed direction.
    return 0.5 * (one_direction(logits) + one_direction(logits.T))


def orthogonality_error(weight: torch.Tensor) -> torch.Tensor:
    """``‖W Wᵀ − I‖_F``: zero exactly when the rows of ``W`` are orthonormal."""
    gram = weight @ weight.T
    identity = torch.eye(gram.shape[0], dtype=gram.dtype, device=gram.device)
    return torch.linalg.matrix_norm(gram - identity, ord="fro")


def orthogonality_penalty(weight: torch.Tensor, lam: float, alpha: float) -> torch.Tensor:
    """The λ-orthogonality penalty ``sigmoid(α (‖WWᵀ − I‖_F − λ)) · ‖WWᵀ − I‖_F``.

    Below the tolerance ``λ`` the gate is closed (≈ 0 value and gradient for large ``α``), so
    ``W`` may deviate from orthogonality by up to ``λ`` for free; above it the penalty grows like
    the deviation itself.
    """
    error = orthogonality_error(weight)
    return torch.sigmoid(alpha * (error - lam)) * error


def info_nce(prediction: torch.Tensor, target: torch.Tensor, temperature: float) -> torch.Tensor:
    """Symmetric InfoNCE with in-batch negatives: row i of ``prediction`` must be nearer (in
    cosine) to target row i than to every other target row of the batch, and vice versa."""
    return supervised_contrastive(prediction, target, None, temperature)


def info_nce_with_negatives(
    query: torch.Tensor, candidates: torch.Tensor, negatives: torch.Tensor, valid: torch.Tensor, temperature: float
) -> torch.Tensor:
    """:func:`info_nce` where each query also ranks ``negatives`` (extra candidates shared by the
    batch, e.g. mined hard negatives) below its own candidate; ``valid`` (batch, n_negatives)
    masks the ones that must not count for a query (its own positive)."""
    q, c, extra = (F.normalize(x, dim=1) for x in (query, candidates, negatives))
    logits = torch.cat([q @ c.T, (q @ extra.T).masked_fill(~valid, float("-inf"))], dim=1) / temperature
    labels = torch.arange(len(q), device=q.device)
    return 0.5 * (F.cross_entropy(logits, labels) + F.cross_entropy(c @ q.T / temperature, labels))


def neighbourhood_kl(
    query: torch.Tensor, student: torch.Tensor, teacher: torch.Tensor, temperature: float
) -> torch.Tensor:
    """KL(softmax(q·teacherᵀ/τ) ‖ softmax(q·studentᵀ/τ)) over the batch's candidates, averaged
    over queries: the student rows (adapted) must rank the batch for each query the way the
    teacher rows (the new model's) do, not only put the positive first."""
    q, s, t = (F.normalize(x, dim=1) for x in (query, student, teacher))
    target = F.log_softmax(q @ t.T / temperature, dim=1)
    return F.kl_div(F.log_softmax(q @ s.T / temperature, dim=1), target, log_target=True, reduction="batchmean")


ObjectiveKind = Literal["auto", "mse", "infonce", "mse+infonce"]


@dataclasses.dataclass
class ObjectiveConfig:
    """What an adapter's output is trained to match.

    ``mse``: the target embedding itself (the conditional mean; right for class-level search).
    ``infonce``: the target's *identity* among the batch (right for instance-level search).
    ``mse+infonce``: both, ``mse / mean(target²) + infonce_weight · infonce``.
    ``auto``: ``fctkit train`` picks MSE for class-level data and InfoNCE for an
    instance-level task; fitted directly, it means MSE.
    """

    kind: ObjectiveKind = "auto"
    temperature: float = 0.05
    infonce_weight: float = 10.0  # measured: 1 lets the (relative) MSE term dominate and lose identity

    def __post_init__(self) -> None:
        if self.kind not in ("auto", "mse", "infonce", "mse+infonce"):
            raise ConfigError(f"objective.kind must be 'auto', 'mse', 'infonce' or 'mse+infonce', got {self.kind!r}")
        if self.temperature <= 0 or self.infonce_weight < 0:
            raise ConfigError("objective.temperature must be > 0 and objective.infonce_weight >= 0")


def objective_loss(config: ObjectiveConfig) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor]:
    """``loss(prediction, target)`` for ``config``."""
    if config.kind in ("auto", "mse"):
        return mse_loss
    if config.kind == "infonce":
        return lambda prediction, target: info_nce(prediction, target, config.temperature)
    return lambda prediction, target: (
        relative_mse(prediction, target) + config.infonce_weight * info_nce(prediction, target, config.temperature)
    )


def relative_mse(prediction: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
    """MSE divided by the batch's mean squared target: scale-free, so that it weighs against
    InfoNCE (itself scale-free) the same way whatever the embedding's norm."""
    return mse_loss(prediction, target) / target.detach().pow(2).mean().clamp_min(1e-12)

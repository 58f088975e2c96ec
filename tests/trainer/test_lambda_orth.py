"""λ-orthogonality: B⊥ orthogonality, the gated penalty, the large-λ limit, truncation, the
materialised backward map, the contrastive loss and input validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import special_ortho_group

from fctkit.errors import ConfigError, InputError
from fctkit.trainer.evaluation import evaluate_retrieval
from fctkit.trainer.lambda_orth import LambdaOrthAdapter, LambdaOrthConfig, OrthogonalMap, rotation_between
from fctkit.trainer.losses import orthogonality_error, orthogonality_penalty, supervised_contrastive
from tests.support.seeds import seed as suite_seed


def train_config(epochs: int = 20, lr: float = 0.1, seed: int | None = None) -> dict:
    return {
        "epochs": epochs,
        "batch_size": 64,
        "warmup_epochs": 1,
        "lr": lr,
        "seed": suite_seed() if seed is None else seed,
        "device": "cpu",
        "progress": False,
    }


def unit_rows(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)


def rotated_versions(n: int = 800, d_old: int = 16, extra: int = 4, seed: int = 0):
    """Old: overlapping class blobs; new: a known rotation of old plus ``extra`` noise dims."""
    rng = np.random.default_rng(seed)
    labels = rng.integers(0, 8, n)
    old = rng.normal(size=(8, d_old))[labels] * 0.6 + rng.normal(size=(n, d_old))
    rotation = special_ortho_group.rvs(d_old, random_state=seed + 1)
    new = np.hstack([old @ rotation.T, rng.normal(size=(n, extra))])
    return old.astype(np.float32), new.astype(np.float32), labels.astype(np.int64), rotation


def test_orthogonal_backward_is_orthogonal_and_recovers_the_rotation():
    old, new, labels, rotation = rotated_versions()
    train, test = slice(0, 600), slice(600, None)
    adapter, _ = LambdaOrthAdapter.fit(old[train], new[train], labels[train], {"train": train_config()})
    matrix = adapter.backward_weight().detach().double()
    identity = torch.eye(16, dtype=torch.float64)
    assert torch.allclose(matrix.T @ matrix, identity, atol=1e-5)
    assert torch.allclose(matrix @ matrix.T, identity, atol=1e-5)
    assert adapter.metrics["orthogonality_error"] < 1e-5
    assert np.abs(matrix.numpy() - rotation.T).max() < 0.2  # B ≈ Rᵀ undoes the rotation
    q_labels = labels[test]
    backward = evaluate_retrieval(
        adapter.transform_new(new[test]), q_labels, adapter.unified_old(old[test]), q_labels, leave_one_out=True
    )
    old_old = evaluate_retrieval(old[test], q_labels, old[test], q_labels, leave_one_out=True)
    assert backward.top1 >= 0.95 * old_old.top1  # B⊥(new)/old is as good as old/old


def test_penalty_has_zero_gradient_well_below_lambda_and_is_active_above():
    torch.manual_seed(0)
    near_orthogonal = (torch.eye(8) + 0.01 * torch.randn(8, 8)).requires_grad_()
    far = (torch.eye(8) + 0.5 * torch.randn(8, 8)).requires_grad_()
    lam, alpha = 1.0, 100.0
    with torch.no_grad():
        assert float(orthogonality_error(near_orthogonal)) < 0.2 < lam < float(orthogonality_error(far))

    below = orthogonality_penalty(near_orthogonal, lam, alpha)
    below.backward()
    assert float(below.detach()) < 1e-20 and near_orthogonal.grad.abs().max() < 1e-20

    above = orthogonality_penalty(far, lam, alpha)
    above.backward()
    error = float(orthogonality_error(far.detach()))
    assert float(above.detach()) == pytest.approx(error, rel=1e-6)  # the gate is open: the penalty is the error itself
    assert far.grad.abs().max() > 1e-2
    # descending along the gradient reduces the deviation from orthogonality
    with torch.no_grad():
        assert float(orthogonality_error(far - 0.01 * far.grad)) < error


def test_large_lambda_reduces_to_the_plain_affine_map():
    old, new, labels, _ = rotated_versions(n=300)
    runs = {}
    for backward in ("lambda", "affine"):
        config = {"backward": backward, "lam": 1e6, "alpha": 10.0, "train": train_config(epochs=5, lr=1e-2)}
        runs[backward], _ = LambdaOrthAdapter.fit(old, new, labels, config)
    lam_model, affine_model = runs["lambda"], runs["affine"]
    weight = lam_model.backward_weight()
    assert float(orthogonality_penalty(weight.detach(), 1e6, 10.0)) == 0.0
    assert lam_model.metrics["orthogonality_error"] > 0.05  # it is not orthogonal: nothing pulled it there
    for a, b in zip(lam_model.state_dict().values(), affine_model.state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)


def test_small_lambda_pulls_the_affine_map_towards_orthogonality(digits_views):
    d = digits_views
    errors = {}
    for backward in ("lambda", "affine"):
        config = {"backward": backward, "lam": 0.0, "alpha": 10.0, "train": train_config(epochs=8, lr=1e-2)}
        adapter, _ = LambdaOrthAdapter.fit(d.old[d.train], d.new[d.train], d.labels[d.train], config)
        errors[backward] = adapter.metrics["orthogonality_error"]
    assert errors["lambda"] < 0.5 * errors["affine"]


@pytest.mark.parametrize("d_old,d_new", [(6, 9), (9, 6)])
def test_mismatched_dims_truncate_the_larger_embedding(d_old, d_new):
    rng = np.random.default_rng(0)
    old = rng.normal(size=(120, d_old)).astype(np.float32)
    new = rng.normal(size=(120, d_new)).astype(np.float32)
    adapter, _ = LambdaOrthAdapter.fit(old, new, rng.integers(0, 3, 120), {"train": train_config(epochs=2)})
    n = min(d_old, d_new)
    assert adapter.n == n
    assert adapter.transform(old).shape == (120, n) and adapter.transform_new(new).shape == (120, n)
    np.testing.assert_allclose(adapter.unified_old(old), unit_rows(old[:, :n]), rtol=0, atol=1e-6)  # normalize = true
    changed_tail = new.copy()
    changed_tail[:, n:] += 100.0  # coordinates beyond n are dropped before B
    np.testing.assert_array_equal(adapter.transform_new(changed_tail), adapter.transform_new(new))


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("forward", ["affine", "mlp"])
@pytest.mark.parametrize("d_old,d_new", [(6, 9), (9, 6)])
def test_untrained_maps_start_as_the_identity(forward, d_old, d_new, normalize):
    rng = np.random.default_rng(0)
    old, new = rng.normal(size=(30, d_old)).astype(np.float32), rng.normal(size=(30, d_new)).astype(np.float32)
    n = min(d_old, d_new)
    space = unit_rows if normalize else (lambda x: x)
    for backward in ("orthogonal", "lambda"):
        config = LambdaOrthConfig(forward=forward, backward=backward, normalize=normalize)
        adapter = LambdaOrthAdapter(config, d_old=d_old, d_new=d_new)
        np.testing.assert_allclose(adapter.transform(old), space(old[:, :n]), atol=1e-6)
        np.testing.assert_allclose(adapter.transform_new(new), space(new[:, :n]), atol=1e-6)
        np.testing.assert_allclose(adapter.unified_old(old), space(old[:, :n]), atol=1e-6)


@pytest.mark.parametrize("normalize", [True, False])
@pytest.mark.parametrize("backward", ["orthogonal", "lambda"])
def test_materialized_backward_equals_the_trained_map(backward, normalize):
    old, new, labels, _ = rotated_versions(n=200)
    config = {"backward": backward, "lam": 0.0, "normalize": normalize, "train": train_config(epochs=3)}
    adapter, _ = LambdaOrthAdapter.fit(old, new, labels, config)
    module = adapter.materialized_backward()
    if normalize:  # unit rows (of the first 16 coords) in, the plain matrix, unit rows out
        assert [type(m).__name__ for m in module] == ["UnitRows", "Linear", "UnitRows"]
        linear = module[1]
    else:
        linear = module
    assert isinstance(linear, torch.nn.Linear) and (linear.in_features, linear.out_features) == (20, 16)
    assert torch.count_nonzero(linear.weight[:, 16:]) == 0
    if backward == "orthogonal":
        upper = torch.triu(adapter.backward_map.upper.detach().double(), diagonal=1)
        expected = torch.linalg.matrix_exp(upper - upper.T).float()
        assert linear.bias is None and float(upper.abs().max()) > 0
    else:
        expected = adapter.backward_map.weight.detach()
        torch.testing.assert_close(linear.bias, adapter.backward_map.bias.detach())
    torch.testing.assert_close(linear.weight[:, :16], expected, rtol=0, atol=1e-6)
    with torch.no_grad():
        _, direct = adapter(torch.from_numpy(old), torch.from_numpy(new))
        torch.testing.assert_close(module(torch.from_numpy(new)), direct, rtol=1e-5, atol=1e-5)


def test_procrustes_start_is_the_best_rotation():
    old, new, _, rotation = rotated_versions(n=300)
    adapter = LambdaOrthAdapter(LambdaOrthConfig(), d_old=16, d_new=20)
    adapter.start_at_procrustes(old, new)
    assert adapter.metrics["procrustes_init"] == 1.0
    np.testing.assert_allclose(adapter.backward_weight().detach().numpy(), rotation.T, atol=1e-4)
    # a reflection is not expm of a skew-symmetric matrix: the best map with det +1 is chosen
    reflected = old.copy()
    reflected[:, 0] *= -1
    best = rotation_between(old, reflected)
    np.testing.assert_allclose(best @ best.T, np.eye(16), atol=1e-8)
    assert np.linalg.det(best) == pytest.approx(1.0)


def test_normalised_unified_space_has_unit_rows():
    old, new, labels, _ = rotated_versions(n=200)
    adapter, _ = LambdaOrthAdapter.fit(5 * old, new, labels, {"backward": "lambda", "train": train_config(epochs=2)})
    for rows in (adapter.transform(5 * old), adapter.transform_new(new), adapter.unified_old(5 * old)):
        np.testing.assert_allclose(np.linalg.norm(rows, axis=1), 1.0, atol=1e-5)


def test_orthogonal_map_is_orthogonal_for_any_parameter():
    torch.manual_seed(1)
    rotation = OrthogonalMap(12)
    with torch.no_grad():
        rotation.upper.normal_(std=2.0)
    matrix = rotation.weight.detach().double()
    torch.testing.assert_close(matrix @ matrix.T, torch.eye(12, dtype=torch.float64), rtol=0, atol=1e-5)
    assert float(torch.linalg.det(matrix)) == pytest.approx(1.0, abs=1e-5)


def reference_contrastive(a: torch.Tensor, c: torch.Tensor, labels: list[int] | None, tau: float) -> float:
    """A loop-by-loop reading of the supervised multi-positive contrastive loss."""
    a = torch.nn.functional.normalize(a, dim=1).double()
    c = torch.nn.functional.normalize(c, dim=1).double()
    n = len(a)

    def direction(x: torch.Tensor, y: torch.Tensor) -> float:
        total = 0.0
        for i in range(n):
            logits = [float(x[i] @ y[j]) / tau for j in range(n)]
            log_norm = float(torch.logsumexp(torch.tensor(logits), 0))
            positives = [j for j in range(n) if (j == i if labels is None else labels[j] == labels[i])]
            total += -sum(logits[j] - log_norm for j in positives) / len(positives)
        return total / n

    return 0.5 * (direction(a, c) + direction(c, a))


@pytest.mark.parametrize("labels", [None, [0, 1, 0, 2, 1, 0]])
def test_supervised_contrastive_matches_its_definition(labels):
    torch.manual_seed(2)
    a, c = torch.randn(6, 5), torch.randn(6, 5)
    label_tensor = None if labels is None else torch.tensor(labels)
    value = supervised_contrastive(a, c, label_tensor, temperature=0.3)
    assert float(value) == pytest.approx(reference_contrastive(a, c, labels, 0.3), rel=1e-5)


def test_contrastive_loss_prefers_class_aligned_views():
    torch.manual_seed(3)
    labels = torch.arange(4).repeat(8)
    centres = 3.0 * torch.randn(4, 6)
    view = centres[labels] + 0.1 * torch.randn(32, 6)
    aligned = supervised_contrastive(view, view + 0.1 * torch.randn(32, 6), labels, 0.1)
    shuffled = supervised_contrastive(view, view[torch.randperm(32)], labels, 0.1)
    assert float(aligned) < float(shuffled)


def test_same_seed_gives_identical_weights():
    old, new, labels, _ = rotated_versions(n=200)
    config = {"forward": "mlp", "hidden_width": 16, "train": train_config(epochs=2, seed=5)}
    first, _ = LambdaOrthAdapter.fit(old, new, labels, config)
    second, _ = LambdaOrthAdapter.fit(old, new, labels, config)
    for a, b in zip(first.state_dict().values(), second.state_dict().values()):
        assert torch.equal(a, b)


def test_bad_inputs_and_configs_are_rejected():
    old, new, labels, _ = rotated_versions(n=100)
    config = {"train": train_config(epochs=1)}
    with pytest.raises(InputError, match="labels"):
        LambdaOrthAdapter.fit(old, new, labels[:50], config)
    with pytest.raises(InputError, match="rows must be aligned"):
        LambdaOrthAdapter.fit(old, new[:80], labels, config)
    with pytest.raises(InputError, match="NaN"):
        LambdaOrthAdapter.fit(old, np.where(new > 2.5, np.inf, new), labels, config)
    adapter, _ = LambdaOrthAdapter.fit(old, new, labels, config)
    with pytest.raises(InputError, match="expected 20 dims"):
        adapter.transform_new(old)
    with pytest.raises(ConfigError):
        LambdaOrthConfig(tau=0.0)
    with pytest.raises(ConfigError, match="not one of"):
        LambdaOrthAdapter.fit(old, new, labels, {"backward": "rotation"})

"""Closed-form baselines: least squares (with bias, ridge) and orthogonal Procrustes."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import special_ortho_group

from fctkit.errors import ConfigError, InputError
from fctkit.trainer.closed_form import ClosedFormAdapter, ClosedFormConfig


def random_pair(n: int = 200, d_old: int = 12, d_new: int = 9, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    old = rng.normal(size=(n, d_old)) + 3.0
    new = np.tanh(old @ rng.normal(size=(d_old, d_new))) + rng.normal(size=(n, d_new)) - 1.0
    return old, new


def test_least_squares_equals_numpy_lstsq_with_a_bias_column():
    old, new = random_pair()
    adapter, history = ClosedFormAdapter.fit(old, new)
    augmented = np.hstack([old, np.ones((len(old), 1))])
    solution = np.linalg.lstsq(augmented, new, rcond=None)[0]
    np.testing.assert_allclose(adapter.linear.weight.detach().numpy(), solution[:-1].T, atol=1e-5)
    np.testing.assert_allclose(adapter.linear.bias.detach().numpy(), solution[-1], atol=1e-5)
    np.testing.assert_allclose(adapter.transform(old), augmented @ solution, atol=1e-4)
    assert history.train_loss[0] == pytest.approx(np.mean((augmented @ solution - new) ** 2), rel=1e-6)


def test_least_squares_without_bias_and_with_ridge():
    old, new = random_pair()
    no_bias, _ = ClosedFormAdapter.fit(old, new, {"bias": False})
    assert no_bias.linear.bias is None
    np.testing.assert_allclose(
        no_bias.linear.weight.detach().numpy().T, np.linalg.lstsq(old, new, rcond=None)[0], atol=1e-5
    )

    ridge = 25.0
    ridged, _ = ClosedFormAdapter.fit(old, new, {"ridge": ridge})
    centred_old, centred_new = old - old.mean(0), new - new.mean(0)
    expected = np.linalg.solve(centred_old.T @ centred_old + ridge * np.eye(12), centred_old.T @ centred_new)
    np.testing.assert_allclose(ridged.linear.weight.detach().numpy().T, expected, atol=1e-5)
    np.testing.assert_allclose(ridged.linear.bias.detach().numpy(), new.mean(0) - old.mean(0) @ expected, atol=1e-5)


def test_procrustes_recovers_a_known_rotation_and_offset():
    rng = np.random.default_rng(1)
    rotation = special_ortho_group.rvs(10, random_state=2)
    old = rng.normal(size=(300, 10))
    offset = rng.normal(size=10)
    new = old @ rotation + offset + 0.01 * rng.normal(size=(300, 10))
    adapter, _ = ClosedFormAdapter.fit(old, new, {"method": "procrustes"})
    weight = adapter.as_linear().weight.detach().double().numpy()  # (d_new, d_old) = rotationᵀ
    np.testing.assert_allclose(weight @ weight.T, np.eye(10), atol=1e-5)
    np.testing.assert_allclose(weight.T, rotation, atol=0.01)
    np.testing.assert_allclose(adapter.as_linear().bias.detach().numpy(), offset, atol=0.01)


@pytest.mark.parametrize("d_old,d_new", [(12, 7), (7, 12)])
def test_procrustes_is_semi_orthogonal_when_dims_differ(d_old, d_new):
    old, new = random_pair(d_old=d_old, d_new=d_new)
    weight = ClosedFormAdapter.fit(old, new, {"method": "procrustes"})[0].linear.weight.detach().double().numpy()
    assert weight.shape == (d_new, d_old)
    small = min(d_old, d_new)
    gram = weight @ weight.T if d_new < d_old else weight.T @ weight  # the orthonormal side
    np.testing.assert_allclose(gram, np.eye(small), atol=1e-5)


def test_procrustes_is_the_best_rotation_and_least_squares_the_best_map():
    old, new = random_pair(d_old=9, d_new=9)
    ls_mse = ClosedFormAdapter.fit(old, new)[1].train_loss[0]
    procrustes_mse = ClosedFormAdapter.fit(old, new, {"method": "procrustes"})[1].train_loss[0]
    centred_old, centred_new = old - old.mean(0), new - new.mean(0)
    other_rotations = [special_ortho_group.rvs(9, random_state=s) for s in range(20)]
    assert ls_mse < procrustes_mse
    assert all(procrustes_mse < np.mean((centred_old @ r - centred_new) ** 2) for r in other_rotations)


def test_the_linear_module_is_the_adapter():
    old, new = random_pair()
    adapter, _ = ClosedFormAdapter.fit(old, new)
    with torch.no_grad():
        direct = adapter.as_linear()(torch.from_numpy(old.astype(np.float32))).numpy()
    np.testing.assert_array_equal(direct, adapter.transform(old))


def test_bad_inputs_and_configs_are_rejected():
    old, new = random_pair()
    with pytest.raises(InputError, match="rows must be aligned"):
        ClosedFormAdapter.fit(old, new[:10])
    with pytest.raises(InputError, match="NaN"):
        ClosedFormAdapter.fit(np.where(old > 5, np.nan, old), new)
    adapter, _ = ClosedFormAdapter.fit(old, new)
    with pytest.raises(InputError, match="expected 12 dims"):
        adapter.transform(new)
    with pytest.raises(ConfigError, match="least squares only"):
        ClosedFormConfig(method="procrustes", ridge=1.0)
    with pytest.raises(ConfigError, match="ridge must be"):
        ClosedFormAdapter.fit(old, new, {"ridge": -1.0})

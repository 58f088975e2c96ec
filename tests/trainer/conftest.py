"""Fixtures of the trainer tests."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest


@dataclasses.dataclass(frozen=True)
class DigitsViews:
    """Two nonlinear 'model versions' of sklearn digits, split into train and test rows."""

    old: np.ndarray  # (N, 24) tanh of a random projection of the pixels
    new: np.ndarray  # (N, 32) ReLU of another random projection
    labels: np.ndarray
    train: np.ndarray  # row indices
    test: np.ndarray


@pytest.fixture(scope="session")
def digits_views() -> DigitsViews:
    from sklearn.datasets import load_digits

    pixels, labels = load_digits(return_X_y=True)
    pixels = pixels / 16.0
    rng = np.random.default_rng(0)
    old = np.tanh(pixels @ rng.normal(size=(64, 24)) / 3.0).astype(np.float32)
    new = np.maximum(pixels @ rng.normal(size=(64, 32)) / 3.0, 0.0).astype(np.float32)
    order = rng.permutation(len(labels))
    return DigitsViews(old, new, labels.astype(np.int64), np.sort(order[:1200]), np.sort(order[1200:]))

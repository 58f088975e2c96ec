"""Linear centred kernel alignment (numpy only)."""

from __future__ import annotations

import numpy as np

from fctkit.errors import InputError


def linear_cka(x: np.ndarray, y: np.ndarray) -> float:
    """Linear CKA between two representations of the same items (Kornblith et al., ICML 2019):
    ``‖Ycᵀ Xc‖²_F / (‖Xcᵀ Xc‖_F ‖Ycᵀ Yc‖_F)`` with column-centred ``Xc``, ``Yc``.

    ``x`` is (N, p), ``y`` is (N, q); rows are the same items in the same order. The value is
    in [0, 1], 1 for identical representations, and invariant to orthogonal transforms and
    isotropic scaling of either side. The FCT paper (Table 6) uses it to show that side-info
    ψ carries information the old embedding φ_old lacks (low CKA).
    """
    xc, yc = _centred(x, "x"), _centred(y, "y")
    if len(xc) != len(yc):
        raise InputError(f"linear_cka: x has {len(xc)} rows and y has {len(yc)}; both must describe the same items")
    cross = np.linalg.norm(yc.T @ xc) ** 2
    return float(cross / (np.linalg.norm(xc.T @ xc) * np.linalg.norm(yc.T @ yc)))


def _centred(array: np.ndarray, name: str) -> np.ndarray:
    array = np.asarray(array, dtype=np.float64)
    if array.ndim != 2 or array.shape[0] < 2 or array.shape[1] == 0:
        raise InputError(f"linear_cka: {name} must be an (N, d) matrix with N >= 2, got shape {array.shape}")
    if not np.isfinite(array).all():
        raise InputError(f"linear_cka: {name} holds NaN or inf")
    centred = array - array.mean(axis=0, keepdims=True)
    # A constant representation (e.g. side-info kind "none") has no variance: CKA is undefined.
    if not np.any(np.abs(centred) > 1e-12 * max(1.0, float(np.abs(array).max()))):
        raise InputError(
            f"linear_cka: {name} is constant over the items (e.g. zero side-info); CKA is undefined for it"
        )
    return centred

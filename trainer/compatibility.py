"""Compatibility of model versions, judged on retrieval results (numpy only): the empirical
compatibility criterion (ECC) of one upgrade and the compatibility matrix over a sequence of
versions with its AC and AM (CoReS definitions)."""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fctkit.errors import InputError

from .evaluation_inputs import check_positive_int
from .retrieval_result import RetrievalResult, metric_value


def ecc(new_to_adapted: RetrievalResult, old_to_old: RetrievalResult, metric: str = "top1") -> bool:
    """Empirical compatibility criterion: M(new, h(old)) > M(old, old), strictly."""
    return metric_value(new_to_adapted, metric) > metric_value(old_to_old, metric)


@dataclass(frozen=True)
class CompatibilityMatrix:
    """C[i, j] = M(query model i, gallery model j) for j <= i (nan above the diagonal).

    ``ac``: average compatibility, the fraction of pairs i > j with C[i, j] > C[j, j];
    ``am``: average multi-model accuracy, the mean of C over i >= j (CoReS definitions).
    """

    values: np.ndarray
    ac: float
    am: float

    def to_markdown(self, names: Sequence[str]) -> str:
        t = self.values.shape[0]
        if len(names) != t:
            raise InputError(f"need {t} version names for a {t}x{t} compatibility matrix; got {len(names)}")
        lines = [
            "| query \\ gallery | " + " | ".join(names) + " |",
            "|---" * (t + 1) + "|",
        ]
        for i, name in enumerate(names):
            cells = [f"{self.values[i, j]:.4f}" if j <= i else "" for j in range(t)]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
        lines.append("")
        lines.append(f"AC = {self.ac:.4f}, AM = {self.am:.4f}")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {
            "values": [[None if np.isnan(v) else float(v) for v in row] for row in self.values],
            "ac": self.ac,
            "am": self.am,
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> CompatibilityMatrix:
        values = np.array([[np.nan if v is None else v for v in row] for row in data["values"]], dtype=float)
        return cls(values=values, ac=float(data["ac"]), am=float(data["am"]))


def compatibility_matrix(evaluate: Callable[[int, int], float], n_versions: int) -> CompatibilityMatrix:
    """Fill C[i, j] = evaluate(i, j) for every j <= i and compute AC and AM.

    AC = 2 / (T (T - 1)) * sum_{i > j} 1[C_ij > C_jj];  AM = 2 / (T (T + 1)) * sum_{i >= j} C_ij.
    """
    t = check_positive_int(n_versions, "n_versions")
    if t < 2:
        raise InputError("a compatibility matrix needs at least two versions")
    values = np.full((t, t), np.nan)
    for i in range(t):
        for j in range(i + 1):
            value = float(evaluate(i, j))
            if not math.isfinite(value):
                raise InputError(f"evaluate({i}, {j}) returned {value!r}; expected a finite metric")
            values[i, j] = value
    lower = np.tril_indices(t, k=-1)
    ac = float(np.count_nonzero(values[lower] > np.diag(values)[lower[1]])) * 2 / (t * (t - 1))
    am = math.fsum(values[np.tril_indices(t)].tolist()) * 2 / (t * (t + 1))
    return CompatibilityMatrix(values=values, ac=ac, am=am)

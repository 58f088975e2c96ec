"""How a device scores queries beyond plain nearest neighbours, as a signed manifest declares it.

- :class:`TransitionPolicy` — transition scoring. While a device still holds the previous
  version's embed graph and its rows' previous vectors, it ranks by
  ``weight · cos(previous query, previous row) + (1 − weight) · cos(query, adapted row)``.
  The weight was chosen on held-out training data. The transition ends on command, after a
  full backfill, or ``max_days`` after the upgrade switched (0: no time limit).
- :class:`HubnessPolicy` — a per-row hubness offset: rank by ``cos(query, row) − beta · r(row)``,
  where ``r`` is what the bundle's ``hubness`` graph computes from the row (the mean of its
  k largest cosines to reference queries shipped as constants in that graph).

Both belong to forward-mode, cosine bundles. A bundle may declare both: during the transition
a device ranks by ``weight · cos(previous) + (1 − weight) · (cos(query, adapted row) − beta · r)``,
and by ``cos − beta · r`` once it ends (the trainer chose the weight with the offset in place).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from fctkit.errors import BundleFormatError

from .strict_json import exact_keys, is_int, is_number, number, typed


@dataclass(frozen=True)
class TransitionPolicy:
    previous_version: int
    weight: float
    max_days: float = 0.0

    def __post_init__(self) -> None:
        where = "manifest transition"
        if not is_int(self.previous_version) or self.previous_version <= 0:
            raise BundleFormatError(
                f"{where}: previous_version must be a positive integer, got {self.previous_version!r}"
            )
        if not is_number(self.weight) or not 0.0 < self.weight < 1.0:
            raise BundleFormatError(f"{where}: weight must be a number strictly between 0 and 1, got {self.weight!r}")
        if not is_number(self.max_days) or self.max_days < 0:
            raise BundleFormatError(
                f"{where}: max_days must be a finite number >= 0 (0: no time limit), got {self.max_days!r}"
            )

    def to_json(self) -> dict[str, Any]:
        return {
            "previous_version": self.previous_version,
            "weight": float(self.weight),
            "max_days": float(self.max_days),
        }

    @classmethod
    def from_json(cls, data: Any, where: str) -> TransitionPolicy:
        data = exact_keys(data, ("previous_version", "weight", "max_days"), where)
        return cls(
            typed(data["previous_version"], int, f"{where}.previous_version"),
            number(data["weight"], f"{where}.weight"),
            number(data["max_days"], f"{where}.max_days"),
        )


@dataclass(frozen=True)
class HubnessPolicy:
    beta: float

    def __post_init__(self) -> None:
        if not is_number(self.beta) or self.beta <= 0:
            raise BundleFormatError(f"manifest hubness: beta must be a finite number > 0, got {self.beta!r}")

    def to_json(self) -> dict[str, Any]:
        return {"beta": float(self.beta)}

    @classmethod
    def from_json(cls, data: Any, where: str) -> HubnessPolicy:
        data = exact_keys(data, ("beta",), where)
        return cls(number(data["beta"], f"{where}.beta"))


def check_search_policies(manifest: Any) -> None:
    """The rules a manifest's transition / hubness declarations obey (see the module docstring)."""
    m = manifest
    hubness_graphs = [a for a in m.artifacts if a.role == "hubness"]
    declared = [name for name in ("transition", "hubness") if getattr(m, name) is not None]
    if declared and (m.mode != "forward" or m.distance != "cosine"):
        raise BundleFormatError(
            f"bundle v{m.version}: {' and '.join(declared)} scoring belongs to a forward-mode cosine bundle, "
            f"not mode {m.mode!r} with distance {m.distance!r}"
        )
    if m.transition is not None:
        sources = {a.source_version for a in m.artifacts if a.role == "forward"}
        if m.transition.previous_version not in sources:
            raise BundleFormatError(
                f"bundle v{m.version}: transition from v{m.transition.previous_version}, but the "
                f"bundle has no forward adapter from it (it adapts: {sorted(sources) or 'none'})"
            )
    if (m.hubness is None) != (not hubness_graphs) or len(hubness_graphs) > 1:
        raise BundleFormatError(
            f"bundle v{m.version}: a hubness declaration needs exactly one hubness artifact and the "
            f"artifact needs the declaration (has {len(hubness_graphs)} artifact(s), declaration "
            f"{'present' if m.hubness else 'absent'})"
        )
    for graph in hubness_graphs:
        rows, offset = graph.inputs[0], graph.outputs[0]
        if len(graph.inputs) != 1 or len(rows.shape) != 2 or rows.feature_dim != m.embedding_dim:
            raise BundleFormatError(
                f"hubness artifact {graph.name!r}: takes one (batch, {m.embedding_dim}) input "
                f"(the rows' embeddings), got {[s.shape for s in graph.inputs]}"
            )
        if offset.shape != (None, 1):
            raise BundleFormatError(
                f"hubness artifact {graph.name!r}: its output is one offset per row, shape "
                f"(batch, 1), got {offset.shape}"
            )


__all__ = ["HubnessPolicy", "TransitionPolicy", "check_search_policies"]

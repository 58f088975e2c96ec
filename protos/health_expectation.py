"""What a release expects its devices to report after upgrading, as its signed manifest records it.

The exporter measures, on the evaluation split that nothing else touched, the same label-free
health a device measures after an upgrade (:mod:`fctkit.upgrade_health`): a sample of
``sample_size`` rows re-embedded by the new model and compared with their adapted vectors.
Self-retrieval depends on how many rows the gallery holds, so each measure is recorded at several
gallery sizes (``gallery_rows``), as the mean and standard deviation over ``draws`` repeated
samples. :meth:`HealthExpectation.expected` reads a measure at any device's gallery size.

``level`` is the task's: ``class`` (a query should find items of its class: the adapter is fitted to
the new model's geometry, so the mean cosine between h(old) and φ_new is the measure that tracks
quality) or ``instance`` (a query should find one item: an InfoNCE adapter keeps identity, not the
new model's geometry, so self-retrieval is the measure and the mean cosine is not).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from fctkit.errors import BundleFormatError
from fctkit.upgrade_health import MEASURES

from .strict_json import exact_keys, is_int, is_number, number, typed

LEVELS = ("class", "instance")
#: the measure a release's guard compares by default, per level
GUARD_MEASURE = {"class": "mean_cosine", "instance": "recall_at_1"}
_WHERE = "manifest health_expectation"


def gate_level(cases: Any) -> str:
    """The level of a release judged by the gate ``cases`` (case -> metrics) when its manifest does
    not record one: ``instance`` when the gate measured recall@1 (instance-level retrieval), else ``class``."""
    tables = cases.values() if isinstance(cases, dict) else ()
    return "instance" if any(isinstance(m, dict) and "recall@1" in m for m in tables) else "class"


def break_even(cases: Any, level: str) -> float:
    """The gate's old/old figure over the release's own case (recall@1 at instance level, top-1 at
    class level; the release's case is the one besides old/old and new/new, the served one when a
    quantised release also records its fp32 case), or 0 when the gate does not say."""
    metric = "recall@1" if level == "instance" else "top1"
    tables = cases if isinstance(cases, dict) else {}
    own = [c for c in tables if c not in ("old/old", "new/new") and not c.endswith("[fp32]")]
    try:
        baseline, release = float(tables["old/old"][metric]), float(tables[own[0]][metric])
    except (KeyError, IndexError, TypeError, ValueError):
        return 0.0
    # a release that found nothing: as far below not upgrading as a finite number can say
    return baseline / max(release, 1e-3) if baseline > 0 else 0.0


@dataclass(frozen=True)
class HealthExpectation:
    level: str
    sample_size: int
    draws: int
    gallery_rows: tuple[int, ...]
    #: measure -> (mean at each gallery size, standard deviation at each gallery size)
    measures: dict[str, tuple[tuple[float, ...], tuple[float, ...]]]
    #: per gallery size: not upgrading's figure over the release's (recall@1 at instance level,
    #: top-1 at class level) on galleries of that size cut from the evaluation split; above 1 the
    #: release does worse than not upgrading at that size, and a fleet is held to it (0: not known)
    break_even: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        if self.level not in LEVELS:
            raise BundleFormatError(f"{_WHERE}: level must be one of {', '.join(LEVELS)}, got {self.level!r}")
        for name in ("sample_size", "draws"):
            value = getattr(self, name)
            if not is_int(value) or value < 1:
                raise BundleFormatError(f"{_WHERE}: {name} must be a positive integer, got {value!r}")
        rows = self.gallery_rows
        if not rows or not all(is_int(r) and r >= 1 for r in rows) or list(rows) != sorted(set(rows)):
            raise BundleFormatError(f"{_WHERE}: gallery_rows must be increasing positive integers, got {rows!r}")
        if sorted(self.measures) != sorted(MEASURES):
            raise BundleFormatError(f"{_WHERE}: measures must be exactly {', '.join(MEASURES)}")
        for name, (means, sds) in self.measures.items():
            values = (*means, *sds)
            if len(means) != len(rows) or len(sds) != len(rows) or not all(is_number(v) for v in values):
                raise BundleFormatError(
                    f"{_WHERE}: {name} needs one finite mean and one standard deviation per gallery size ({len(rows)})"
                )
            if any(sd < 0 for sd in sds):
                raise BundleFormatError(f"{_WHERE}: {name} has a negative standard deviation")
        if len(self.break_even) != len(rows) or not all(is_number(b) and b >= 0 for b in self.break_even):
            raise BundleFormatError(
                f"{_WHERE}: break_even needs one finite number >= 0 per gallery size ({len(rows)}), got {self.break_even!r:.80}"
            )

    @classmethod
    def measured(
        cls,
        cases: dict[str, Any],
        sizes: tuple[int, ...],
        measures: dict[str, tuple[tuple[float, ...], tuple[float, ...]]],
        sample_size: int,
        draws: int,
        sized_break_even: tuple[float, ...] | None = None,
    ) -> HealthExpectation:
        """The expectation of a release whose gate recorded ``cases`` (its level: :func:`gate_level`),
        from :func:`fctkit.upgrade_health.expected_health`'s ``sizes`` and ``measures``; its
        break-even by size (``sized_break_even``; None: the gate's own figure, :func:`break_even`,
        at every size)."""
        level = gate_level(cases)
        sized = sized_break_even or (break_even(cases, level),) * len(sizes)
        return cls(level, sample_size, draws, sizes, measures, tuple(sized))

    def bound(self, margin: float, rows: int) -> float:
        """The fraction of the expected measure a device of ``rows`` rows is held to: 1 − ``margin``,
        or the break-even at its size when that is above 1 — the release did worse than not upgrading
        there on the evaluation split, and the fleet is held to doing better than that. A break-even
        under 1 is no floor: it assumes the measure falls in proportion to quality against a fixed
        not-upgrading figure, but on devices whose data drifted not upgrading falls too."""
        at_size = self._interpolated(self.break_even, rows, extrapolate=False)
        return at_size if at_size > 1.0 else 1.0 - margin

    def vote(self, measure: str, value: float, rows: int, margin: float) -> float:
        """A device's guard vote: its :meth:`ratio` over its :meth:`bound` (below 1: under the bound)."""
        return self.ratio(measure, value, rows) / self.bound(margin, rows)

    def ratio(self, measure: str, value: float, rows: int) -> float:
        """``value`` of ``measure`` reported by a device whose gallery held ``rows`` rows, as a
        fraction of what the release expects there (the expectation floored at 0.05, so that a
        near-zero expectation cannot blow the fraction up)."""
        return value / max(self.expected(measure, rows)[0], 0.05)

    @property
    def guard_measure(self) -> str:
        """The measure that tracks quality at this release's level (:data:`GUARD_MEASURE`)."""
        return GUARD_MEASURE[self.level]

    def expected(self, measure: str, rows: int) -> tuple[float, float]:
        """(mean, standard deviation) of ``measure`` for a gallery of ``rows`` rows: interpolated
        linearly in log(rows) between the measured sizes, held at the smallest size below it, and
        carried on along the last segment's slope beyond the largest (self-retrieval keeps falling
        as a gallery grows), kept within the measure's range."""
        means, sds = self.measures[measure]
        mean = self._interpolated(means, rows, extrapolate=True)
        sd = self._interpolated(sds, rows, extrapolate=False)
        low, high = (1.0, math.inf) if measure == "median_rank" else (-1.0, 1.0)
        return min(max(mean, low), high), max(sd, 0.0)

    def _interpolated(self, values: tuple[float, ...], rows: int, *, extrapolate: bool) -> float:
        """``values`` (one per gallery size) at ``rows`` rows: linear in log(rows) between the sizes,
        held at the smallest below it, and beyond the largest carried on along the last segment's
        slope (``extrapolate``) or held."""
        sizes = [math.log(r) for r in self.gallery_rows]
        at = math.log(max(rows, 1))
        if len(sizes) == 1 or at <= sizes[0]:
            return values[0]
        segment = next((i for i in range(1, len(sizes)) if at <= sizes[i]), len(sizes) - 1)
        t = (at - sizes[segment - 1]) / (sizes[segment] - sizes[segment - 1])
        t = t if extrapolate else min(t, 1.0)
        return values[segment - 1] + t * (values[segment] - values[segment - 1])

    def to_json(self) -> dict[str, Any]:
        return {
            "level": self.level,
            "sample_size": self.sample_size,
            "draws": self.draws,
            "gallery_rows": list(self.gallery_rows),
            "break_even": [float(b) for b in self.break_even],
            "measures": {
                name: {"mean": [float(v) for v in means], "sd": [float(v) for v in sds]}
                for name, (means, sds) in sorted(self.measures.items())
            },
        }

    @classmethod
    def from_json(cls, data: Any, where: str) -> HealthExpectation:
        data = exact_keys(data, ("level", "sample_size", "draws", "gallery_rows", "measures", "break_even"), where)
        measures = exact_keys(data["measures"], MEASURES, f"{where}.measures")
        parsed = {}
        for name, value in measures.items():
            value = exact_keys(value, ("mean", "sd"), f"{where}.measures.{name}")
            parsed[name] = tuple(
                tuple(
                    number(v, f"{where}.measures.{name}.{part}")
                    for v in typed(value[part], list, f"{where}.measures.{name}.{part}")
                )
                for part in ("mean", "sd")
            )
        return cls(
            typed(data["level"], str, f"{where}.level"),
            typed(data["sample_size"], int, f"{where}.sample_size"),
            typed(data["draws"], int, f"{where}.draws"),
            tuple(
                typed(r, int, f"{where}.gallery_rows")
                for r in typed(data["gallery_rows"], list, f"{where}.gallery_rows")
            ),
            parsed,  # type: ignore[arg-type]
            tuple(number(b, f"{where}.break_even") for b in typed(data["break_even"], list, f"{where}.break_even")),
        )

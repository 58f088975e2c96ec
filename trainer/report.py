"""Evaluation reports: named retrieval cases, verdicts, backfill curves, a compatibility matrix
and free facts, rendered as markdown, JSON and a PNG plot (matplotlib, imported only to draw).

Case names follow ``query/gallery``: ``old/old``, ``new/h(old)``, ``B(new)/F(old)``, ...
Reference numbers (e.g. a paper's) are fractions in [0, 1] like ours, keyed by metric
(``top1``, ``top5``, ``mean_ap``); the markdown shows them next to our value.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from fctkit.errors import InputError, require

from .backfill_curves import BackfillCurve
from .compatibility import CompatibilityMatrix, ecc
from .retrieval_result import RetrievalResult, metric_k, metric_value

REPORT_FORMAT = "fctkit-report/1"
_Scalar = str | int | float | bool | None


@dataclass(frozen=True)
class Case:
    """One retrieval evaluation in a report."""

    name: str
    result: RetrievalResult
    reference: dict[str, float] = field(default_factory=dict)
    extra: dict[str, _Scalar] = field(default_factory=dict)


@dataclass(frozen=True)
class Verdict:
    """A pass/fail check, e.g. ECC, with a one-line explanation."""

    name: str
    passed: bool
    detail: str = ""


class Report:
    """Collects evaluation results and renders them (see the module docstring)."""

    def __init__(self, title: str) -> None:
        if not isinstance(title, str) or not title.strip():
            raise InputError("a report needs a non-empty title")
        self.title = title
        self.cases: dict[str, Case] = {}
        self.verdicts: list[Verdict] = []
        self.backfill_curves: dict[str, BackfillCurve] = {}
        self.compatibility: CompatibilityMatrix | None = None
        self.compatibility_names: list[str] = []
        self.facts: dict[str, Any] = {}

    # -- building ---------------------------------------------------------------------------

    def add_case(
        self,
        name: str,
        result: RetrievalResult,
        *,
        reference: float | Mapping[str, float] | None = None,
        **extra: _Scalar,
    ) -> Case:
        """Add retrieval case ``name``; ``reference`` is a top-1 fraction or {metric: fraction}."""
        _check_new_name(name, self.cases, "case")
        if not isinstance(result, RetrievalResult):
            raise InputError(f"case {name!r}: expected a RetrievalResult, got {type(result).__name__}")
        case = Case(name, result, _normalise_reference(name, reference), _json_scalars(name, extra))
        self.cases[name] = case
        return case

    def add_verdict(self, name: str, passed: bool, detail: str = "") -> Verdict:
        verdict = Verdict(str(name), bool(passed), str(detail))
        self.verdicts.append(verdict)
        return verdict

    def add_ecc(self, adapted_case: str = "new/h(old)", baseline_case: str = "old/old", metric: str = "top1") -> bool:
        """Add the ECC verdict M(adapted_case) > M(baseline_case) from two added cases."""
        adapted, baseline = (self._case(adapted_case), self._case(baseline_case))
        passed = ecc(adapted.result, baseline.result, metric)
        a, b = metric_value(adapted.result, metric), metric_value(baseline.result, metric)
        relation = ">" if passed else "<="
        self.add_verdict(f"ECC ({metric})", passed, f"{adapted_case} {a:.4f} {relation} {baseline_case} {b:.4f}")
        return passed

    def add_backfill_curve(self, name: str, curve: BackfillCurve) -> None:
        _check_new_name(name, self.backfill_curves, "backfill curve")
        if not isinstance(curve, BackfillCurve):
            raise InputError(f"backfill curve {name!r}: expected a BackfillCurve, got {type(curve).__name__}")
        self.backfill_curves[name] = curve

    def set_compatibility_matrix(self, matrix: CompatibilityMatrix, names: Sequence[str]) -> None:
        matrix.to_markdown(names)  # validates the names against the matrix size
        self.compatibility = matrix
        self.compatibility_names = [str(n) for n in names]

    def add_fact(self, name: str, value: Any) -> None:
        """A free key/value fact (e.g. CKA between models); the value must be JSON-serialisable."""
        _check_new_name(name, self.facts, "fact")
        value = _plain(value)
        try:
            json.dumps(value, allow_nan=False)
        except (TypeError, ValueError) as exc:
            raise InputError(f"fact {name!r}: value {value!r} is not JSON-serialisable: {exc}") from exc
        self.facts[name] = value

    def _case(self, name: str) -> Case:
        if name not in self.cases:
            raise InputError(f"no case named {name!r} in this report; cases: {', '.join(self.cases) or 'none'}")
        return self.cases[name]

    # -- rendering --------------------------------------------------------------------------

    def topk(self) -> list[int]:
        """Every k that some case reports, sorted."""
        return sorted({k for case in self.cases.values() for k in case.result.cmc})

    def instance_level(self) -> bool:
        """Whether some case judged relevance by explicit positives (then R@k, MRR, nDCG@10 are shown)."""
        return any(case.result.relevance == "explicit" for case in self.cases.values())

    def to_markdown(self) -> str:
        parts = [f"# {self.title}"]
        if self.cases:
            parts.append("## Retrieval\n\n" + self._cases_markdown())
        if self.verdicts:
            rows = [
                f"| {_cell(v.name)} | {'PASS' if v.passed else 'FAIL'} | {_cell(v.detail)} |" for v in self.verdicts
            ]
            parts.append("## Verdicts\n\n| check | verdict | detail |\n|---|---|---|\n" + "\n".join(rows))
        if self.backfill_curves:
            parts.append("## Backfill\n\n" + self._backfill_markdown())
        if self.compatibility is not None:
            parts.append("## Compatibility matrix\n\n" + self.compatibility.to_markdown(self.compatibility_names))
        if self.facts:
            rows = [f"| {_cell(k)} | {_cell(_format_fact(v))} |" for k, v in self.facts.items()]
            parts.append("## Facts\n\n| fact | value |\n|---|---|\n" + "\n".join(rows))
        return "\n\n".join(parts) + "\n"

    def _cases_markdown(self) -> str:
        ks = self.topk()
        extra_keys = list(dict.fromkeys(k for c in self.cases.values() for k in c.extra))
        ir = self.instance_level()
        ir_metrics = [f"recall@{k}" for k in (1, 5, 10)] + ["mrr", "ndcg@10"] if ir else []
        header = [
            "case",
            *(f"top-{k}" for k in ks),
            "mAP@1.0",
            *(_IR_HEADERS[m] for m in ir_metrics),
            "queries",
            "skipped",
            *map(_cell, extra_keys),
        ]
        lines = ["| " + " | ".join(header) + " |", "|---" * len(header) + "|"]
        for case in self.cases.values():
            cells = [case.name]
            for k in ks:
                ours = case.result.cmc.get(k)
                cells.append("–" if ours is None else _with_reference(ours, case.reference.get(f"top{k}")))
            cells.append(_with_reference(case.result.mean_ap, case.reference.get("mean_ap")))
            cells += [_ir_cell(case, metric) for metric in ir_metrics]
            cells += [str(case.result.n_queries), str(case.result.n_skipped)]
            cells += [_cell(_format_fact(case.extra.get(key, ""))) for key in extra_keys]
            lines.append("| " + " | ".join(cells) + " |")
        unshown = sorted(
            {m for c in self.cases.values() for m in c.reference}
            - {f"top{k}" for k in ks}
            - {"mean_ap"}
            - set(ir_metrics)
        )
        if unshown:
            lines.append(f"\nReferences for metrics not evaluated here: {', '.join(unshown)}.")
        if any(c.reference for c in self.cases.values()):
            lines.append("\nValues in parentheses are reference numbers (e.g. the paper's), as fractions.")
        return "\n".join(lines)

    def _backfill_markdown(self) -> str:
        lines = ["| ordering | metric | area M~ | at 0 | at 1 | curve |", "|---|---|---|---|---|---|"]
        for name, curve in self.backfill_curves.items():
            points = ", ".join(f"{v:.3f}" for v in curve.values)
            lines.append(
                f"| {name} | {curve.metric} | {curve.area:.4f} | {curve.values[0]:.4f} | {curve.values[-1]:.4f} | {points} |"
            )
        return "\n".join(lines)

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict; :meth:`from_json` rebuilds the report from it."""
        return {
            "format": REPORT_FORMAT,
            "title": self.title,
            "cases": [
                {"name": c.name, "result": c.result.to_dict(), "reference": dict(c.reference), "extra": dict(c.extra)}
                for c in self.cases.values()
            ],
            "verdicts": [{"name": v.name, "passed": v.passed, "detail": v.detail} for v in self.verdicts],
            "backfill_curves": [{"name": n, **c.to_dict()} for n, c in self.backfill_curves.items()],
            "compatibility": None
            if self.compatibility is None
            else {"names": list(self.compatibility_names), **self.compatibility.to_dict()},
            "facts": dict(self.facts),
        }

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Report:
        if not isinstance(data, Mapping) or data.get("format") != REPORT_FORMAT:
            raise InputError(f"not an fctkit report (expected format {REPORT_FORMAT!r})")
        try:
            report = cls(data["title"])
            for c in data["cases"]:
                report.add_case(
                    c["name"], RetrievalResult.from_dict(c["result"]), reference=c["reference"], **c["extra"]
                )
            for v in data["verdicts"]:
                report.add_verdict(v["name"], v["passed"], v["detail"])
            for b in data["backfill_curves"]:
                report.add_backfill_curve(b["name"], BackfillCurve.from_dict(b))
            if data["compatibility"] is not None:
                comp = data["compatibility"]
                report.set_compatibility_matrix(CompatibilityMatrix.from_dict(comp), comp["names"])
            for name, value in data["facts"].items():
                report.add_fact(name, value)
        except (KeyError, TypeError) as exc:
            raise InputError(f"malformed fctkit report: {exc!r}") from exc
        return report

    def save(self, directory: str | Path) -> dict[str, Path]:
        """Write report.md, report.json and report.png into ``directory`` (created if needed)."""
        out = Path(directory)
        out.mkdir(parents=True, exist_ok=True)
        paths = {"markdown": out / "report.md", "json": out / "report.json", "png": out / "report.png"}
        paths["markdown"].write_text(self.to_markdown(), encoding="utf-8")
        paths["json"].write_text(json.dumps(self.to_json(), indent=2, allow_nan=False) + "\n", encoding="utf-8")
        self.plot(paths["png"])
        return paths

    def plot(self, path: str | Path) -> Path:
        """Draw CMC@k curves of every case (and backfill curves when present) into a PNG."""
        path = Path(path)
        self.figure().savefig(path, dpi=100, format="png")
        return path

    def figure(self) -> Any:
        """The report's matplotlib Figure (see :meth:`plot`)."""
        require("matplotlib", "report")
        from matplotlib.figure import Figure

        n_panels = 2 if self.backfill_curves else 1
        # legends sit below their panels (inside they covered the curves): the figure grows with
        # them, one legend column where the case names are long
        longest = max((len(c.name) for c in self.cases.values()), default=0)
        columns = 2 if longest <= 45 else 1
        rows = max(math.ceil(len(self.cases) / columns), math.ceil(len(self.backfill_curves) / 2))
        width = max(6.0, 0.075 * longest * columns + 1.0)
        fig = Figure(figsize=(width * n_panels, 4.5 + 0.22 * rows), layout="constrained")
        axes = fig.subplots(1, n_panels, squeeze=False)[0]
        fig.suptitle(self.title)
        cmc_ax = axes[0]
        for i, case in enumerate(self.cases.values()):
            ks, values = _cmc_points(case.result)
            # ten colours cycle: the line style tells the 11th case from the 1st
            cmc_ax.plot(ks, values, marker="o", linestyle=("-", "--", ":")[i // 10 % 3], label=case.name)
        hit = "a positive" if self.instance_level() else "an item of their class"
        cmc_ax.set(xlabel="k", ylabel=f"CMC@k: queries with {hit} in the top k", title="CMC", ylim=(0, 1.02))
        if self.cases:
            cmc_ax.legend(
                fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=columns, frameon=False
            )
            cmc_ax.xaxis.get_major_locator().set_params(integer=True)
        else:
            cmc_ax.text(0.5, 0.5, "no retrieval cases", ha="center", va="center", transform=cmc_ax.transAxes)
        if self.backfill_curves:
            bf_ax = axes[1]
            for name, curve in self.backfill_curves.items():
                bf_ax.plot(curve.fractions, curve.values, marker=".", label=f"{name} (M~ {curve.area:.3f})")
            metrics = ", ".join(dict.fromkeys(c.metric for c in self.backfill_curves.values()))
            bf_ax.set(xlabel="fraction of gallery backfilled", ylabel=metrics, title="Backfill", xlim=(0, 1))
            bf_ax.legend(fontsize="small", loc="upper center", bbox_to_anchor=(0.5, -0.14), ncol=2, frameon=False)
        return fig


def _cmc_points(result: RetrievalResult) -> tuple[list[int], list[float]]:
    if result.cmc_curve:
        return list(range(1, len(result.cmc_curve) + 1)), list(result.cmc_curve)
    ks = sorted(result.cmc)
    return ks, [result.cmc[k] for k in ks]


_IR_HEADERS = {"recall@1": "R@1", "recall@5": "R@5", "recall@10": "R@10", "mrr": "MRR", "ndcg@10": "nDCG@10"}


def _ir_cell(case: Case, metric: str) -> str:
    try:
        return _with_reference(metric_value(case.result, metric), case.reference.get(metric))
    except InputError:
        return "–"


def _with_reference(ours: float, reference: float | None) -> str:
    return f"{ours:.4f}" if reference is None else f"{ours:.4f} ({reference:.4f})"


def _cell(text: str) -> str:
    """Text safe inside a markdown table cell."""
    return str(text).replace("|", "\\|").replace("\n", " ")


def _format_fact(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _check_new_name(name: str, existing: Mapping[str, Any], what: str) -> None:
    if not isinstance(name, str) or not name.strip() or "|" in name or "\n" in name:
        raise InputError(f"{what} name must be a non-empty single-line string without '|'; got {name!r}")
    if name in existing:
        raise InputError(f"{what} {name!r} is already in the report; names must be unique")


def _normalise_reference(case: str, reference: float | Mapping[str, float] | None) -> dict[str, float]:
    if reference is None:
        return {}
    items = reference.items() if isinstance(reference, Mapping) else [("top1", reference)]
    out: dict[str, float] = {}
    for metric, value in items:
        metric_k(metric)
        value = float(value)
        if not 0.0 <= value <= 1.0:
            raise InputError(
                f"case {case!r}: reference {metric}={value} is not a fraction in [0, 1]; "
                "give paper percentages as fractions (65.0% -> 0.650)"
            )
        out[metric] = value
    return out


def _json_scalars(case: str, extra: Mapping[str, Any]) -> dict[str, _Scalar]:
    out = {}
    for key, value in extra.items():
        value = _plain(value)
        if not isinstance(value, (str, int, float, bool, type(None))) or (
            isinstance(value, float) and not math.isfinite(value)
        ):
            raise InputError(f"case {case!r}: extra {key}={value!r} must be a finite number, string, bool or None")
        out[key] = value
    return out


def _plain(value: Any) -> Any:
    """numpy scalars and arrays to plain Python values."""
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    return value

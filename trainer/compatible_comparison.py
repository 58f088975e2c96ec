"""The `fctkit train-compatible` run (methods and protocol: :mod:`.compatible_config`): the
one-upgrade comparison and the multi-step sequence, then their report, ``gate.json`` (what a
compatible bundle records), ``results.json`` and the figures' tables in ``report.md``."""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from fctkit.config import to_mapping

from .compatible_config import METHOD_LABELS, CompatibleConfig
from .compatible_sequence import SequenceResult, SequenceRun
from .report import Report
from .retrieval_result import RetrievalResult
from .run_data import load_image_splits
from .run_outputs import quiet_progress, write_json


@dataclasses.dataclass
class CompatibleResult:
    upgrade: SequenceResult | None
    sequence: SequenceResult | None
    files: dict[str, Path]
    seconds: float


def run_compatible(config: CompatibleConfig, out: str | Path, log: Callable[[str], None] = print) -> CompatibleResult:
    """Run the one-upgrade comparison and the multi-step sequence; write models, results and
    ``report.{md,json,png}`` to ``out``."""
    start = time.perf_counter()
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    quiet_progress(config)
    splits = load_image_splits(config)
    runs: dict[str, SequenceResult | None] = {"upgrade": None, "sequence": None}
    for name in runs:
        counts = getattr(config, name)
        if counts:
            runs[name] = SequenceRun(
                config,
                name,
                counts,
                splits.images,
                splits.labels,
                splits.train,
                splits.evaluation,
                splits.n_classes,
                out,
                log,
            ).run()
    report = (
        upgrade_report(config, runs["upgrade"])
        if runs["upgrade"]
        else Report(f"fctkit train-compatible: {config.data.name}")
    )
    files = report.save(out)
    markdown = report.to_markdown() + "\n" + results_markdown(runs["upgrade"], runs["sequence"])
    files["markdown"].write_text(markdown, encoding="utf-8")
    files["results"] = write_json(out / "results.json", {k: v.to_dict() for k, v in runs.items() if v is not None})
    if runs["upgrade"]:
        files["gate"] = write_json(out / "gate.json", compatible_gate(runs["upgrade"], config.evaluation_classes))
    files["config"] = write_json(out / "config.json", to_mapping(config))
    seconds = time.perf_counter() - start
    log(f"done in {seconds:.1f} s; report in {files['markdown']}")
    return CompatibleResult(runs["upgrade"], runs["sequence"], files, seconds)


def upgrade_report(config: CompatibleConfig, result: SequenceResult) -> Report:
    """The one upgrade as a report: cases per method and their ECC verdicts."""
    report = Report(
        f"fctkit train-compatible: {config.data.name}, classes {result.class_counts[0]} → {result.class_counts[1]}"
    )
    for method, cases in result.results.items():
        label = METHOD_LABELS[method]
        names = {
            (0, 0): "old/old",
            (1, 1): "new/new",
            (1, 0): {"fct": "new/h(old)", "lambda-orth": "B(new)/old"}.get(method, "new/old"),
        }
        for key, case in names.items():
            report.add_case(f"{case} [{label}]", cases[key], method=method)
        report.add_verdict(
            f"ECC [{label}]",
            result.ecc(method, 1, 0),
            f"{names[(1, 0)]} {cases[(1, 0)].top1:.4f} vs old/old {cases[(0, 0)].top1:.4f}",
        )
    return report


def compatible_gate(result: SequenceResult, evaluation_classes: str) -> dict[str, Any]:
    """Per backbone method of the one upgrade: the cases and ECC a compatible bundle records,
    and which evaluation classes they were measured on."""
    gate: dict[str, Any] = {"cases": {}, "ecc": {}, "dims": {}, "evaluation_classes": evaluation_classes}
    for method in result.results:
        cases = result.results[method]
        gate["cases"][method] = {
            name: _metrics(cases[key]) for name, key in (("old/old", (0, 0)), ("new/old", (1, 0)), ("new/new", (1, 1)))
        }
        gate["ecc"][method] = result.ecc(method, 1, 0)
        gate["dims"][method] = result.dims[method]
    return gate


def results_markdown(upgrade: SequenceResult | None, sequence: SequenceResult | None) -> str:
    """The figures' tables: one upgrade (new/old, new/new, ECC per method) and the multi-step
    sequence (AC, AM and C per method)."""
    lines: list[str] = []
    if upgrade is not None:
        old_classes = upgrade.class_counts[0]
        fraction = upgrade.facts.get("first_version_items")
        images = f", v1 on {fraction:.0%} of the training images" if fraction else ""
        lines += [
            f"## One upgrade: classes {old_classes} → {upgrade.class_counts[1]}{images} (top-1)",
            "",
            (
                "Evaluation classes held out from every version's training (the CoReS protocol)"
                if not upgrade.known
                else "All evaluation classes"
            )
            + " (ECC on top-1, and on mAP@1.0 with both mAPs); the last three columns on the old model's classes only.",
            "",
            "| method | old/old | new/old | new/new | ECC | mAP old/old → new/old, ECC | dims (old → new) "
            "| old/old, old classes | new/old, old classes | ECC, old classes |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for method, cases in upgrade.results.items():
            dims = upgrade.dims[method]
            on_old_classes = ["—"] * 3  # held-out evaluation classes: none of them is an old class
            if upgrade.known:
                known = upgrade.known[method]
                on_old_classes = [
                    f"{known[(0, 0)].top1:.4f}",
                    f"{known[(1, 0)].top1:.4f}",
                    _yes(upgrade.ecc(method, 1, 0, True)),
                ]
            lines.append(
                f"| {METHOD_LABELS[method]} | {cases[(0, 0)].top1:.4f} | {cases[(1, 0)].top1:.4f} | "
                f"{cases[(1, 1)].top1:.4f} | {_yes(upgrade.ecc(method, 1, 0))} | {cases[(0, 0)].mean_ap:.4f} → "
                f"{cases[(1, 0)].mean_ap:.4f}, {_yes(upgrade.ecc(method, 1, 0, metric='mean_ap'))} | {dims[0]} → {dims[1]} | "
                + " | ".join(on_old_classes)
                + " |"
            )
        lines.append("")
    if sequence is not None:
        counts = " → ".join(map(str, sequence.class_counts))
        lines += [f"## Multi-step sequence: classes {counts} (top-1)", "", "| method | AC | AM |", "|---|---|---|"]
        lines += [f"| {METHOD_LABELS[m]} | {c.ac:.4f} | {c.am:.4f} |" for m, c in sequence.matrices.items()]
        names = [f"v{k + 1}" for k in range(len(sequence.class_counts))]
        for method, matrix in sequence.matrices.items():
            lines += ["", f"### {METHOD_LABELS[method]}", "", matrix.to_markdown(names)]
        lines.append("")
    return "\n".join(lines)


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _metrics(result: RetrievalResult) -> dict[str, float]:
    return {f"top{k}": v for k, v in result.cmc.items()} | {"mAP": result.mean_ap}


__all__ = ["CompatibleResult", "run_compatible"]

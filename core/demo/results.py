"""The demo's report: the before/after table per device and overall, bytes moved and time
per phase, written as ``report.md``, ``report.json`` and ``report.png``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from matplotlib.figure import Figure

CASES = ("old/old", "new/old", "new/h(old)", "after backfill", "new/new")
CASE_NOTES = {"new/old": "no adapter", "new/new": "bound: every image re-embedded"}


def render_table(report: dict[str, Any]) -> str:
    """The before/after table (top-1 / mAP per device and overall), bytes and costs, as markdown."""
    names = list(report["per_device"])
    header = "| case | " + " | ".join(names) + " | overall |"
    lines = [
        f"## fctkit demo: {report['data']}, {report['devices']} devices, {report['rows']} rows, method {report['method']}",
        "",
        "top-1 / mAP, leave-one-out (each device: its own items as queries and gallery)",
        "",
        header,
        "|" + "---|" * (len(names) + 2),
    ]
    for case in CASES:
        label = case + (f" ({CASE_NOTES[case]})" if case in CASE_NOTES else "")
        if case == "after backfill":
            label += (
                f" ({report['backfill']['device']}: {report['backfill']['rows']} rows, {report['backfill']['order']})"
            )
        cells = [_cell(report["per_device"][n]["cases"][case]) for n in names] + [_cell(report["overall"][case])]
        lines.append(f"| {label} | " + " | ".join(cells) + " |")
    b, c = report["bytes"], report["cost"]
    lines += [
        "",
        f"ECC (new/h(old) > old/old): {'holds' if report['ecc']['holds'] else 'FAILS'}",
        "",
        "| transfer | bytes |",
        "|---|---|",
        f"| bundle v1 / v2 (per device) | {b['bundle_v1']:,} / {b['bundle_v2']:,} |",
        f"| bundles to the fleet | {b['bundles_to_fleet']:,} |",
        f"| sealed originals uploaded to the vault | {b['vault_uploads']:,} |",
        f"| partial backfill downloads | {b['backfill_downloads']:,} |",
        f"| a full re-embed would download | {b['full_reembed_downloads']:,} |",
        "",
        "| cost | value |",
        "|---|---|",
        f"| in-place upgrade, all devices | {c['upgrade_s']:.2f} s for {c['upgrade_rows']} rows ({c['upgrade_per_row_ms']:.3f} ms/row) |",
        f"| backfill per row (download + decrypt + embed + write) | {c['backfill_per_row_ms']:.3f} ms |",
        f"| embed + side-info per row alone | {c['embed_per_row_ms']:.3f} ms |",
        f"| full re-embed of the fleet (estimate) | {c['full_reembed_estimate_s']:.2f} s |",
        f"| a backfilled row costs (same run) | {c['backfill_row_over_upgrade_row']:.1f}x an upgraded row |",
        "",
        "| phase | seconds |",
        "|---|---|",
        *(f"| {name} | {s:.1f} |" for name, s in report.get("phases_s", {}).items()),
    ]
    return "\n".join(lines)


def _cell(metrics: dict[str, float]) -> str:
    return f"{metrics['top1']:.3f} / {metrics['mAP']:.3f}"


def write_report(report: dict[str, Any], out: Path) -> dict[str, Path]:
    files = {"json": out / "report.json", "markdown": out / "report.md", "png": out / "report.png"}
    files["json"].write_text(json.dumps(report, indent=2, sort_keys=True, default=float) + "\n")
    files["markdown"].write_text(render_table(report) + "\n")
    figure(report).savefig(files["png"], dpi=110)
    return files


def figure(report: dict[str, Any]) -> Figure:
    """Top-1 per case for each device and overall, beside the device-side cost in seconds."""
    from matplotlib.figure import Figure

    columns = [*report["per_device"], "overall"]
    drawing = Figure(figsize=(13, 4.5))
    left, right = drawing.subplots(1, 2, gridspec_kw={"width_ratios": [2, 1]})
    width = 0.8 / len(CASES)
    for k, case in enumerate(CASES):
        values = [report["per_device"][c]["cases"][case]["top1"] for c in columns[:-1]] + [
            report["overall"][case]["top1"]
        ]
        left.bar(np.arange(len(columns)) + (k - (len(CASES) - 1) / 2) * width, values, width, label=case)
    left.set_xticks(np.arange(len(columns)), columns)
    left.set_ylabel("top-1 (leave-one-out)")
    left.set_ylim(0, 1.05)
    left.set_title(f"model update v1 -> v2 on {report['data']} ({report['method']})")
    # below the axes, in one row: inside, it covered the bars of the last group
    left.legend(fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=len(CASES), frameon=False)
    c = report["cost"]
    bars = {
        "in-place upgrade\n(all devices)": c["upgrade_s"],
        f"partial backfill\n({report['backfill']['rows']} rows)": report["backfill"]["seconds"],
        "full re-embed\n(estimate)": c["full_reembed_estimate_s"],
    }
    right.bar(list(bars), list(bars.values()), color=["tab:green", "tab:orange", "tab:red"])
    right.set_ylabel("seconds")
    right.set_title("device-side cost")
    drawing.tight_layout()
    return drawing


__all__ = ["CASES", "CASE_NOTES", "figure", "render_table", "write_report"]

"""The report figures' legends do not cover what they label (issue 19 part 5: the demo's legend
covered the last group of bars): each legend's box lies outside every axes' plotting area."""

from __future__ import annotations

import numpy as np

from fctkit.demo import results as demo_results
from fctkit.trainer.evaluation import evaluate_retrieval
from fctkit.trainer.report import Report


def overlaps(figure) -> list[str]:
    from matplotlib.backends.backend_agg import FigureCanvasAgg

    canvas = FigureCanvasAgg(figure)
    canvas.draw()
    renderer = canvas.get_renderer()
    found = []
    for axes in figure.axes:
        legend = axes.get_legend()
        if legend is None:
            continue
        box = legend.get_window_extent(renderer)
        for other in figure.axes:
            if box.overlaps(other.get_window_extent(renderer)):
                found.append(f"the legend of {axes.get_title()!r} covers {other.get_title()!r}")
    return found


def test_the_demo_figure_keeps_its_legend_off_the_bars():
    cases = {case: {"top1": 0.9} for case in demo_results.CASES}
    report = {
        "per_device": {f"device-{i}": {"cases": cases} for i in (1, 2, 3)},
        "overall": cases,
        "data": "digits",
        "method": "fct",
        "backfill": {"rows": 72, "seconds": 0.4},
        "cost": {"upgrade_s": 0.2, "full_reembed_estimate_s": 3.8},
    }
    assert overlaps(demo_results.figure(report)) == []


def test_the_train_report_keeps_its_legends_off_the_curves():
    rng = np.random.default_rng(0)
    x, labels = rng.standard_normal((60, 8)), np.repeat(np.arange(6), 10)
    report = Report("test")
    for i in range(14):  # more cases than colours
        report.add_case(
            f"case {i}", evaluate_retrieval(x, labels, x, labels, distance="l2", topk=(1, 5), leave_one_out=True)
        )
    assert overlaps(report.figure()) == []

"""Report rendering: markdown, JSON round trip, PNG, and its input checks."""

from __future__ import annotations

import json

import numpy as np
import pytest

from fctkit.errors import InputError
from fctkit.trainer.backfill_curves import BackfillCurve, backfill_curve
from fctkit.trainer.compatibility import compatibility_matrix
from fctkit.trainer.evaluation import evaluate_retrieval
from fctkit.trainer.report import Report
from fctkit.trainer.retrieval_result import RetrievalResult


def result(top1: float, top5: float, mean_ap: float, n: int = 100, skipped: int = 0) -> RetrievalResult:
    curve = tuple(np.linspace(top1, top5, 5).tolist())
    return RetrievalResult(cmc={1: top1, 5: top5}, mean_ap=mean_ap, n_queries=n, n_skipped=skipped, cmc_curve=curve)


@pytest.fixture()
def full_report() -> Report:
    report = Report("digits: old -> new")
    report.add_case("old/old", result(0.94, 0.99, 0.81), reference={"top1": 0.465})
    report.add_case("new/new", result(0.955, 0.995, 0.85), model="wide", epochs=3)
    report.add_case("new/h(old)", result(0.935, 0.99, 0.80, skipped=2), reference={"top1": 0.65, "mean_ap": 0.436})
    report.add_ecc("new/h(old)", "old/old")
    report.add_verdict("parity", True, "max |onnx - torch| 3e-7")
    report.add_backfill_curve("random", BackfillCurve(np.linspace(0, 1, 3), np.array([0.5, 0.6, 0.9]), 0.65))
    values = {(0, 0): 0.5, (1, 0): 0.6, (1, 1): 0.7}
    report.set_compatibility_matrix(compatibility_matrix(lambda i, j: values[i, j], 2), ["v1", "v2"])
    report.add_fact("CKA(old, new)", np.float32(0.5))
    report.add_fact("backbones", ["small", "wide"])
    return report


def test_markdown_shows_cases_references_verdicts_and_sections(full_report):
    md = full_report.to_markdown()
    assert md.startswith("# digits: old -> new\n")
    assert "| case | top-1 | top-5 | mAP@1.0 | queries | skipped | model | epochs |" in md
    assert "| old/old | 0.9400 (0.4650) | 0.9900 | 0.8100 | 100 | 0 |  |  |" in md
    assert "| new/new | 0.9550 | 0.9950 | 0.8500 | 100 | 0 | wide | 3 |" in md
    assert "| new/h(old) | 0.9350 (0.6500) | 0.9900 | 0.8000 (0.4360) | 100 | 2 |" in md
    assert "| ECC (top1) | FAIL | new/h(old) 0.9350 <= old/old 0.9400 |" in md
    assert "| parity | PASS | max \\|onnx - torch\\| 3e-7 |" in md  # pipes in cells are escaped
    assert "| random | top1 | 0.6500 | 0.5000 | 0.9000 | 0.500, 0.600, 0.900 |" in md
    assert "| v2 | 0.6000 | 0.7000 |" in md and "AC = 1.0000" in md
    assert "| CKA(old, new) | 0.5 |" in md and "| backbones | ['small', 'wide'] |" in md


def test_ecc_verdict_passes_when_adapted_is_better():
    report = Report("t")
    report.add_case("old/old", result(0.5, 0.8, 0.4))
    report.add_case("new/h(old)", result(0.6, 0.8, 0.3))
    assert report.add_ecc() is True
    assert report.add_ecc(metric="mean_ap") is False
    assert [v.passed for v in report.verdicts] == [True, False]
    assert report.verdicts[0].detail == "new/h(old) 0.6000 > old/old 0.5000"
    with pytest.raises(InputError, match="no case named 'new/old'"):
        report.add_ecc("new/old")


def test_json_round_trips(full_report):
    data = full_report.to_json()
    text = json.dumps(data, allow_nan=False)
    again = Report.from_json(json.loads(text))
    assert again.to_json() == data
    assert again.to_markdown() == full_report.to_markdown()
    assert again.cases["new/h(old)"].result == full_report.cases["new/h(old)"].result
    assert np.isnan(again.compatibility.values[0, 1])


def test_save_writes_markdown_json_and_a_valid_png(full_report, tmp_path):
    import matplotlib.image

    paths = full_report.save(tmp_path / "out")
    assert set(paths) == {"markdown", "json", "png"}
    assert paths["markdown"].read_text() == full_report.to_markdown()
    assert Report.from_json(json.loads(paths["json"].read_text())).to_json() == full_report.to_json()
    assert paths["png"].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(paths["png"])
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 1000  # two panels side by side
    assert image.std() > 0.05  # something was drawn


def test_report_of_real_evaluations_renders(tmp_path):
    rng = np.random.default_rng(0)
    labels = rng.integers(0, 5, 150)
    new = rng.normal(size=(5, 8))[labels] + 0.7 * rng.normal(size=(150, 8))
    adapted = new + 0.5 * rng.normal(size=new.shape)
    report = Report("real")
    report.add_case("new/new", evaluate_retrieval(new, labels, new, labels, leave_one_out=True, topk=(1, 5, 10)))
    report.add_case("new/h(old)", evaluate_retrieval(new, labels, adapted, labels, leave_one_out=True))
    report.add_backfill_curve(
        "random", backfill_curve(new, labels, adapted, new, labels, rng.permutation(150), steps=3, leave_one_out=True)
    )
    assert "| new/h(old) |" in report.to_markdown() and "top-10" in report.to_markdown()
    paths = report.save(tmp_path)
    assert paths["png"].stat().st_size > 1000


def test_empty_report_still_saves(tmp_path):
    paths = Report("nothing yet").save(tmp_path)
    assert paths["markdown"].read_text() == "# nothing yet\n"
    assert paths["png"].read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("action", "message"),
    [
        (lambda r: r.add_case("old/old", result(0.1, 0.2, 0.1)), "already in the report"),
        (lambda r: r.add_case("a|b", result(0.1, 0.2, 0.1)), "without '|'"),
        (lambda r: r.add_case("x/x", {"top1": 0.5}), "expected a RetrievalResult"),
        (lambda r: r.add_case("x/x", result(0.1, 0.2, 0.1), reference=65.0), "65.0% -> 0.650"),
        (lambda r: r.add_case("x/x", result(0.1, 0.2, 0.1), reference={"recall": 0.5}), "unknown metric"),
        (lambda r: r.add_case("x/x", result(0.1, 0.2, 0.1), note=[1, 2]), "must be a finite number"),
        (lambda r: r.add_case("x/x", result(0.1, 0.2, 0.1), score=float("nan")), "must be a finite number"),
        (lambda r: r.add_fact("f", object()), "not JSON-serialisable"),
        (lambda r: r.add_fact("f", float("inf")), "not JSON-serialisable"),
        (lambda r: r.add_backfill_curve("b", [0.1, 0.2]), "expected a BackfillCurve"),
    ],
)
def test_bad_report_input_gets_a_clear_error(action, message):
    report = Report("t")
    report.add_case("old/old", result(0.5, 0.8, 0.4))
    with pytest.raises(InputError, match=message):
        action(report)


def test_bad_title_and_malformed_json():
    with pytest.raises(InputError, match="non-empty title"):
        Report("  ")
    with pytest.raises(InputError, match="not an fctkit report"):
        Report.from_json({"title": "x"})
    data = Report("t").to_json()
    del data["cases"]
    with pytest.raises(InputError, match="malformed fctkit report"):
        Report.from_json(data)

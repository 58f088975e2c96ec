"""The Fashion-MNIST benchmark's summary: ranking by adapted top-1, fraction of new/new, ECC."""

from __future__ import annotations

import pytest

from tests.support.benchmark_scripts import benchmark_script


@pytest.fixture(scope="module")
def bench():
    with benchmark_script("fashion_mnist.py") as module:
        yield module


def test_summary_ranks_methods_and_names_the_best(bench) -> None:
    gate = {
        "cases": {
            "old/old": {"top1": 0.7},
            "new/new": {"top1": 0.9},
            "fct": {"top1": 0.855},
            "procrustes": {"top1": 0.6},
        },
        "ecc": {"procrustes": False, "fct": True},
        "backfill_area": {"random": 0.85, "class-mean-l2": 0.87},
    }
    text = bench.summary_markdown(gate, 10000)
    rows = [line for line in text.splitlines() if line.startswith("| fct") or line.startswith("| procrustes")]
    assert rows == ["| fct | 0.8550 | 0.950 | PASS |", "| procrustes | 0.6000 | 0.667 | FAIL |"]
    assert "best: fct, 0.950 × new/new, ECC holds" in text
    assert "class-mean-l2 0.8700" in text


def test_missing_data_is_reported_with_the_install_command(bench, monkeypatch) -> None:
    import debian_data

    monkeypatch.setattr(debian_data.os, "geteuid", lambda: 1000)
    with pytest.raises(
        debian_data.BenchmarkSetupError, match="apt-get install -y --no-install-recommends dataset-fashion-mnist"
    ):
        debian_data.ensure_debian_package("dataset-fashion-mnist", lambda: False, "fashion-mnist idx files")

"""The edge upgrade benchmark runs end to end at a tiny size and reports every column its
BENCHMARKS.md table has (no timing is asserted: figures belong to the benchmark's own runs)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.benchmark_scripts import benchmark_script


@pytest.fixture(scope="module")
def bench():
    with benchmark_script("edge_upgrade.py") as module:
        yield module


def test_small_run_reports_ratios_and_both_floors(bench, tmp_path: Path) -> None:
    table = tmp_path / "edge.md"
    bench.main(["--rows", "3000", "--batch", "512", "--threads", "1", "--skip-reembed", "--markdown", str(table)])
    lines = table.read_text().splitlines()
    header = next(line for line in lines if line.startswith("| adapter"))
    assert "bulk floor rows/s" in header and "best possible upgrade / bare" in header
    rows = {
        line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]]
        for line in lines
        if line.startswith("| fct") or line.startswith("| linear")
    }
    assert set(rows) == {"fct", "fct-int8", "linear"}
    for cells in rows.values():
        assert len(cells) == 8 and all(re.fullmatch(r"[\d,.]+", c) for c in cells)
        assert 0 < float(cells[6]) <= 1  # bare / (bare + bulk floor) is a fraction by construction
    int8 = next(line for line in lines if line.startswith("int8 FCT mixer"))
    cosine = float(re.search(r"mean cosine (\d\.\d+)", int8).group(1))
    assert re.search(r"device upgrade \*\*[\d.]+x\*\*", int8) and 0.99 < cosine <= 1.0001


def test_bulk_floor_leaves_nothing_behind(bench, tmp_path: Path) -> None:
    import numpy as np

    seconds = bench.bulk_floor_seconds(np.ones((5000, 128), dtype=np.float32), tmp_path, chunk_bytes=64 << 10)
    assert seconds > 0 and list(tmp_path.iterdir()) == []


def test_wider_rows_reach_the_graphs_the_gallery_and_the_ratio_table(tmp_path: Path) -> None:
    table = tmp_path / "costs.md"
    with benchmark_script("photo_costs.py") as costs:
        costs.main(
            [
                "--rows",
                "1500",
                "--query-rows",
                "1500",
                "--queries",
                "10",
                "--dim",
                "320",
                "--side-dim",
                "48",
                "--batch",
                "512",
                "--threads",
                "1",
                "--markdown",
                str(table),
            ]
        )
    text = table.read_text()
    assert "Rows: 1,500 (320-d φ, 48-d ψ;" in text and "1,500 rows, 320-d, cosine" in text
    ratios = re.findall(r"^\| (upgrade|query p50), .*\*\*([\d.]+)\*\* \|$", text, flags=re.M)
    assert [kind for kind, _ in ratios].count("upgrade") == 2 and [kind for kind, _ in ratios].count("query p50") >= 2
    assert all(float(value) > 0 for _, value in ratios)

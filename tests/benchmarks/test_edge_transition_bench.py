"""The transition/hubness cost benchmark runs end to end at a tiny size: each scoring is the one
the device really used, and every ratio column is against the plain baseline of the same run
(no timing is asserted: figures belong to the benchmark's own runs)."""

from __future__ import annotations

from pathlib import Path

from tests.support.benchmark_scripts import benchmark_script


def test_small_run_reports_each_scoring_against_plain_search(tmp_path: Path) -> None:
    table = tmp_path / "transition.md"
    with benchmark_script("edge_transition.py") as module:
        module.main(["--rows", "1500", "--queries", "5", "--markdown", str(table)])
    rows = {
        line.split("|")[1].strip().split(" ")[0]: [c.strip() for c in line.split("|")[2:-1]]
        for line in table.read_text().splitlines()
        if line.startswith("| ") and not line.startswith("| scoring")
    }
    assert set(rows) == {"plain", "transition", "hubness"}
    assert [rows["plain"][i] for i in (2, 4, 6, 8)] == ["1.00"] * 4  # the baseline's own ratios
    assert (
        float(rows["transition"][6]) > 1.2 and float(rows["transition"][8]) > 1.2
    )  # previous embeddings are held and stored

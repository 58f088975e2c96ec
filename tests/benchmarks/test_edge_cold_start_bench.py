"""The cold-start benchmark runs end to end at a tiny size and reports every row its BENCHMARKS.md
table has, each against the AES-GCM floor of the same run (no timing is asserted)."""

from __future__ import annotations

import re
from pathlib import Path

from tests.support.benchmark_scripts import benchmark_script


def test_small_run_reports_each_step_against_the_aes_floor_and_the_memory(tmp_path: Path) -> None:
    table = tmp_path / "cold.md"
    with benchmark_script("edge_cold_start.py") as module:
        module.main(["--rows", "5000", "--markdown", str(table)])
    text = table.read_text()
    rows = {
        line.split("|")[1].strip(): [c.strip(" *") for c in line.split("|")[2:-1]]
        for line in text.splitlines()
        if line.startswith("| ") and not line.startswith("| measure")
    }
    assert len(rows) == 4 and rows["bulk AES-GCM decrypt of the same bytes (floor)"][1] == "1.00"
    for seconds, ratio in rows.values():  # a step can round to 0.0 s on a fast or idle machine
        assert float(seconds) >= 0 and float(ratio.split()[0].strip("*")) >= 0
    assert re.search(r"peak [\d,]+ MiB = \*\*[\d.]+×\*\*", text)

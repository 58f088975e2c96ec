"""The replication benchmark runs end to end at a tiny size (a loopback `fctkit serve`, two devices
of one owner, the plain-stream baseline) and reports both directions against the plain stream
of the same run (no timing is asserted). It had rotted once, unnoticed, when operations began
taking ``DeviceParts``."""

from __future__ import annotations

from pathlib import Path

from tests.support.benchmark_scripts import benchmark_script


def test_small_run_reports_push_and_pull_against_the_plain_stream(tmp_path: Path) -> None:
    table = tmp_path / "replication.md"
    with benchmark_script("edge_replication.py") as module:
        assert module.main(["--rows", "300", "--markdown", str(table)]) == 0
    rows = [line for line in table.read_text().splitlines() if line.startswith("| push") or line.startswith("| pull")]
    assert len(rows) == 2
    for line in rows:
        replication, plain, ratio = (float(c.strip().replace(",", "")) for c in line.split("|")[2:5])
        assert replication > 0 and plain > 0 and ratio > 0

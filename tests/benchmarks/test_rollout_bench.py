"""The rollout acceptance benchmark runs end to end on a small fleet (12 devices; v3's stage at 50%
so that it is never empty): every check it makes passes, and it exits 0 only then."""

from __future__ import annotations

from pathlib import Path

from tests.support.benchmark_scripts import benchmark_script


def test_small_run_halts_withdraws_and_reverts_with_every_check_passing(tmp_path: Path, capsys) -> None:
    with benchmark_script("rollout.py") as module:
        status = module.main(["--devices", "12", "--queries", "10", "--v3-percent", "50", "--halt-min-devices", "1",
                              "--keep", str(tmp_path / "work")])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "checks: 18 passed, 0 failed" in out
    assert "v3 state 'withdrawn'" in out and "revert methods {'exact':" in out

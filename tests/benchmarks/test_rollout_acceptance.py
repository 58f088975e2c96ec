"""The rollout acceptance scenarios as tests, once per server storage backend (SQLite; PostgreSQL +
S3 from the session's cluster and S3 endpoint, which must start under CI=true): a real
`fctkit serve` and a fleet of devices run ``benchmarks/rollout.py`` and every check passes.

Class level (digits): v2 5% → 25% → 100%, a broken v3 halted by an explicit guard, withdrawn,
reverted. Smaller than the benchmark, and with 20 devices on PostgreSQL + S3 (each vault upload is
dearer there than on SQLite), so that each runs in well under a minute on 2 cores: 16 rows per
device and a health sample of 8 (half the gallery is re-embedded natively, the other half goes
through the adapter, so v3's broken adapter reaches the answers, which a check asserts; 8 rows
still separate v2, mean cosine above 0.85, from v3, below 0), and 20 queries. v3 is staged at 5%
with two testers (the first two devices, in its stage whatever their hash draws, as internal
testers would be): the stage is otherwise the devices whose hash of (random device id, version)
falls below 5%, and a 50-device fleet draws fewer than the guard's 2 reporting devices in 28% of
runs (a 20-device fleet more often still). The guard halts v3 at its second report.

Instance level (the synthetic instance task, ``--scenario instance``): no explicit guard; the
server's default one lets the good v2 through at 100% and halts the bad v3 (v2's expectation, a
random orthogonal adapter) at its 5% stage on R@1, at the report of the 5th of its 5 testers (the
owners the default guard waits for), before the 3 other devices sync. 8 devices on both backends,
each with 64 items (the smallest gallery size the release's expectation is measured at) and the
default health sample of 32 (the sample size it is measured with), and 20 queries: 20-30 s on
SQLite and about 85 s on PostgreSQL + S3 (where each of the 512 vault uploads costs ~0.1 s) on 2
busy cores. Fewer rows would not do: with 32 per device v2's true R@1 ties not upgrading.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from tests.support.benchmark_scripts import benchmark_script

ARGS = [
    "--rows-per-device",
    "16",
    "--health-sample",
    "8",
    "--queries",
    "20",
    "--v3-percent",
    "5",
    "--v3-cohort",
    "2",
    "--halt-min-devices",
    "2",
]
INSTANCE_ARGS = ["--scenario", "instance", "--devices", "8", "--queries", "20"]


@pytest.fixture(params=("sqlite", "postgres"))
def storage(request, tmp_path: Path) -> list[str]:
    """rollout.py's storage arguments: none (a data directory), or a database and bucket prefix of
    this test's own on the session's PostgreSQL cluster and S3 endpoint."""
    if request.param == "sqlite":
        return []
    from tests.server.conftest import postgres_backend

    backend = postgres_backend(request)  # also puts the endpoint's AWS_* credentials in os.environ
    return [*backend.server_args(tmp_path / "server-data"), "--s3-endpoint-url", backend.s3.url]


def run_benchmark(args: list[str], tmp_path: Path, capsys) -> str:
    """rollout.py's output, once it ran with ``args`` and exited 0."""
    with benchmark_script("rollout.py") as module:
        status = module.main([*args, "--keep", str(tmp_path / "work")])
    out = capsys.readouterr().out
    assert status == 0, out
    return out


@pytest.mark.slow
def test_rollout_halts_withdraws_and_reverts_a_fleet(storage: list[str], tmp_path: Path, capsys) -> None:
    # 50 devices on a data directory; 20 through S3, where every vault upload is dearer (the
    # stages and the guard play out the same)
    devices = ["--devices", "20" if storage else "50"]
    out = run_benchmark([*ARGS, *devices, *storage], tmp_path, capsys)
    assert "checks: 18 passed, 0 failed" in out, out
    assert ("server storage: PostgreSQL + S3" in out) == bool(storage)
    assert "v2 at 100%: every device upgraded to v2" in out and "v3 state 'withdrawn'" in out
    stage = re.search(r"v3's first stage holds (\d+) devices \(the server's bucket, 2 testers\); (\d+) took v3", out)
    assert stage and int(stage[1]) >= 2 and int(stage[2]) == 2, out  # the guard stopped v3 at its second report
    assert re.search(
        r"\[ok\] the signal separates v3 from v2 \(worst v2 0\.\d+ > halt 0\.65 > best v3 -?0\.\d+\)", out
    ), out


@pytest.mark.slow
def test_the_default_guard_halts_a_bad_instance_level_release_and_not_the_good_one(
    storage: list[str], tmp_path: Path, capsys
) -> None:
    out = run_benchmark([*INSTANCE_ARGS, *storage], tmp_path, capsys)
    assert "checks: 22 passed, 0 failed" in out, out
    assert ("server storage: PostgreSQL + S3" in out) == bool(storage)
    assert "[ok] the default guard let v2 through: 'staged' at 100%" in out, out
    halt = re.search(
        r"v3 state 'halted', percent 5, halt reason: median recall_at_1 / expected / bound (\d\.\d+) of 5 owners", out
    )
    assert halt and float(halt[1]) < 0.8, out
    stage = re.search(r"v3's first stage holds (\d+) devices \(the server's bucket, 5 testers\); (\d+) took v3", out)
    assert stage and int(stage[2]) == 5, out  # the default guard stopped v3 at the 5th owner's report
    assert "[ok] v3 is worse than not upgrading on the devices that took it" in out, out

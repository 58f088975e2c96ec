"""The rollout acceptance scenario as a test, once per server storage backend (SQLite; PostgreSQL +
S3 from the session's cluster and S3 endpoint, which must start under CI=true): a real
`fctkit serve` and a fleet of devices holding digits galleries run ``benchmarks/rollout.py``'s scenario
(v2 5% → 25% → 100%, a broken v3 halted by the guard, withdrawn, reverted) and every check passes.

Smaller than the benchmark, and with 20 devices on PostgreSQL + S3 (each vault upload is dearer
there than on SQLite), so that each runs in well under a minute on 2 cores: 16 rows per device and a health sample of 8 (half the
gallery is re-embedded natively, the other half goes through the adapter, so v3's broken adapter
reaches the answers, which a check asserts; 8 rows still separate v2, mean cosine above 0.85, from
v3, below 0), and 20 queries. v3 is staged at 5% with two testers (the first two devices, in its
stage whatever their hash draws, as internal testers would be): the stage is otherwise the devices
whose hash of (random device id, version) falls below 5%, and a 50-device fleet draws fewer than
the guard's 2 reporting devices in 28% of runs (a 20-device fleet more often still). The guard halts v3 at its second report.
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


@pytest.fixture(params=("sqlite", "postgres"))
def storage(request, tmp_path: Path) -> list[str]:
    """rollout.py's fleet size and storage arguments: 50 devices on a data directory, or 20 devices
    (every vault upload is dearer through S3; the stages and the guard play out the same) on a
    database and bucket prefix of this test's own on the session's PostgreSQL cluster and S3 endpoint."""
    if request.param == "sqlite":
        return ["--devices", "50"]
    from tests.server.conftest import postgres_backend

    backend = postgres_backend(request)  # also puts the endpoint's AWS_* credentials in os.environ
    return ["--devices", "20", *backend.server_args(tmp_path / "server-data"), "--s3-endpoint-url", backend.s3.url]


@pytest.mark.slow
def test_rollout_halts_withdraws_and_reverts_a_fleet(storage: list[str], tmp_path: Path, capsys) -> None:
    with benchmark_script("rollout.py") as module:
        status = module.main([*ARGS, *storage, "--keep", str(tmp_path / "work")])
    out = capsys.readouterr().out
    assert status == 0, out
    assert "checks: 18 passed, 0 failed" in out, out
    assert ("server storage: PostgreSQL + S3" in out) == (len(storage) > 2)
    assert "v2 at 100%: every device upgraded to v2" in out and "v3 state 'withdrawn'" in out
    stage = re.search(r"v3's first stage holds (\d+) devices \(the server's bucket, 2 testers\); (\d+) took v3", out)
    assert stage and int(stage[1]) >= 2 and int(stage[2]) == 2, out  # the guard stopped v3 at its second report
    assert re.search(
        r"\[ok\] the signal separates v3 from v2 \(worst v2 0\.\d+ > halt 0\.65 > best v3 -?0\.\d+\)", out
    ), out

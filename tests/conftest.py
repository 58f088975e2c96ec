"""Shared test helpers. Each part keeps its own fixtures in tests/<part>/conftest.py; the session
services that several parts use (PostgreSQL, S3) start here, from tests/support/scale_services.py."""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

# One intra-op thread: tests start servers and device subprocesses next to the test process,
# and torch with 2 threads on 2 oversubscribed cores runs many times slower, not faster.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")


# The suite runs on two pytest-xdist workers (`make test`), a test file at a time. Files start in this
# order, the longest first (measured with --durations), so that the workers finish together instead of
# one running the last long file alone; the files that build the shared digits runs
# (tests/support/releases.py, compatible_run.py) start apart, so neither worker waits on the other's build.
LONGEST_FIRST = (
    "tests/benchmarks/test_rollout_acceptance.py",
    "tests/trainer/test_pipeline.py",
    "tests/benchmarks/test_quality_suite.py",
    "tests/export/test_release_export.py",
    "tests/edge/test_revert_crash_edge.py",
    "tests/trainer/test_compatible_backbones.py",
    "tests/test_demo_end_to_end.py",
    "tests/export/test_quantized_export.py",
    "tests/edge/test_replication_crash_edge.py",
    "tests/trainer/test_task_pipeline.py",
    "tests/export/test_features_export.py",
    "tests/edge/test_compatible_device_edge.py",
    "tests/docs/test_tutorial.py",
    "tests/edge/test_digits_release_edge.py",
    "tests/edge/test_backfill_edge.py",
    "tests/edge/test_device_damage_fuzz_edge.py",
    "tests/edge/test_upgrade_crash_edge.py",
    "tests/edge/test_backfill_crash_edge.py",
    "tests/server/test_scale_out_failover.py",
    "tests/edge/test_device_damage_sweep_edge.py",
    "tests/export/test_roles_export.py",
    "tests/architecture/test_code_checks.py",
    "tests/trainer/test_backbones.py",
)


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(config, items):
    """Put the files of :data:`LONGEST_FIRST` first, in its order; the others keep theirs."""
    rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
    root = config.rootpath
    items.sort(key=lambda item: rank.get(item.path.relative_to(root).as_posix(), len(rank)))


def _service_unavailable(reason: str) -> NoReturn:
    """Skip the test that needs a service which cannot start; under CI=true, fail it instead."""
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(f"CI=true, so this service must start: {reason}", pytrace=False)
    pytest.skip(reason)


def _started(start, what: str):
    """``start()``'s service, or the skip (the failure under CI=true) that says why it could not start."""
    from tests.support.scale_services import ServiceUnavailable

    try:
        return start()
    except ServiceUnavailable as exc:
        reason = f"{what} unavailable: {exc}"
    _service_unavailable(reason)  # outside the except: no chained traceback in the report


@pytest.fixture(scope="session")
def postgres_cluster(tmp_path_factory):
    """A throwaway PostgreSQL cluster on loopback for the whole session (superuser ``fctkit``,
    trust auth; ``create_database(name)`` gives a test its own database), stopped at the end.

    When it cannot start (PostgreSQL not installed, no ``postgres`` user while root, a failed
    start) the tests that use it are skipped with the reason, except when the environment has
    CI=true: there they fail with it, because CI must run them, not skip them."""
    from tests.support.scale_services import start_postgres

    cluster = _started(lambda: start_postgres(tmp_path_factory.mktemp("postgres")), "PostgreSQL")
    yield cluster
    cluster.stop()


@pytest.fixture(scope="session")
def s3_endpoint(tmp_path_factory):
    """A real S3-compatible HTTP endpoint on loopback for the whole session (moto's server;
    ``create_bucket(name)``; ``s3_environment(url)`` is the environment a server process needs
    for it), stopped at the end.

    When it cannot start (moto[server] not installed, the server does not answer) the tests that
    use it are skipped with the reason, except when the environment has CI=true: there they fail
    with it, because CI must run them, not skip them."""
    from tests.support.scale_services import start_s3

    endpoint = _started(lambda: start_s3(tmp_path_factory.mktemp("s3") / "moto.log"), "S3 (moto)")
    yield endpoint
    endpoint.stop()

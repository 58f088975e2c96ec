"""Rollout status counts run off the event loop (issue 49): while a GetRollout's count takes
seconds (a slow query, as at millions of devices), a device's ListVersions on the same server
still answers within :data:`BOUND_S`; too many status reads at once are refused with
RESOURCE_EXHAUSTED, one that takes too long answers DEADLINE_EXCEEDED; both backends."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from fctkit.errors import RpcStatusError
from fctkit.protos import fleet_pb2
from fctkit.protos.client import FctkitClient
from fctkit.server import status_reads
from fctkit.server.rollout_store import RolloutStore
from tests.server.conftest import ADMIN_TOKEN, call_status, enrolled_client
from tests.server.test_device_indexes import _Target, in_process_server, server_config

SLOW_S = 2.5  # how long the patched device count takes
BOUND_S = 0.5  # the most a concurrent ListVersions may take (it takes milliseconds when nothing blocks it)


@pytest.fixture
def slow_count(monkeypatch) -> tuple[threading.Event, threading.Event]:
    """Make every count of the rollout's devices take :data:`SLOW_S`; the events are set when one
    starts and when one ends."""
    started, ended = threading.Event(), threading.Event()
    device_states = RolloutStore.device_states

    def slow(self):
        started.set()
        time.sleep(SLOW_S)
        ended.set()
        return device_states(self)

    monkeypatch.setattr(RolloutStore, "device_states", slow)
    return started, ended


@pytest.fixture
def served(tmp_path, backend, archives, publisher_pub, admin_token_file):
    """A server in this process with v1 published and v2 staged at 50%, and an enrolled device's client."""
    config = server_config(backend, tmp_path / "data", publisher_pub, admin_token_file)
    with in_process_server(config) as target:
        with FctkitClient(target, ADMIN_TOKEN) as admin:
            admin.publish_bundle(archives[1])
            admin.publish_bundle(archives[2], rollout_percent=50.0)
        device, _ = enrolled_client(_Target(target), name="device")
        with device:
            device.report(1, 10, fleet_pb2.UPGRADE_STATE_IDLE)
            yield target, device


def test_a_slow_rollout_status_does_not_delay_a_devices_list_versions(served, slow_count) -> None:
    target, device = served
    count_started, count_ended = slow_count
    with FctkitClient(target, ADMIN_TOKEN) as admin, ThreadPoolExecutor(1) as background:
        status = background.submit(admin.rollout_status, 2)
        assert count_started.wait(10)
        seconds, during = [], []
        for _ in range(5):
            started = time.perf_counter()
            assert [v.version for v in device.list_versions()]
            seconds.append(time.perf_counter() - started)
            during.append(not count_ended.is_set())
        assert during[0]  # the device was answered while the count was under way
        assert max(seconds) < BOUND_S, seconds
        assert status.result(30).state == "staged" and status.result().stages[0].offered in (0, 1)


def test_too_many_status_reads_at_once_are_refused(served, slow_count, monkeypatch) -> None:
    target, _ = served
    monkeypatch.setattr(status_reads, "MAX_WAITING", 2)
    with FctkitClient(target, ADMIN_TOKEN) as admin, ThreadPoolExecutor(4) as callers:
        codes = list(callers.map(lambda _: call_status(lambda: admin.rollout_status(2)), range(4)))
    assert sorted(codes) == ["OK", "OK", "RESOURCE_EXHAUSTED", "RESOURCE_EXHAUSTED"]


def test_a_status_read_that_takes_too_long_answers_deadline_exceeded(served, slow_count, monkeypatch) -> None:
    target, device = served
    monkeypatch.setattr(status_reads, "TIMEOUT_S", 0.3)
    with FctkitClient(target, ADMIN_TOKEN) as admin:
        with pytest.raises(RpcStatusError) as refused:
            admin.rollout_status(2)
        assert refused.value.code == "DEADLINE_EXCEEDED" and "took longer than 0.3 s" in str(refused.value)
        assert device.list_versions()  # the server goes on serving

"""Prometheus metrics of a running `fctkit serve --metrics-port` (issue 36 §4), on both backends:
scraped over HTTP and parsed with prometheus-client's own parser; RPC counts by method and
code, latency histograms, vault bytes, a provoked storage error; a taken metrics port is refused
and without the flag nothing more listens."""

from __future__ import annotations

import asyncio
import os
import socket
import sqlite3
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from fctkit import __version__
from fctkit.errors import FctkitError
from fctkit.protos.client import FctkitClient

from .conftest import ADMIN_TOKEN, ServerProcess, enrolled_client, status_code

prometheus_parser = pytest.importorskip("prometheus_client.parser")

LIST_VERSIONS, GET_MANIFEST = "/fctkit.v1.Registry/ListVersions", "/fctkit.v1.Registry/GetManifest"


def scrape(port: int) -> dict[tuple[str, frozenset], float]:
    """Every sample at http://127.0.0.1:PORT/metrics, by (name, labels)."""
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
        assert response.status == 200
        text = response.read().decode()
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in prometheus_parser.text_string_to_metric_families(text)
        for s in family.samples
    }


def value(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, frozenset(labels.items())), 0.0)


def metrics_port(server: ServerProcess) -> int:
    return next(e["port"] for e in server.events() if e.get("event") == "metrics listening")


def listening_ports(pid: int) -> set[int]:
    """TCP ports process ``pid`` listens on (from /proc: its socket inodes in LISTEN state)."""
    inodes = set()
    for fd in Path(f"/proc/{pid}/fd").iterdir():
        target = os.readlink(fd)
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    ports = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        for line in Path(table).read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] == "0A" and fields[9] in inodes:  # 0A: LISTEN
                ports.add(int(fields[1].rsplit(":", 1)[1], 16))
    return ports


#: the tests below compare scrapes taken a moment apart: each scrape renders afresh
NO_CACHE = ("--metrics-cache", "0")


@pytest.fixture(scope="module")
def metered(start_server) -> ServerProcess:
    return start_server("--metrics-port", "0", *NO_CACHE)


def test_the_server_logs_its_metrics_port_and_listens_there_only_besides_grpc(metered, backend):
    port = metrics_port(metered)
    assert listening_ports(metered.process.pid) == {metered.port, port}
    samples = scrape(port)
    assert value(samples, "fctkit_build_info", version=__version__, backend=backend.name) == 1
    assert value(samples, "process_resident_memory_bytes") > 0


def answer(port: int, path: str, method: str = "GET") -> tuple[int, bytes]:
    """The status and body the metrics port answers ``method path``."""
    request = urllib.request.Request(f"http://127.0.0.1:{port}{path}", method=method)
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status, response.read()
    except urllib.error.HTTPError as refused:
        return refused.code, refused.read()


def test_the_metrics_port_answers_metrics_and_nothing_else(metered):
    port = metrics_port(metered)
    for path in ("/", "/admin", "/metrics/", "/metricsx", "/favicon.ico", "/../metrics", "/admin?x=/metrics"):
        assert answer(port, path)[0] == 404, path
    assert answer(port, "/metrics", "POST")[0] == 405
    status, body = answer(port, "/metrics?name[]=fctkit_build_info")
    assert status == 200 and b"fctkit_build_info" in body
    assert answer(port, "/metrics", "HEAD") == (200, b"")


def test_a_burst_of_concurrent_scrapes_renders_once_per_cache_period():
    from fctkit.server.metrics import RolloutGauges, ServerMetrics

    renders: list[int] = []  # the rollout source is read once per render

    def source() -> list[RolloutGauges]:
        renders.append(threading.get_ident())
        return [RolloutGauges(4, "staged", 10.0)]

    metrics = ServerMetrics("sqlite", cache_s=3600)  # one period spans the whole test
    metrics.set_rollout_source(source)
    port = metrics.listen("127.0.0.1", 0)
    try:
        with ThreadPoolExecutor(max_workers=32) as scrapers:
            pages = list(scrapers.map(lambda _: answer(port, "/metrics"), range(96)))
            again = list(scrapers.map(lambda _: answer(port, "/metrics"), range(32)))
    finally:
        metrics.close()
    assert {status for status, _ in pages + again} == {200} and len({body for _, body in pages + again}) == 1
    assert len(renders) == 1 and b'fctkit_rollout_percent{state="staged",version="4"} 10.0' in pages[0][1]


def scrape_until(port: int, done: Callable[[dict], bool], what: str, timeout_s: float = 10.0) -> dict:
    """Scrape until ``done(samples)``: a call is counted as its handler ends on the server, which
    can be just after its client got the answer (a refused token's status, a stream's last bytes)."""
    deadline = time.monotonic() + timeout_s
    while not done(samples := scrape(port)):
        assert time.monotonic() < deadline, f"{what} not counted within {timeout_s:g} s"
        time.sleep(0.05)
    return samples


def test_rpcs_are_counted_by_method_and_code_with_their_latency(metered):
    port = metrics_port(metered)
    before = scrape(port)
    with FctkitClient(metered.target, ADMIN_TOKEN) as admin:
        admin.list_versions()
        admin.list_versions()
        assert status_code(lambda: admin.get_manifest(404)) == "NOT_FOUND"
    with FctkitClient(metered.target, "fcta_not-a-token") as stranger:
        assert status_code(stranger.list_versions) == "UNAUTHENTICATED"
    calls = lambda samples: value(samples, "fctkit_rpc_seconds_count", method=LIST_VERSIONS)  # noqa: E731
    after = scrape_until(port, lambda samples: calls(samples) - calls(before) >= 3, "the three ListVersions calls")

    def added(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert added("fctkit_rpc_total", method=LIST_VERSIONS, code="OK") == 2
    assert added("fctkit_rpc_total", method=LIST_VERSIONS, code="UNAUTHENTICATED") == 1
    assert added("fctkit_rpc_total", method=GET_MANIFEST, code="NOT_FOUND") == 1
    assert added("fctkit_rpc_seconds_count", method=LIST_VERSIONS) == 3
    assert 0 < added("fctkit_rpc_seconds_sum", method=LIST_VERSIONS) < 30
    assert added("fctkit_rpc_seconds_bucket", method=LIST_VERSIONS, le="30.0") == 3
    assert added("fctkit_rpc_seconds_bucket", method=LIST_VERSIONS, le="+Inf") == 3


def test_vault_bytes_are_counted_and_a_download_stream_once_at_its_end(metered):
    port = metrics_port(metered)
    before = scrape(port)
    blob = os.urandom(300_000)
    device, _ = enrolled_client(metered, name="metered")
    with device:
        sha256 = device.upload_blob(blob).sha256
        assert device.read_blob(sha256) == blob
    downloads_of = lambda samples: value(samples, "fctkit_rpc_total", method="/fctkit.v1.Vault/Download", code="OK")  # noqa: E731
    after = scrape_until(port, lambda samples: downloads_of(samples) > downloads_of(before), "the download")
    received = value(after, "fctkit_transfer_bytes_total", kind="vault_blob", direction="received") - value(
        before, "fctkit_transfer_bytes_total", kind="vault_blob", direction="received"
    )
    sent = value(after, "fctkit_transfer_bytes_total", kind="vault_blob", direction="sent") - value(
        before, "fctkit_transfer_bytes_total", kind="vault_blob", direction="sent"
    )
    assert len(blob) <= received < len(blob) + 4096  # the payload plus a little framing
    assert len(blob) <= sent < len(blob) + 4096
    downloads = [value(s, "fctkit_rpc_total", method="/fctkit.v1.Vault/Download", code="OK") for s in (before, after)]
    assert downloads[1] - downloads[0] == 1


def storage_errors(samples: dict) -> dict[tuple[str, str], float]:
    return {
        (dict(labels)["kind"], dict(labels)["error"]): v
        for (name, labels), v in samples.items()
        if name == "fctkit_storage_errors_total"
    }


def test_storage_errors_are_counted_by_kind_and_class(start_server, backend, tmp_path):
    data = tmp_path / "data"
    server = start_server("--metrics-port", "0", *NO_CACHE, data_dir=data)
    port = metrics_port(server)
    assert storage_errors(scrape(port)) == {}
    backend.alter(
        data, "ALTER TABLE enrolment_codes RENAME TO enrolment_codes_away"
    )  # a statement fails in the database
    try:
        with FctkitClient(server.target, ADMIN_TOKEN) as admin:
            assert status_code(lambda: admin.create_enrolment_code(label="no table")) == "INTERNAL"
    finally:
        backend.alter(data, "ALTER TABLE enrolment_codes_away RENAME TO enrolment_codes")
    error = "OperationalError" if backend.name == "sqlite" else "UndefinedTable"
    assert storage_errors(scrape(port)) == {("database", error): 1}
    if backend.name == "postgres":  # the database drops every connection: calls meet an unreachable database
        backend.query(
            data,
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity "
            "WHERE datname = current_database() AND pid <> pg_backend_pid()",
        )
        with FctkitClient(server.target, ADMIN_TOKEN) as admin:
            admin.create_enrolment_code(label="after the drop")  # the client retries UNAVAILABLE
        unreachable = {e: v for (kind, e), v in storage_errors(scrape(port)).items() if kind == "unreachable"}
        assert sum(unreachable.values()) >= 1
    with FctkitClient(server.target, ADMIN_TOKEN) as admin:
        admin.create_enrolment_code(label="table back")  # the server recovered


def test_a_taken_metrics_port_is_refused_with_a_clear_error(start_server):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        with pytest.raises(
            RuntimeError, match=rf"cannot serve metrics on 127\.0\.0\.1:{port}: .*choose another --metrics-port"
        ):
            start_server("--metrics-port", str(port))


def test_without_metrics_port_nothing_more_listens(start_server):
    server = start_server()
    assert listening_ports(server.process.pid) == {server.port}
    assert not any(e.get("event") == "metrics listening" for e in server.events())


def test_rollout_gauges_come_from_the_source_at_each_scrape_and_replicas_keep_apart():
    from fctkit.server.metrics import RolloutGauges, ServerMetrics, StageGauges

    # two replicas in one process, each scrape rendered afresh
    first, second = ServerMetrics("sqlite", cache_s=0), ServerMetrics("postgres", cache_s=0)
    stages = [
        StageGauges(1, {"offered": 3, "upgraded": 3}, 0.97),
        StageGauges(2, {"offered": 10, "upgraded": 7, "failed": 1}),
    ]
    rollouts = [RolloutGauges(2, "staged", 25.0, stages)]
    first.set_rollout_source(lambda: rollouts)
    ports = first.listen("127.0.0.1", 0), second.listen("127.0.0.1", 0)
    try:
        samples = scrape(ports[0])
        assert value(samples, "fctkit_rollout_percent", version="2", state="staged") == 25.0
        assert value(samples, "fctkit_rollout_devices", version="2", stage="1", status="upgraded") == 3
        assert value(samples, "fctkit_rollout_devices", version="2", stage="2", status="upgraded") == 7
        assert value(samples, "fctkit_rollout_devices", version="2", stage="2", status="failed") == 1
        assert value(samples, "fctkit_rollout_health_median", version="2", stage="1") == 0.97
        assert ("fctkit_rollout_health_median", frozenset({("version", "2"), ("stage", "2")})) not in samples
        rollouts[0] = RolloutGauges(2, "paused", 25.0, stages)
        assert value(scrape(ports[0]), "fctkit_rollout_percent", version="2", state="paused") == 25.0
        assert not any(name.startswith("fctkit_rollout") for name, _ in scrape(ports[1]))
        assert value(scrape(ports[1]), "fctkit_build_info", version=__version__, backend="postgres") == 1

        def unreadable():
            raise sqlite3.OperationalError("database is locked")

        first.set_rollout_source(unreadable)  # a failed read leaves the rollout gauges out, not the scrape
        samples = scrape(ports[0])
        assert not any(name.startswith("fctkit_rollout") for name, _ in samples)
        assert storage_errors(samples) == {("database", "OperationalError"): 1}
    finally:
        first.close()
        second.close()
    with pytest.raises(OSError):
        scrape(ports[0])


def test_without_prometheus_client_the_error_names_the_extra(monkeypatch):
    from fctkit.server.metrics import ServerMetrics

    monkeypatch.setitem(sys.modules, "prometheus_client", None)  # as if not installed
    with pytest.raises(FctkitError, match=r"pip install 'fctkit\[metrics\]'"):
        ServerMetrics("sqlite")


def test_the_rollout_source_never_runs_on_the_servers_event_loop():
    from fctkit.server.metrics import RolloutGauges, ServerMetrics, StageGauges

    readers: list[int] = []

    def source() -> list[RolloutGauges]:
        readers.append(threading.get_ident())
        return [RolloutGauges(3, "staged", 5.0, [StageGauges(1, {"offered": 2})])]

    async def serve_and_scrape() -> dict:
        metrics = ServerMetrics("sqlite")
        metrics.set_rollout_source(source)
        port = metrics.listen("127.0.0.1", 0)
        try:
            return await asyncio.to_thread(scrape, port)
        finally:
            metrics.close()

    samples = asyncio.run(serve_and_scrape())
    # asyncio.run's loop runs in this thread: a source read there would stall every RPC while it counts
    assert len(readers) == 1 and readers != [threading.get_ident()]
    assert value(samples, "fctkit_rollout_devices", version="3", stage="1", status="offered") == 2


def test_bundle_and_artifact_bytes_and_a_cancelled_stream_counted_once(metered, archives, tmp_path):
    port = metrics_port(metered)
    before = scrape(port)
    with FctkitClient(metered.target, ADMIN_TOKEN) as admin:
        info = admin.publish_bundle(archives[1])
    artifact = max(info.artifacts, key=lambda a: a.size)
    device, _ = enrolled_client(metered, name="watcher")
    with device:
        device.download_artifact(1, artifact.name, tmp_path / "artifact")
        watch = device.watch_versions()
        assert next(watch).version == 1
        watch.close()  # the client cancels the stream
    watch_method = "/fctkit.v1.Registry/WatchVersions"
    cancelled = lambda samples: value(samples, "fctkit_rpc_total", method=watch_method, code="CANCELLED")  # noqa: E731
    after = scrape_until(port, lambda samples: cancelled(samples) != cancelled(before), "the cancelled watch")

    def added(name: str, **labels: str) -> float:
        return value(after, name, **labels) - value(before, name, **labels)

    assert added("fctkit_rpc_total", method=watch_method, code="CANCELLED") == 1
    assert added("fctkit_rpc_seconds_count", method=watch_method) == 1
    archive_size = archives[1].stat().st_size
    assert (
        archive_size <= added("fctkit_transfer_bytes_total", kind="bundle", direction="received") < archive_size + 65536
    )
    assert (
        artifact.size <= added("fctkit_transfer_bytes_total", kind="artifact", direction="sent") < artifact.size + 4096
    )
    assert added("fctkit_rpc_total", method="/fctkit.v1.Registry/PublishBundle", code="OK") == 1


def test_rollout_gauges_show_what_rollout_status_answers(metered, archives):
    port = metrics_port(metered)
    with FctkitClient(metered.target, ADMIN_TOKEN) as admin:
        admin.publish_bundle(archives[2], rollout_percent=25.0)
        for name in ("one", "two", "three"):
            enrolled_client(metered, name=f"fleet-{name}")[0].close()
        admin.set_rollout(2, percent=100.0)  # every device enters: some in each run
        status = admin.rollout_status(2)
    samples = scrape(port)
    assert [s.percent for s in status.stages] == [25.0, 100.0]
    assert value(samples, "fctkit_rollout_percent", version="2", state="staged") == 100.0
    shown = {
        (dict(labels)["stage"], dict(labels)["status"]): v
        for (name, labels), v in samples.items()
        if name == "fctkit_rollout_devices" and dict(labels)["version"] == "2"
    }
    expected = {
        (str(stage.stage), status_name): getattr(stage, status_name)
        for stage in status.stages
        for status_name in ("offered", "downloaded", "upgraded", "failed", "reverted")
    }
    assert shown == expected
    assert (
        sum(v for (_, status_name), v in shown.items() if status_name == "offered")
        == sum(stage.offered for stage in status.stages)
        >= 3
    )


def test_a_complete_confirmed_rollout_drops_out_of_the_gauges(metered, archives):
    port = metrics_port(metered)
    with FctkitClient(metered.target, ADMIN_TOKEN) as admin:
        admin.publish_bundle(archives[3], rollout_percent=10.0)
        admin.set_rollout(3, action="complete")
        assert value(scrape(port), "fctkit_rollout_percent", version="3", state="complete") == 100.0
        admin.confirm_version(3)  # complete and confirmed: no longer under way
    assert not [key for key in scrape(port) if key[0] == "fctkit_rollout_percent" and dict(key[1])["version"] == "3"]


def test_gauges_of_a_rollout_status_message():
    from fctkit.protos import registry_pb2
    from fctkit.server.metrics import RolloutGauges, StageGauges, gauges_of

    status = registry_pb2.RolloutStatus(
        version=3,
        state="halted",
        percent=5.0,
        stages=[
            registry_pb2.RolloutStage(
                stage=1,
                percent=5.0,
                offered=4,
                downloaded=3,
                upgraded=2,
                failed=1,
                health=registry_pb2.HealthSummary(devices=2, median=0.25),
            ),
            registry_pb2.RolloutStage(stage=2, percent=20.0, offered=1),
        ],
    )
    assert gauges_of(status) == RolloutGauges(
        3,
        "halted",
        5.0,
        [
            StageGauges(1, {"offered": 4, "downloaded": 3, "upgraded": 2, "failed": 1, "reverted": 0}, 0.25),
            StageGauges(2, {"offered": 1, "downloaded": 0, "upgraded": 0, "failed": 0, "reverted": 0}, None),
        ],
    )

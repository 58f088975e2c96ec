"""Per-device and status calls against fleet size: real gRPC calls to a real `fctkit serve` whose
devices table holds 1k, 10k and 100k devices (issue 49: a per-device call must not grow with the fleet).

    python benchmarks/fleet_scale.py                     # SQLite, 1k / 10k / 100k devices
    python benchmarks/fleet_scale.py --million           # and 1M
    python benchmarks/fleet_scale.py --postgres          # PostgreSQL + S3 (moto) as well

For each size the metadata database is created and filled directly with ``size`` devices in the
rows enrolment and reports write (``dev-`` ids, token hashes, owners of one to four devices,
reported versions) and, for the devices inside a 10% rollout of version 2, the health reports
they would have sent for it. Then the server starts on it, v1 is published and v2 staged at 10%
with a guard, four devices are enrolled into one owner through the API and put in v2's cohort,
and each call is timed ``--reports`` times after a warm-up:

- ``Report``: a plain report (version, gallery size, state);
- ``Report + health``: a report carrying a health for v2, which the guard judges;
- ``ListVersions``: what a device is offered;
- ``GetRollout``: v2's rollout status (an admin call, not per device: it counts the whole
  fleet's devices in the rollout, so it still grows with the fleet);
- ``ListVersions during GetRollouts``: a device's ListVersions while an admin asks GetRollout
  over and over (the count runs off the event loop: it must not delay the device);
- ``reports/s``: Reports that 8 client threads of the benchmark get through in 5 s (the clients
  share the two cores with the server: a lower bound of what the server sustains).

The median latency per call and size is printed with its ratio to the smallest size of the same
run, and the 99th percentile of ListVersions during GetRollouts.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support, benchmarks._loopback

import numpy as np

from benchmarks._loopback import LoopbackServer
from fctkit.protos import fleet_pb2
from fctkit.protos.client import FctkitClient

BATCH = 20_000
DEVICE_COLUMNS = "device_id, token_hash, name, label, enrolled_at, owner_id, last_report_at, version, gallery_size"
HEALTH_COLUMNS = (
    "device_id, version, rows_upgraded, failures, seconds, sample_size, mean_cosine, p10_cosine, recall_at_1, "
    "mean_reciprocal_rank, reported_at"
)
STAGED_VERSION, STAGED_PERCENT = 2, 10.0
CALLS = ("Report", "Report + health", "ListVersions", "GetRollout", "ListVersions during GetRollouts")


def device_rows(size: int) -> Iterator[tuple]:
    """``size`` devices as enrolment and reports leave them: owners of one to four devices."""
    for k in range(size):
        digest = hashlib.sha256(k.to_bytes(8, "big")).hexdigest()
        owner = hashlib.sha256(b"owner" + (k // (1 + k % 4)).to_bytes(8, "big")).hexdigest()[:16]
        at = "2025-01-01T00:00:00Z"
        yield (f"dev-{digest[:16]}", digest, f"device {k}", "bench", at, f"own-{owner}", at, k % 3, 100 + k % 50)


def health_rows(size: int) -> Iterator[tuple]:
    """The health reports for v2 of the devices inside its 10% rollout (as record_health stores them)."""
    from fctkit.server.rollout import bucket

    for row in device_rows(size):
        device_id = row[0]
        if bucket(device_id, STAGED_VERSION) < STAGED_PERCENT:
            cosine = 0.85 + (int(device_id[-2:], 16) % 10) / 100
            yield (device_id, STAGED_VERSION, 100, 0, 1.0, 32, cosine, cosine - 0.1, 0.95, 0.97, "2025-01-02T00:00:00Z")


def _insert(db, table: str, columns: str, rows: Iterator[tuple]) -> None:
    marks = ", ".join("?" * len(columns.split(", ")))
    while batch := [row for _, row in zip(range(BATCH), rows, strict=False)]:
        with db.transaction():
            db.executemany(f"INSERT INTO {table} ({columns}) VALUES ({marks})", batch)


def fill(storage: object, size: int) -> None:
    """Insert ``size`` devices, and the health reports of those in v2's rollout, straight into the
    storage's metadata database."""
    db = storage._db  # type: ignore[attr-defined]  # the benchmark writes the tables the API writes
    _insert(db, "devices", DEVICE_COLUMNS, device_rows(size))
    _insert(db, "device_health", HEALTH_COLUMNS, health_rows(size))
    if type(db).__name__ == "PostgresDatabase":
        db.execute("ANALYZE devices, device_health")  # what autovacuum does after such growth


def staged(server: LoopbackServer) -> list[FctkitClient]:
    """Publish v1, stage v2 at 10% with a guard, enrol four devices of one owner into its cohort."""
    from fctkit.protos.bundle import pack_bundle
    from tests.server.conftest import chain_bundle

    with server.admin() as admin:
        for version in (1, STAGED_VERSION):
            archive = pack_bundle(
                chain_bundle(server.work / "bundles", version, server.key), server.work / f"v{version}.tar"
            )
            admin.publish_bundle(archive, rollout_percent=STAGED_PERCENT if version == STAGED_VERSION else None)
    clients, cohort = [], []
    for k in range(4):
        with FctkitClient(server.target) as anonymous:
            enrolment = anonymous.enrol(server.code("own-bench"), f"b{k}")
        clients.append(FctkitClient(server.target, enrolment.token))
        cohort.append(enrolment.device_id)
    with server.admin() as admin:  # the guard's votes are counted here, once, from the health rows
        admin.set_rollout(STAGED_VERSION, cohort=cohort, halt_below=0.5, halt_min_devices=3)
    return clients


def timed_calls(server: LoopbackServer, reports: int) -> dict[str, list[float]]:
    """Seconds per call (:data:`CALLS`), the devices taking turns."""
    clients = staged(server)
    health = fleet_pb2.UpgradeHealth(
        version=STAGED_VERSION, rows_upgraded=100, seconds=1.0, sample_size=16, mean_cosine=0.9, p10_cosine=0.8,
        recall_at_1=0.95, mean_reciprocal_rank=0.97,
    )  # fmt: skip
    admin = server.admin()
    calls = {
        "Report": lambda k: clients[k % 4].report(STAGED_VERSION, 100, fleet_pb2.UPGRADE_STATE_IDLE),
        "Report + health": lambda k: clients[k % 4].report(
            STAGED_VERSION, 100, fleet_pb2.UPGRADE_STATE_IDLE, health=health
        ),
        "ListVersions": lambda k: clients[k % 4].list_versions(),
        "GetRollout": lambda k: admin.rollout_status(STAGED_VERSION),
    }
    seconds: dict[str, list[float]] = {}
    try:
        for name, call in calls.items():
            seconds[name] = timed(call, reports)
        stop = threading.Event()

        def ask_status() -> None:
            with server.admin() as other_admin:
                while not stop.is_set():
                    other_admin.rollout_status(STAGED_VERSION)

        asking = threading.Thread(target=ask_status)
        asking.start()
        try:
            seconds["ListVersions during GetRollouts"] = timed(calls["ListVersions"], reports * 3)
        finally:
            stop.set()
            asking.join()
        seconds["reports/s"] = [report_throughput(calls["Report"])]
    finally:
        for client in [*clients, admin]:
            client.close()
    return seconds


THROUGHPUT_THREADS, THROUGHPUT_S = 8, 5.0


def report_throughput(report: Callable[[int], object]) -> float:
    """Reports a second that :data:`THROUGHPUT_THREADS` client threads of this process get through
    in :data:`THROUGHPUT_S` (the clients share the machine's two cores with the server: a lower bound)."""
    deadline = time.perf_counter() + THROUGHPUT_S
    counts = [0] * THROUGHPUT_THREADS

    def send(slot: int) -> None:
        while time.perf_counter() < deadline:
            report(slot * 1_000_003 + counts[slot])
            counts[slot] += 1

    threads = [threading.Thread(target=send, args=(slot,)) for slot in range(THROUGHPUT_THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(counts) / THROUGHPUT_S


def timed(call: Callable[[int], object], count: int) -> list[float]:
    """Seconds of ``count`` calls of ``call(k)``, after 8 untimed ones."""
    seconds = []
    for k in range(count + 8):
        started = time.perf_counter()
        call(k)
        if k >= 8:
            seconds.append(time.perf_counter() - started)
    return seconds


def measure(work: Path, size: int, reports: int, storage_args: Sequence[str], open_storage) -> dict[str, float]:
    """The median latency (seconds) of each call with ``size`` devices enrolled."""
    # the throughput step sends more reports a device than the default limit lets through
    server = LoopbackServer(work, "--max-reports-per-minute", "100000", storage=storage_args)
    server.data_dir.mkdir(parents=True, exist_ok=True)
    storage = open_storage(server.data_dir)
    try:
        fill(storage, size)
    finally:
        storage.close()
    with server:
        seconds = timed_calls(server, reports)
    medians = {name: statistics.median(s) for name, s in seconds.items() if name != "reports/s"}
    medians["reports/s"] = seconds["reports/s"][0]
    medians["p99"] = float(np.percentile(seconds["ListVersions during GetRollouts"], 99))
    return medians


def sqlite_backend(work: Path, size: int):
    from fctkit.server.storage import SqliteStorage

    return (), SqliteStorage


def postgres_backend(stack: ExitStack, work: Path):
    """A function of (work, size) -> (server storage arguments, a storage opener) on a fresh
    PostgreSQL cluster and moto S3 server (started once)."""
    from fctkit.server.scale_out import ScaleOutStorage
    from tests.server.conftest import BUCKET
    from tests.support.scale_services import s3_environment, start_postgres, start_s3

    cluster = start_postgres(work / "postgres")
    stack.callback(cluster.stop)
    s3 = start_s3(work / "moto.log")
    stack.callback(s3.stop)
    s3.create_bucket(BUCKET)
    os.environ.update(s3_environment(s3.url))

    def backend(_: Path, size: int):
        dsn, store = cluster.create_database(f"fleet_{size}"), f"s3://{BUCKET}/fleet{size}"
        args = ("--database", dsn, "--object-store", store, "--s3-endpoint-url", s3.url)
        return args, lambda _: ScaleOutStorage(dsn, store, s3_endpoint_url=s3.url)

    return backend


def table(name: str, medians: dict[int, dict[str, float]]) -> str:
    sizes = list(medians)
    smallest = sizes[0]
    lines = [
        f"{name}: median latency, ms (× the smallest fleet)",
        "| call | " + " | ".join(f"{n:,} devices" for n in sizes) + " |",
        "|---|" + "---:|" * len(sizes),
    ]
    for call in CALLS:
        cells = [f"{medians[n][call] * 1e3:.2f} (×{medians[n][call] / medians[smallest][call]:.2f})" for n in sizes]
        lines.append(f"| {call} | " + " | ".join(cells) + " |")
    lines.append(
        "| ListVersions during GetRollouts, p99 | " + " | ".join(f"{medians[n]['p99'] * 1e3:.2f}" for n in sizes) + " |"
    )
    lines.append(
        "| Reports a second, 8 client threads | " + " | ".join(f"{medians[n]['reports/s']:.0f}" for n in sizes) + " |"
    )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reports", type=int, default=60, help="timed calls of each kind per size (default 60)")
    parser.add_argument("--million", action="store_true", help="add 1,000,000 devices to the sizes")
    parser.add_argument("--postgres", action="store_true", help="measure PostgreSQL + S3 as well")
    parser.add_argument("--sizes", type=int, nargs="+", default=None, help="fleet sizes in place of the default ones")
    parser.add_argument("--only-postgres", action="store_true", help="measure PostgreSQL + S3 only")
    args = parser.parse_args()
    sizes = args.sizes or [1_000, 10_000, 100_000] + ([1_000_000] if args.million else [])
    with tempfile.TemporaryDirectory(prefix="fleet-scale-") as tmp, ExitStack() as stack:
        backends = {} if args.only_postgres else {"SQLite": sqlite_backend}
        if args.postgres or args.only_postgres:
            backends["PostgreSQL"] = postgres_backend(stack, Path(tmp))
        for name, backend in backends.items():
            medians = {}
            for size in sizes:
                work = Path(tmp) / f"{name}-{size}"
                storage_args, opener = backend(work, size)
                medians[size] = measure(work, size, args.reports, storage_args, opener)
                shown = ", ".join(
                    f"{call} {s:.0f}" if call == "reports/s" else f"{call} {s * 1e3:.2f} ms"
                    for call, s in medians[size].items()
                )
                print(f"{name} {size:,} devices: {shown}", flush=True)
            print(table(name, medians), flush=True)


if __name__ == "__main__":
    main()

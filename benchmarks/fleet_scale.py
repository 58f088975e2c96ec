"""Per-device calls against fleet size: real gRPC Reports to a real `fctkit serve` whose devices
table holds 1k, 10k and 100k devices (issue 49: a Report must not grow with the fleet).

    python benchmarks/fleet_scale.py                     # SQLite, 1k / 10k / 100k devices
    python benchmarks/fleet_scale.py --million           # and 1M
    python benchmarks/fleet_scale.py --postgres          # PostgreSQL + S3 (moto) as well

For each size the metadata database is created and filled directly with ``size`` devices in the
rows enrolment and reports write (``dev-`` ids, token hashes, owners of one to four devices,
reported versions), then the server starts on it, four devices are enrolled into one owner
through the API, and each sends Reports in turn (``--reports`` timed, after a warm-up). The
median latency per size is printed with its ratio to the smallest size of the same run.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.support, benchmarks._loopback

from benchmarks._loopback import LoopbackServer
from fctkit.protos import fleet_pb2
from fctkit.protos.client import FctkitClient

BATCH = 20_000
DEVICE_COLUMNS = "device_id, token_hash, name, label, enrolled_at, owner_id, last_report_at, version, gallery_size"


def device_rows(size: int) -> Iterator[tuple]:
    """``size`` devices as enrolment and reports leave them: owners of one to four devices."""
    for k in range(size):
        digest = hashlib.sha256(k.to_bytes(8, "big")).hexdigest()
        owner = hashlib.sha256(b"owner" + (k // (1 + k % 4)).to_bytes(8, "big")).hexdigest()[:16]
        at = "2025-01-01T00:00:00Z"
        yield (f"dev-{digest[:16]}", digest, f"device {k}", "bench", at, f"own-{owner}", at, k % 3, 100 + k % 50)


def fill(storage: object, size: int) -> None:
    """Insert ``size`` devices straight into the storage's metadata database."""
    db = storage._db  # type: ignore[attr-defined]  # the benchmark writes the table the API writes
    rows = device_rows(size)
    marks = ", ".join("?" * len(DEVICE_COLUMNS.split(", ")))
    while batch := [row for _, row in zip(range(BATCH), rows, strict=False)]:
        with db.transaction():
            db.executemany(f"INSERT INTO devices ({DEVICE_COLUMNS}) VALUES ({marks})", batch)
    if type(db).__name__ == "PostgresDatabase":
        db.execute("ANALYZE devices")  # what autovacuum does after such growth


def timed_reports(server: LoopbackServer, reports: int) -> list[float]:
    """Seconds per Report of four devices of one owner, taking turns."""
    clients = []
    for k in range(4):
        with FctkitClient(server.target) as anonymous:
            clients.append(FctkitClient(server.target, anonymous.enrol(server.code("own-bench"), f"b{k}").token))
    seconds = []
    try:
        for k in range(reports + 8):  # the first 8: warm-up
            started = time.perf_counter()
            clients[k % 4].report(0, k, fleet_pb2.UPGRADE_STATE_IDLE)
            if k >= 8:
                seconds.append(time.perf_counter() - started)
    finally:
        for client in clients:
            client.close()
    return seconds


def measure(work: Path, size: int, reports: int, storage_args: Sequence[str], open_storage) -> float:
    """The median Report latency (seconds) with ``size`` devices enrolled."""
    server = LoopbackServer(work, storage=storage_args)
    server.data_dir.mkdir(parents=True, exist_ok=True)
    storage = open_storage(server.data_dir)
    try:
        fill(storage, size)
    finally:
        storage.close()
    with server:
        return statistics.median(timed_reports(server, reports))


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


def table(name: str, medians: dict[int, float]) -> str:
    smallest = min(medians)
    lines = [f"{name}: median Report latency", "| devices | median ms | × smallest |", "|---:|---:|---:|"]
    lines += [f"| {n:,} | {s * 1e3:.2f} | {s / medians[smallest]:.2f} |" for n, s in medians.items()]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--reports", type=int, default=60, help="timed Reports per size (default 60)")
    parser.add_argument("--million", action="store_true", help="add 1,000,000 devices to the sizes")
    parser.add_argument("--postgres", action="store_true", help="measure PostgreSQL + S3 as well")
    args = parser.parse_args()
    sizes = [1_000, 10_000, 100_000] + ([1_000_000] if args.million else [])
    with tempfile.TemporaryDirectory(prefix="fleet-scale-") as tmp, ExitStack() as stack:
        backends = {"SQLite": sqlite_backend}
        if args.postgres:
            backends["PostgreSQL"] = postgres_backend(stack, Path(tmp))
        for name, backend in backends.items():
            medians = {}
            for size in sizes:
                work = Path(tmp) / f"{name}-{size}"
                storage_args, opener = backend(work, size)
                medians[size] = measure(work, size, args.reports, storage_args, opener)
                print(f"{name} {size:,} devices: {medians[size] * 1e3:.2f} ms", flush=True)
            print(table(name, medians), flush=True)


if __name__ == "__main__":
    main()

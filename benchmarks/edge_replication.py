"""Gallery replication throughput: one device pushes N sealed rows to the owner's replica, a
second device of the owner pulls and merges them — against a plain gRPC byte stream of the
same bytes over the same loopback, in the same run.

    python benchmarks/edge_replication.py                 # 100,000 rows (the acceptance size)
    python benchmarks/edge_replication.py --rows 20000 --markdown BENCHMARKS-replication.md

Rows: a 128-d embedding and a 128-d side-info each (random, sealed in the first device's
gallery; the fill is not timed), at the owner's current version. Timed:

* push: ``replication.push`` on the first device — read and decrypt the changed rows (device
  key, block by block), seal them under the owner key as blocks of up to 1 MiB (one commit per
  16,384 changes keeps the sealed blocks), send them (PushRecords, up to 65,536 rows per call;
  the server stores each message in one transaction and compacts), forget them;
* pull: ``replication.pull`` on the second device — stream the blocks, open each under the owner
  key, merge them (one pass per block; rows sealed under its device key in blocks, about 8,192
  rows per commit with the cursor);
* plain up / down: the same number of bytes as the sealed records, in messages of the same
  size (about 1 MiB), streamed to / from a minimal gRPC server (raw bytes, no protobuf, no
  storage) in a subprocess on the same loopback.

The ratios replication/plain say what sealing, SQLite and the server's checks cost on top of
moving the bytes. ``--profile`` also prints where each direction's time goes. CPU timings vary with load on shared machines: read the ratios.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from fctkit.edge_runtime import Device, DeviceSettings, NewRow, VersionTag

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _loopback import LoopbackServer, report

DIM = 128
MESSAGE_BYTES = 1 << 20

ECHO_SERVER = """
import sys
from concurrent import futures
import grpc
def sink(requests, context):
    return sum(len(r) for r in requests).to_bytes(8, "big")
def source(request, context):
    total, size = int.from_bytes(request[:8], "big"), int.from_bytes(request[8:16], "big")
    block, sent = bytes(size), 0
    while sent < total:
        n = min(size, total - sent)
        yield block[:n]
        sent += n
handlers = grpc.method_handlers_generic_handler("bench.Bytes", {
    "Sink": grpc.stream_unary_rpc_method_handler(sink), "Source": grpc.unary_stream_rpc_method_handler(source)})
server = grpc.server(futures.ThreadPoolExecutor(4), options=[("grpc.max_receive_message_length", 4 << 20)])
server.add_generic_rpc_handlers((handlers,))
port = server.add_insecure_port("127.0.0.1:0")
server.start()
print(port, flush=True)
server.wait_for_termination()
"""


def fill(device: Device, rows: int, seed: int = 0, chunk: int = 10_000) -> None:
    rng = np.random.default_rng(seed)
    tag = VersionTag(1, 1, "native")
    device.gallery.set_meta({"query_version": "1"})
    for first in tqdm(range(0, rows, chunk), desc="fill gallery", unit="chunk", file=sys.stderr):
        n = min(chunk, rows - first)
        emb = rng.standard_normal((n, DIM), dtype=np.float32)
        side = rng.standard_normal((n, DIM), dtype=np.float32)
        device.gallery.add_rows([NewRow(f"r{first + i:08d}", emb[i], side[i], "label") for i in range(n)], tag)


def plain_stream_seconds(total_bytes: int) -> tuple[float, float]:
    """(upload s, download s) of ``total_bytes`` through a minimal gRPC byte server."""
    import grpc

    process = subprocess.Popen([sys.executable, "-c", ECHO_SERVER], stdout=subprocess.PIPE, text=True)
    try:
        port = int(process.stdout.readline())
        channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", 4 << 20)])
        sink = channel.stream_unary("/bench.Bytes/Sink")
        source = channel.unary_stream("/bench.Bytes/Source")
        payload = np.random.default_rng(1).bytes(MESSAGE_BYTES)
        sizes = [min(MESSAGE_BYTES, total_bytes - s) for s in range(0, total_bytes, MESSAGE_BYTES)]
        sink(iter([payload[:1024]]))  # warm-up: connection established
        start = time.perf_counter()
        received = int.from_bytes(sink(payload[:n] for n in sizes), "big")
        up = time.perf_counter() - start
        assert received == total_bytes
        start = time.perf_counter()
        got = sum(len(m) for m in source(total_bytes.to_bytes(8, "big") + MESSAGE_BYTES.to_bytes(8, "big")))
        down = time.perf_counter() - start
        assert got == total_bytes
        channel.close()
        return up, down
    finally:
        process.kill()
        process.wait()


def timed(run, profile: bool, what: str) -> float:
    """Seconds ``run()`` took; with ``profile``, its 15 costliest functions (own time) on stderr."""
    profiler = cProfile.Profile() if profile else None
    start = time.perf_counter()
    if profiler is None:
        run()
    else:
        profiler.runcall(run)
    seconds = time.perf_counter() - start
    if profiler is not None:
        print(f"--- profile: {what} ({seconds:.2f} s with the profiler on) ---", file=sys.stderr)
        pstats.Stats(profiler, stream=sys.stderr).sort_stats("tottime").print_stats(15)
    return seconds


def measure(rows: int, work: Path, profile: bool = False) -> dict:
    from fctkit.edge_runtime.replication import ReplicationResult, pull, push

    with LoopbackServer(work, "--replica-quota-bytes", str(1 << 40)) as server:
        first = Device.init(work / "first", publisher_key=server.publisher_pub, settings=DeviceSettings())
        first.progress = False
        first.enrol(server.target, server.code("bench"))
        fill(first, rows)
        key_file = first.export_owner_key(work / "owner.key", "benchmark")
        second = Device.init(
            work / "second",
            publisher_key=server.publisher_pub,
            settings=DeviceSettings(),
            owner_key_file=key_file,
            owner_key_passphrase="benchmark",
        )
        second.enrol(server.target, server.code("bench"))
        second.gallery.set_meta({"query_version": "1"})
        pushed, pulled = ReplicationResult(), ReplicationResult()
        with first.client() as client:
            push_s = timed(lambda: push(first.parts, client, pushed), profile, "push")
            sealed_bytes = sum(len(r.sealed) for batch in client.pull_records() for r in batch.records)
        with second.client() as client:
            pull_s = timed(lambda: pull(second.parts, client, pulled), profile, "pull")
        assert pushed.pushed == rows and pulled.applied == rows and len(second.gallery) == rows
        first.close()
        second.close()
    up_s, down_s = plain_stream_seconds(sealed_bytes)
    return {
        "rows": rows,
        "sealed_bytes": sealed_bytes,
        "bytes_per_row": sealed_bytes / rows,
        "push_s": push_s,
        "pull_s": pull_s,
        "plain_up_s": up_s,
        "plain_down_s": down_s,
        "push_rows_per_s": rows / push_s,
        "pull_rows_per_s": rows / pull_s,
        "plain_up_rows_per_s": rows / up_s,
        "plain_down_rows_per_s": rows / down_s,
        "push_ratio": up_s / push_s,
        "pull_ratio": down_s / pull_s,
    }


def markdown(result: dict) -> str:
    r = result
    return "\n".join(
        [
            f"Replication of {r['rows']:,} rows (128-d embedding + 128-d side-info, {r['bytes_per_row']:.0f} sealed bytes per row) "
            "between two devices of one owner over loopback, against a plain gRPC byte stream of the same bytes in the same run "
            "(`python benchmarks/edge_replication.py`):",
            "",
            "| direction | replication rows/s | plain gRPC stream rows/s | ratio |",
            "|---|---|---|---|",
            f"| push (seal + PushRecords + commit) | {r['push_rows_per_s']:,.0f} | {r['plain_up_rows_per_s']:,.0f} | {r['push_ratio']:.3f} |",
            f"| pull (PullRecords + open + merge + commit) | {r['pull_rows_per_s']:,.0f} | {r['plain_down_rows_per_s']:,.0f} | {r['pull_ratio']:.3f} |",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--markdown", type=Path, default=None, help="Also append the table to this file.")
    parser.add_argument(
        "--profile",
        action="store_true",
        help="Profile push and pull (the device side; the server runs in its own process) and print "
        "the costliest functions; the timings then include the profiler's overhead.",
    )
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fctkit-replication-bench-") as tmp:
        result = measure(args.rows, Path(tmp), args.profile)
    report(result, markdown(result), args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())

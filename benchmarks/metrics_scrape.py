"""Does scraping /metrics slow the gRPC service? ListVersions latency with and without scrapers.

    python benchmarks/metrics_scrape.py                         # 2000 calls per phase, 16 scrapers
    python benchmarks/metrics_scrape.py --calls 300 --rounds 1  # a quick run

One real `fctkit serve --metrics-port 0` on loopback (embedded backend, its default metrics
cache), one tiny signed bundle published at 50% (a rollout whose gauges the metrics render reads
from the database). This process calls ListVersions ``--calls`` times in a row per phase, one
call at a time on one channel, and records each call's latency. Phases alternate, ``--rounds``
times: without scrapers (the baseline, measured in the same run), then with ``--scrapers``
threads scraping ``/metrics`` nonstop. The scrapers run in a process of their own (16 threads
in one Python process, as a scraping storm from elsewhere would be): threads here would compete
with the measuring client for this process's GIL and measure the client, not the server.

Printed: p50 and p99 of each condition (all rounds pooled), the scrapes answered per second, and
the ratio with / without of p50 and p99 (target <= 1.2 for p50). The figures and the command are
appended to ``--markdown`` when given.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import shlex
import statistics
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from _loopback import LoopbackServer, report
from server_load import weights_bundle

TINY_MIB = 16 * 8 * 4 / (1 << 20)  # a 16 x 8 MatMul: the bundle is not what this measures


def scrape(url: str, threads: int, go, stop, scraped) -> None:
    """Scraper process: ``threads`` threads GET ``url`` nonstop while ``go`` is set, until ``stop``."""

    def one() -> None:
        while not stop.is_set():
            if not go.wait(0.05):
                continue
            with urllib.request.urlopen(url, timeout=60) as response:
                response.read()
            with scraped.get_lock():
                scraped.value += 1

    workers = [threading.Thread(target=one) for _ in range(threads)]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()


def latencies(client, calls: int) -> list[float]:
    """Seconds of each of ``calls`` ListVersions calls, one after the other."""
    took = []
    for _ in range(calls):
        started = time.perf_counter()
        client.list_versions()
        took.append(time.perf_counter() - started)
    return took


def percentile(values: list[float], q: int) -> float:
    return statistics.quantiles(values, n=100, method="inclusive")[q - 1]


def measure(server: LoopbackServer, metrics_port: int, args: argparse.Namespace) -> dict:
    spawn = multiprocessing.get_context("spawn")  # no fork of this process's gRPC channel
    go, stop, scraped = spawn.Event(), spawn.Event(), spawn.Value("q", 0)
    scrapers = spawn.Process(
        target=scrape, args=(f"http://127.0.0.1:{metrics_port}/metrics", args.scrapers, go, stop, scraped)
    )
    scrapers.start()
    pooled: dict[str, list[float]] = {"without": [], "with": []}
    scraping_s, scrapes = 0.0, 0
    try:
        with server.admin() as client:
            latencies(client, args.warmup)
            for _ in range(args.rounds):
                pooled["without"] += latencies(client, args.calls)
                go.set()
                time.sleep(args.settle_s)  # every scraper thread started and scraping
                started, before = time.perf_counter(), scraped.value
                pooled["with"] += latencies(client, args.calls)
                scraping_s, scrapes = scraping_s + time.perf_counter() - started, scrapes + scraped.value - before
                go.clear()
                time.sleep(args.settle_s)  # the scrapes still waiting for their turn are answered
    finally:
        stop.set()
        go.set()
        scrapers.join(120)
    figures = {
        name: {"p50_ms": 1000 * percentile(values, 50), "p99_ms": 1000 * percentile(values, 99), "calls": len(values)}
        for name, values in pooled.items()
    }
    return {
        **figures,
        "scrapes_per_s": scrapes / scraping_s,
        "ratio_p50": figures["with"]["p50_ms"] / figures["without"]["p50_ms"],
        "ratio_p99": figures["with"]["p99_ms"] / figures["without"]["p99_ms"],
    }


def metrics_port_of(server: LoopbackServer) -> int:
    for line in server.log_path.read_text().splitlines():
        if line.startswith("{") and json.loads(line).get("event") == "metrics listening":
            return int(json.loads(line)["port"])
    raise SystemExit(f"the server logged no metrics port; see {server.log_path}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000, help="ListVersions calls per phase")
    parser.add_argument("--rounds", type=int, default=2, help="alternate without / with scrapers this many times")
    parser.add_argument("--scrapers", type=int, default=16, help="threads scraping /metrics nonstop")
    parser.add_argument("--warmup", type=int, default=100, help="calls before measuring")
    parser.add_argument(
        "--settle-s", type=float, default=1.0, help="pause around each with-scrapers phase (scrapers start, drain)"
    )
    parser.add_argument("--markdown", type=Path, default=None, help="append the table to this file")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fctkit-metrics-scrape-") as scratch:
        work = Path(scratch)
        with LoopbackServer(work, "--metrics-port", "0") as server:
            archive = weights_bundle(work / "bundle", TINY_MIB, server.key)
            with server.admin() as admin:
                admin.publish_bundle(archive, rollout_percent=50.0)
            result = measure(server, metrics_port_of(server), args)
    result["command"] = shlex.join(["python", "benchmarks/metrics_scrape.py", *(argv or sys.argv[1:])])
    without, with_ = result["without"], result["with"]
    table = (
        f"| ListVersions, {args.scrapers} threads scraping /metrics | p50 ms | p99 ms |\n|---|---|---|\n"
        f"| without scrapers | {without['p50_ms']:.2f} | {without['p99_ms']:.2f} |\n"
        f"| with scrapers ({result['scrapes_per_s']:.0f} scrapes/s answered) | {with_['p50_ms']:.2f} | "
        f"{with_['p99_ms']:.2f} |\n"
        f"| ratio with / without (target p50 <= 1.2) | {result['ratio_p50']:.2f}x | {result['ratio_p99']:.2f}x |"
    )
    report(result, table, args.markdown)
    return 0 if result["ratio_p50"] <= 1.2 else 1


if __name__ == "__main__":
    sys.exit(main())

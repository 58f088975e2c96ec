"""Query latency on a 100k-row encrypted device gallery, against faiss IndexFlat in the same run.

    python benchmarks/edge_query.py                       # 100,000 rows, 128-d, 300 queries
    python benchmarks/edge_query.py --markdown out.md
    python benchmarks/edge_query.py --dim 1280            # real image widths

One query at a time (what an app does), exact search with the bundle's distance (cosine):

* ``Device.query`` end to end — embed the query image with the bundle's ONNX graph, then
  search the decrypted, cached gallery (the first query decrypts it; timed separately);
* the device's ``ExactIndex`` alone with the numpy backend and with the faiss backend;
* bare faiss ``IndexFlatIP`` on the same normalised vectors (the baseline).

Reports p50/p99 per query and each as a ratio to bare faiss p50, once with faiss's default
OpenMP threads and once with one (single queries on a busy machine suffer from OpenMP's
thread wake-ups; ``Device.query`` uses faiss when installed, so it follows the setting). Needs faiss-cpu
(``pip install 'fctkit[faiss]'``). Timings vary with load: read the ratios.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from fctkit.edge_runtime import ExactIndex
from fctkit.edge_runtime.search import normalise

sys.path.insert(0, str(Path(__file__).resolve().parent))
from edge_upgrade import D_OLD, D_SIDE, DEFAULT_DIMS, IMAGE_DIM, Dims, bench_workspace, emit, filled_device


def latencies(fn, queries: np.ndarray) -> np.ndarray:
    fn(queries[:1])  # warm-up
    times = []
    for i in range(len(queries)):
        start = time.perf_counter()
        fn(queries[i : i + 1])
        times.append(time.perf_counter() - start)
    return np.asarray(times)


@dataclass
class QueryTimes:
    """Single-query latencies (seconds) per faiss OpenMP thread count and search, and the first
    query's time (it decrypts the gallery once)."""

    rows: int
    dims: Dims
    queries: int
    first_s: float
    times: dict[int, dict[str, np.ndarray]]

    def p50_ratio(self, threads: int, name: str) -> float:
        """``name``'s p50 over bare faiss IndexFlatIP's p50 at ``threads``."""
        by_name = self.times[threads]
        return float(np.percentile(by_name[name], 50) / np.percentile(by_name[BASELINE], 50))


BASELINE = "faiss IndexFlatIP (baseline)"
DEVICE_QUERY = "Device.query (embed + search)"


def measure(rows: int, queries: int, dims: Dims = DEFAULT_DIMS) -> QueryTimes:
    """A device filled with ``rows`` random rows at ``dims``; ``queries`` single queries timed
    through each search, with faiss's default OpenMP threads and with one."""
    import faiss

    with bench_workspace("fctkit-edge-query-") as (work, key, pub):
        device = filled_device(work, key, pub, rows, seed=3, dims=dims)
        images = np.random.default_rng(4).standard_normal((queries, IMAGE_DIM), dtype=np.float32)
        start = time.perf_counter()
        device.query(images[:1], k=10)
        first_s = time.perf_counter() - start
        vectors = device.query_vectors(images)
        _, loaded = device.searchable()
        flat = faiss.IndexFlatIP(dims.embedding)
        flat.add(normalise(loaded.embeddings))
        numpy_index = ExactIndex(loaded.embeddings, "cosine", backend="numpy")
        faiss_index = ExactIndex(loaded.embeddings, "cosine", backend="faiss")
        # the device's answers equal faiss's on the same vectors
        assert np.array_equal(
            faiss_index.search(vectors[:20], 10).indices, numpy_index.search(vectors[:20], 10).indices
        )
        times = {}
        for threads in dict.fromkeys((faiss.omp_get_max_threads(), 1)):
            faiss.omp_set_num_threads(threads)
            times[threads] = {
                BASELINE: latencies(lambda q: flat.search(normalise(q), 10), vectors),
                "ExactIndex, faiss backend": latencies(lambda q: faiss_index.search(q, 10), vectors),
                "ExactIndex, numpy backend": latencies(lambda q: numpy_index.search(q, 10), vectors),
                DEVICE_QUERY: latencies(lambda q: device.query(q, k=10), images),
            }
        device.close()
    return QueryTimes(rows, dims, queries, first_s, times)


def markdown(result: QueryTimes) -> str:
    lines = [
        f"{result.rows:,} rows, {result.dims.embedding}-d, cosine, k = 10, {result.queries} single queries; first query "
        f"(decrypts the gallery once) {result.first_s:.2f} s.",
        "",
        "| faiss OpenMP threads | search | p50 ms | p99 ms | p50 / faiss p50 |",
        "|---|---|---:|---:|---:|",
    ]
    for threads, cases in result.times.items():
        for name, times in cases.items():
            p50, p99 = np.percentile(times, 50), np.percentile(times, 99)
            lines.append(
                f"| {threads} | {name} | {p50 * 1e3:.2f} | {p99 * 1e3:.2f} | {result.p50_ratio(threads, name):.2f} |"
            )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--dim", type=int, default=D_OLD, help="Width of the gallery's embeddings.")
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args(argv)
    emit(markdown(measure(args.rows, args.queries, Dims(args.dim, D_SIDE))), args.markdown)


if __name__ == "__main__":
    main()

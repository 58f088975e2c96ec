"""Query latency on a 100k-row encrypted device gallery, against faiss IndexFlat in the same run.

    python benchmarks/edge_query.py                       # 100,000 rows, 128-d, 300 queries
    python benchmarks/edge_query.py --markdown out.md

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
from pathlib import Path

import numpy as np

from fctkit.edge_runtime import ExactIndex
from fctkit.edge_runtime.search import normalise

sys.path.insert(0, str(Path(__file__).resolve().parent))
from edge_upgrade import D_OLD, IMAGE_DIM, bench_workspace, emit, filled_device  # noqa: E402


def latencies(fn, queries: np.ndarray) -> np.ndarray:
    fn(queries[:1])  # warm-up
    times = []
    for i in range(len(queries)):
        start = time.perf_counter()
        fn(queries[i:i + 1])
        times.append(time.perf_counter() - start)
    return np.asarray(times)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=100_000)
    parser.add_argument("--queries", type=int, default=300)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args(argv)
    import faiss

    with bench_workspace("fctkit-edge-query-") as (work, key, pub):
        device = filled_device(work, key, pub, args.rows, seed=3)
        rng = np.random.default_rng(4)
        images = rng.standard_normal((args.queries, IMAGE_DIM), dtype=np.float32)
        start = time.perf_counter()
        device.query(images[:1], k=10)
        first_s = time.perf_counter() - start
        vectors = device.query_vectors(images)
        index, rows = device.searchable()
        gallery = normalise(rows.embeddings)
        flat = faiss.IndexFlatIP(D_OLD)
        flat.add(gallery)
        numpy_index = ExactIndex(rows.embeddings, "cosine", backend="numpy")
        faiss_index = ExactIndex(rows.embeddings, "cosine", backend="faiss")
        # the device's answers equal faiss's on the same vectors
        assert np.array_equal(faiss_index.search(vectors[:20], 10).indices, numpy_index.search(vectors[:20], 10).indices)
        lines = [
            f"{args.rows:,} rows, {D_OLD}-d, cosine, k = 10, {args.queries} single queries; first query "
            f"(decrypts the gallery once) {first_s:.2f} s.", "",
            "| faiss OpenMP threads | search | p50 ms | p99 ms | p50 / faiss p50 |", "|---|---|---:|---:|---:|",
        ]
        for threads in (faiss.omp_get_max_threads(), 1):
            faiss.omp_set_num_threads(threads)
            cases = {
                "faiss IndexFlatIP (baseline)": latencies(lambda q: flat.search(normalise(q), 10), vectors),
                "ExactIndex, faiss backend": latencies(lambda q: faiss_index.search(q, 10), vectors),
                "ExactIndex, numpy backend": latencies(lambda q: numpy_index.search(q, 10), vectors),
                "Device.query (embed + search)": latencies(lambda q: device.query(q, k=10), images),
            }
            base = np.percentile(cases["faiss IndexFlatIP (baseline)"], 50)
            for name, times in cases.items():
                p50, p99 = np.percentile(times, 50), np.percentile(times, 99)
                lines.append(f"| {threads} | {name} | {p50 * 1e3:.2f} | {p99 * 1e3:.2f} | {p50 / base:.2f} |")
        emit("\n".join(lines) + "\n", args.markdown)
        device.close()


if __name__ == "__main__":
    main()

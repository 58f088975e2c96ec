"""Large retrieval evaluation: fctkit's chunked evaluation vs a numpy full-matrix baseline.

    python benchmarks/eval_large.py                      # 100k x 100k x 128, baseline at 10k
    python benchmarks/eval_large.py --n 20000 --baseline-n 5000   # a quick run

Each evaluation runs in its own subprocess so its peak RSS (ru_maxrss) is its own. The
baseline holds the full distance matrix and argsorts every row (stable: distance, then
index), which is what fits in memory only for small sets; both methods must give the same
numbers on the shared size, and the script checks that. Printed: wall time, queries/s,
peak RSS, and the throughput ratios ours / baseline (same size) and ours at --n / baseline.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time

import numpy as np


def make_sets(n: int, dim: int, classes: int, seed: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Clustered float32 query and gallery sets of n items each, drawn around shared class centres."""
    rng = np.random.default_rng(seed)
    centres = rng.normal(size=(classes, dim)).astype(np.float32)
    sets = []
    for _ in range(2):
        labels = rng.integers(0, classes, n)
        sets += [centres[labels] + rng.normal(scale=1.5, size=(n, dim)).astype(np.float32), labels]
    return tuple(sets)


def run_ours(q, ql, g, gl, chunk_size: int, workers: int | None) -> dict:
    from fctkit.trainer.evaluation import evaluate_retrieval

    result = evaluate_retrieval(q, ql, g, gl, topk=(1, 5), chunk_size=chunk_size, workers=workers, progress=True)
    return {"cmc": {str(k): v for k, v in result.cmc.items()}, "mean_ap": result.mean_ap}


def run_baseline(q, ql, g, gl) -> dict:
    """Full distance matrix, a stable argsort of every row, AP from cumulative hits."""
    q, g = q.astype(np.float64), g.astype(np.float64)
    dist = (q * q).sum(1)[:, None] + (g * g).sum(1)[None, :] - 2.0 * q @ g.T
    order = np.argsort(dist, axis=1, kind="stable")
    del dist
    hits = gl[order] == ql[:, None]
    del order
    ranks = np.arange(1, hits.shape[1] + 1)
    first = hits.argmax(axis=1) + 1
    cum = np.cumsum(hits, axis=1, dtype=np.int32)
    ap = np.where(hits, cum / ranks, 0.0).sum(axis=1) / hits.sum(axis=1)
    return {"cmc": {str(k): float(np.mean(first <= k)) for k in (1, 5)}, "mean_ap": float(ap.mean())}


def child(args: argparse.Namespace) -> None:
    q, ql, g, gl = make_sets(args.n, args.dim, args.classes, args.seed)
    rss_data = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    start = time.perf_counter()
    if args.child == "ours":
        metrics = run_ours(q, ql, g, gl, args.chunk_size, args.workers)
    else:
        metrics = run_baseline(q, ql, g, gl)
    wall = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print(json.dumps({"wall_s": wall, "peak_rss_mib": peak, "data_rss_mib": rss_data, "metrics": metrics}))


def measure(method: str, n: int, args: argparse.Namespace) -> dict:
    command = [
        sys.executable,
        __file__,
        "--child",
        method,
        "--n",
        str(n),
        "--dim",
        str(args.dim),
        "--classes",
        str(args.classes),
        "--seed",
        str(args.seed),
        "--chunk-size",
        str(args.chunk_size),
    ]
    if args.workers is not None:
        command += ["--workers", str(args.workers)]
    print(f"running {method} at {n} x {n} x {args.dim} ...", file=sys.stderr, flush=True)
    done = subprocess.run(command, stdout=subprocess.PIPE, text=True, check=True)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    out.update(method=method, n=n, queries_per_s=n / out["wall_s"])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--n", type=int, default=100_000, help="queries = gallery items of the large run")
    parser.add_argument("--baseline-n", type=int, default=10_000, help="size both methods run at")
    parser.add_argument("--dim", type=int, default=128)
    parser.add_argument("--classes", type=int, default=100)
    parser.add_argument("--chunk-size", type=int, default=1024)
    parser.add_argument("--workers", type=int, default=None, help="ranking threads (default: up to 4 CPUs)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--child", choices=["ours", "baseline"], help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args)
        return

    baseline = measure("baseline", args.baseline_n, args)
    ours_small = measure("ours", args.baseline_n, args)
    ours_large = measure("ours", args.n, args)
    same = (
        baseline["metrics"]["cmc"] == ours_small["metrics"]["cmc"]
        and abs(baseline["metrics"]["mean_ap"] - ours_small["metrics"]["mean_ap"]) < 1e-9
    )

    print(f"\nretrieval evaluation, {args.dim}-d, {args.classes} classes, chunk {args.chunk_size}")
    print(f"{'method':<10}{'n x n':>16}{'wall s':>10}{'queries/s':>12}{'peak RSS MiB':>14}{'top-1':>8}{'mAP':>8}")
    for row in (baseline, ours_small, ours_large):
        m = row["metrics"]
        print(
            f"{row['method']:<10}{row['n']:>8} x {row['n']:<6}{row['wall_s']:>10.1f}{row['queries_per_s']:>12.0f}"
            f"{row['peak_rss_mib']:>14.0f}{m['cmc']['1']:>8.4f}{m['mean_ap']:>8.4f}"
        )
    print(f"\nsame metrics as the baseline at {args.baseline_n}: {'yes' if same else 'NO'}")
    print(
        f"throughput ratio ours / baseline at {args.baseline_n}: {ours_small['queries_per_s'] / baseline['queries_per_s']:.2f}x"
    )
    print(
        f"throughput ratio ours at {args.n} / baseline at {args.baseline_n}: "
        f"{ours_large['queries_per_s'] / baseline['queries_per_s']:.3f}x "
        f"(each query ranks a {args.n / args.baseline_n:.0f}x larger gallery)"
    )
    print(
        f"peak RSS of ours at {args.n}: {ours_large['peak_rss_mib']:.0f} MiB "
        f"({ours_large['data_rss_mib']:.0f} MiB of it is the generated input)"
    )
    if not same:
        sys.exit(1)


if __name__ == "__main__":
    main()

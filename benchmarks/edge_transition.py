"""What transition scoring and hubness offsets cost a device, as ratios to plain single-space
search on the same gallery, measured in the same run.

    python benchmarks/edge_transition.py                  # 50,000 rows, 128-d, 200 queries
    python benchmarks/edge_transition.py --markdown out.md

A v1 gallery of random rows is upgraded to a v2 bundle (linear adapter) that declares

* a **transition** (w = 0.5): queries are embedded by both models and ranked by the fused
  score; the rows' previous embeddings stay sealed in the gallery until it ends. Measured
  during the transition, then on the same device after ``end_transition`` (the baseline:
  the same adapted rows, plain cosine search);
* a **hubness offset** (β = 0.5, 1,000 reference queries, k = 10) on a second device filled
  with the same rows: offsets computed by the bundle's graph at upgrade and stored sealed.

Per case: single-query ``Device.query`` p50/p99 (embed + search, one query at a time), the
first query after opening (decrypts the gallery and its extras, builds the index), the bytes
of decrypted vectors held for search, and the sealed vector bytes stored in the gallery. Timings vary with load:
read the ratios.
"""

from __future__ import annotations

import argparse
import sqlite3
import sys
import time
from pathlib import Path

import numpy as np

from fctkit.edge_runtime import Device, DeviceSettings

sys.path.insert(0, str(Path(__file__).parent))
from edge_query import latencies
from edge_upgrade import D_NEW, IMAGE_DIM, bench_workspace, build_bundles, emit, fill

WEIGHT, BETA, REFERENCES, K = 0.5, 0.5, 1000, 10


def upgraded_device(root: Path, v1: Path, v2: Path, pub: Path, rows: int) -> tuple[Device, float]:
    device = Device.init(root, publisher_key=pub, settings=DeviceSettings(batch_size=4096))
    device.progress = False
    device.install_bundle(v1)
    device.gallery.set_meta({"query_version": "1"})
    fill(device, rows, seed=3)
    start = time.perf_counter()
    device.upgrade(v2)
    return device, time.perf_counter() - start


def measure(device: Device, images: np.ndarray) -> dict[str, float]:
    root = device.root
    device.close()
    device = Device.open(root)  # a cold start: nothing decrypted yet
    start = time.perf_counter()
    device.query(images[:1], k=10)
    first = time.perf_counter() - start
    times = latencies(lambda q: device.query(q, k=10), images)
    index, rows = device.searchable()
    held = index.vectors.nbytes + rows.embeddings.nbytes + rows.side_infos.nbytes
    with sqlite3.connect(root / "gallery.sqlite") as db:  # the sealed vectors stored (a file keeps freed pages)
        live = db.execute("SELECT value FROM meta WHERE key = 'live_vectors'").fetchone()[0]
        sealed = db.execute(
            "SELECT SUM(LENGTH(embedding) + LENGTH(side_info)) FROM vector_blocks WHERE vector_set = ?", (live,)
        ).fetchone()[0]
        sealed += db.execute("SELECT COALESCE(SUM(LENGTH(sealed)), 0) FROM row_extras").fetchone()[0]
    result = {
        "p50": float(np.percentile(times, 50)),
        "p99": float(np.percentile(times, 99)),
        "first": first,
        "held": held,
        "file": sealed,
        "scoring": device.status()["scoring"],
    }
    device.close()
    return result


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=50_000)
    parser.add_argument("--queries", type=int, default=200)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args(argv)
    from fctkit.export.bundle_builder import ArtifactSource
    from fctkit.export.hubness_graph import hubness_onnx
    from fctkit.protos.search_policy import HubnessPolicy, TransitionPolicy

    with bench_workspace("fctkit-edge-transition-") as (work, key, pub):
        v1, v2_transition = build_bundles(work / "transition", "linear", key, transition=TransitionPolicy(1, WEIGHT))
        reference = np.random.default_rng(5).standard_normal((REFERENCES, D_NEW))
        graph = hubness_onnx(reference, K, work / "hubness.onnx")
        _, v2_hubness = build_bundles(
            work / "hubness", "linear", key, v2_extra=(ArtifactSource(graph, "hubness"),), hubness=HubnessPolicy(BETA)
        )
        images = np.random.default_rng(4).standard_normal((args.queries, IMAGE_DIM), dtype=np.float32)

        device, upgrade_transition = upgraded_device(work / "dev-transition", v1, v2_transition, pub, args.rows)
        root = device.root
        fused = measure(device, images)
        with Device.open(root) as device:
            assert device.end_transition()
        plain = measure(Device.open(root), images)
        device, upgrade_hubness = upgraded_device(work / "dev-hubness", v1, v2_hubness, pub, args.rows)
        hubness = measure(device, images)
        assert (fused["scoring"], plain["scoring"], hubness["scoring"]) == ("transition", "plain", "hubness")

        lines = [
            f"{args.rows:,} rows, {D_NEW}-d (previous and new), cosine, k = 10, {args.queries} single queries; upgrade "
            f"with a transition {upgrade_transition:.1f} s, with hubness offsets {upgrade_hubness:.1f} s.",
            "",
            "| scoring | p50 ms | p99 ms | p50 ÷ plain | first query s | ÷ plain | vectors held MiB | ÷ plain | sealed on disk MiB | ÷ plain |",
            "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for name, case in (
            ("plain (baseline: after end_transition)", plain),
            (f"transition (w = {WEIGHT})", fused),
            (f"hubness (β = {BETA}, {REFERENCES} references, k = {K})", hubness),
        ):
            lines.append(
                f"| {name} | {case['p50'] * 1e3:.2f} | {case['p99'] * 1e3:.2f} | {case['p50'] / plain['p50']:.2f} | "
                f"{case['first']:.2f} | {case['first'] / plain['first']:.2f} | {case['held'] / 2**20:.1f} | "
                f"{case['held'] / plain['held']:.2f} | {case['file'] / 2**20:.1f} | {case['file'] / plain['file']:.2f} |"
            )
        emit("\n".join(lines) + "\n", args.markdown)


if __name__ == "__main__":
    main()

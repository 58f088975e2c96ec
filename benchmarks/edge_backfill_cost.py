"""Backfill cost per row against forward-upgrade cost per row, on one device, in the same run.

    python benchmarks/edge_backfill_cost.py                  # 5,000 rows of 28x28 images
    python benchmarks/edge_backfill_cost.py --rows 2000 --markdown BENCHMARKS-replication.md

A device enrolled with a real server on loopback installs v1, adds N images (sealed
originals uploaded to the vault; not timed) and downloads v2, then:

* upgrade: ``Device.upgrade`` to v2 with the FCT mixer at the paper's widths (branches 256,
  mixer 2048, 128-d φ and ψ) — per batch decrypt + h + seal + commit, then the switch;
* backfill: ``Device.backfill`` of every row (random order) — per row download the sealed
  original from the vault, open it (owner-key-wrapped data key), re-embed it with v2's
  ``embed`` and ``side_info`` graphs, seal, commit per batch.

The embedding graphs here are linear maps of the 784 pixels (the bundle format's smallest
real graphs), so the backfill figure is the kit's floor — transfer, crypto and storage; a
real backbone adds its own per-image cost (``benchmarks/edge_upgrade.py`` measures a
ResNet-50 per image on the same machine). CPU timings vary with load: read the ratio.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _loopback import LoopbackServer, report
from edge_upgrade import D_NEW, D_OLD, D_SIDE, fct_graph, linear_graph

from fctkit.edge_runtime import Device, DeviceSettings

PIXELS = 28 * 28


def build_bundles(folder: Path, key) -> tuple[Path, Path]:
    from fctkit.export.bundle_builder import ArtifactSource, build_bundle

    folder.mkdir(parents=True, exist_ok=True)

    def base(version: int) -> list[ArtifactSource]:
        return [
            ArtifactSource(
                linear_graph(folder / f"embed{version}.onnx", {"image": PIXELS}, D_OLD, "embedding", version), "embed"
            ),
            ArtifactSource(
                linear_graph(folder / f"side{version}.onnx", {"image": PIXELS}, D_SIDE, "side_info", 10 + version),
                "side_info",
            ),
        ]

    common = {"mode": "forward", "distance": "cosine", "normalize": True, "private_key": key}
    v1 = build_bundle(
        folder / "v1", version=1, parents=(), artifacts=base(1), gate={"cases": {}, "ecc": {}}, **common
    ).root
    h = fct_graph(folder / "h.onnx", 7)
    assert D_NEW == D_OLD
    v2 = build_bundle(
        folder / "v2",
        version=2,
        parents=(1,),
        artifacts=[*base(2), ArtifactSource(h, "forward", 1, 2)],
        gate={"cases": {}, "ecc": {"forward_1_to_2": True}},
        **common,
    ).root
    return v1, v2


def measure(rows: int, batch: int, work: Path) -> dict:
    with LoopbackServer(work) as server:
        v1, v2 = build_bundles(work / "bundles", server.key)
        server.publish(v1)
        device = Device.init(
            work / "device",
            publisher_key=server.publisher_pub,
            settings=DeviceSettings(batch_size=batch, health_sample=0),
        )
        device.progress = False
        device.enrol(server.target, server.code())
        device.sync(replicate=False)
        images = np.random.default_rng(0).integers(0, 256, (rows, PIXELS)).astype(np.float32) / 255
        for first in range(0, rows, 1000):
            device.add(
                images[first : first + 1000],
                item_ids=[f"i{first + k:07d}" for k in range(len(images[first : first + 1000]))],
            )
        server.publish(v2)
        device.sync(upgrade=False, replicate=False)  # download and verify v2 (not timed)
        start = time.perf_counter()
        upgraded = device.upgrade(device.root / "bundles" / "v2")
        upgrade_s = time.perf_counter() - start
        start = time.perf_counter()
        result = device.backfill(rows, order="random", batch_size=batch)
        backfill_s = time.perf_counter() - start
        assert upgraded == rows and result.backfilled == rows
        assert device.status()["rows_by_space"] == {"v2": rows}
        device.close()
    return {
        "rows": rows,
        "batch": batch,
        "upgrade_s": upgrade_s,
        "backfill_s": backfill_s,
        "upgrade_ms_per_row": 1000 * upgrade_s / rows,
        "backfill_ms_per_row": 1000 * backfill_s / rows,
        "sealed_bytes_downloaded_per_row": result.bytes_downloaded / rows,
        "backfill_over_upgrade": backfill_s / upgrade_s,
    }


def markdown(r: dict) -> str:
    return "\n".join(
        [
            f"Backfill vs forward upgrade on one device, {r['rows']:,} rows of 28x28 images, batch {r['batch']}, same run "
            "(`python benchmarks/edge_backfill_cost.py`; linear embed graphs, so the backfill row is the kit's floor):",
            "",
            "| per row | ms | what it includes |",
            "|---|---|---|",
            f"| forward upgrade (FCT mixer) | {r['upgrade_ms_per_row']:.3f} | decrypt + h(φ, ψ) + seal + commit + switch |",
            f"| backfill | {r['backfill_ms_per_row']:.3f} | download {r['sealed_bytes_downloaded_per_row']:,.0f} sealed bytes + open + "
            "re-embed + seal + commit |",
            f"| ratio backfill / upgrade | {r['backfill_over_upgrade']:.1f}x | |",
            "",
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=5000)
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--markdown", type=Path, default=None, help="Also append the table to this file.")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fctkit-backfill-bench-") as tmp:
        result = measure(args.rows, args.batch, Path(tmp))
    report(result, markdown(result), args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())

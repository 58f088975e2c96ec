"""Cold start of a block-sealed device gallery: open + first query, against bulk AES-GCM over the same bytes.

    python benchmarks/edge_cold_start.py                  # 1,000,000 rows (128-d embedding + 128-d side-info)
    python benchmarks/edge_cold_start.py --rows 200000 --markdown out.md

Fills a device gallery (blocks of ``BLOCK_ROWS`` rows), closes it, then times in this process:

* **open + first query** — ``Device.open`` and one ``query`` (which decrypts every block into
  the search matrix, then embeds and searches the query);
* the gallery's ``load`` alone (decrypt + placement, no query);
* the floor: AES-256-GCM decryption of the same number of plaintext bytes, in records of one
  block each, from memory (no SQLite, no placement) — issue 22's baseline;
* SQLite's read of the same BLOBs without decrypting (the container's share).

Open + first query runs in a fresh process (page cache warm, process cold: an app starting),
which also reports its peak and held resident memory over its state before opening, as a
multiple of the raw float32 bytes of the rows' embeddings and side-info.
Timings vary with load: read the ratios.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import subprocess
import sys
import time
from pathlib import Path

from cryptography.hazmat.primitives.ciphers.aead import AESGCM

from fctkit.edge_runtime import Device
from fctkit.edge_runtime.gallery.vectors import BLOCK_ROWS

sys.path.insert(0, str(Path(__file__).resolve().parent))
from edge_upgrade import D_OLD, D_SIDE, IMAGE_DIM, bench_workspace, emit, filled_device


def aes_floor_seconds(rows: int, row_bytes: int) -> float:
    """AES-256-GCM decryption of ``rows * row_bytes`` bytes in block-sized records."""
    aead, nonce = AESGCM(os.urandom(32)), os.urandom(12)
    record = aead.encrypt(nonce, os.urandom(BLOCK_ROWS * row_bytes), b"aad")
    full, rest = divmod(rows, BLOCK_ROWS)
    last = aead.encrypt(nonce, os.urandom(rest * row_bytes), b"aad") if rest else None
    start = time.perf_counter()
    for _ in range(full):
        aead.decrypt(nonce, record, b"aad")
    if last is not None:
        aead.decrypt(nonce, last, b"aad")
    return time.perf_counter() - start


def blob_read_seconds(path: Path) -> float:
    with sqlite3.connect(path) as db:
        start = time.perf_counter()
        for _ in db.execute("SELECT embedding, side_info FROM vector_blocks"):
            pass
        return time.perf_counter() - start


_COLD_START = """
import json, sys, time
import numpy as np
import onnxruntime  # imported before the baseline: a running app has them loaded
try:
    import faiss
except ImportError:
    pass
from fctkit.edge_runtime import Device

def rss(field):
    return int(next(l for l in open("/proc/self/status") if l.startswith(field)).split()[1]) * 1024

query = np.random.default_rng(4).standard_normal((1, int(sys.argv[2])), dtype=np.float32)
before = rss("VmRSS:")
start = time.perf_counter()
device = Device.open(sys.argv[1])
device.query(query, k=10)
seconds = time.perf_counter() - start
print(json.dumps({"seconds": seconds, "peak_bytes": rss("VmHWM:") - before, "held_bytes": rss("VmRSS:") - before}))
"""


def cold_start(device_dir: Path) -> dict:
    """Open + first query in a fresh process (the page cache warm, the process cold), with its peak memory."""
    out = subprocess.run(
        [sys.executable, "-c", _COLD_START, str(device_dir), str(IMAGE_DIM)], capture_output=True, text=True, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--markdown", type=Path)
    args = parser.parse_args(argv)
    with bench_workspace("fctkit-cold-start-") as (work, key, pub):
        filled_device(work, key, pub, args.rows, seed=3).close()
        blob_s = blob_read_seconds(work / "device" / "gallery.sqlite")
        first = cold_start(work / "device")
        with Device.open(work / "device") as device:
            start = time.perf_counter()
            loaded = device.gallery.load(with_labels=False)
            load_s = time.perf_counter() - start
            assert len(loaded) == args.rows and not loaded.corrupt
            del loaded
        row_bytes = 4 * (D_OLD + D_SIDE)
        aes_s = aes_floor_seconds(args.rows, row_bytes)
        raw = args.rows * row_bytes
        lines = [
            f"{args.rows:,} rows x ({D_OLD}-d embedding + {D_SIDE}-d side-info) float32 = {raw / 2**20:,.0f} MiB, "
            f"blocks of {BLOCK_ROWS:,} rows, one run.",
            "",
            "| measure | seconds | ÷ bulk AES-GCM |",
            "|---|---:|---:|",
            f"| bulk AES-GCM decrypt of the same bytes (floor) | {aes_s:.3f} | 1.00 |",
            f"| SQLite read of the sealed BLOBs alone | {blob_s:.3f} | {blob_s / aes_s:.2f} |",
            f"| `gallery.load()` (read + decrypt + place) | {load_s:.3f} | {load_s / aes_s:.2f} |",
            f"| **open + first query** (fresh process) | {first['seconds']:.3f} | **{first['seconds'] / aes_s:.2f}** (target ≤ 2) |",
            "",
            f"Memory of the fresh process over its state before opening (RSS): peak {first['peak_bytes'] / 2**20:,.0f} MiB = "
            f"**{first['peak_bytes'] / raw:.2f}×** the raw float bytes (target ≤ 1.5); held after the query "
            f"{first['held_bytes'] / 2**20:,.0f} MiB = {first['held_bytes'] / raw:.2f}×.",
        ]
        emit("\n".join(lines), args.markdown)


if __name__ == "__main__":
    main()

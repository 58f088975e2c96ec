"""Edge upgrade throughput: a device upgrading its encrypted gallery in place, against
(a) the bare ONNX Runtime transform of the same rows and (b) re-embedding them from images.

    python benchmarks/edge_upgrade.py                      # 1,000,000 rows (the acceptance size)
    python benchmarks/edge_upgrade.py --rows 200000 --markdown BENCHMARKS-edge.md
    python benchmarks/edge_upgrade.py --dim 1280 --side-dim 128 --adapters fct,fct-int8   # real image widths

``--dim`` sets φ's width (old and new), ``--side-dim`` ψ's (both 128 by default); the FCT
mixer keeps the kit's default widths at any φ (``FCTConfig``: branches 256, mixer 2048).

For each adapter (the FCT mixer at the paper's widths — branches 256, mixer 2048, 128-d φ
and ψ, 11.4 MFLOP/row —, that mixer quantised to int8 as ``fctkit export --quantize int8``
ships it, and a 128x128 linear map) a device gallery of N random sealed rows
is built (not timed), then:

* bare: one ONNX Runtime session runs the adapter over the same N rows, already decrypted in
  memory, at the same batch size and threads (measured before and after the upgrade; mean);
* upgrade: ``Device.upgrade(bundle)`` end to end — bundle verification, then per batch
  read + decrypt the rows' blocks + transform + seal a new block + one SQLite commit, then the
  switch commit.

The ratio upgrade/bare is the target. Two floors put it in context: the *per-row sealed* floor
(the per-row sealing and SQLite writes of a one-record-per-vector store, the gallery's layout
before schema 5, nothing else)
and the *bulk* floor (AES-GCM in 1 MiB records + one fsync'd sequential write: what any
encrypted durable store pays, whatever its layout); bare / (bare + bulk floor) is the best
ratio any encrypted, durable upgrade could reach on this machine. Re-embedding: a ResNet-50 with a 128-d head
(the FCT paper's backbone, 224x224 images, random weights: cost does not depend on them)
exported to ONNX, per image on the same machine; the ratio is re-embed time per row over
FCT upgrade time per row (target ≥ 100). Torch is needed only to export the ResNet-50
(``--skip-reembed`` avoids it). Timings vary with load on shared machines: read the ratios.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import itertools
import os
import shutil
import sqlite3
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from tqdm import tqdm

from fctkit.edge_runtime import Device, DeviceSettings, NewRow, VersionTag
from fctkit.edge_runtime.crypto import Sealer

D_OLD = D_NEW = D_SIDE = 128
IMAGE_DIM = 16
FLOOR_BYTES = 1 << 29  # the floors are measured on at most this many bytes of embeddings, then scaled


@dataclasses.dataclass(frozen=True)
class Dims:
    """Widths of the benchmark's spaces: φ (old and new, equal) and ψ."""

    embedding: int = D_OLD
    side: int = D_SIDE

    def __str__(self) -> str:
        return f"{self.embedding}-d φ, {self.side}-d ψ"


DEFAULT_DIMS = Dims()


# --------------------------------------------------------------------------- graphs


def _save(path: Path, nodes, inputs: dict[str, int], output: str, out_dim: int, weights: dict[str, np.ndarray]) -> Path:
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    graph = helper.make_graph(
        nodes,
        path.stem,
        [helper.make_tensor_value_info(n, TensorProto.FLOAT, ["batch", d]) for n, d in inputs.items()],
        [helper.make_tensor_value_info(output, TensorProto.FLOAT, ["batch", out_dim])],
        initializer=[numpy_helper.from_array(w.astype(np.float32), n) for n, w in weights.items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def _mlp(rng, prefix: str, x: str, dims: list[int], weights: dict, nodes: list, last_relu: bool) -> str:
    from onnx import helper

    for i, (d_in, d_out) in enumerate(itertools.pairwise(dims)):
        w, b, y = f"{prefix}W{i}", f"{prefix}b{i}", f"{prefix}y{i}"
        weights[w] = rng.standard_normal((d_in, d_out)) * np.sqrt(2.0 / d_in)
        weights[b] = np.zeros(d_out)
        nodes.append(helper.make_node("Gemm", [x, w, b], [y]))
        x = y
        if i < len(dims) - 2 or last_relu:
            nodes.append(helper.make_node("Relu", [x], [f"{y}r"]))
            x = f"{y}r"
    return x


def fct_graph(path: Path, seed: int, dims: Dims = DEFAULT_DIMS) -> Path:
    """h(φ, ψ) at the kit's default FCTConfig widths: two Lin-ReLU-Lin-ReLU branches (256),
    concat, mixer 512→2048→2048→φ (BN folded)."""
    from onnx import helper

    rng, weights, nodes = np.random.default_rng(seed), {}, []
    a = _mlp(rng, "old_", "old", [dims.embedding, 256, 256], weights, nodes, last_relu=True)
    b = _mlp(rng, "side_", "side", [dims.side, 256, 256], weights, nodes, last_relu=True)
    nodes.append(helper.make_node("Concat", [a, b], ["joined"], axis=1))
    out = _mlp(rng, "mix_", "joined", [512, 2048, 2048, dims.embedding], weights, nodes, last_relu=False)
    nodes.append(helper.make_node("Identity", [out], ["embedding"]))
    return _save(path, nodes, {"old": dims.embedding, "side": dims.side}, "embedding", dims.embedding, weights)


def fct_flops_per_row(dims: Dims) -> int:
    """Multiply-adds x 2 of :func:`fct_graph` for one row."""
    layers = [
        (dims.embedding, 256),
        (256, 256),
        (dims.side, 256),
        (256, 256),
        (512, 2048),
        (2048, 2048),
        (2048, dims.embedding),
    ]
    return 2 * sum(a * b for a, b in layers)


def linear_graph(path: Path, inputs: dict[str, int], out_dim: int, output: str, seed: int) -> Path:
    from onnx import helper

    rng, weights, nodes = np.random.default_rng(seed), {}, []
    x = next(iter(inputs))
    out = _mlp(rng, "lin_", x, [inputs[x], out_dim], weights, nodes, last_relu=False)
    nodes.append(helper.make_node("Identity", [out], [output]))
    return _save(path, nodes, inputs, output, out_dim, weights)


def adapter_graph(folder: Path, adapter: str, dims: Dims = DEFAULT_DIMS) -> Path:
    """The forward graph of ``adapter`` ("fct", "fct-int8", "linear") in ``folder`` as h.onnx;
    fct-int8 is the fct graph quantised as ``fctkit export --quantize int8`` does it."""
    if adapter == "linear":
        return linear_graph(folder / "h.onnx", {"old": dims.embedding}, dims.embedding, "embedding", 7)
    fp32 = fct_graph(folder / ("h.onnx" if adapter == "fct" else "h-fp32.onnx"), 7, dims)
    if adapter == "fct":
        return fp32
    from fctkit.export.quantize import quantize_graph

    return quantize_graph(fp32, folder / "h.onnx", "int8")


def int8_output_error(folder: Path, rows: int = 20_000, dims: Dims = DEFAULT_DIMS) -> dict:
    """How far the int8 mixer's outputs are from fp32's on the same random rows: the median
    and worst relative L2 error and the mean cosine between the two (accuracy on a real task
    is the export gate's: see BENCHMARKS.md)."""
    from fctkit.export.onnx_export import run_onnx

    rng = np.random.default_rng(3)
    inputs = [
        rng.standard_normal((rows, dims.embedding), dtype=np.float32),
        rng.standard_normal((rows, dims.side), dtype=np.float32),
    ]
    fp32, int8 = (run_onnx(folder / name, inputs)[0] for name in ("h-fp32.onnx", "h.onnx"))
    error = np.linalg.norm(int8 - fp32, axis=1) / np.linalg.norm(fp32, axis=1)
    cosine = np.sum(int8 * fp32, axis=1) / (np.linalg.norm(int8, axis=1) * np.linalg.norm(fp32, axis=1))
    return {
        "median_relative_error": float(np.median(error)),
        "max_relative_error": float(error.max()),
        "mean_cosine": float(cosine.mean()),
    }


def build_bundles(
    folder: Path, adapter: str, key, *, dims: Dims = DEFAULT_DIMS, v2_extra: tuple = (), **v2_declarations
) -> tuple[Path, Path]:
    """Bundles v1 and v2 (forward 1 -> 2 by ``adapter``) at ``dims``; ``v2_extra`` artifact
    sources and ``v2_declarations`` (transition=, hubness=) go into v2."""
    from fctkit.export.bundle_builder import ArtifactSource, build_bundle

    folder.mkdir(parents=True, exist_ok=True)

    def base(version: int) -> list[ArtifactSource]:
        return [
            ArtifactSource(
                linear_graph(
                    folder / f"embed{version}.onnx", {"image": IMAGE_DIM}, dims.embedding, "embedding", version
                ),
                "embed",
            ),
            ArtifactSource(
                linear_graph(
                    folder / f"side{version}.onnx", {"image": IMAGE_DIM}, dims.side, "side_info", 10 + version
                ),
                "side_info",
            ),
        ]

    h = adapter_graph(folder, adapter, dims)
    common = {"mode": "forward", "distance": "cosine", "normalize": True, "private_key": key}
    v1 = build_bundle(
        folder / "v1", version=1, parents=(), artifacts=base(1), gate={"cases": {}, "ecc": {}}, **common
    ).root
    sources = [*base(2), ArtifactSource(h, "forward", 1, 2), *v2_extra]
    v2 = build_bundle(
        folder / "v2",
        version=2,
        parents=(1,),
        artifacts=sources,
        gate={"cases": {}, "ecc": {"forward_1_to_2": True}},
        **common,
        **v2_declarations,
    ).root
    return v1, v2


# --------------------------------------------------------------------------- measurements


def fill(device: Device, rows: int, seed: int, chunk: int = 20_000, dims: Dims = DEFAULT_DIMS) -> float:
    rng = np.random.default_rng(seed)
    start = time.perf_counter()
    tag = VersionTag(1, 1, "native")
    for first in tqdm(range(0, rows, chunk), desc="fill gallery", unit="chunk", file=sys.stderr):
        n = min(chunk, rows - first)
        emb = rng.standard_normal((n, dims.embedding), dtype=np.float32)
        side = rng.standard_normal((n, dims.side), dtype=np.float32)
        device.gallery.add_rows([NewRow(f"r{first + i:08d}", emb[i], side[i]) for i in range(n)], tag)
    return time.perf_counter() - start


def filled_device(work: Path, key, pub: Path, rows: int, seed: int, dims: Dims = DEFAULT_DIMS) -> Device:
    """A device at v1 (linear bundles built in ``work/bundles``) with ``rows`` random rows."""
    v1, _ = build_bundles(work / "bundles", "linear", key, dims=dims)
    device = Device.init(work / "device", publisher_key=pub, settings=DeviceSettings(batch_size=1024))
    device.progress = False
    device.install_bundle(v1)
    device.gallery.set_meta({"query_version": "1"})
    fill(device, rows, seed=seed, dims=dims)
    return device


def bare_transform_seconds(model: Path, inputs: list[np.ndarray], batch: int, threads: int) -> float:
    import onnxruntime as ort

    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(model), sess_options=options, providers=["CPUExecutionProvider"])
    names = [i.name for i in session.get_inputs()]
    session.run(None, {n: x[:batch] for n, x in zip(names, inputs)})  # warm-up
    start = time.perf_counter()
    for first in range(0, len(inputs[0]), batch):
        session.run(None, {n: x[first : first + batch] for n, x in zip(names, inputs)})
    return time.perf_counter() - start


def sealed_store_floor_seconds(embeddings: np.ndarray, side_infos: np.ndarray, folder: Path) -> float:
    """The least work the encrypted gallery's contract asks per upgraded row, done in bulk: open the
    row's two sealed vectors, seal the two new ones (AES-256-GCM, fresh nonce, per-record
    authenticated data) and write them to SQLite (WAL) in one transaction. No transform, no
    version guards, no change log: what any one-record-per-vector store must pay on this machine."""
    sealer = Sealer(bytes(32))
    aads = [f"gallery|{i}|r{i:08d}|1|2|forward|".encode() for i in range(len(embeddings))]
    old = [
        sealer.seal_many([r.tobytes() for r in block], [a + field for a in aads])
        for block, field in ((embeddings, b"embedding"), (side_infos, b"side_info"))
    ]
    path = folder / "floor.sqlite3"
    for stale in (path, path.with_name(path.name + "-wal"), path.with_name(path.name + "-shm")):
        stale.unlink(missing_ok=True)
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("CREATE TABLE vectors (row_id INTEGER PRIMARY KEY, embedding BLOB, side_info BLOB)")
    start = time.perf_counter()
    opened = [
        [sealer.open(r, a + field) for r, a in zip(records, aads)]
        for records, field in zip(old, (b"embedding", b"side_info"))
    ]
    sealed = [
        sealer.seal_many(plain, [a + field for a in aads]) for plain, field in zip(opened, (b"embedding", b"side_info"))
    ]
    db.execute("BEGIN")
    db.executemany("INSERT INTO vectors VALUES (?, ?, ?)", zip(range(len(aads)), *sealed))
    db.execute("COMMIT")
    seconds = time.perf_counter() - start
    db.close()
    return seconds


def bulk_floor_seconds(embeddings: np.ndarray, folder: Path, chunk_bytes: int = 1 << 20) -> float:
    """The least work *any* encrypted durable store must do to replace N embeddings, whatever its
    record layout: open the old vectors and seal the new ones with AES-256-GCM in 1 MiB records
    (one call per MiB, so no per-row cost at all), then write the new ciphertext sequentially to
    one file and fsync it. Only the embeddings count (ψ unchanged, no index, no metadata)."""
    aesgcm = AESGCM(bytes(32))
    plain = embeddings.tobytes()
    chunks = [plain[i : i + chunk_bytes] for i in range(0, len(plain), chunk_bytes)]
    nonces = [i.to_bytes(12, "big") for i in range(len(chunks))]
    sealed_old = [aesgcm.encrypt(n, c, b"old") for n, c in zip(nonces, chunks)]
    path = folder / "bulk-floor.bin"
    start = time.perf_counter()
    opened = [aesgcm.decrypt(n, c, b"old") for n, c in zip(nonces, sealed_old)]
    with path.open("wb") as out:
        for n, c in zip(nonces, opened):
            out.write(aesgcm.encrypt(n, c, b"new"))
        out.flush()
        os.fsync(out.fileno())
    seconds = time.perf_counter() - start
    path.unlink()
    return seconds


def floor_sample(rows: int, dims: Dims) -> int:
    """How many rows the floors are measured on: all of them up to FLOOR_BYTES of embeddings
    (1M rows at 128-d), fewer at wider rows so that their copies fit in memory; scaled to N."""
    return min(rows, max(1, FLOOR_BYTES // (4 * dims.embedding)))


def measure_adapter(
    adapter: str, rows: int, batch: int, threads: int, work: Path, key, pub: Path, dims: Dims = DEFAULT_DIMS
) -> dict:
    v1, v2 = build_bundles(work / f"{adapter}-bundles", adapter, key, dims=dims)
    device = Device.init(
        work / f"{adapter}-device", publisher_key=pub, settings=DeviceSettings(batch_size=batch, threads=threads)
    )
    device.install_bundle(v1)
    device.gallery.set_meta({"query_version": "1"})
    fill_s = fill(device, rows, seed=1, dims=dims)
    loaded = device.gallery.load(with_labels=False)
    mixer = adapter.startswith("fct")
    inputs = [loaded.embeddings, loaded.side_infos] if mixer else [loaded.embeddings]
    model = work / f"{adapter}-bundles" / "h.onnx"
    bare = [bare_transform_seconds(model, inputs, batch, threads)]
    sample = floor_sample(rows, dims)
    floor_s = sealed_store_floor_seconds(loaded.embeddings[:sample], loaded.side_infos[:sample], work) * rows / sample
    bulk_floor_s = bulk_floor_seconds(loaded.embeddings[:sample], work) * rows / sample
    del loaded, inputs
    start = time.perf_counter()
    upgraded = device.upgrade(v2)
    upgrade_s = time.perf_counter() - start
    assert upgraded == rows and device.version == 2
    loaded = device.gallery.load(with_labels=False)  # φ_new has φ_old's width: the same cost, no copy
    inputs = [loaded.embeddings, loaded.side_infos] if mixer else [loaded.embeddings]
    bare.append(bare_transform_seconds(model, inputs, batch, threads))
    del loaded, inputs
    device.close()
    shutil.rmtree(work / f"{adapter}-device")
    bare_s = statistics.mean(bare)
    fidelity = int8_output_error(work / f"{adapter}-bundles", dims=dims) if adapter == "fct-int8" else {}
    return {
        **fidelity,
        "adapter": adapter,
        "rows": rows,
        "dims": dims,
        "fill_s": fill_s,
        "bare_s": bare_s,
        "bare_runs_s": bare,
        "upgrade_s": upgrade_s,
        "bare_rows_per_s": rows / bare_s,
        "upgrade_rows_per_s": rows / upgrade_s,
        "ratio": bare_s / upgrade_s,
        "floor_rows": sample,
        "floor_s": floor_s,
        "ceiling_ratio": (bare_s + floor_s) / upgrade_s,
        "bulk_floor_s": bulk_floor_s,
        "best_possible_ratio": bare_s / (bare_s + bulk_floor_s),
    }


def resnet50(embedding_dim: int = 128):
    import torch
    from torch import nn

    class Bottleneck(nn.Module):
        def __init__(self, c_in: int, width: int, stride: int) -> None:
            super().__init__()
            c_out = width * 4
            self.body = nn.Sequential(
                nn.Conv2d(c_in, width, 1, bias=False),
                nn.BatchNorm2d(width),
                nn.ReLU(inplace=True),
                nn.Conv2d(width, width, 3, stride, 1, bias=False),
                nn.BatchNorm2d(width),
                nn.ReLU(inplace=True),
                nn.Conv2d(width, c_out, 1, bias=False),
                nn.BatchNorm2d(c_out),
            )
            self.skip = (
                nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False), nn.BatchNorm2d(c_out))
                if stride != 1 or c_in != c_out
                else nn.Identity()
            )

        def forward(self, x):
            return torch.relu(self.body(x) + self.skip(x))

    layers, c_in = (
        [nn.Conv2d(3, 64, 7, 2, 3, bias=False), nn.BatchNorm2d(64), nn.ReLU(inplace=True), nn.MaxPool2d(3, 2, 1)],
        64,
    )
    for width, blocks, stride in ((64, 3, 1), (128, 4, 2), (256, 6, 2), (512, 3, 2)):
        for i in range(blocks):
            layers.append(Bottleneck(c_in, width, stride if i == 0 else 1))
            c_in = width * 4
    layers += [nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(c_in, embedding_dim)]
    torch.manual_seed(0)
    return nn.Sequential(*layers).eval()


def reembed_seconds_per_row(work: Path, images: int, threads: int) -> float:
    import onnxruntime as ort

    from fctkit.export.onnx_export import InputSpec, export_onnx

    path = work / "resnet50.onnx"
    export_onnx(resnet50(), [InputSpec("image", (3, 224, 224))], ["embedding"], path)
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = ort.InferenceSession(str(path), sess_options=options, providers=["CPUExecutionProvider"])
    batch = np.random.default_rng(0).standard_normal((min(16, images), 3, 224, 224), dtype=np.float32)
    session.run(None, {"image": batch[:2]})
    start, done = time.perf_counter(), 0
    while done < images:
        session.run(None, {"image": batch})
        done += len(batch)
    return (time.perf_counter() - start) / done


def markdown(results: list[dict], reembed_s: float | None, args: argparse.Namespace) -> str:
    dims = Dims(args.dim, args.side_dim)
    sample = floor_sample(args.rows, dims)
    lines = [
        f"Rows: {args.rows:,} ({dims}; FCT mixer {fct_flops_per_row(dims) / 1e6:.1f} MFLOP/row), batch {args.batch}, "
        f"ONNX Runtime threads {args.threads or 'default'}, CPU provider."
        + (f" Floors measured on the first {sample:,} rows, scaled to {args.rows:,}." if sample < args.rows else ""),
        "",
        "| adapter | bare ORT rows/s | device upgrade rows/s | upgrade / bare | per-row sealed floor rows/s "
        "| upgrade / (bare + per-row floor) | bulk floor rows/s | best possible upgrade / bare | gallery fill s |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in results:
        lines.append(
            f"| {r['adapter']} | {r['bare_rows_per_s']:,.0f} | {r['upgrade_rows_per_s']:,.0f} | {r['ratio']:.2f} "
            f"| {r['rows'] / r['floor_s']:,.0f} | {r['ceiling_ratio']:.2f} | {r['rows'] / r['bulk_floor_s']:,.0f} "
            f"| {r['best_possible_ratio']:.2f} | {r['fill_s']:.0f} |"
        )
    by_name = {r["adapter"]: r for r in results}
    if {"fct", "fct-int8"} <= set(by_name):
        fp32, int8 = by_name["fct"], by_name["fct-int8"]
        lines += [
            "",
            f"int8 FCT mixer (ONNX Runtime dynamic quantisation, int8 weights per channel) ÷ fp32, same run: "
            f"device upgrade **{int8['upgrade_rows_per_s'] / fp32['upgrade_rows_per_s']:.2f}x** rows/s (target ≥ 1.5x), "
            f"bare ORT {int8['bare_rows_per_s'] / fp32['bare_rows_per_s']:.2f}x. Outputs against fp32 on 20,000 random rows: "
            f"median relative L2 error {int8['median_relative_error']:.4f}, worst {int8['max_relative_error']:.4f}, "
            f"mean cosine {int8['mean_cosine']:.5f}.",
        ]
    if reembed_s is not None:
        fct = next(r for r in results if r["adapter"] == "fct")
        per_row = fct["upgrade_s"] / fct["rows"]
        lines += [
            "",
            f"Re-embedding with ResNet-50-128 (224x224, ONNX Runtime): {1 / reembed_s:,.1f} images/s, "
            f"{reembed_s * 1e3:.1f} ms per row; FCT upgrade {per_row * 1e6:.1f} µs per row: "
            f"**{reembed_s / per_row:,.0f}x cheaper** (target ≥ 100x).",
        ]
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def bench_workspace(prefix: str):
    """A scratch folder, a fixed publisher key and its public key file; removed afterwards."""
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from fctkit.export.keys import save_public_key

    work = Path(tempfile.mkdtemp(prefix=prefix))
    try:
        key = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
        yield work, key, save_public_key(key.public_key(), work / "publisher.pub")
    finally:
        shutil.rmtree(work, ignore_errors=True)


def emit(text: str, markdown_path: Path | None) -> None:
    """Print a result table, and write it to ``markdown_path`` when given."""
    print(text)
    if markdown_path:
        markdown_path.write_text(text)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--batch", type=int, default=1024)
    parser.add_argument("--threads", type=int, default=0)
    parser.add_argument("--dim", type=int, default=D_OLD, help="Width of φ (old and new).")
    parser.add_argument("--side-dim", type=int, default=D_SIDE, help="Width of the side-info ψ.")
    parser.add_argument(
        "--adapters",
        default="fct,fct-int8,linear",
        help="Comma-separated: fct (the FCT mixer), fct-int8 (it, quantised to int8), linear.",
    )
    parser.add_argument("--reembed-images", type=int, default=32)
    parser.add_argument("--skip-reembed", action="store_true")
    parser.add_argument("--markdown", type=Path, help="Also write the table to this file.")
    args = parser.parse_args(argv)
    with bench_workspace("fctkit-edge-upgrade-") as (work, key, pub):
        results = []
        for adapter in args.adapters.split(","):
            result = measure_adapter(
                adapter, args.rows, args.batch, args.threads, work, key, pub, Dims(args.dim, args.side_dim)
            )
            print(
                f"{adapter}: bare {result['bare_rows_per_s']:,.0f} rows/s, upgrade {result['upgrade_rows_per_s']:,.0f} rows/s, "
                f"ratio {result['ratio']:.2f}, vs bare + per-row sealed floor {result['ceiling_ratio']:.2f}, "
                f"best possible for any encrypted durable store {result['best_possible_ratio']:.2f} (bare runs {', '.join(f'{s:.1f}' for s in result['bare_runs_s'])} s)",
                flush=True,
            )
            results.append(result)
        reembed = None if args.skip_reembed else reembed_seconds_per_row(work, args.reembed_images, args.threads)
        emit(markdown(results, reembed, args), args.markdown)


if __name__ == "__main__":
    main()

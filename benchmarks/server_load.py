"""Server load: many devices download one big bundle artifact at once.

    python benchmarks/server_load.py                       # 200 clients x 25 MiB
    python benchmarks/server_load.py --clients 20 --size-mib 5   # a quick run

One `fctkit serve` process publishes a signed bundle whose embed artifact is a ~25 MiB ONNX
graph; ``--clients`` enrolled devices (one gRPC channel each, spread over ``--workers``
processes of threads) download it at the same time with the client library
(``FctkitClient.fetch_artifact``: 1 MiB chunks unless ``--chunk-kib``, SHA-256 checked). Every download must
complete with the right hash.

Baseline, measured in the same run with the same client processes and threads: a plain
grpc.aio server process streaming the same bytes from memory in chunks of the same size
(raw bytes messages: no protobuf, auth, storage or logging), each client hashing what it
receives. The printed ratio is fctkit's aggregate MiB/s over the baseline's (target >= 0.5).
All traffic goes to 127.0.0.1. The figures and the command are written to
BENCHMARKS-server.md (``--markdown``).
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import multiprocessing
import os
import platform
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PLAIN_METHOD = "/bench.Plain/Stream"


class _HashingSink:
    """A write-only sink: the client library hashes the bytes itself, nothing is kept."""

    def write(self, data: bytes) -> int:
        return len(data)


# -- the two servers -------------------------------------------------------------------------


def weights_bundle(folder: Path, size_mib: float, key) -> Path:
    """A signed, packed v1 bundle whose embed graph is one MatMul holding ``size_mib`` MiB of
    float32 weights (8 outputs)."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from fctkit.export.bundle_builder import ArtifactSource, build_bundle
    from fctkit.protos.bundle import pack_bundle

    out_dim = 8
    in_dim = max(1, int(size_mib * (1 << 20) / 4 / out_dim))
    weight = np.random.default_rng(0).standard_normal((in_dim, out_dim)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["image", "W"], ["embedding"])],
        "big",
        [helper.make_tensor_value_info("image", TensorProto.FLOAT, ["batch", in_dim])],
        [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["batch", out_dim])],
        initializer=[numpy_helper.from_array(weight, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    folder.mkdir(parents=True, exist_ok=True)
    onnx.save(model, str(folder / "embed.onnx"))
    bundle = build_bundle(
        folder / "bundle",
        version=1,
        parents=(),
        mode="forward",
        distance="cosine",
        normalize=True,
        artifacts=[ArtifactSource(folder / "embed.onnx", "embed")],
        gate={"cases": {}, "ecc": {}},
        private_key=key,
    )
    return pack_bundle(bundle.root, folder / "bundle.tar")


def _start_fctkit_server(folder: Path, public_key_path: Path, token_file: Path) -> tuple[subprocess.Popen, int]:
    log = folder / "server.log"
    command = [
        sys.executable,
        "-m",
        "fctkit.cli",
        "serve",
        "--data",
        str(folder / "data"),
        "--port",
        "0",
        "--publisher-key",
        str(public_key_path),
        "--admin-token-file",
        str(token_file),
    ]
    process = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=log.open("w"))
    port = _wait_for_port(process, log)
    return process, port


def _wait_for_port(process: subprocess.Popen, log: Path) -> int:
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise SystemExit(f"server exited:\n{log.read_text()}")
        for line in log.read_text().splitlines():
            if line.startswith("{") and json.loads(line).get("event") == "listening":
                return json.loads(line)["port"]
        time.sleep(0.05)
    raise SystemExit("server did not start in 60 s")


def _plain_server(data_path: str, chunk: int, ready: multiprocessing.Queue) -> None:
    """A bare grpc.aio server streaming the file's bytes (held in memory) in ``chunk``-byte messages."""
    import grpc

    payload = Path(data_path).read_bytes()

    async def stream(request, context):
        for start in range(0, len(payload), chunk):
            yield payload[start : start + chunk]

    async def main() -> None:
        server = grpc.aio.server(options=[("grpc.so_reuseport", 0)])
        handler = grpc.method_handlers_generic_handler(
            "bench.Plain", {"Stream": grpc.unary_stream_rpc_method_handler(stream)}
        )
        server.add_generic_rpc_handlers((handler,))
        ready.put(server.add_insecure_port("127.0.0.1:0"))
        await server.start()
        stop = asyncio.Event()
        asyncio.get_running_loop().add_signal_handler(signal.SIGTERM, stop.set)
        await stop.wait()
        await server.stop(1)

    asyncio.run(main())


# -- the clients -------------------------------------------------------------------------------


def _client_worker(
    kind: str,
    target: str,
    tokens: list[str],
    expected_sha256: str,
    size: int,
    chunk: int,
    start: multiprocessing.Barrier,
    results: multiprocessing.Queue,
) -> None:
    """``len(tokens)`` concurrent clients in threads, one channel each, released together."""
    import grpc

    from fctkit.protos.client import FctkitClient, RetryPolicy

    outcomes: list[tuple[bool, float, float]] = []
    lock = threading.Lock()
    ready = threading.Barrier(len(tokens) + 1)

    def one_client(token: str) -> None:
        if kind == "fctkit":
            client = FctkitClient(target, token, retry=RetryPolicy(attempts=3), chunk_size=chunk)
            grpc.channel_ready_future(client._channel).result(timeout=60)
        else:
            channel = grpc.insecure_channel(target)
            grpc.channel_ready_future(channel).result(timeout=60)
        ready.wait()
        began = time.monotonic()
        try:
            if kind == "fctkit":
                transfer = client.fetch_artifact(1, "embed", _HashingSink())  # raises unless the SHA-256 matches
                ok = transfer.sha256 == expected_sha256 and transfer.size == size
            else:
                digest, received = hashlib.sha256(), 0
                for message in channel.unary_stream(PLAIN_METHOD)(b""):
                    digest.update(message)
                    received += len(message)
                ok = digest.hexdigest() == expected_sha256 and received == size
        except Exception as exc:  # reported as a failed download, never hidden
            print(f"client failed: {exc}", file=sys.stderr)
            ok = False
        ended = time.monotonic()
        with lock:
            outcomes.append((ok, began, ended))
        (client if kind == "fctkit" else channel).close()

    threads = [threading.Thread(target=one_client, args=(t,)) for t in tokens]
    for thread in threads:
        thread.start()
    ready.wait()
    start.wait()
    for thread in threads:
        thread.join()
    results.put(outcomes)


def _run_clients(
    kind: str, target: str, tokens: list[str], workers: int, expected_sha256: str, size: int, chunk: int
) -> dict:
    ctx = multiprocessing.get_context("spawn")
    start, results = ctx.Barrier(workers), ctx.Queue()
    shares = [tokens[i::workers] for i in range(workers)]
    processes = [
        ctx.Process(target=_client_worker, args=(kind, target, share, expected_sha256, size, chunk, start, results))
        for share in shares
    ]
    for process in processes:
        process.start()
    outcomes = [o for _ in processes for o in results.get(timeout=3600)]
    for process in processes:
        process.join()
    began, ended = min(o[1] for o in outcomes), max(o[2] for o in outcomes)
    ok = sum(o[0] for o in outcomes)
    return {
        "clients": len(outcomes),
        "ok": ok,
        "seconds": ended - began,
        "mib_per_s": ok * size / (1 << 20) / (ended - began),
    }


# -- main --------------------------------------------------------------------------------------


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clients", type=int, default=200)
    parser.add_argument("--size-mib", type=float, default=25.0, help="size of the downloaded artifact")
    parser.add_argument("--workers", type=int, default=max(1, min(4, os.cpu_count() or 1)), help="client processes")
    parser.add_argument(
        "--chunk-kib", type=int, default=1024, help="bytes per streamed message, both servers (at most 1024)"
    )
    parser.add_argument(
        "--rounds", type=int, default=1, help="alternate baseline/fctkit this many times; sums are compared"
    )
    parser.add_argument("--markdown", default="BENCHMARKS-server.md", help="where to write the figures ('' to skip)")
    args = parser.parse_args()

    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

    from fctkit.export.keys import save_public_key
    from fctkit.protos.bundle import Manifest
    from fctkit.protos.client import FctkitClient

    with tempfile.TemporaryDirectory(prefix="fctkit-load-") as tmp:
        folder = Path(tmp)
        key = Ed25519PrivateKey.from_private_bytes(bytes(range(32)))
        public_key_path = save_public_key(key.public_key(), folder / "publisher.pub")
        token_file = folder / "admin.token"
        token_file.write_text("fcta_" + "benchmark-admin-token-" * 3)
        archive = weights_bundle(folder, args.size_mib, key)
        server, port = _start_fctkit_server(folder, public_key_path, token_file)
        ctx = multiprocessing.get_context("spawn")
        plain_port = ctx.Queue()
        embed_path = folder / "bundle" / "embed.onnx"
        chunk = args.chunk_kib * 1024
        plain = ctx.Process(target=_plain_server, args=(str(embed_path), chunk, plain_port))
        plain.start()
        try:
            target, plain_target = f"127.0.0.1:{port}", f"127.0.0.1:{plain_port.get(timeout=60)}"
            with FctkitClient(target, token_file.read_text()) as admin:
                info = admin.publish_bundle(archive)
                tokens = [
                    FctkitClient(target).enrol(admin.create_enrolment_code().code, f"load-{i}").token
                    for i in range(args.clients)
                ]
                manifest = Manifest.from_bytes(admin.get_manifest(info.version)[0])
            embed = manifest.artifact("embed")
            print(
                f"{args.clients} clients x {embed.size / (1 << 20):.1f} MiB, {args.workers} client processes, "
                f"{os.cpu_count()} CPUs",
                flush=True,
            )
            runs: dict[str, list[dict]] = {"plain": [], "fctkit": []}
            for _ in range(args.rounds):
                for kind, where in (("plain", plain_target), ("fctkit", target)):
                    run = _run_clients(kind, where, tokens, args.workers, embed.sha256, embed.size, chunk)
                    runs[kind].append(run)
                    print(
                        f"  {kind:7s} {run['ok']}/{run['clients']} ok  {run['seconds']:6.1f} s  {run['mib_per_s']:7.1f} MiB/s",
                        flush=True,
                    )
        finally:
            server.send_signal(signal.SIGTERM)
            server.wait(60)
            plain.terminate()
            plain.join(30)
    rate = {k: sum(r["ok"] for r in v) * embed.size / (1 << 20) / sum(r["seconds"] for r in v) for k, v in runs.items()}
    all_ok = all(r["ok"] == r["clients"] == args.clients for v in runs.values() for r in v)
    ratio = rate["fctkit"] / rate["plain"]
    print(
        f"fctkit {rate['fctkit']:.1f} MiB/s vs plain gRPC {rate['plain']:.1f} MiB/s: ratio {ratio:.2f} "
        f"(target >= 0.5); every download verified: {all_ok}"
    )
    if args.markdown:
        _write_markdown(args, embed.size, runs, rate, ratio, all_ok)
    sys.exit(0 if all_ok else 1)


def _write_markdown(args, size: int, runs: dict, rate: dict, ratio: float, all_ok: bool) -> None:
    command = "python benchmarks/server_load.py " + shlex.join(sys.argv[1:])
    lines = [
        "## Server load: concurrent bundle downloads",
        "",
        f"`{command.strip()}` — {time.strftime('%Y-%m-%d')}, {platform.machine()}, {os.cpu_count()} CPUs "
        "(shared with other work: absolute MiB/s vary with load, the ratio much less).",
        "",
        f"{args.clients} enrolled devices, one gRPC channel each ({args.workers} client processes of threads), download "
        f"the same {size / (1 << 20):.1f} MiB artifact at once from one `fctkit serve` process with the client library "
        f"({args.chunk_kib} KiB chunks, SHA-256 checked). Baseline in the same run: a bare grpc.aio server streaming "
        f"the same bytes from memory in {args.chunk_kib} KiB raw messages to the same clients, which hash them too.",
        "",
        "| server | downloads ok | seconds | aggregate MiB/s |",
        "|---|---|---|---|",
    ]
    for kind, label in (("plain", "plain gRPC stream (baseline)"), ("fctkit", "fctkit Registry.DownloadArtifact")):
        for run in runs[kind]:
            lines.append(f"| {label} | {run['ok']}/{run['clients']} | {run['seconds']:.1f} | {run['mib_per_s']:.1f} |")
    lines += [
        "",
        f"**Ratio fctkit / plain: {ratio:.2f}** (target >= 0.5); every download verified: {'yes' if all_ok else 'NO'}.",
        "",
    ]
    Path(args.markdown).write_text("\n".join(lines))
    print(f"wrote {args.markdown}")


if __name__ == "__main__":
    main()

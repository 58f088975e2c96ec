"""What the root of trust costs a sync (issue 35): the chain walk and the timestamp check a
device runs before every download, against a no-op sync, in the same run.

    python benchmarks/trust_sync_cost.py                 # 40 rounds
    python benchmarks/trust_sync_cost.py --rounds 100 --markdown out.md

Two real `fctkit serve` processes on loopback, each with v1 published: one started with a root
(`--root`, `--timestamp-key`), one with the bare publisher key (as before roots). One device
enrolled on each (by the root's fingerprint / pinning the key), v1 installed, 1,000 rows, an
owner (so a sync also pulls and pushes the replica: nothing to move). Timed, interleaved:

* no-op sync: ``Device.sync()`` with nothing new, on each device;
* trust refresh: what the root device adds to each sync (``refresh_trust``: GetTrust, walk,
  timestamp check, and writing the accepted state), on an open client;
* trust check: the same verification on bytes already received (no RPC, no write);
* bytes: the GetTrust answer on a sync (no new root), and with one new root to walk.

Read the ratios: CPU timings here vary with load.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _loopback import LoopbackServer, report  # noqa: E402
from edge_backfill_cost import PIXELS, build_bundles  # noqa: E402

from fctkit.edge_runtime import Device, DeviceSettings  # noqa: E402
from fctkit.edge_runtime.device_trust_sync import accept, refresh_trust  # noqa: E402
from fctkit.protos import registry_pb2  # noqa: E402

ROWS = 1000


def median_ms(run, rounds: int) -> float:
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def ready_device(server: LoopbackServer, folder: Path, bundle: Path, **enrol) -> Device:
    server.publish(bundle)
    pinned = {} if server.fingerprint else {"publisher_key": server.publisher_pub}
    device = Device.init(folder, settings=DeviceSettings(), **pinned)
    device.progress = False
    device.enrol(server.target, server.code("bench"), **({"root_fingerprint": server.fingerprint} if server.fingerprint else {}))
    assert device.sync().installed_after == 1
    images = np.random.default_rng(0).integers(0, 256, (ROWS, PIXELS)).astype(np.float32) / 255
    device.add(images, item_ids=[f"i{k:05d}" for k in range(ROWS)])
    device.sync()
    return device


def trust_answer_bytes(device: Device, after: int) -> int:
    with device.client() as client:
        answer = client.registry.GetTrust(registry_pb2.GetTrustRequest(after_root_version=after), metadata=client._metadata)
    return answer.ByteSize()


def measure(rounds: int, work: Path) -> dict:
    with LoopbackServer(work / "rooted", root_of_trust=True) as rooted, LoopbackServer(work / "legacy") as legacy:
        v1, _ = build_bundles(work / "bundles", rooted.key)
        root_device = ready_device(rooted, work / "root-device", v1)
        legacy_v1, _ = build_bundles(work / "legacy-bundles", legacy.key)
        key_device = ready_device(legacy, work / "key-device", legacy_v1)
        sync_root, sync_key = [], []
        for _ in range(rounds):  # interleaved: load changes hit both alike
            sync_root.append(median_ms(root_device.sync, 1))
            sync_key.append(median_ms(key_device.sync, 1))
        with root_device.client() as client:
            refresh_ms = median_ms(lambda: refresh_trust(root_device.trust, client), rounds)
            update = client.get_trust(root_device.trust.current_root().body.version)
        trust, state = root_device.trust, root_device.trust.state()
        check_ms = median_ms(lambda: accept(trust, trust.current_root(), update.roots, update.timestamp,
                                            state.timestamp_version, start_is_new=False), rounds)
        steady_bytes = trust_answer_bytes(root_device, state.root_version)
        one_root_bytes = trust_answer_bytes(root_device, 0)  # root.1 offered again: the size of one root
        root_device.close()
        key_device.close()
    sync_root_ms, sync_key_ms = statistics.median(sync_root), statistics.median(sync_key)
    return {
        "rounds": rounds, "rows": ROWS, "noop_sync_root_ms": sync_root_ms, "noop_sync_key_ms": sync_key_ms,
        "trust_refresh_ms": refresh_ms, "trust_check_ms": check_ms,
        "refresh_over_noop_sync": refresh_ms / sync_root_ms, "check_over_noop_sync": check_ms / sync_root_ms,
        "root_sync_over_key_sync": sync_root_ms / sync_key_ms,
        "get_trust_bytes_per_sync": steady_bytes, "get_trust_bytes_with_one_root": one_root_bytes,
    }


def markdown(r: dict) -> str:
    return "\n".join([
        f"| per sync ({r['rounds']} rounds, {r['rows']:,} rows, medians) | ms | ÷ no-op sync (root device) |",
        "| --- | --- | --- |",
        f"| no-op sync, device with a root | {r['noop_sync_root_ms']:.1f} | 1 |",
        f"| no-op sync, device pinning one key (legacy server) | {r['noop_sync_key_ms']:.1f} | "
        f"{r['noop_sync_key_ms'] / r['noop_sync_root_ms']:.3f} |",
        f"| trust refresh (GetTrust, walk, timestamp, state written) | {r['trust_refresh_ms']:.2f} | "
        f"{r['refresh_over_noop_sync']:.3f} |",
        f"| trust check alone (bytes in hand) | {r['trust_check_ms']:.2f} | {r['check_over_noop_sync']:.3f} |",
        "",
        f"GetTrust answer per sync: {r['get_trust_bytes_per_sync']:,} B; with one root to walk: "
        f"{r['get_trust_bytes_with_one_root']:,} B.",
    ])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=40)
    parser.add_argument("--markdown", type=Path, default=None, help="Also append the table to this file.")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="fctkit-trust-bench-") as tmp:
        result = measure(args.rounds, Path(tmp))
    report(result, markdown(result), args.markdown)
    return 0


if __name__ == "__main__":
    sys.exit(main())

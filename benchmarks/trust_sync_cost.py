"""What the root of trust costs a sync (issue 35): the chain walk and the timestamp check a
device runs before every download, against a no-op sync, in the same run.

    python benchmarks/trust_sync_cost.py                 # 40 rounds
    python benchmarks/trust_sync_cost.py --rounds 100 --markdown out.md

Two real `fctkit serve` processes on loopback, each with v1 published: one started with a root
(`--root`, `--timestamp-key`), one with the bare publisher key (as before roots). One device
enrolled on each (by the root's fingerprint / pinning the key), v1 installed, 1,000 rows, an
owner (so a sync also pulls and pushes the replica: nothing to move). Timed, interleaved:

* no-op sync: ``Device.sync()`` with nothing new, on each device: their difference is what the
  root costs a sync (its ListVersions answer carries the timestamp, so no extra round trip);
* trust from the listing: what the root device does with that answer (``refresh_trust`` with the
  listing: the timestamp checked, the accepted state kept), on bytes in hand;
* trust through GetTrust: the same with its own round trip, as a sync does when the root changed;
* trust check alone: the walk and timestamp verification of those bytes (no state kept);
* bytes: what the timestamp adds to a ListVersions answer, and a GetTrust answer with one root.

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
from _loopback import LoopbackServer, report
from edge_backfill_cost import PIXELS, build_bundles

from fctkit.edge_runtime import Device, DeviceSettings
from fctkit.edge_runtime.device_trust_sync import accept, refresh_trust
from fctkit.protos import registry_pb2

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
    device.enrol(
        server.target, server.code("bench"), **({"root_fingerprint": server.fingerprint} if server.fingerprint else {})
    )
    assert device.sync().installed_after == 1
    images = np.random.default_rng(0).integers(0, 256, (ROWS, PIXELS)).astype(np.float32) / 255
    device.add(images, item_ids=[f"i{k:05d}" for k in range(ROWS)])
    device.sync()
    return device


def listing_answer_bytes(device: Device) -> int:
    with device.client() as client:
        answer = client.registry.ListVersions(
            registry_pb2.ListVersionsRequest(after_version=1), metadata=client._metadata
        )
    return answer.ByteSize()


def trust_answer_bytes(device: Device, after: int) -> int:
    with device.client() as client:
        answer = client.registry.GetTrust(
            registry_pb2.GetTrustRequest(after_root_version=after), metadata=client._metadata
        )
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
            listing = client.version_listing(1)
            listed_ms = median_ms(lambda: refresh_trust(root_device.trust, client, listing), rounds)
            refresh_ms = median_ms(lambda: refresh_trust(root_device.trust, client), rounds)
            update = client.get_trust(root_device.trust.current_root().body.version)
        trust, state = root_device.trust, root_device.trust.state()
        check_ms = median_ms(
            lambda: accept(
                trust,
                trust.current_root(),
                update.roots,
                update.timestamp,
                state.timestamp_version - 1,
                start_is_new=False,
            ),
            rounds,
        )
        listing_bytes = {
            name: listing_answer_bytes(device) for name, device in (("root", root_device), ("key", key_device))
        }
        one_root_bytes = trust_answer_bytes(root_device, 0)  # root.1 offered again: the size of one root
        root_device.close()
        key_device.close()
    sync_root_ms, sync_key_ms = statistics.median(sync_root), statistics.median(sync_key)
    return {
        "rounds": rounds,
        "rows": ROWS,
        "noop_sync_root_ms": sync_root_ms,
        "noop_sync_key_ms": sync_key_ms,
        "trust_from_listing_ms": listed_ms,
        "trust_via_get_trust_ms": refresh_ms,
        "trust_check_ms": check_ms,
        "root_sync_over_key_sync": sync_root_ms / sync_key_ms,
        "listing_over_noop_sync": listed_ms / sync_root_ms,
        "get_trust_over_noop_sync": refresh_ms / sync_root_ms,
        "check_over_noop_sync": check_ms / sync_root_ms,
        "list_versions_bytes_root": listing_bytes["root"],
        "list_versions_bytes_key": listing_bytes["key"],
        "get_trust_bytes_with_one_root": one_root_bytes,
    }


def markdown(r: dict) -> str:
    return "\n".join(
        [
            f"| per sync ({r['rounds']} rounds, {r['rows']:,} rows, medians) | ms | ÷ no-op sync (root device) |",
            "| --- | --- | --- |",
            f"| no-op sync, device with a root | {r['noop_sync_root_ms']:.2f} | 1 |",
            f"| no-op sync, device pinning one key (legacy server) | {r['noop_sync_key_ms']:.2f} | "
            f"{1 / r['root_sync_over_key_sync']:.3f} |",
            f"| trust from the ListVersions answer (timestamp checked, state kept) | {r['trust_from_listing_ms']:.3f} | "
            f"{r['listing_over_noop_sync']:.3f} |",
            f"| trust through GetTrust (when the root changed: one more round trip) | {r['trust_via_get_trust_ms']:.3f} | "
            f"{r['get_trust_over_noop_sync']:.3f} |",
            f"| walk and timestamp verification alone | {r['trust_check_ms']:.3f} | {r['check_over_noop_sync']:.3f} |",
            "",
            f"ListVersions answer: {r['list_versions_bytes_root']:,} B with a root, {r['list_versions_bytes_key']:,} B "
            f"without (+{r['list_versions_bytes_root'] - r['list_versions_bytes_key']:,} B per sync); a GetTrust answer "
            f"with one root to walk: {r['get_trust_bytes_with_one_root']:,} B.",
        ]
    )


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

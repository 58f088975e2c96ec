"""What a sync costs as releases pile up (issue 49): a real `fctkit serve` with a root of trust,
grown to 10, 100 and 1,000 published releases in one run.

    python benchmarks/release_scale.py                 # 10 / 100 / 1,000 releases
    python benchmarks/release_scale.py --sizes 10 100  # a quicker look

Each release is a tiny signed bundle (16-value images, one adapter from the release before),
published through the API. At each size, for an enrolled device that holds the current
timestamp and the latest version:

- ``no-op ListVersions``: the call a sync that finds nothing new makes (it names the timestamp
  version it holds: the answer says "unchanged" instead of carrying the timestamp), its median
  latency and its size on the wire;
- ``ListVersions with the timestamp``: the same call from a device that holds no timestamp (what
  every sync cost before the "unchanged" answer), its size and latency;
- ``first ListVersions after a publish``: the call that signs the new timestamp (one entry per
  release), median over a few publishes;
- ``start-up``: `fctkit serve` started again on the same data (it re-verifies every release).

Ratios are to the smallest size of the same run; CPU timings here vary with load.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests.*, benchmarks._loopback

from benchmarks._loopback import LoopbackServer
from fctkit.protos import registry_pb2
from fctkit.protos.bundle import pack_bundle
from fctkit.protos.client import FctkitClient
from fctkit.protos.trust import parse_timestamp
from tests.edge.conftest import make_tiny_bundle

TIMED = 30
PUBLISHES_TIMED = 3


def publish_through(server: LoopbackServer, version: int, work: Path) -> None:
    hops = ((version - 1, version),) if version > 1 else ()
    bundle = make_tiny_bundle(work / f"v{version}", server.key, version, hops)
    with server.admin() as admin:
        admin.publish_bundle(pack_bundle(bundle, work / f"v{version}.tar"))


def listing(client: FctkitClient, after: int, known: int) -> registry_pb2.ListVersionsResponse:
    request = registry_pb2.ListVersionsRequest(after_version=after, known_timestamp_version=known)
    return client._unary(client.registry.ListVersions, request)  # the raw answer, to weigh it


def median_ms(call: Callable[[], object], count: int = TIMED) -> float:
    seconds = []
    for _ in range(count + 3):
        started = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - started)
    return 1000 * statistics.median(seconds[3:])


def measure(server: LoopbackServer, token: str, releases: int) -> dict[str, float]:
    """The figures at ``releases`` published, the server started again first (timed)."""
    server.stop()
    started = time.perf_counter()
    server.start(timeout_s=600)
    startup_s = time.perf_counter() - started
    with FctkitClient(server.target, token) as device:
        full = listing(device, releases, 0)
        known = parse_timestamp(full.timestamp).body.version
        noop = listing(device, releases, known)
        assert noop.timestamp_unchanged and not noop.timestamp and not noop.versions
        return {
            "no-op ListVersions ms": median_ms(lambda: listing(device, releases, known)),
            "no-op ListVersions bytes": len(noop.SerializeToString()),
            "ListVersions with the timestamp ms": median_ms(lambda: listing(device, releases, 0)),
            "ListVersions with the timestamp bytes": len(full.SerializeToString()),
            "start-up s": startup_s,
        }


def first_listing_after_publish_ms(server: LoopbackServer, token: str, versions: range, work: Path) -> float:
    """Median latency of the ListVersions right after each publish of ``versions`` (it signs a timestamp)."""
    seconds = []
    with FctkitClient(server.target, token) as device:
        for version in versions:
            publish_through(server, version, work)
            started = time.perf_counter()
            listing(device, version, 0)
            seconds.append(time.perf_counter() - started)
    return 1000 * statistics.median(seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[10, 100, 1000], help="release counts to measure at")
    args = parser.parse_args()
    sizes = sorted(args.sizes)
    figures: dict[int, dict[str, float]] = {}
    with (
        tempfile.TemporaryDirectory(prefix="release-scale-") as tmp,
        LoopbackServer(Path(tmp), root_of_trust=True) as server,
    ):
        work = Path(tmp) / "bundles"
        with FctkitClient(server.target) as anonymous:
            token = anonymous.enrol(server.code(), "bench").token
        published = 0
        for size in sizes:
            bulk_end = size - PUBLISHES_TIMED
            for version in range(published + 1, bulk_end + 1):
                publish_through(server, version, work)
                if version % 100 == 0:
                    print(f"  {version} releases published", flush=True)
            after_publish = first_listing_after_publish_ms(server, token, range(bulk_end + 1, size + 1), work)
            published = size
            figures[size] = {**measure(server, token, size), "first ListVersions after a publish ms": after_publish}
            print(f"{size:,} releases: " + ", ".join(f"{k} {v:.2f}" for k, v in figures[size].items()), flush=True)
    print(table(figures))


def table(figures: dict[int, dict[str, float]]) -> str:
    sizes = list(figures)
    lines = [
        "| at N releases | " + " | ".join(f"{n:,}" for n in sizes) + " |",
        "|---|" + "---:|" * len(sizes),
    ]
    for name in figures[sizes[0]]:
        cells = [f"{figures[n][name]:,.2f} (×{figures[n][name] / figures[sizes[0]][name]:.2f})" for n in sizes]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()

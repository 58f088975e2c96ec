"""Upgrade planning: the cheapest chain of published adapters from one version's embedding
space to another's.

Each published bundle contributes edges into its own version: one per ``forward`` artifact
(source -> bundle version, with the ``side_forward`` of the same pair when there is one), and,
for a bundle in ``compatible`` mode (a backbone trained to be compatible, nothing to run),
an identity edge from each parent. A path is cheapest by (number of hops, bytes to download),
ties broken by the lower versions along the way, so a direct 1->3 adapter beats 1->2->3 and
the same inputs always give the same plan. The server plans over its catalogue; a device
offline over the bundles it has installed.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterable
from dataclasses import dataclass

from fctkit.protos.bundle import Artifact, Manifest


@dataclass(frozen=True)
class PlannedHop:
    source_version: int
    target_version: int
    bundle_version: int
    forward: Artifact | None  # None for an identity hop
    side_forward: Artifact | None

    @property
    def identity(self) -> bool:
        return self.forward is None

    @property
    def download_bytes(self) -> int:
        return sum(a.size for a in (self.forward, self.side_forward) if a is not None)


def upgrade_edges(manifests: Iterable[Manifest]) -> dict[int, list[PlannedHop]]:
    """Every hop the published bundles offer, by source version."""
    edges: dict[int, list[PlannedHop]] = {}
    for manifest in manifests:
        hops: list[PlannedHop] = []
        if manifest.mode == "compatible":
            hops = [PlannedHop(parent, manifest.version, manifest.version, None, None) for parent in manifest.parents]
        side = {(a.source_version, a.target_version): a for a in manifest.artifacts if a.role == "side_forward"}
        for artifact in manifest.artifacts:
            source, target = artifact.source_version, artifact.target_version
            if artifact.role == "forward" and source is not None and target is not None:  # always set on a forward
                hops.append(PlannedHop(source, target, manifest.version, artifact, side.get((source, target))))
        for hop in hops:
            edges.setdefault(hop.source_version, []).append(hop)
    return edges


def plan_upgrade(manifests: Iterable[Manifest], from_version: int, to_version: int) -> list[PlannedHop] | None:
    """The hops from ``from_version`` to ``to_version`` in order ([] when equal), or None when
    no chain of published adapters connects them."""
    if from_version == to_version:
        return []
    edges = upgrade_edges(manifests)
    # Dijkstra on (hops, bytes, versions visited); the path tuple makes ties deterministic.
    tiebreak = itertools.count()
    frontier: list[tuple[int, int, tuple[int, ...], int, tuple[PlannedHop, ...]]] = [(0, 0, (from_version,), 0, ())]
    settled: set[int] = set()
    while frontier:
        hop_count, size, path, _, hops = heapq.heappop(frontier)
        here = path[-1]
        if here == to_version:
            return list(hops)
        if here in settled:
            continue
        settled.add(here)
        for hop in edges.get(here, ()):
            if hop.target_version not in settled:
                path_there = (*path, hop.target_version)
                step = (hop_count + 1, size + hop.download_bytes, path_there, next(tiebreak), (*hops, hop))
                heapq.heappush(frontier, step)
    return None

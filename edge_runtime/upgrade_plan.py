"""An upgrade plan and the maths of one step: the hops that take each stored version to the
target (planned from every version the gallery's rows are in, by the server or over the
installed bundles), the check that every adapter on a path gets vectors of its input size, and
moving rows through their path (:func:`transform_rows`, shared by the upgrade and by replica
records that arrive from an older version)."""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from fctkit.errors import DeviceError, GalleryError, RpcStatusError

from .engine import Engine
from .gallery import Gallery
from .gallery.rows import VersionTag

if TYPE_CHECKING:
    from fctkit.protos.bundle import Artifact, Manifest
    from fctkit.protos.client import FctkitClient


@dataclass(frozen=True)
class Hop:
    """One step of a plan: the bundle holding the adapter(s); ``forward`` None for identity."""

    source: int
    target: int
    bundle: int
    forward: str | None
    side_forward: str | None


@dataclass(frozen=True)
class UpgradePlan:
    target: int
    mode: str
    hops: tuple[Hop, ...]

    def to_json(self) -> str:
        return json.dumps(
            {"target": self.target, "mode": self.mode, "hops": [asdict(h) for h in self.hops]}, sort_keys=True
        )

    @classmethod
    def from_state(cls, state: Mapping[str, Any]) -> UpgradePlan:
        return cls(state["target"], state["mode"], tuple(Hop(**h) for h in state["hops"]))

    def path_from(self, version: int) -> list[Hop]:
        """The hops that take a row tagged ``version`` to the target."""
        by_source = {h.source: h for h in self.hops}
        path: list[Hop] = []
        while version != self.target:
            if version not in by_source:
                raise GalleryError(
                    f"the upgrade plan to v{self.target} has no path from a row's v{version}; sync again"
                )
            path.append(by_source[version])
            version = by_source[version].target
        return path


def plan_to(
    gallery: Gallery,
    target: int,
    mode: str,
    find_hops: Callable[[int], list[Hop] | None],
    missing: str,
    manifest_of: Callable[[int], Any],
    fetch: Callable[[set[int]], None] | None = None,
) -> UpgradePlan:
    """One plan to ``target`` with a path from every version the gallery's rows are in (after a
    "compatible" upgrade rows keep their older tag) and from the installed version (rows added
    while the upgrade runs); hops are shared where paths meet. ``find_hops(source)`` gives a
    path or None (``missing`` says why in the error); ``fetch(bundles)`` brings the hops'
    bundles before :func:`check_plan_dims` reads them. In unified mode a source without a path
    keeps its rows (they stay comparable)."""
    sources = sorted(set(gallery.row_versions(target)) | {gallery.query_version})
    by_source: dict[int, Hop] = {}
    for source in sources:
        if source == target or source in by_source:
            continue
        hops = find_hops(source)
        if hops is None:
            if mode == "unified":
                continue
            raise DeviceError(
                f"no upgrade from v{source} to v{target}: {missing} from v{source} "
                f"({gallery.remaining(target)} row(s) wait); publish or install one, or back-fill those rows"
            )
        for hop in hops:
            by_source.setdefault(hop.source, hop)
    plan = UpgradePlan(target, mode, tuple(sorted(by_source.values(), key=lambda h: (h.source, h.target))))
    if fetch is not None:
        fetch({h.bundle for h in plan.hops})
    check_plan_dims(plan, sources, manifest_of)
    return plan


def server_hops(client: FctkitClient, target: int) -> Callable[[int], list[Hop] | None]:
    """``find_hops`` for :func:`plan_to` that asks the server (None where it has no path)."""

    def find(source: int) -> list[Hop] | None:
        try:
            planned = client.plan_upgrade(source, target)
        except RpcStatusError as exc:
            if exc.code in ("NOT_FOUND", "FAILED_PRECONDITION"):
                return None
            raise
        return [
            Hop(
                h.source_version,
                h.target_version,
                h.bundle_version,
                None if h.identity else h.forward.name,
                h.side_forward.name if h.HasField("side_forward") else None,
            )
            for h in planned.hops
        ]

    return find


def check_plan_dims(plan: UpgradePlan, sources: Sequence[int], manifest_of: Callable[[int], Any]) -> None:
    """Refuse, before any row is touched, a plan whose path from one of ``sources`` feeds an
    adapter vectors of the wrong length: after a "compatible" identity hop rows keep their
    version's dims, so a later adapter trained on the new version's longer embeddings (BT²)
    cannot take them. ``manifest_of(v)`` is version v's manifest, None when it is not on the
    device (rows replicated from a version this device never installed: their dims are then
    checked by the engine when the batch runs)."""
    covered = {h.source for h in plan.hops}
    for source in sources:
        if source == plan.target or manifest_of(source) is None or (plan.mode == "unified" and source not in covered):
            continue  # unified mode: rows without an F stay as they are
        dims = manifest_of(source).embedding_dim
        for hop in plan.path_from(source):
            if hop.forward is None:
                continue
            forward = _artifact(manifest_of(hop.bundle), hop.forward)
            wanted = forward.inputs[0].shape[-1]
            if wanted != dims:
                raise GalleryError(
                    f"rows of v{source} are {dims}-d, but the adapter v{hop.source}->v{hop.target} on their "
                    f"path to v{plan.target} takes {wanted}-d embeddings (v{hop.source}'s own); publish an "
                    f"adapter from v{source}, or back-fill those rows with v{plan.target}'s model"
                )
            dims = forward.outputs[0].shape[-1]


def transform_rows(
    plan: UpgradePlan, engines: Mapping[int, Engine], tag: VersionTag, embeddings: np.ndarray, side_infos: np.ndarray
) -> tuple[VersionTag, np.ndarray, np.ndarray]:
    """Move rows tagged ``tag`` through their path to the plan's target."""
    for hop in plan.path_from(tag.version):
        if hop.forward is not None:
            manifest = engines[hop.bundle].manifest
            forward = _artifact(manifest, hop.forward)
            new_embeddings = engines[hop.bundle].run(forward, *_inputs(forward, embeddings, side_infos))
            if hop.side_forward is not None:  # without g the side-info model is shared: ψ stays
                side = _artifact(manifest, hop.side_forward)
                side_infos = engines[hop.bundle].run(side, *_inputs(side, embeddings, side_infos))
            embeddings = new_embeddings
        tag = VersionTag(tag.origin_version, hop.target, "forward")
    return tag, embeddings, side_infos


def _artifact(manifest: Manifest, name: str) -> Artifact:
    for artifact in manifest.artifacts:
        if artifact.name == name:
            return artifact
    raise GalleryError(f"bundle v{manifest.version} has no artifact {name!r} named by the upgrade plan")


def _inputs(artifact: Artifact, embeddings: np.ndarray, side_infos: np.ndarray) -> tuple[np.ndarray, ...]:
    return (embeddings,) if len(artifact.inputs) == 1 else (embeddings, side_infos)


def hop_list(hops: Sequence[Hop]) -> str:
    return " -> ".join([f"v{hops[0].source}", *(f"v{h.target}" for h in hops)]) if hops else "(none)"

"""Crash-safe, resumable in-place upgrade of a gallery along a planned path.

The plan (target version, mode, hops) is written to the gallery before the first batch;
each batch takes the next rows (by row id) not yet in the target space, moves them through
every hop from their own version tag (h and g hop by hop, or the direct adapter when the
plan has one) and writes them back with their new tag in **one transaction**, each row
guarded by the tag it was computed from. A process killed at any moment leaves every row
either untouched or fully upgraded, and a restart takes the same next batch, so the result
is bit-for-bit that of an uninterrupted run (same batch size and threads).

Guarantees while an upgrade runs (zero downtime):

* **forward mode** — new vectors go into the *staged* vector table; queries keep using the
  old query model against the live (old) vectors, complete and exact, until the switch
  commits (one transaction makes the staged table live and sets the new query version).
  Rows added meanwhile are embedded with the old model and upgraded before the switch; a
  row embedded by a process that still ran the old model after the switch is refused.
* **unified mode** (λ-orth) — the query model switches first to B(φ_new); rows are rewritten
  in place with F where the bundle has one, and every row, adapted or not, stays comparable.
* **compatible mode** — identity hops only change the version tags.

Readers in other processes see one consistent snapshot per query (SQLite WAL); they are
never blocked by the upgrade's writes. Not guaranteed: a query issued while the switch
commits is answered by whichever version its snapshot saw (old or new, never a mix).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, dataclass
from typing import Any

import numpy as np

from fctkit.errors import GalleryError

from .engine import Engine
from .gallery import Gallery, LoadedRows, UpgradedRows, VersionTag, take_rows


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
        return json.dumps({"target": self.target, "mode": self.mode, "hops": [asdict(h) for h in self.hops]}, sort_keys=True)

    @classmethod
    def from_state(cls, state: Mapping) -> UpgradePlan:
        return cls(state["target"], state["mode"], tuple(Hop(**h) for h in state["hops"]))

    def path_from(self, version: int) -> list[Hop]:
        """The hops that take a row tagged ``version`` to the target."""
        by_source = {h.source: h for h in self.hops}
        path: list[Hop] = []
        while version != self.target:
            if version not in by_source:
                raise GalleryError(f"the upgrade plan to v{self.target} has no path from a row's v{version}; sync again")
            path.append(by_source[version])
            version = by_source[version].target
        return path


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
                raise GalleryError(f"rows of v{source} are {dims}-d, but the adapter v{hop.source}->v{hop.target} on their "
                                   f"path to v{plan.target} takes {wanted}-d embeddings (v{hop.source}'s own); publish an "
                                   f"adapter from v{source}, or back-fill those rows with v{plan.target}'s model")
            dims = forward.outputs[0].shape[-1]


def transform_rows(plan: UpgradePlan, engines: Mapping[int, Engine], tag: VersionTag,
                   embeddings: np.ndarray, side_infos: np.ndarray) -> tuple[VersionTag, np.ndarray, np.ndarray]:
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


def _artifact(manifest, name: str):
    for artifact in manifest.artifacts:
        if artifact.name == name:
            return artifact
    raise GalleryError(f"bundle v{manifest.version} has no artifact {name!r} named by the upgrade plan")


def _inputs(artifact, embeddings: np.ndarray, side_infos: np.ndarray) -> tuple[np.ndarray, ...]:
    return (embeddings,) if len(artifact.inputs) == 1 else (embeddings, side_infos)


def run_upgrade(gallery: Gallery, plan: UpgradePlan, engines: Mapping[int, Engine], *, batch_size: int,
                on_batch: Callable[[int], None] | None = None) -> int:
    """Upgrade every row not yet in ``plan.target``'s space; returns the rows upgraded now.
    ``on_batch(rows)`` is called after each committed batch.

    Batches are the next ``batch_size`` pending rows in row-id order, so a restart after a
    crash (which begins again at the lowest pending row) forms the same batches as an
    uninterrupted run. While a batch is transformed and written, a second connection reads
    and decrypts the next one (rows with higher ids, which this batch does not touch). Rows
    added meanwhile get higher ids and are picked up; a final pass from the start catches
    anything else before returning."""
    staged = plan.mode == "forward"
    done, last_row_id = 0, 0
    reader = gallery.reader()
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="fctkit-prefetch") as pool:
        try:
            upcoming = pool.submit(reader.rows_to_upgrade, plan.target, 0, batch_size)
            while True:
                batch = upcoming.result()
                if batch.corrupt:
                    row_id, item_id, reason = batch.corrupt[0]
                    raise GalleryError(f"row {row_id} ({item_id!r}) cannot be upgraded: {reason}; run "
                                       f"`fctkit device check --dir DIR` to list every damaged row, "
                                       f"`fctkit device repair --dir DIR` to restore them from the owner's replica or "
                                       f"remove them, then the upgrade again (it resumes)")
                if not len(batch):
                    if last_row_id == 0 or gallery.remaining(plan.target) == 0:
                        return done
                    last_row_id = 0
                    upcoming = pool.submit(reader.rows_to_upgrade, plan.target, 0, batch_size)
                    continue
                last_row_id = int(batch.row_ids[-1])
                upcoming = pool.submit(reader.rows_to_upgrade, plan.target, last_row_id, batch_size)
                gallery.write_upgrades(_transform_batch(plan, engines, batch), staged=staged)
                done += len(batch)
                if on_batch is not None:
                    on_batch(len(batch))
        finally:
            pool.shutdown(wait=True)
            reader.close()


def _transform_batch(plan: UpgradePlan, engines: Mapping[int, Engine], batch: LoadedRows) -> list[UpgradedRows]:
    """The batch's rows moved to the target, one group per version tag."""
    groups: list[UpgradedRows] = []
    for tag in sorted(set(batch.tags), key=lambda t: (t.origin_version, t.version, t.via)):
        rows = [i for i, t in enumerate(batch.tags) if t == tag]
        new_tag, embeddings, side_infos = transform_rows(
            plan, engines, tag, take_rows(batch.embeddings, rows), take_rows(batch.side_infos, rows))
        groups.append(UpgradedRows([int(batch.row_ids[i]) for i in rows], [batch.item_ids[i] for i in rows],
                                   tag, new_tag, embeddings, side_infos))
    return groups


def hop_list(hops: Sequence[Hop]) -> str:
    return " -> ".join([f"v{hops[0].source}", *(f"v{h.target}" for h in hops)]) if hops else "(none)"

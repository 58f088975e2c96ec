"""Partial backfill on a device: re-embed the most useful rows from their encrypted originals.

After an upgrade, rows hold adapted vectors (h(φ_old) or F(φ_old)). A backfill picks rows
by an ordering (``random``, FastFill ``uncertainty`` σ, ``class-mean-l2`` /
``class-mean-cosine`` distance to the class mean — k-means clusters when rows have no
labels — or ``kmeans``) within a budget of rows and/or vault bytes, downloads each chosen
row's sealed original from the vault, opens it with its wrapped data key, runs the installed
bundle's ``embed`` and ``side_info`` graphs, and replaces the row, tagged native at the
installed version.

Crash safety mirrors the upgrade: the chosen row ids are recorded in the gallery before the
first download (``meta.backfill``), each batch is written in one transaction guarded by the
tag each row was read with, and a restart continues the recorded plan. A row already
native at the installed version is never fetched or re-embedded again.

FastFill σ: the ``uncertainty`` graph takes φ_old and ψ, which a forward-mode upgrade
overwrites; so σ is computed **at upgrade time** (:func:`record_uncertainty`, before the
first upgrade batch) and kept sealed in the gallery's metadata. Rows without a recorded σ
(added after that moment) are ordered first: their uncertainty is unknown.
"""

from __future__ import annotations

import base64
import dataclasses
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, cast

import numpy as np

from fctkit.backfill_order import backfill_order
from fctkit.errors import DeviceError, GalleryError, InputError
from fctkit.feature_checks import nonfinite_items

from .gallery.rows import LoadedRows, UpgradedRows, VersionTag, rows_by_tag, take_rows
from .vault_blob import original_items
from .work_window import Window

if TYPE_CHECKING:
    from fctkit.protos.client import FctkitClient

    from .device_parts import DeviceParts
    from .engine import Engine, Items

Ordering = Literal["random", "uncertainty", "class-mean-l2", "class-mean-cosine", "kmeans"]
ORDERINGS: tuple[str, ...] = ("random", "uncertainty", "class-mean-l2", "class-mean-cosine", "kmeans")
PLAN_KEY = "backfill"
_SIGMA_PREFIX = "uncertainty:v"


@dataclass(frozen=True)
class BackfillResult:
    """What one :func:`run_backfill` call did. ``planned``: rows in the recorded plan;
    ``backfilled``: rows re-embedded by this call; ``skipped``: planned rows found already
    native (done before a crash or an earlier window); ``bytes_downloaded``: sealed vault bytes
    fetched; ``left``: planned rows still to do (more than 0 only when the window was spent: the
    next call resumes the plan)."""

    version: int
    order: str
    planned: int
    backfilled: int
    skipped: int
    bytes_downloaded: int
    left: int = 0


def default_order(engine: Engine) -> str:
    """FastFill σ when the bundle ships an ``uncertainty`` graph, else distance to the class mean."""
    has_sigma = any(a.role == "uncertainty" for a in engine.manifest.artifacts)
    return "uncertainty" if has_sigma else "class-mean-l2"


def plan_rows(
    rows: LoadedRows,
    version: int,
    order: str,
    *,
    candidates: Sequence[bool],
    sizes: Sequence[int],
    budget: int | None,
    budget_bytes: int | None,
    sigma: np.ndarray | None,
    seed: int,
) -> list[int]:
    """Row ids to backfill: the gallery ordered by ``order`` (computed over every comparable
    row), restricted to ``candidates`` and cut at ``budget`` rows and ``budget_bytes``."""
    if order not in ORDERINGS:
        raise InputError(f"unknown backfill order {order!r}; choose one of {', '.join(ORDERINGS)}")
    if budget is None and budget_bytes is None:
        raise InputError("give a backfill budget: a number of rows (--budget) and/or bytes (--budget-bytes)")
    if (budget is not None and budget < 0) or (budget_bytes is not None and budget_bytes < 0):
        raise InputError("backfill budgets must be >= 0")
    if not len(rows):
        return []
    embeddings = take_rows(rows.embeddings, range(len(rows)))
    # backfill_order refuses any other name (InputError)
    ranking = backfill_order(cast(Ordering, order), embeddings, _integer_labels(rows.labels), sigma, seed=seed)
    chosen: list[int] = []
    used_bytes = 0
    for index in ranking:
        if budget is not None and len(chosen) >= budget:
            break
        if not candidates[index]:
            continue
        if budget_bytes is not None and used_bytes + sizes[index] > budget_bytes:
            break
        chosen.append(int(rows.row_ids[index]))
        used_bytes += sizes[index]
    return chosen


def _integer_labels(labels: Sequence[str | None]) -> np.ndarray | None:
    """Class ids for the class-mean orderings; None (k-means stands in) unless every row has a label."""
    if any(label is None for label in labels):
        return None
    return np.unique(np.asarray(labels, dtype=str), return_inverse=True)[1].astype(np.int64)


def run_backfill(
    device: DeviceParts,
    searchable: Callable[[], LoadedRows],
    *,
    budget: int | None = None,
    budget_bytes: int | None = None,
    order: str | None = None,
    seed: int = 0,
    batch_size: int = 64,
    on_batch: Callable[[int], object] | None = None,
    window: Window | None = None,
) -> BackfillResult:
    """Backfill the device's gallery (see the module docstring); resumes a recorded plan first.
    ``searchable()`` gives the rows queries compare with (a new plan orders those).

    A recorded plan for the installed version is continued as it is (``budget`` / ``order``
    apply only to a new plan); ``on_batch(rows)`` is called after each committed batch. ``window``
    bounds this call (:mod:`.work_window`): once spent it pauses after a committed batch, the plan kept."""
    from tqdm import tqdm

    clock = (window or Window()).clock()
    gallery, version = device.gallery, device.version
    if gallery.upgrade_state is not None:
        raise DeviceError("an upgrade is in progress: finish it (`fctkit device upgrade`) before backfilling")
    if batch_size < 1:
        raise InputError(f"batch_size must be >= 1, got {batch_size}")
    engine = device.engine()
    device.flush_outbox()
    plan = _stored_plan(device, version)
    if plan is None:
        order = order or default_order(engine)
        plan = {
            "version": version,
            "order": order,
            "row_ids": _new_plan(device, searchable(), engine, order, budget, budget_bytes, seed),
        }
        gallery.set_meta({PLAN_KEY: json.dumps(plan)})
    row_ids: list[int] = plan["row_ids"]
    rows = gallery.load(with_labels=False)
    position = {int(r): i for i, r in enumerate(rows.row_ids)}
    present = [r for r in row_ids if r in position]  # a row removed since the plan was made is moot
    done_before = [r for r in present if _is_native(rows.tags[position[r]], version)]
    todo = [position[r] for r in present if not _is_native(rows.tags[position[r]], version)]
    downloaded, backfilled = 0, 0
    with (
        device.connect() as client,
        tqdm(
            total=len(todo),
            desc=f"backfill v{version} ({plan['order']})",
            unit="row",
            disable=not device.progress or not todo,
        ) as bar,
    ):
        for start in range(0, len(todo), batch_size):
            if clock.spent(backfilled):
                break
            batch = todo[start : start + batch_size]
            images, size = vault_originals(device, client, [rows.item_ids[i] for i in batch], engine)
            downloaded += size
            gallery.write_upgrades(reembedded_rows(rows, batch, gallery_vectors(engine, images), version), staged=False)
            backfilled += len(batch)
            bar.update(len(batch))
            clock.window.tell(len(done_before) + backfilled, len(present))
            if on_batch is not None:
                on_batch(len(batch))
    if not clock.stopped:
        gallery.set_meta({PLAN_KEY: None})
    left = len(todo) - backfilled
    return BackfillResult(version, plan["order"], len(row_ids), backfilled, len(done_before), downloaded, left)


def _is_native(tag: VersionTag, version: int) -> bool:
    """Embedded from the image by ``version``'s model (φ_v, or B(φ_v) in unified mode)."""
    return tag.version == version and tag.via in ("native", "backward")


def _stored_plan(device: DeviceParts, version: int) -> dict[str, Any] | None:
    text = device.gallery.meta(PLAN_KEY)
    if text is None:
        return None
    plan: dict[str, Any] = json.loads(text)
    if plan["version"] != version:  # the gallery moved on to a newer version: that plan's rows are moot
        device.gallery.set_meta({PLAN_KEY: None})
        return None
    return plan


def _new_plan(
    device: DeviceParts,
    searchable: LoadedRows,
    engine: Engine,
    order: str,
    budget: int | None,
    budget_bytes: int | None,
    seed: int,
) -> list[int]:
    rows = _comparable_rows(searchable)
    labels = device.gallery.labels(rows.row_ids.tolist())  # the search keeps no labels (class-mean order needs them)
    rows = dataclasses.replace(rows, labels=[labels.get(int(r)) for r in rows.row_ids])
    version = device.version
    shas = [device.gallery.replica_log.vault_sha256(item) for item in rows.item_ids]
    candidates = [sha is not None and not _is_native(tag, version) for sha, tag in zip(shas, rows.tags, strict=True)]
    sizes = _blob_sizes(device, shas) if budget_bytes is not None else [0] * len(rows)
    sigma = recorded_uncertainty(device, version, rows.row_ids) if order == "uncertainty" else None
    return plan_rows(
        rows,
        version,
        order,
        candidates=candidates,
        sizes=sizes,
        budget=budget,
        budget_bytes=budget_bytes,
        sigma=sigma,
        seed=seed,
    )


def _comparable_rows(rows: LoadedRows) -> LoadedRows:
    """The searchable rows, refused when one of them cannot be read."""
    if rows.corrupt:
        row_id, item_id, reason = rows.corrupt[0]
        raise GalleryError(
            f"row {row_id} ({item_id!r}) cannot be read: {reason}; run `fctkit device repair --dir DIR` "
            f"(it restores damaged rows from the owner's replica or removes them), then backfill again"
        )
    return rows


def _blob_sizes(device: DeviceParts, shas: Sequence[str | None]) -> list[int]:
    with device.connect() as client:
        sizes = {b.sha256: b.size for b in client.list_blobs()}
    return [sizes.get(sha, 0) if sha else 0 for sha in shas]


def _vault_sha(device: DeviceParts, item_id: str) -> str:
    sha = device.gallery.replica_log.vault_sha256(item_id)
    if sha is None:
        raise DeviceError(f"item {item_id!r} has no original in the vault yet: sync, then backfill again")
    return sha


def vault_originals(
    device: DeviceParts, client: FctkitClient, item_ids: Sequence[str], engine: Engine
) -> tuple[Any, int]:
    """The items' originals downloaded from the vault and opened, as ``engine``'s embed graph
    takes them, and the sealed bytes downloaded."""
    blobs = [client.read_blob(_vault_sha(device, item)) for item in item_ids]
    opened = [device.open_original(item, blob) for item, blob in zip(item_ids, blobs, strict=True)]
    return original_items(opened, raw=engine.takes_items), sum(len(b) for b in blobs)


def reembedded_rows(
    rows: LoadedRows, batch: Sequence[int], vectors: tuple[np.ndarray, np.ndarray, str], version: int
) -> list[UpgradedRows]:
    """The rows at positions ``batch`` of ``rows`` with their new ``vectors`` (:func:`gallery_vectors`
    of their originals), one group per old tag (each write is guarded by the tag read)."""
    embeddings, side_infos, via = vectors
    groups = []
    for tag, index in rows_by_tag([rows.tags[i] for i in batch]).items():
        groups.append(
            UpgradedRows(
                [int(rows.row_ids[batch[k]]) for k in index],
                [rows.item_ids[batch[k]] for k in index],
                tag,
                VersionTag(tag.origin_version, version, via),
                embeddings[index],
                side_infos[index],
            )
        )
    return groups


def gallery_vectors(engine: Engine, images: Items) -> tuple[np.ndarray, np.ndarray, str]:
    """What a gallery row of freshly embedded ``images`` holds (:meth:`Engine.row_vectors`)."""
    return engine.row_vectors(engine.embed(images), engine.side_info(images))


# -- FastFill σ, recorded at upgrade time -------------------------------------------------


def record_uncertainty(device: DeviceParts, target_engine: Engine) -> int:
    """Compute σ = uncertainty(φ, ψ) of every row the target bundle has an ``uncertainty``
    graph for (by the row's version) and keep it sealed in the gallery metadata; returns the
    rows covered (0 when the bundle has no such graph). Call before the upgrade rewrites them."""
    graphs = {a.source_version: a for a in target_engine.manifest.artifacts if a.role == "uncertainty"}
    if not graphs or not len(device.gallery):
        return 0
    rows = device.gallery.load(with_labels=False)
    lost = set(nonfinite_items(rows.item_ids, rows.embeddings, rows.side_infos))  # side-info lost (repair): σ unknown
    ids, sigmas = [], []
    for version, artifact in graphs.items():
        index = [i for i, t in enumerate(rows.tags) if t.version == version and rows.item_ids[i] not in lost]
        if not index:
            continue
        inputs = (take_rows(rows.embeddings, index), take_rows(rows.side_infos, index))[: len(artifact.inputs)]
        sigma = target_engine.run(artifact, *inputs)
        ids.append(rows.row_ids[index])
        sigmas.append(sigma.reshape(len(index), -1).mean(axis=1))
    if not ids:
        return 0
    payload = np.concatenate(ids).astype("<i8").tobytes() + np.concatenate(sigmas).astype("<f4").tobytes()
    sealed = device.sealer.seal(payload, _sigma_aad(device, target_engine.manifest.version))
    device.gallery.set_meta({_SIGMA_PREFIX + str(target_engine.manifest.version): base64.b64encode(sealed).decode()})
    return sum(len(i) for i in ids)


def recorded_uncertainty(device: DeviceParts, version: int, row_ids: np.ndarray) -> np.ndarray:
    """σ per row (in ``row_ids`` order) recorded at the upgrade to ``version``; rows without
    one get more than the largest σ (unknown: backfilled first)."""
    text = device.gallery.meta(_SIGMA_PREFIX + str(version))
    if text is None:
        raise InputError(
            f"no FastFill σ was recorded for v{version} (its bundle has no uncertainty graph, or the "
            "gallery was upgraded without it); choose another --order, e.g. class-mean-l2"
        )
    payload = device.sealer.open(base64.b64decode(text), _sigma_aad(device, version), f"σ of v{version}")
    n = len(payload) // 12
    known = dict(zip(np.frombuffer(payload[: 8 * n], "<i8").tolist(), np.frombuffer(payload[8 * n :], "<f4").tolist()))
    unknown = max(known.values(), default=0.0) + 1.0
    return np.array([known.get(int(r), unknown) for r in row_ids], dtype=np.float64)


def _sigma_aad(device: DeviceParts, version: int) -> bytes:
    return b"fctkit-uncertainty|%s|%d" % (device.gallery.gallery_id, version)

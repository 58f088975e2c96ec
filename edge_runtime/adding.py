"""Adding items to a device's gallery, and checking query items, for both kinds of bundle: one
that takes arrays, and one that declares preprocessing and takes raw items (image file bytes,
texts).

An item the installed bundle's preprocessing cannot take (a corrupt image, an empty text, a
text over the declared limit; during a transition, over the previous version's limit too) is
reported by id: ``on_bad_item="refuse"`` refuses the whole call before anything is stored,
``"skip"`` stores the others. Each stored row's original (the array, or the raw item as it
came) is sealed for the vault in the same transaction.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal, cast

import numpy as np

from fctkit.errors import DeviceError, FctkitError, InputError, ItemError
from fctkit.feature_checks import nonfinite_items

from .device_parts import DeviceParts
from .engine import Engine, Items
from .gallery.rows import LoadedRows, NewRow, VersionTag
from .scoring import TransitionState, store_hubness_offsets
from .upgrade_plan import UpgradePlan, transform_rows
from .vault_blob import original_items, seal_image, stored_original

OnBadItem = Literal["refuse", "skip"]
ON_BAD_ITEM: tuple[str, ...] = ("refuse", "skip")


@dataclass(frozen=True)
class AddedItems:
    """The ids stored, and (id, reason) of each item left out (``on_bad_item="skip"``)."""

    item_ids: list[str]
    skipped: list[tuple[str, str]] = field(default_factory=list)


def add_items(
    parts: DeviceParts,
    items: Items,
    item_ids: Sequence[str] | None,
    labels: Sequence[str | None] | None,
    on_bad_item: OnBadItem = "refuse",
    *,
    in_vault: dict[str, str] | None = None,
) -> AddedItems:
    """Embed ``items`` with the installed bundle and store them (see the module docstring).
    ``in_vault``: item id -> SHA-256 of items whose original is in the vault already (not queued again)."""
    in_vault = in_vault or {}
    if on_bad_item not in ON_BAD_ITEM:
        raise InputError(f"on_bad_item must be one of {', '.join(ON_BAD_ITEM)}, got {on_bad_item!r}")
    engine = parts.engine()
    items = checked_items(engine, items)
    item_ids = list(item_ids) if item_ids is not None else [uuid.uuid4().hex for _ in range(len(items))]
    labels = list(labels) if labels is not None else [None] * len(items)
    if len(item_ids) != len(items) or len(labels) != len(items):
        raise InputError(f"{len(items)} items but {len(item_ids)} item ids and {len(labels)} labels")
    if len(set(item_ids)) != len(item_ids) or not all(isinstance(i, str) and i for i in item_ids):
        raise InputError("item ids must be unique non-empty strings")
    transition = TransitionState.from_json(parts.gallery.meta("transition"))
    previous = parts.engine(transition.previous_version) if transition and transition.version == parts.version else None
    good, bad, vectors = _embedded(parts, engine, previous, items, keep_going=on_bad_item == "skip")
    skipped = [(item_ids[i], reason) for i, reason in bad]
    if skipped and on_bad_item == "refuse":
        raise bad_items_error(skipped, "nothing was added")
    if not good:
        return AddedItems([], skipped)
    embeddings, side_infos, via = engine.row_vectors(vectors["embed"], vectors["side_info"])
    tag = VersionTag(parts.version, parts.version, via)
    rows = [
        NewRow(item_ids[i], embeddings[k], side_infos[k], None if labels[i] is None else str(labels[i]))
        for k, i in enumerate(good)
    ]
    outbox = [
        (item_ids[i], seal_image(parts.owner_sealer, item_ids[i], stored_original(items[i])))
        for i in good
        if item_ids[i] not in in_vault
    ]
    kept = None
    if previous is not None and transition is not None:  # kept for transition scoring (previous: only in one)
        u = transition.previous_version
        kept = (VersionTag(u, u, "native"), vectors["previous"])
    parts.gallery.add_rows(
        rows,
        tag,
        outbox,
        query_version=engine.manifest.version,
        previous=kept,
        in_vault={item_ids[i]: in_vault[item_ids[i]] for i in good if item_ids[i] in in_vault},
    )
    store_hubness_offsets(parts.gallery, engine)
    return AddedItems([item_ids[i] for i in good], skipped)


def restore_from_vault(parts: DeviceParts, originals: dict[str, tuple[str | None, str]]) -> list[str]:
    """Embed again, with the installed version, the items whose originals are in the vault
    (item id -> (label, SHA-256)) and store them as new rows (rows a repair forgot and the
    owner's replica did not hold); returns the ids restored. An original the vault no longer
    has, or that fails to open, is left out."""
    engine = parts.engine()
    opened = _from_vault(parts, {item_id: sha256 for item_id, (_, sha256) in originals.items()})
    if not opened:
        return []
    ids = list(opened)
    items = original_items([opened[i] for i in ids], raw=engine.takes_items)
    added = add_items(
        parts, items, ids, [originals[i][0] for i in ids], "skip", in_vault={i: originals[i][1] for i in ids}
    )
    return added.item_ids


def _from_vault(parts: DeviceParts, shas: dict[str, str]) -> dict[str, np.ndarray]:
    """The originals (item id -> SHA-256) downloaded from the vault and opened; one the vault
    no longer has, or that fails to open, is left out."""
    opened: dict[str, np.ndarray] = {}
    with parts.connect() as client:
        for item_id, sha256 in shas.items():
            try:
                opened[item_id] = parts.open_original(item_id, client.read_blob(sha256))
            except FctkitError:
                continue
    return opened


def side_infos_again(parts: DeviceParts, rows: LoadedRows, *, online: bool) -> dict[int, np.ndarray]:
    """ψ of ``rows`` (their side-info was lost: repair) embedded again from their originals,
    queued on the device or (``online``) in the vault: by the side-info model of the row's origin
    version, then, for an adapted row, along the installed path to its version (as an upgrade
    moved it); row id -> ψ. Rows whose bundles or path are not installed, or whose original
    cannot be had or embedded, are left out."""
    installed = set(parts.bundles.versions())
    wanted = {rows.item_ids[k]: k for k, t in enumerate(rows.tags) if {t.origin_version, t.version} <= installed}
    originals: dict[str, np.ndarray] = {}
    for item_id, blob in parts.gallery.replica_log.outbox():
        if item_id in wanted:
            try:
                originals[item_id] = parts.open_original(item_id, blob)
            except FctkitError:
                continue
    shas = (
        {i: sha for i in wanted if i not in originals and (sha := parts.gallery.replica_log.vault_sha256(i))}
        if online
        else {}
    )
    if shas:
        with contextlib.suppress(FctkitError):  # the server is away: the rows keep their mark
            originals.update(_from_vault(parts, shas))
    found: dict[int, np.ndarray] = {}
    for tag in {rows.tags[wanted[i]] for i in originals}:
        ids = [i for i in originals if rows.tags[wanted[i]] == tag]
        try:
            found.update(
                zip([int(rows.row_ids[wanted[i]]) for i in ids], _side_infos(parts, tag, [originals[i] for i in ids]))
            )
        except (
            FctkitError,
            ValueError,
        ):  # a bundle damaged or gone, no path, originals it refuses: the rows keep their mark
            continue
    return found


def _side_infos(parts: DeviceParts, tag: VersionTag, originals: list[np.ndarray]) -> np.ndarray:
    """ψ of rows tagged ``tag`` from their originals (see :func:`side_infos_again`)."""
    engine = parts.engine(tag.origin_version)
    items = original_items(originals, raw=engine.takes_items)
    side_infos = engine.side_info(items)
    if tag.version == tag.origin_version:
        return side_infos
    hops = parts.bundles.hops(tag.origin_version, tag.version)
    if hops is None:
        raise DeviceError(f"no installed path from v{tag.origin_version} to v{tag.version}")
    plan = UpgradePlan(tag.version, "forward", tuple(hops))
    engines = {h.bundle: parts.engine(h.bundle) for h in hops}
    native = VersionTag(tag.origin_version, tag.origin_version, "native")
    return transform_rows(plan, engines, native, engine.embed(items), side_infos)[2]


def checked_items(engine: Engine, items: Items) -> Items:
    """``items`` as ``engine`` takes them: a list of raw items (bytes, str) or an array of at least one row."""
    if engine.takes_items:
        items = list(items)
        if not items:
            raise InputError("give at least one item")
        kinds = {type(i).__name__ for i in items if not isinstance(i, (bytes, bytearray, str))}
        if kinds:
            raise InputError(
                f"bundle v{engine.manifest.version} takes raw items (image file bytes or texts), got {sorted(kinds)}"
            )
        return items
    if not isinstance(items, np.ndarray) and len(items) and isinstance(items[0], (bytes, bytearray, str)):
        raise InputError(
            f"bundle v{engine.manifest.version} declares no preprocessing: it takes arrays (.npy/.npz), not "
            "image files or texts"
        )
    items = np.asarray(items)
    if items.ndim < 2 or len(items) == 0:
        raise InputError(f"images must be an array of at least one image, got shape {items.shape}")
    if np.issubdtype(items.dtype, np.complexfloating):
        raise InputError(f"the items are complex numbers ({items.dtype}); give real-valued arrays")
    return items


def _unusable_arrays(items: Items) -> tuple[Items, dict[int, str]]:
    """Array items with a value NaN, inf or beyond float32's range (what the graphs compute in)
    are bad items: (position, reason) each, and ``items`` with those rows zeroed so the others can run."""
    if not isinstance(items, np.ndarray) or not np.issubdtype(items.dtype, np.number):
        return items, {}
    flat = items.reshape(len(items), -1)
    bad = np.flatnonzero(~(np.isfinite(flat) & (np.abs(flat) <= np.finfo(np.float32).max)).all(axis=1))
    if not len(bad):
        return items, {}
    items = items.copy()
    items[bad] = 0
    return items, {int(i): "holds NaN, inf or a value beyond float32's range" for i in bad}


def _embedded(
    parts: DeviceParts, engine: Engine, previous: Engine | None, items: Items, keep_going: bool
) -> tuple[list[int], list[tuple[int, str]], dict[str, np.ndarray]]:
    """The positions of the good items, (position, reason) of the bad ones, and each role's
    vectors of the good ones ('embed', 'side_info', and 'previous' during a transition)."""
    from tqdm import tqdm

    items, bad = _unusable_arrays(items)
    with tqdm(
        total=len(items),
        desc=f"embed v{engine.manifest.version}",
        unit="item",
        leave=False,
        disable=not parts.progress or len(items) < 2048,
    ) as bar:
        runs = {"embed": engine.embed_items("embed", items, keep_going=keep_going, progress=bar.update)}
    if engine.manifest.side_info_dim:
        runs["side_info"] = engine.embed_items("side_info", items, keep_going=keep_going)
    if previous is not None:
        runs["previous"] = previous.embed_items("embed", items, keep_going=keep_going)
    for done in runs.values():
        for index, reason in done.bad:
            bad.setdefault(index, reason)
        for index in nonfinite_items(done.good, done.vectors) if done.vectors is not None else ():
            bad.setdefault(
                index, "embeds to vectors that are not finite (its values are too large for the model): scale it down"
            )
    good = [i for i in range(len(items)) if i not in bad]
    if bad and not keep_going:
        return good, sorted(bad.items()), {}
    # every run embedded every good item (a bad one stops the runs only when not keep_going, returned above)
    vectors = {name: cast(np.ndarray, done.vectors)[np.searchsorted(done.good, good)] for name, done in runs.items()}
    vectors.setdefault("side_info", np.zeros((len(good), 0), np.float32))
    return good, sorted(bad.items()), vectors


def usable_queries(
    engines: Sequence[Engine], items: Items, query_ids: Sequence[str], on_bad_item: OnBadItem
) -> tuple[Items, list[str], list[tuple[str, str]]]:
    """The query items every engine (the query version's, and the previous one's during a
    transition) can take, their ids, and (id, reason) of the others; refused when
    ``on_bad_item`` is 'refuse' and any is bad."""
    if not engines[0].takes_items:
        return checked_items(engines[0], items), list(query_ids), []
    items = checked_items(engines[0], items)
    bad: dict[int, str] = {}
    for engine in engines:
        for index, reason in engine.item_problems(items, purpose="query"):
            bad.setdefault(index, reason)
    skipped = [(query_ids[i], reason) for i, reason in sorted(bad.items())]
    if skipped and on_bad_item == "refuse":
        raise bad_items_error(skipped, "no query was answered")
    keep = [i for i in range(len(items)) if i not in bad]
    return [items[i] for i in keep], [query_ids[i] for i in keep], skipped


def bad_items_error(problems: list[tuple[str, str]], outcome: str) -> ItemError:
    listed = "; ".join(f"{item_id!r} {reason}" for item_id, reason in problems[:10])
    more = f" (and {len(problems) - 10} more)" if len(problems) > 10 else ""
    return ItemError(
        f"{len(problems)} item(s) cannot be embedded, {outcome}: {listed}{more}; fix or drop them, or "
        "skip them (--on-bad-item skip)",
        tuple(problems),
    )

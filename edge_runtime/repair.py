"""Finding and repairing damage in a device's gallery (``fctkit device check`` / ``repair``).

:func:`damage_report` opens everything the gallery keeps and lists all damage at once.
:func:`repair_gallery` fixes, in one transaction, what can be fixed on the device alone:

* settings that can be derived again: ``replica_cursor`` (0: the next pull merges the owner's
  whole replica again, idempotently), ``row_count`` (recounted), ``transition`` (ended),
  ``backfill`` and ``uncertainty:v…`` (dropped: a backfill plans again; the FastFill order
  needs the next upgrade's σ), ``upgrade`` (the upgrade is given up: its staged rows go, the
  live rows are untouched, and the installed version stays to be applied again), ``withdrawn``
  (rebuilt conservatively, never dropped: :func:`~.revert_records.rebuilt_withdrawals`),
  ``live_vectors`` (the vector table that holds rows) and ``query_version`` (the version the
  live rows are in; for an empty gallery the newest installed version);
* a row whose side-info alone fails to open is kept (its embedding, label and tag are intact):
  it is written again in place with ψ embedded again from its original (queued on the device, or
  in the vault) by its origin version's side-info model and, for an adapted row, moved along the
  installed path to its version; or, with no original at hand, with NaN ψ and
  listed under ``side_info_lost`` (`status` lists them too); an upgrade whose adapters take
  side-info refuses such rows by name rather than guess their ψ (remove them and add their
  originals again), one that does not carries the mark along;
* rows whose embedding fails to open are forgotten here, without a tombstone, each with its
  reason, so the device (``Device.repair``) can pull them back from the owner's replica;
  per-row extras that fail to open are dropped (hubness offsets are computed again; a row
  without a previous embedding scores on its adapted vector); damaged queued originals are
  dropped (they would upload garbage).

What cannot be derived (the essential settings, a live table that cannot be told) raises a
:class:`GalleryDamagedError` whose message says how to rebuild the gallery from the replica.
Works on a :class:`~fctkit.edge_runtime.gallery.Gallery` and plain callables, not on a Device.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, cast

import numpy as np

from fctkit.errors import CorruptRecordError, DeviceKeyError, FctkitError, GalleryDamagedError, InputError
from fctkit.feature_checks import nonfinite_items

from .gallery import Gallery
from .gallery.extras import EXTRA_FIELDS
from .gallery.rows import LoadedRows, UpgradedRows, VersionTag, rows_by_tag, take_rows
from .gallery.schema import SCHEMA_VERSION, VECTOR_TABLES
from .gallery.settings import REQUIRED, stored_name
from .rebuild import rebuild_advice
from .revert_records import rebuilt_withdrawals

#: ``rollback`` with its kept vectors (a withdrawal then reverts through backward or the vault), ``revert`` (reports
#: stop naming it); ``withdrawn`` is rebuilt conservatively instead (:func:`~.revert_records.rebuilt_withdrawals`)
DROPPED_WHEN_DAMAGED = ("transition", "backfill", "upgrade", "rollback", "revert", "withdrawn")
DROPPED_PREFIXES = ("uncertainty:v",)
OpenOriginal = Callable[[str, bytes], Any]
#: rows whose side-info was lost -> row id -> ψ embedded again from the row's original (rows left out: none at hand)
SideInfoAgain = Callable[[LoadedRows], dict[int, np.ndarray]]


@dataclass
class RepairResult:
    """What :func:`repair_gallery` did."""

    settings_restored: dict[str, str | None] = field(default_factory=dict)
    rows_forgotten: list[str] = field(default_factory=list)
    #: why each forgotten row could not be kept (item id -> reason)
    forgotten_because: dict[str, str] = field(default_factory=dict)
    #: forgotten rows whose original is in the vault: item id -> (label, SHA-256), to embed again
    vault_originals: dict[str, tuple[str | None, str]] = field(default_factory=dict)
    rows_missing: int = 0
    extras_dropped: int = 0
    queued_originals_dropped: list[str] = field(default_factory=list)
    #: rows kept whose label failed to open (their per-row entry was set back from their block first): the label is gone
    labels_dropped: list[str] = field(default_factory=list)
    #: rows kept whose per-row entry had a damaged row id: moved back to the row its block authenticates
    row_ids_restored: list[str] = field(default_factory=list)
    #: rows kept whole although a whole-set load failed them (e.g. their block's list of removed rows): sealed again
    rows_sealed_again: list[str] = field(default_factory=list)
    #: rows kept although their side-info failed to open: ψ embedded again from the original ...
    side_info_restored: list[str] = field(default_factory=list)
    #: ... or, with no original at hand, stored as NaN: marked lost (an upgrade that needs it names these rows)
    side_info_lost: list[str] = field(default_factory=list)


def damage_report(
    gallery: Gallery, open_original: OpenOriginal, damaged_bundles: Callable[[], dict[int, str]] = dict
) -> dict[str, Any]:
    """Everything damaged, all at once: settings, rows (and rows gone from the file), per-row
    extras, queued originals, installed bundles (``damaged_bundles``: version -> what is wrong);
    a part SQLite cannot read is named under ``unreadable``. ``damaged`` counts it all (0: clean)."""
    unreadable: dict[str, str] = {}

    def read(part: str, load: Callable[[], Any], empty: Any) -> Any:
        try:
            return load()
        except (GalleryDamagedError, CorruptRecordError, DeviceKeyError) as exc:  # e.g. a row in two authentic blocks
            unreadable[part] = str(exc)
            return empty

    settings = gallery.settings.damaged()
    rows = read("rows", gallery.load, None)
    extras = {name: read(name, functools.partial(_corrupt_extras, gallery, name), []) for name in EXTRA_FIELDS}
    originals = read("queued_originals", lambda: damaged_originals(gallery, open_original), [])
    report: dict[str, Any] = {
        "damaged_settings": settings,
        "rows": None if rows is None else len(rows) + len(rows.corrupt),
        "damaged_rows": [] if rows is None else [list(r) for r in rows.corrupt],
        "missing_rows": 0 if rows is None else rows.missing,
        "damaged_extras": {k: [list(r) for r in v] for k, v in extras.items() if v},
        "damaged_queued_originals": [list(o) for o in originals],
    }
    file = {"sqlite_integrity": gallery.sqlite_problems(), **read("file", gallery.file_damage, {})}
    report.update({k: v for k, v in file.items() if v})
    if file["sqlite_integrity"] or unreadable:
        report["next"] = (
            f"SQLite finds damage in {gallery.path}: `fctkit device repair --dir DIR` rebuilds damaged indexes; "
            f"if the damage is in a table and stays after repair, restore a backup of the directory or "
            f"{rebuild_advice(gallery.path.parent)}"
        )
    bundles = damaged_bundles()
    if bundles:
        report["damaged_bundles"] = {f"v{v}": reason for v, reason in bundles.items()}
    if unreadable:
        report["unreadable"] = unreadable
    report["damaged"] = len(bundles) + (
        len(settings)
        + len(report["damaged_rows"])
        + report["missing_rows"]
        + sum(map(len, extras.values()))
        + len(originals)
        + len(unreadable)
        + sum(len(v) if isinstance(v, list) else int(v) for v in file.values())
    )
    return report


def _corrupt_extras(gallery: Gallery, name: str) -> Any:
    return gallery.extras.load(name).corrupt


def damaged_originals(gallery: Gallery, open_original: OpenOriginal) -> list[tuple[str, str]]:
    found = []
    for item_id, blob in gallery.replica_log.outbox():
        try:
            if not isinstance(item_id, str) or not isinstance(blob, bytes) or not _utf8(item_id):
                raise CorruptRecordError(
                    f"queued original {stored_name(item_id)!r}: its item id or sealed bytes were damaged"
                )
            open_original(item_id, blob)
        except DeviceKeyError:  # the key, not the record: nothing is damaged that a repair could drop
            raise
        except FctkitError as exc:
            found.append((stored_name(item_id), str(exc)))
    return found


def valid_names(names: Sequence[str]) -> list[str]:
    """The item ids that can be looked up (a damaged byte can leave one that is not valid UTF-8)."""
    return [n for n in names if _utf8(n)]


def _utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:  # read back with surrogateescape: a damaged byte
        return False
    return True


def derived_settings(
    gallery: Gallery, damaged: Sequence[str], installed_versions: Sequence[int]
) -> tuple[dict[str, str | None], str | None]:
    """New values (None: delete) for the damaged settings that can be derived, and the live
    table to empty when an upgrade is given up; a setting that cannot be derived raises."""
    found = {  # vouched for by opening, or their MACs; an open gallery is at the current schema (its tables say so)
        **gallery.settings.opened_essentials(),
        **gallery.settings.recovered(),
        "schema_version": str(SCHEMA_VERSION),
    }
    recovered = {k: v for k, v in found.items() if k in damaged}
    damaged = [k for k in damaged if k not in recovered]
    values: dict[str, str | None] = dict(recovered)  # written back as they were
    for key in damaged:
        if key in DROPPED_WHEN_DAMAGED or key.startswith(DROPPED_PREFIXES) or not _known_setting(key):
            values[key] = None  # an unknown name is a damaged one: dropped (the setting it was is then missing)
        elif key == "replica_cursor":
            values[key] = "0"
    live = recovered.get("live_vectors") or (
        gallery.settings.get("live_vectors") if "live_vectors" not in damaged else _derived_live(gallery, damaged)
    )
    if "live_vectors" in damaged:
        values["live_vectors"] = live
    if "query_version" in damaged:
        versions = gallery.table_versions(cast(str, live))  # a REQUIRED setting, or derived: never None
        values["query_version"] = str(max(versions) if versions else max(installed_versions, default=0))
    other = VECTOR_TABLES[1 - VECTOR_TABLES.index(live)]
    upgrade = recovered.get("upgrade") or (None if "upgrade" in damaged else gallery.settings.get("upgrade"))
    upgrade_given_up = (
        "upgrade" in damaged
        or (upgrade is not None and "live_vectors" in damaged)
        or (upgrade is None and gallery.vector_table_rows()[other] > 0)
    )  # staged rows of an upgrade whose setting's name was lost
    if upgrade_given_up:
        values["upgrade"] = None
    if "withdrawn" in damaged:  # never dropped: a withdrawn version must not be installed again
        heading = None if upgrade_given_up or upgrade is None else json.loads(upgrade)["target"]
        query_version = int(values.get("query_version") or gallery.settings.get("query_version") or 0)
        above = [v for v in installed_versions if v > query_version and v != heading]
        values["withdrawn"] = rebuilt_withdrawals(gallery, above)
    left = [k for k in damaged if k not in values and k != "row_count"]
    if left:
        raise GalleryDamagedError(
            f"{gallery.path}: setting(s) {', '.join(left)} are damaged and cannot be derived; "
            f"{rebuild_advice(gallery.path.parent)}",
            tuple(left),
        )
    return values, other if upgrade_given_up else None


def _known_setting(key: str) -> bool:
    return key in (*REQUIRED, *DROPPED_WHEN_DAMAGED) or key.startswith(DROPPED_PREFIXES)


def _derived_live(gallery: Gallery, damaged: Sequence[str]) -> str:
    """The live vector table when its setting is damaged: the one that holds rows (both empty:
    the first); while both do (an upgrade's staged rows), the one whose rows are not all in the
    upgrade's target version; undecidable without an intact upgrade setting."""
    holding = [t for t, n in gallery.vector_table_rows().items() if n]
    if len(holding) > 1:
        state = None if "upgrade" in damaged else gallery.upgrade_state
        holding = [t for t in holding if state is not None and gallery.table_versions(t) != [state["target"]]]
        if len(holding) != 1:
            raise GalleryDamagedError(
                f"{gallery.path}: live_vectors is damaged and both vector tables hold rows (an upgrade "
                f"was under way), so the live one cannot be told; {rebuild_advice(gallery.path.parent)}",
                ("live_vectors",),
            )
    return holding[0] if holding else VECTOR_TABLES[0]


def repair_gallery(
    gallery: Gallery,
    open_original: OpenOriginal,
    installed_versions: Sequence[int],
    side_info_again: SideInfoAgain | None = None,
) -> RepairResult:
    """Fix what can be fixed on the device alone (see the module doc): one transaction, then one
    more that re-seals the rows kept whose side-info was lost."""
    damaged = gallery.settings.damaged()
    settings, clear_table = derived_settings(gallery, damaged, installed_versions)
    result = RepairResult(settings_restored=settings)
    unknown_count = {"row_count": "0"} if "row_count" in damaged else {}  # forget_rows counts afresh
    with gallery.settings.override({**settings, **unknown_count}):  # the rows are read with the derived settings
        result.labels_dropped, result.row_ids_restored = _mend_entries(gallery)
        rows = gallery.load()  # with the per-row table: rows whose vectors are gone are listed
        embedded = gallery.load(with_side_info=False)  # a side-info record that fails costs the side-info only
        intact = gallery.open_rows([r for r, _, _ in rows.corrupt])  # e.g. a block's dead list failed: pointers suffice
        bad_extras = [(name, r) for name in EXTRA_FIELDS for r, _, _ in gallery.extras.load(name).corrupt]
    keep = set(intact.row_ids.tolist())
    kept = _side_info_lost(rows, embedded, keep)
    keep |= set(kept.row_ids.tolist())
    lost = list(dict.fromkeys((r, item) for r, item, _ in rows.corrupt if r not in keep))  # a row can fail twice
    for row_id, item, reason in rows.corrupt:
        if row_id not in keep:
            result.forgotten_because.setdefault(item, reason)
    result.rows_forgotten = list(result.forgotten_because)
    result.vault_originals = _vault_originals(gallery, lost)
    result.rows_missing = rows.missing
    result.extras_dropped = len(bad_extras)
    result.queued_originals_dropped = list(dict.fromkeys(item for item, _ in damaged_originals(gallery, open_original)))
    for setting, fields in (
        ("transition", ("previous_embedding",)),
        ("rollback", ("rollback_embedding", "rollback_side_info")),
    ):
        if setting in damaged:
            bad_extras += [(name, r) for name in fields for r in gallery.extras.load(name).row_ids.tolist()]
    if result.rows_forgotten or result.rows_missing:  # the next pull brings back what the owner's replica has
        settings = {**settings, "replica_cursor": "0"}
    gallery.forget_rows(
        lost,
        drop_queued=result.queued_originals_dropped,
        drop_extras=bad_extras,
        settings=settings,
        clear_table=clear_table,
    )
    if len(intact):  # sealed again in new blocks as they are: nothing changed for the replica
        gallery.write_upgrades(
            [
                UpgradedRows(
                    intact.row_ids[g].tolist(),
                    [intact.item_ids[k] for k in g],
                    tag,
                    tag,
                    take_rows(intact.embeddings, g),
                    take_rows(intact.side_infos, g),
                )
                for tag, g in rows_by_tag(intact.tags).items()
            ],
            staged=False,
            logged=False,
        )
        result.rows_sealed_again = list(dict.fromkeys(intact.item_ids))
    if len(kept):
        _reseal_side_info(gallery, kept, side_info_again, result)
    return result


def _mend_entries(gallery: Gallery) -> tuple[list[str], list[str]]:
    """Damaged rows whose block is intact (its records authenticate the rows' item ids and tag):
    a per-row entry a damaged row id left beside its row is moved back to it
    (:meth:`Gallery.restore_row_ids`), then their per-row entries are set back from the block and a
    label that fails is dropped, so only the label is lost (:meth:`Gallery.restore_entries`).
    Returns the items whose label was dropped and those whose row id was set back."""
    damaged = {r for r, _, _ in gallery.load(with_side_info=False).corrupt}
    if not damaged:
        return [], []
    authentic = gallery.load(with_labels=False, with_side_info=False)  # the blocks alone
    rows = authentic.subset([k for k, r in enumerate(authentic.row_ids.tolist()) if r in damaged])
    moved = gallery.restore_row_ids(rows)
    return gallery.restore_entries(rows), moved


def side_info_lost(gallery: Gallery) -> list[str]:
    """The rows a repair kept whose side-info was lost (stored as NaN): they answer queries, and an
    upgrade whose adapters take side-info refuses them by name (`fctkit device status` lists them)."""
    rows = gallery.load(with_labels=False)
    return nonfinite_items(rows.item_ids, rows.side_infos)


def _side_info_lost(rows: LoadedRows, embedded: LoadedRows, intact: set[int]) -> LoadedRows:
    """The rows of ``embedded`` (opened without side-info) that the full load found damaged and
    that are not ``intact``: their embeddings, labels and pointers are intact, only their side-info fails."""
    damaged = {r for r, _, _ in rows.corrupt} - intact
    return embedded.subset([k for k, r in enumerate(embedded.row_ids.tolist()) if r in damaged])


def _reseal_side_info(
    gallery: Gallery, kept: LoadedRows, side_info_again: SideInfoAgain | None, result: RepairResult
) -> None:
    """Write ``kept`` again in place (same tag, same embedding) with ψ embedded again where
    ``side_info_again`` could, else NaN; the NaN rows' change is not logged, so no other device
    of the owner gets the lost side-info."""
    widths = gallery.side_info_widths(kept.row_ids.tolist())
    again = side_info_again(kept) if side_info_again is not None else {}
    groups: dict[tuple[VersionTag, int, bool], list[int]] = {}
    values: list[np.ndarray] = []
    for k, (row_id, tag) in enumerate(zip(kept.row_ids.tolist(), kept.tags, strict=True)):
        value = again.get(row_id)  # the model's own width, whatever the block's (unsealed) width column says
        if value is None or not np.isfinite(value).all():  # the mark, at the width the block records (0: nothing lost)
            value = np.full(widths.get(row_id, 0), np.nan)
        values.append(np.asarray(value, dtype=np.float32).reshape(-1))
        groups.setdefault((tag, len(values[-1]), not np.isnan(values[-1]).any()), []).append(k)
    for restored in (True, False):
        batches = [
            UpgradedRows(
                kept.row_ids[g].tolist(),
                [kept.item_ids[k] for k in g],
                tag,
                tag,
                take_rows(kept.embeddings, g),
                np.stack([values[k] for k in g]).reshape(len(g), width),
            )
            for (tag, width, ok), g in groups.items()
            if ok == restored
        ]
        if batches:
            gallery.write_upgrades(batches, staged=False, logged=restored)
        named = list(dict.fromkeys(i for b in batches for i in b.item_ids))
        (result.side_info_restored if restored else result.side_info_lost).extend(named)


def _vault_originals(gallery: Gallery, rows: Sequence[tuple[int, str]]) -> dict[str, tuple[str | None, str]]:
    """Before damaged rows are forgotten: each one's label and vault SHA-256, where its per-row
    entry is intact and its original was uploaded."""
    labels = gallery.labels([r for r, _ in rows])
    found = {}
    for row_id, item_id in rows:
        if not _utf8(item_id):  # a name a damaged byte left invalid: nothing to look it up by
            continue
        try:
            sha256 = gallery.replica_log.vault_sha256(item_id)
        except InputError:  # its per-row entry is gone: nothing to go by
            continue
        if sha256 is not None:
            found[item_id] = (labels.get(row_id), sha256)
    return found

"""Withdrawals on a device: at each sync the device verifies the signed withdrawals its
listing carries and, when the version answering its queries (or the one an interrupted upgrade
is heading to) is withdrawn, goes back to the withdrawal's ``revert_to``.

- A withdrawal is checked like a release (:func:`~fctkit.protos.trust.verify_withdrawal` with the
  device's current root, or its pinned publisher key): one that fails is refused, recorded for
  status and changes nothing (a server alone cannot send a device back). A verified one is
  recorded: that version is never installed again (:func:`~.revert_records.refuse_withdrawn`).
- **exact**: within the rollback window (:mod:`.revert_records`) each row gets back the embedding
  and side-info it had before the upgrade, the very sealed values kept at the switch
  (:meth:`~.gallery.upgrades.GalleryUpgrades.switch_to`), bit for bit.
- otherwise (no window, closed, confirmed, or kept for another version; the status and sync notes say so):
  **backward** through the withdrawn bundle's ``backward`` graph to ``revert_to`` when it has one,
  else **reembedded**: each row's original is fetched from the vault and embedded by ``revert_to``'s
  model, as backfill does. Rows with neither are left out of searches and reported. Rows without
  kept vectors (added on the withdrawn version) go these ways inside an exact revert too, and the
  record says the mix ("exact 58, reembedded 6"). A row added on the withdrawn version takes
  ``revert_to`` as its origin version (origin <= version, as the server checks every record).
- an upgrade to the withdrawn version that a crash interrupted is not finished: in forward mode
  it is given up (its staged vectors dropped: queries never left the version before it); in
  unified and compatible mode, whose queries switched at its start, the rows already in the
  withdrawn space go back as above, the others stay where they are.

Every vector is computed first; then one transaction writes every row back (each guarded by the
tag it was read with), drops the kept vectors, switches the query version and records the revert.
Queries never see the two spaces mixed, and a process killed at any point leaves either nothing
done (the next sync starts again) or everything.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from fctkit.errors import BundleFormatError, DeviceError, TrustError
from fctkit.protos.trust import parse_withdrawal, verify_withdrawal
from fctkit.protos.trust.withdrawal import Withdrawal

from .backfill import gallery_vectors, vault_originals
from .device_parts import DeviceParts
from .device_trust import DeviceTrust
from .gallery.rows import UpgradedRows, VersionTag
from .revert_records import (
    LISTED_ITEMS,
    ROLLBACK_KEY,
    RevertRecord,
    RollbackWindow,
    WithdrawalLog,
    log_meta,
    method_mix,
    revert_meta,
    rollback_window,
    withdrawal_log,
)
from .upgrade_plan import UpgradePlan

BATCH = 64  # originals fetched and embedded at a time


@dataclass
class MovedRows:
    """Rows with their vectors in the space they go back to, and the item ids that cannot go."""

    batches: list[UpgradedRows]
    moved: set[int]
    not_moved: list[str]


def take_withdrawals(
    parts: DeviceParts, trust: DeviceTrust, documents: Sequence[bytes], client: Any, now: float | None = None
) -> list[str]:
    """Verify the listing's withdrawals, record them, and go back when the version the device is on,
    or the one an interrupted upgrade is heading to, is withdrawn (that upgrade is not finished
    first: :func:`go_back`); returns notes for the sync's output."""
    log, accepted = _recorded(parts, trust, documents)
    under_way = parts.gallery.upgrade_state
    plan = None if under_way is None else UpgradePlan.from_state(under_way)
    heading = parts.version if plan is None else plan.target
    current = next((w for w in accepted if w.version == heading), None)
    return log.refused + ([] if current is None else [go_back(parts, current, plan, client, log, now)])


def go_back(
    parts: DeviceParts,
    withdrawal: Withdrawal,
    plan: UpgradePlan | None,
    client: Any,
    log: WithdrawalLog,
    now: float | None = None,
) -> str:
    """Leave the withdrawn version: give up a forward-mode upgrade to it that has not switched
    (:func:`give_up_note`), else :func:`revert`, from where an interrupted upgrade stopped when
    ``plan`` is one (a failure then raises: that upgrade can be neither finished nor kept); returns
    the note."""
    if plan is not None and plan.mode == "forward":
        return give_up_note(parts, withdrawal)
    try:
        return revert_note(revert(parts, withdrawal, client, log, now))
    except DeviceError as exc:
        if plan is not None:
            raise
        return f"not reverted: {exc}"  # the sync goes on (its report says the device is still on the version)


def _recorded(
    parts: DeviceParts, trust: DeviceTrust, documents: Sequence[bytes]
) -> tuple[WithdrawalLog, list[Withdrawal]]:
    """The withdrawal log with the verified ``documents`` recorded (written when it changed) and
    the refused ones' reasons, and the verified withdrawals."""
    log = withdrawal_log(parts.gallery)
    log.refused = []
    accepted = []
    for document in documents:
        try:
            accepted.append(verify_withdrawal(trust.release_trust(), parse_withdrawal(document)).body)
        except (TrustError, BundleFormatError) as exc:
            log.refused.append(f"a withdrawal was refused and changed nothing: {exc}")
    signed = {str(w.version): w for w in accepted}
    log.versions = {v: e for v, e in log.versions.items() if not e.get("rebuilt") or v in signed}  # repair's guesses
    for version, withdrawal in signed.items():
        if log.versions.get(version, {}).get("rebuilt", True):
            log.versions[version] = {
                "revert_to": withdrawal.revert_to,
                "reason": withdrawal.reason,
                "withdrawn_at": withdrawal.withdrawn_at.isoformat(),
            }
    if log != withdrawal_log(parts.gallery):
        parts.gallery.set_meta(log_meta(log))
    return log, accepted


def give_up_note(parts: DeviceParts, withdrawal: Withdrawal) -> str:
    """Give up a forward-mode upgrade to the withdrawn version before its switch (queries never left
    the version before it; :meth:`~.gallery.upgrades.GalleryUpgrades.give_up_staged`)."""
    staged = parts.gallery.give_up_staged({"upgrade": None})
    return (
        f"v{withdrawal.version} was withdrawn ({withdrawal.reason!r}) while the upgrade to it was under way: "
        f"the upgrade was given up ({staged} staged row(s) dropped), v{parts.version} answers queries as before"
    )


def revert_note(record: RevertRecord) -> str:
    lost = (
        f"; {record.rows_not_moved} row(s) could not be moved and are left out of searches"
        if record.rows_not_moved
        else ""
    )
    return (
        f"v{record.reverted_from} was withdrawn ({record.reason!r}): reverted to v{record.revert_to} "
        f"({record.method}, {record.rows_moved} row(s)){lost}{'; ' + record.note if record.note else ''}"
    )


def revert(
    parts: DeviceParts, withdrawal: Withdrawal, client: Any, log: WithdrawalLog | None = None, now: float | None = None
) -> RevertRecord:
    """Go back from the withdrawn version to ``withdrawal.revert_to`` (see the module docstring)."""
    gallery, version, target = parts.gallery, withdrawal.version, withdrawal.revert_to
    under_way = gallery.upgrade_state
    if under_way is not None and (under_way["target"] != version or under_way["mode"] == "forward"):
        raise DeviceError("an upgrade is under way: finish it (`fctkit device upgrade --dir DIR`), then sync again")
    if target not in parts.bundles.versions() and target and client is not None:
        parts.bundles.download(client, target, 0)  # older than the query version: the verified withdrawal names it
    if target == 0 or target not in parts.bundles.versions():
        raise DeviceError(
            f"v{version} was withdrawn, but this device cannot get the bundle of v{target} to go back to: "
            f"it stays on v{version} until a later version is published"
        )
    window = rollback_window(gallery)
    exact = (
        window is not None and window.version == version and window.previous_version == target and window.is_open(now)
    )
    note = "" if exact else _no_window_note(window, version, target, now)
    kept = _kept_rows(parts) if exact else MovedRows([], set(), [])
    live = gallery.live_rows()
    left = {r: entry for r, entry in live.items() if entry[1].version == version and r not in kept.moved}
    backward = _backward_artifact(parts, version, target)
    rest = _through_backward(parts, version, target, left) if backward else _reembedded(parts, client, target, left)
    rest_method = "backward" if backward else "reembedded"
    by_method = {m: n for m, n in (("exact", len(kept.moved)), (rest_method, len(rest.moved))) if n}
    record = RevertRecord(
        version,
        target,
        method_mix(by_method, "exact" if exact else rest_method),
        withdrawal.reason,
        time.time() if now is None else now,
        len(kept.moved) + len(rest.moved),
        len(rest.not_moved),
        rest.not_moved[:LISTED_ITEMS],
        note,
        by_method,
    )
    meta = {
        "query_version": str(target),
        "upgrade": None,  # an upgrade to the withdrawn version that stopped after queries switched (unified mode)
        "transition": None,
        ROLLBACK_KEY: None,
        **revert_meta(record),
        **log_meta(log if log is not None else withdrawal_log(gallery)),
    }
    gallery.revert_rows(kept.batches + rest.batches, meta)
    return record


def _no_window_note(window: RollbackWindow | None, version: int, target: int, now: float | None) -> str:
    if window is None or window.version != version:
        return f"no rollback window kept v{target}'s vectors (the bundle has none, or it was dropped)"
    if window.previous_version != target:
        return f"the rollback window kept v{window.previous_version}'s vectors, not v{target}'s"
    if window.confirmed_at is not None:
        return (
            f"v{version} was confirmed at {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(window.confirmed_at))}: "
            f"the vectors kept of v{target} were dropped then"
        )
    return f"the rollback window closed at {time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(window.until))}: its vectors are gone"


def _kept_rows(parts: DeviceParts) -> MovedRows:
    """The rows' vectors kept at the upgrade, as batches back to their kept tags (those whose kept
    vectors fail to open are left to the other ways)."""
    gallery = parts.gallery
    embeddings, side_infos = gallery.extras.load("rollback_embedding"), gallery.extras.load("rollback_side_info")
    side_of = {int(r): i for i, r in enumerate(side_infos.row_ids)}
    live = gallery.live_rows()
    picked = [
        i
        for i, r in enumerate(embeddings.row_ids)
        if int(r) in side_of and int(r) in live and side_infos.tags[side_of[int(r)]] == embeddings.tags[i]
    ]
    row_ids = [int(embeddings.row_ids[i]) for i in picked]
    return MovedRows(
        _batches(
            row_ids,
            live,
            [embeddings.tags[i] for i in picked],
            _stack([embeddings.embeddings[i] for i in picked]),
            _stack([side_infos.embeddings[side_of[r]] for r in row_ids]),
        ),
        set(row_ids),
        [],
    )


def _backward_artifact(parts: DeviceParts, version: int, target: int):
    matches = [
        a
        for a in parts.bundles.manifest(version).artifacts
        if a.role == "backward" and a.source_version == version and a.target_version == target
    ]
    return matches[0] if len(matches) == 1 else None


def _through_backward(
    parts: DeviceParts, version: int, target: int, left: dict[int, tuple[str, VersionTag]]
) -> MovedRows:
    """Rows of the withdrawn space mapped by its bundle's backward graph B into ``target``'s space
    (tagged 'backward', side-info as it was, like unified mode's rows)."""
    if not left:
        return MovedRows([], set(), [])
    engine = parts.bundles.engine(version)
    rows = parts.gallery.space_rows(version, 0, len(left), only=sorted(left))
    if rows.corrupt:
        row_id, _, reason = rows.corrupt[0]
        raise DeviceError(
            f"row {row_id} cannot be read ({reason}): run `fctkit device repair --dir DIR`, then sync again"
        )
    row_ids = [int(r) for r in rows.row_ids]
    mapped = engine.run(_backward_artifact(parts, version, target), _stack(list(rows.embeddings)))
    tags = [_back_in(left[r][1], target, "backward") for r in row_ids]
    return MovedRows(_batches(row_ids, left, tags, mapped, _stack(list(rows.side_infos))), set(row_ids), [])


def _reembedded(parts: DeviceParts, client: Any, target: int, left: dict[int, tuple[str, VersionTag]]) -> MovedRows:
    """Rows whose originals are in the vault, embedded again by ``target``'s model; the rest (all of
    them without a ``client``) are not moved."""
    engine = parts.bundles.engine(target)
    vault = parts.gallery.replica_log.vault_sha256
    with_original = [r for r in sorted(left) if client is not None and vault(left[r][0]) is not None]
    fetched = set(with_original)
    not_moved = [left[r][0] for r in sorted(left) if r not in fetched]
    batches: list[UpgradedRows] = []
    for start in range(0, len(with_original), BATCH):
        chunk = with_original[start : start + BATCH]
        images, _ = vault_originals(parts, client, [left[r][0] for r in chunk], engine)
        embeddings, side_infos, via = gallery_vectors(engine, images)
        tags = [_back_in(left[r][1], target, via) for r in chunk]
        batches += _batches(chunk, left, tags, embeddings, side_infos)
    return MovedRows(batches, set(with_original), not_moved)


def _back_in(tag: VersionTag, target: int, via: str) -> VersionTag:
    """A row's tag once back in ``target``'s space: a row added on the withdrawn version (or any
    version above ``target``) takes ``target`` as its origin, so that origin <= version holds."""
    return VersionTag(min(tag.origin_version, target), target, via)


def _batches(
    row_ids: list[int],
    live: dict[int, tuple[str, VersionTag]],
    new_tags: list[VersionTag],
    embeddings: np.ndarray,
    side_infos: np.ndarray,
) -> list[UpgradedRows]:
    """One write per (live tag, new tag) pair, each guarded by the live tag."""
    pairs = [(live[r][1], t) for r, t in zip(row_ids, new_tags, strict=True)]
    groups: dict[tuple[VersionTag, VersionTag], list[int]] = {}
    for i, pair in enumerate(pairs):
        groups.setdefault(pair, []).append(i)
    return [
        UpgradedRows(
            [row_ids[i] for i in index],
            [live[row_ids[i]][0] for i in index],
            old,
            new,
            embeddings[index],
            side_infos[index],
        )
        for (old, new), index in groups.items()
    ]


def _stack(vectors: list[np.ndarray]) -> np.ndarray:
    return np.stack(vectors).astype(np.float32, copy=False) if vectors else np.zeros((0, 0), np.float32)

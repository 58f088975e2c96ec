"""Encrypted gallery replication across an owner's devices (``Device.sync`` runs it).

**Push.** Every local change of a live row (add, upgrade switch, in-place upgrade, backfill,
removal) is logged in the gallery's ``changes`` table in the transaction that makes it. A
push seals pending changes under the owner key (:mod:`fctkit.edge_runtime.records`: the row's
content as it is now, or a tombstone) and keeps the sealed bytes in the change (one
transaction), then sends them with their change id as idempotency key and forgets them only
once the server acknowledged them. A crash between the two resends the same bytes: the
server answers with the sequence number it gave them before and stores nothing twice. An
item whose original still waits for upload is pushed after the upload, so the vault blob a
record names is always there for the owner's other devices (backfill, restore).

**Pull.** Records after the gallery's cursor arrive in sequence order, batch by batch; each
batch is opened (authenticated under the owner key: a tampered record or a wrong owner key
stops the pull before anything of the batch is written), then merged **and** the cursor
advanced in one transaction. Merging follows :func:`fctkit.edge_runtime.records.beats`:

* a record at the device's query version replaces the item's row when it beats it;
* a record at an older version is moved to the query version with the installed adapters
  (hop by hop or a direct adapter, as in an upgrade) and lands as a local change, which the
  device pushes in turn (in unified mode, without an adapter, it is comparable as it is);
* a record at a version the device has not installed (or cannot reach with its adapters) is
  kept *pending*, never compared in the wrong space, and applied when the device reaches
  that version (after an upgrade: :func:`apply_pending`);
* a tombstone removes the item everywhere and for good; the device that removed the item
  deletes its original from the vault once the server acknowledged the tombstone.

The server compacts the replica (``fctkit.server.replica_compaction.compact_replica``): it drops records
that lose, in this same order, to a tombstone of the item, to another record of the item at
the same version, or to a record at the version every device of the owner reports. A device
at that version ends with the row it would have had; a device further ahead that moves old
records with its adapters may move a different one of equal rank first, and converges with
the others as before, through the records it pushes back.

Replication waits while an upgrade is in progress (``sync`` finishes the upgrade first).
A device restored from the owner key alone (``init --import-key``, enrol into the owner,
``sync``) rebuilds its gallery from these records: rows at the installed version are the
decrypted record vectors, bit for bit; nothing is re-embedded.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

from fctkit.errors import DeviceError, GalleryError

from .gallery_replica import ItemState, ReplicaWrite, SealedChange
from .gallery_rows import VersionTag
from .records import RecordHeader, RowContent, beats, open_record, seal_record, sealed_sha256
from .upgrade_plan import UpgradePlan, transform_rows

if TYPE_CHECKING:
    from .device_parts import DeviceParts

SEAL_BATCH = 1024  # changes sealed per transaction
PUSH_BATCH = 2048  # sealed records per PushRecords call (acknowledged together)
PULL_BATCH = 1024  # pulled records merged per transaction (with the cursor)


@dataclass
class ReplicationResult:
    """What one :func:`replicate` did: records pulled and how they merged, records pushed."""

    pulled: int = 0
    applied: int = 0
    pending: int = 0
    ignored: int = 0
    removed: int = 0
    pushed: int = 0
    already_stored: int = 0
    originals_deleted: int = 0
    cursor: int = 0
    still_pending: int = 0
    unpushed: int = 0

    def add(self, counts: dict[str, int]) -> None:
        self.applied += counts.get("row", 0)
        self.pending += counts.get("pending", 0)
        self.ignored += counts.get("ignore", 0)
        self.removed += counts.get("tombstone", 0)


@dataclass(frozen=True)
class Incoming:
    """An opened record and where it lands on this device (``landing`` None: keep it pending)."""

    sequence: int
    header: RecordHeader
    sealed: bytes
    content: RowContent | None
    landing: tuple[VersionTag, np.ndarray, np.ndarray] | None

    @property
    def item_id(self) -> str:
        return self.header.item_id


def replicate(device: DeviceParts, client, *, on_batch=None) -> ReplicationResult:
    """Apply pending records the device can now place, pull everything after the cursor,
    push the device's changes. ``on_batch(kind, records)`` after each committed batch."""
    _check_ready(device)
    result = ReplicationResult()
    result.add(apply_pending(device))
    pull(device, client, result, on_batch=on_batch)
    push(device, client, result, on_batch=on_batch)
    counts = device.gallery.replica_log.replication_counts()
    result.cursor, result.still_pending, result.unpushed = counts["cursor"], counts["pending"], counts["unpushed"]
    return result


def _check_ready(device: DeviceParts) -> None:
    if not device.owner_id:
        raise DeviceError("this device belongs to no owner yet: enrol it (`fctkit device enrol`) to replicate")
    if device.gallery.upgrade_state is not None:
        raise DeviceError("an upgrade is in progress: finish it (`fctkit device upgrade`) before replicating")


# -- push -----------------------------------------------------------------------------------


def seal_changes(device: DeviceParts, limit: int = SEAL_BATCH) -> int:
    """Seal up to ``limit`` logged changes under the owner key; returns how many were looked at."""
    log = device.gallery.replica_log
    changes = log.unsealed_changes(limit)
    if not changes:
        return 0
    rows, vault_shas = log.load_items([item for _, item, tombstone in changes if not tombstone])
    if rows.corrupt:
        row_id, item_id, reason = rows.corrupt[0]
        raise GalleryError(f"row {row_id} ({item_id!r}) cannot be read to replicate it: {reason}; remove it and sync again")
    at = {item: k for k, item in enumerate(rows.item_ids)}
    owner, owner_id = device.owner_sealer, device.owner_id
    sealed = []
    for change_id, item_id, tombstone in changes:
        if tombstone:
            tag, content = None, None
        elif item_id in at:
            k = at[item_id]
            tag = rows.tags[k]
            content = RowContent(np.asarray(rows.embeddings[k]), np.asarray(rows.side_infos[k]), rows.labels[k], vault_shas[item_id])
        else:
            tag, content = VersionTag(1, 1, "native"), None  # the row is gone: the change is stale (dropped below)
        record = seal_record(owner, owner_id, item_id, tag, content) if tombstone or content else b""
        sealed.append(SealedChange(change_id, item_id, tag, record, sealed_sha256(record)))
    log.store_sealed(sealed)
    return len(changes)


def push(device: DeviceParts, client, result: ReplicationResult, *, on_batch=None) -> None:
    """Seal and push every logged change (see the module docstring)."""
    from fctkit.protos import vault_pb2

    log = device.gallery.replica_log
    while True:
        looked_at = seal_changes(device)
        while batch := log.sealed_changes(PUSH_BATCH):
            response = client.push_records([
                vault_pb2.SealedRecord(change_id=c, item_id=i, version=v, origin_version=o, via=via, tombstone=t, sealed=s)
                for c, i, v, o, via, t, s in batch])
            log.mark_pushed([c for c, *_ in batch])
            result.pushed += response.stored
            result.already_stored += response.already_stored
            if on_batch is not None:
                on_batch("push", len(batch))
        if not looked_at:
            break
    result.originals_deleted += delete_removed_originals(device, client)


def delete_removed_originals(device: DeviceParts, client) -> int:
    """Delete from the vault the originals of items removed here, once their tombstones are
    acknowledged (the owner's other devices learn of the removal first). Returns how many."""
    from fctkit.errors import RpcStatusError

    deleted = 0
    for item_id, sha256 in device.gallery.replica_log.originals_to_delete():
        try:
            client.delete_blob(sha256)
            deleted += 1
        except RpcStatusError as exc:
            if exc.code != "NOT_FOUND":  # already gone: nothing left to do
                raise
        device.gallery.replica_log.forget_original(item_id)
    return deleted


# -- pull -----------------------------------------------------------------------------------


def pull(device: DeviceParts, client, result: ReplicationResult, *, on_batch=None) -> None:
    """Merge every record after the gallery's cursor, one transaction per :data:`PULL_BATCH` records."""
    log = device.gallery.replica_log
    for response in client.pull_records(after_sequence=log.replica_cursor):
        for start in range(0, len(response.records), PULL_BATCH):
            messages = response.records[start:start + PULL_BATCH]
            opened = [_open(device, m.sequence, m.item_id, _tag_of(m), m.sealed) for m in messages]
            placed = _place(device, opened)
            result.add(log.merge_replica(placed, _decide, cursor=messages[-1].sequence))
            result.pulled += len(placed)
            if on_batch is not None:
                on_batch("pull", len(placed))


def apply_pending(device: DeviceParts) -> dict[str, int]:
    """Merge the kept records whose version the device has reached (one transaction)."""
    log = device.gallery.replica_log
    if not device.version or not device.owner_id:
        return {}
    kept = log.pending_records(device.version)
    if not kept:
        return {}
    opened = [_open(device, seq, item, VersionTag(origin, version, via), sealed) for seq, item, version, origin, via, sealed in kept]
    placed = _place(device, opened)
    done = [r.sequence for r in placed if r.landing is not None]
    return log.merge_replica([r for r in placed if r.landing is not None], _decide, done_pending=done)


def _tag_of(message) -> VersionTag | None:
    if message.tombstone:
        return None
    try:
        return VersionTag(message.origin_version, message.version, message.via)
    except GalleryError as exc:
        raise GalleryError(f"replica record of item {message.item_id!r} has a bad version tag: {exc}") from None


def _open(device: DeviceParts, sequence: int, item_id: str, tag: VersionTag | None, sealed: bytes) -> Incoming:
    content = open_record(device.owner_sealer, device.owner_id, item_id, tag, sealed)
    return Incoming(sequence, RecordHeader(item_id, tag, sealed_sha256(sealed)), sealed, content, None)


def _place(device: DeviceParts, records: Sequence[Incoming]) -> list[Incoming]:
    """Each record with its landing on this device: as it is at the query version, moved there
    by the installed adapters from an older one (batched per tag), or None (pending)."""
    version = device.version
    landing: dict[int, tuple[VersionTag, np.ndarray, np.ndarray]] = {}
    groups: dict[VersionTag, list[int]] = {}
    for k, record in enumerate(records):
        tag = record.header.tag
        if tag is None or not version or tag.version > version:
            continue
        if tag.version == version:
            landing[k] = (tag, record.content.embedding, record.content.side_info)
        else:
            groups.setdefault(tag, []).append(k)
    for tag, members in groups.items():
        plan = local_plan(device, tag.version, version)
        embeddings = np.stack([records[k].content.embedding for k in members])
        side_infos = np.stack([records[k].content.side_info for k in members])
        if plan is None:
            if device.engine().manifest.mode != "unified":
                continue  # no adapter from that version here: pending
            new_tag = tag  # unified: every row is comparable as it is
        else:
            engines = {h.bundle: device.engine(h.bundle) for h in plan.hops if h.forward is not None}
            new_tag, embeddings, side_infos = transform_rows(plan, engines, tag, embeddings, side_infos)
        for j, k in enumerate(members):
            landing[k] = (new_tag, embeddings[j], side_infos[j])
    return [Incoming(r.sequence, r.header, r.sealed, r.content, landing.get(k)) for k, r in enumerate(records)]


def _decide(record: Incoming, state: ItemState) -> ReplicaWrite:
    item_id, header = record.item_id, record.header
    if header.tombstone:
        return ReplicaWrite("ignore" if state.tombstoned and state.tag is None else "tombstone", item_id)
    if state.tombstoned or not beats(header, state.tag, state.record_sha256):
        return ReplicaWrite("ignore", item_id)
    if record.landing is None:
        return ReplicaWrite("pending", item_id, tag=header.tag, sequence=record.sequence, sealed=record.sealed)
    tag, embedding, side_info = record.landing
    moved = tag != header.tag
    if moved and state.tag is not None and RecordHeader(item_id, tag, "").rank <= RecordHeader(item_id, state.tag, "").rank:
        return ReplicaWrite("ignore", item_id)  # the row here is already at least as good
    content = record.content
    return ReplicaWrite("row", item_id, tag=tag, embedding=embedding, side_info=side_info, label=content.label,
                        vault_sha256=content.vault_sha256, record_sha256=None if moved else header.sha256)


def local_plan(device: DeviceParts, source: int, target: int) -> UpgradePlan | None:
    """Hops from ``source`` to ``target`` through the installed bundles (as an offline upgrade
    plans them), or None when none connects."""
    hops = device.bundles.hops(source, target)
    return None if hops is None else UpgradePlan(target, device.engine(target).manifest.mode, tuple(hops))

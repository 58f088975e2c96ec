"""Encrypted gallery replication across an owner's devices (``Device.sync`` runs it).

**Push.** Every local change of a live row (add, upgrade switch, in-place upgrade, backfill,
removal) is logged in the gallery's ``changes`` table in the transaction that makes it. A
push seals pending changes under the owner key as **blocks** (:mod:`fctkit.edge_runtime.records`:
up to 4,096 rows of one version tag, as they are now, or tombstones, in one AES-GCM record of at
most 1 MiB) and keeps the sealed blocks (one transaction reads, seals and keeps them), then
sends them with their first change id as idempotency key and forgets them only once the server
acknowledged them. A crash between the two resends the same bytes: the server answers with the
sequence number it gave them before and stores nothing twice. An item whose original still
waits for upload is pushed after the upload, so the vault blob a record names is always there
for the owner's other devices (backfill, restore).

**Pull.** Records after the gallery's cursor arrive in sequence order, message by message; each
record is opened (authenticated under the owner key: a tampered record or a wrong owner key
stops the pull before anything of them is written), then about 8,192 rows of records are
merged **and** the cursor advanced in one transaction. A block is merged in one pass against
its items' states (rows skipped that the server reports superseded); its rows are written
together. Merging follows :func:`fctkit.edge_runtime.records.beats`, with a block's SHA-256
standing for each of its rows:

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

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any, cast

import numpy as np

from fctkit.errors import DeviceError, GalleryError
from fctkit.protos import limits

from .gallery.replica_log import BlockMerge, ItemState, OutgoingBlock, PendingBlock, ReplicaRows
from .gallery.rows import VersionTag
from .records import RecordHeader, beats, open_block, seal_block, sealed_sha256
from .upgrade_plan import UpgradePlan, transform_rows

if TYPE_CHECKING:
    from fctkit.protos import vault_pb2
    from fctkit.protos.client import FctkitClient

    from .device_parts import DeviceParts

OnBatch = Callable[[str, int], object]  # on_batch(kind, rows): "push" or "pull", after each committed batch

SEAL_BATCH = 16384  # changes sealed per transaction
PUSH_ROWS = limits.MAX_RECORDS_PER_PUSH  # rows per PushRecords call (acknowledged together)
PULL_ROWS = 8192  # pulled rows merged per transaction (with the cursor)
_BLOCK_BYTES = limits.MAX_RECORD_BATCH_BYTES - 1024  # a block's plaintext, with room for the header and the seal


@dataclass
class ReplicationResult:
    """What one :func:`replicate` did, in rows: pulled and how they merged, pushed (stored now,
    or already stored by an earlier try)."""

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
    """A pulled record, opened: its live rows (positions ``live``) and where they land on this
    device (``landing`` None: keep the record pending)."""

    pending: PendingBlock  # the record as it would be kept
    sha256: str
    rows: ReplicaRows | None
    live: list[int]
    landing: tuple[VersionTag, ReplicaRows] | None = None

    @property
    def tag(self) -> VersionTag | None:  # None: tombstones
        return self.pending.tag

    @property
    def item_ids(self) -> list[str]:
        return [self.pending.item_ids[k] for k in self.live]


def replicate(device: DeviceParts, client: FctkitClient, *, on_batch: OnBatch | None = None) -> ReplicationResult:
    """Apply pending records the device can now place, pull everything after the cursor,
    push the device's changes. ``on_batch(kind, rows)`` after each committed batch."""
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
    """Seal up to ``limit`` logged changes under the owner key, as blocks; returns how many were looked at."""
    owner, owner_id = device.owner_sealer, cast(str, device.owner_id)  # replicate() refuses a device without owner

    def seal(tag: VersionTag | None, rows: ReplicaRows) -> list[tuple[tuple[str, ...], bytes]]:
        return [(part.item_ids, seal_block(owner, owner_id, tag, part)) for part in block_parts(rows)]

    return device.gallery.replica_log.seal_changes(limit, seal)


def block_parts(rows: ReplicaRows) -> list[ReplicaRows]:
    """``rows`` cut into blocks within the wire limits (rows, sealed bytes, item id bytes)."""
    vector_bytes = 4 * (rows.embeddings.shape[1] + rows.side_infos.shape[1]) + 38  # + label flag, length, vault SHA
    parts, start, size, id_bytes = [], 0, 0, 0
    for k, (item_id, label) in enumerate(zip(rows.item_ids, rows.labels, strict=True)):
        row_size, row_ids = vector_bytes + (len(label.encode("utf-8")) if label else 0), len(item_id.encode("utf-8"))
        if k > start and (
            k - start == limits.MAX_BLOCK_ROWS
            or size + row_size > _BLOCK_BYTES
            or id_bytes + row_ids > limits.MAX_ITEM_ID_BATCH_BYTES
        ):
            parts.append(rows.take(range(start, k)))
            start, size, id_bytes = k, 0, 0
        size, id_bytes = size + row_size, id_bytes + row_ids
    return [*parts, rows.take(range(start, len(rows)))] if len(rows) else parts


def push(
    device: DeviceParts, client: FctkitClient, result: ReplicationResult, *, on_batch: OnBatch | None = None
) -> None:
    """Seal and push every logged change (see the module docstring). While the server stores one
    batch, the next changes are sealed: the call runs on its own thread, every database write on
    this one, and batches go out one at a time, oldest first."""
    log = device.gallery.replica_log
    with ThreadPoolExecutor(1, thread_name_prefix="fctkit-push") as network:
        in_flight = None
        while True:
            looked_at = seal_changes(device)
            if in_flight is not None:
                batch, call = in_flight
                response = call.result()
                log.mark_pushed([b.key for b in batch])
                result.pushed += response.stored_rows
                result.already_stored += response.already_stored_rows
                if on_batch is not None:
                    on_batch("push", sum(len(b.item_ids) for b in batch))
            batch = log.outgoing(PUSH_ROWS)
            in_flight = (
                (batch, network.submit(client.push_records, [record_message(b) for b in batch])) if batch else None
            )
            if not looked_at and in_flight is None:
                break
    result.originals_deleted += delete_removed_originals(device, client)


def record_message(block: OutgoingBlock) -> vault_pb2.SealedRecord:
    """The SealedRecord of a sealed outgoing record."""
    from fctkit.protos import vault_pb2

    tag = block.tag
    header: dict[str, Any] = (
        {} if tag is None else {"version": tag.version, "origin_version": tag.origin_version, "via": tag.via}
    )
    ids: dict[str, Any] = {"item_ids": block.item_ids} if block.block else {"item_id": block.item_ids[0]}
    return vault_pb2.SealedRecord(change_id=block.key, tombstone=tag is None, sealed=block.sealed, **header, **ids)


def delete_removed_originals(device: DeviceParts, client: FctkitClient) -> int:
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


def pull(
    device: DeviceParts, client: FctkitClient, result: ReplicationResult, *, on_batch: OnBatch | None = None
) -> None:
    """Merge every record after the gallery's cursor, one transaction per :data:`PULL_ROWS` rows
    or so (whole messages; each transaction also advances the cursor)."""
    log = device.gallery.replica_log
    opened: list[Incoming] = []

    def merge() -> None:
        counts = log.merge_blocks(opened, _decide, cursor=opened[-1].pending.sequence)
        rows = sum(len(r.live) for r in opened)
        result.add(counts)
        result.pulled += rows
        opened.clear()
        if on_batch is not None:
            on_batch("pull", rows)

    for response in client.pull_records(after_sequence=log.replica_cursor):
        opened += [_place(device, _open(device, _pulled(m))) for m in response.records]
        if sum(len(r.pending.item_ids) for r in opened) >= PULL_ROWS:
            merge()
    if opened:
        merge()


def apply_pending(device: DeviceParts) -> dict[str, int]:
    """Merge the kept records whose version the device has reached (one transaction)."""
    log = device.gallery.replica_log
    if not device.version or not device.owner_id:
        return {}
    kept = log.pending_blocks(device.version)
    if not kept:
        return {}
    placed = [r for r in (_place(device, _open(device, k)) for k in kept) if r.landing is not None]
    return log.merge_blocks(placed, _decide, done_pending=[r.pending.sequence for r in placed])


def _pulled(message: vault_pb2.SealedRecord) -> PendingBlock:
    """A pulled message as a record to open (its rows and tag checked)."""
    block = bool(message.item_ids)
    item_ids = tuple(message.item_ids) if block else (message.item_id,)
    if not all(item_ids) or any(k >= len(item_ids) for k in message.superseded):
        raise GalleryError(f"replica record {message.sequence} names an empty item id or skips rows it does not have")
    try:
        tag = None if message.tombstone else VersionTag(message.origin_version, message.version, message.via)
    except GalleryError as exc:
        raise GalleryError(
            f"replica record {message.sequence} of item {item_ids[0]!r} has a bad version tag: {exc}"
        ) from None
    return PendingBlock(message.sequence, block, tag, item_ids, tuple(message.superseded), message.sealed)


def _open(device: DeviceParts, record: PendingBlock) -> Incoming:
    rows = open_block(
        device.owner_sealer,
        cast(str, device.owner_id),  # replicate() and apply_pending() refuse a device without owner
        record.item_ids,
        record.tag,
        record.sealed,
        block=record.block,
    )
    skipped = set(record.skipped)
    live = [k for k in range(len(record.item_ids)) if k not in skipped]
    return Incoming(record, sealed_sha256(record.sealed), rows, live)


def _place(device: DeviceParts, record: Incoming) -> Incoming:
    """The record with where its rows land on this device: as they are at the query version,
    moved there by the installed adapters from an older one (one transform per record), or
    nowhere yet (kept pending)."""
    version, tag = device.version, record.tag
    if tag is None or not version or tag.version > version:
        return record
    rows = record.rows
    assert rows is not None  # only tombstones (no tag) have no rows
    if tag.version == version:
        return replace(record, landing=(tag, rows))
    plan = local_plan(device, tag.version, version)
    if plan is None:
        if device.engine().manifest.mode != "unified":
            return record  # no adapter from that version here: pending
        return replace(record, landing=(tag, rows))  # unified: every row is comparable as it is
    live = record.live
    engines = {h.bundle: device.engine(h.bundle) for h in plan.hops if h.forward is not None}
    new_tag, embeddings, side_infos = transform_rows(plan, engines, tag, rows.embeddings[live], rows.side_infos[live])
    moved = (
        np.zeros((len(rows), embeddings.shape[1]), np.float32),
        np.zeros((len(rows), side_infos.shape[1]), np.float32),
    )
    moved[0][live], moved[1][live] = embeddings, side_infos
    return replace(record, landing=(new_tag, replace(rows, embeddings=moved[0], side_infos=moved[1])))


def _decide(record: Incoming, states: dict[str, ItemState]) -> BlockMerge:
    """What the record's live rows do against their items' states (items without one: no row here)."""
    item_ids = record.pending.item_ids
    if record.tag is None:
        removed = [item_ids[k] for k in record.live if not _gone(states.get(item_ids[k]))]
        return BlockMerge(tombstones=removed, ignored=len(record.live) - len(removed))
    winners = [k for k in record.live if _wins(record, states.get(item_ids[k]))]
    ignored = len(record.live) - len(winners)
    if record.landing is None:
        if not winners:
            return BlockMerge(ignored=ignored)
        return BlockMerge(pending=record.pending, pending_rows=len(winners), ignored=ignored)
    tag, rows = record.landing
    moved = tag != record.tag
    if moved:  # a row here already at least as good as the moved one stays
        rank = RecordHeader("", tag, "").rank
        kept = [
            k
            for k in winners
            if (s := states.get(item_ids[k])) is None or s.tag is None or rank > RecordHeader("", s.tag, "").rank
        ]
        winners, ignored = kept, ignored + len(winners) - len(kept)
    return BlockMerge(
        content=rows, rows=winners, tag=tag, record_sha256=None if moved else record.sha256, ignored=ignored
    )


def _gone(state: ItemState | None) -> bool:
    return state is not None and state.tombstoned and state.tag is None


def _wins(record: Incoming, state: ItemState | None) -> bool:
    if state is None:
        return True  # no row, no tombstone
    return not state.tombstoned and beats(RecordHeader("", record.tag, record.sha256), state.tag, state.record_sha256)


def local_plan(device: DeviceParts, source: int, target: int) -> UpgradePlan | None:
    """Hops from ``source`` to ``target`` through the installed bundles (as an offline upgrade
    plans them), or None when none connects."""
    hops = device.bundles.hops(source, target)
    return None if hops is None else UpgradePlan(target, device.engine(target).manifest.mode, tuple(hops))

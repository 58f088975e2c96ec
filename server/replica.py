"""The Vault service's replica RPCs: each owner's replicated, sealed gallery records.

A device pushes its new and changed gallery rows as blocks of records sealed under the owner key (the
server never has it) and pulls the records its owner's other devices pushed. The server
checks the plaintext fields and sizes, gives every new record the owner's next sequence
number in the transaction that stores it, and answers a retried push (same device, same
change id) with what it stored before, never storing a record twice.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence

from fctkit.errors import RpcStatusError
from fctkit.protos import limits, vault_pb2

from .auth import current_device_id, current_owner_id
from .storage import ReplicaQuotaExceeded, ReplicaRecord, Storage
from .validation import counter_field, invalid, quoted, text_field, text_fields, timestamp

VIAS = ("native", "forward", "backward")
_SEALED_OVERHEAD = 28  # nonce (12) + tag (16): the smallest sealed record


def replica_record(message: vault_pb2.SealedRecord, index: int) -> ReplicaRecord:
    """The checked record of a pushed message; INVALID_ARGUMENT naming the field otherwise."""
    field = f"records[{index}]"
    if message.change_id == 0:
        raise invalid(f"{field}.change_id must be positive (the device's idempotency key)")
    counter_field(message.change_id, f"{field}.change_id")
    item_ids, max_sealed = _item_ids(message, field)
    if message.tombstone:
        if message.via:
            raise invalid(f"{field}.via must be empty for a tombstone")
    else:
        if message.via not in VIAS:
            raise invalid(f"{field}.via is {quoted(message.via)}; one of {', '.join(VIAS)}")
        if not 0 < message.origin_version <= message.version:
            raise invalid(
                f"{field}: origin_version {message.origin_version} and version {message.version} "
                "must satisfy 0 < origin_version <= version"
            )
    if not _SEALED_OVERHEAD <= len(message.sealed) <= max_sealed:
        raise invalid(
            f"{field}.sealed has {len(message.sealed)} bytes; a sealed {'block' if message.item_ids else 'record'} "
            f"has {_SEALED_OVERHEAD} to {max_sealed}"
        )
    if message.sequence or message.superseded:
        raise invalid(f"{field}.sequence and .superseded are set by the server; leave them empty")
    return ReplicaRecord(
        message.change_id,
        item_ids,
        message.version,
        message.origin_version,
        message.via,
        message.tombstone,
        message.sealed,
        block=bool(message.item_ids),
    )


def _item_ids(message: vault_pb2.SealedRecord, field: str) -> tuple[tuple[str, ...], int]:
    """The record's checked item ids (one, or a block's) and the most sealed bytes it may have."""
    if not message.item_ids:
        item_id = text_field(message.item_id, f"{field}.item_id")
        if not item_id:
            raise invalid(f"{field}.item_id is empty (set item_id for a single-row record or item_ids for a block)")
        return (item_id,), limits.MAX_RECORD_BYTES
    if message.item_id:
        raise invalid(f"{field}: set item_id (a single-row record) or item_ids (a block), not both")
    if len(message.item_ids) > limits.MAX_BLOCK_ROWS:
        raise invalid(
            f"{field}.item_ids holds {len(message.item_ids)} rows; a block holds at most {limits.MAX_BLOCK_ROWS}"
        )
    item_ids = text_fields(message.item_ids, f"{field}.item_ids")
    if not all(item_ids):
        raise invalid(f"{field}.item_ids[{item_ids.index('')}] is empty")
    if len(set(item_ids)) != len(item_ids):
        raise invalid(f"{field}.item_ids names an item twice; a block holds one row per item")
    return item_ids, limits.MAX_RECORD_BATCH_BYTES


def _checked_batch(request: vault_pb2.PushRecordsRequest) -> list[ReplicaRecord]:
    batch = [replica_record(r, i) for i, r in enumerate(request.records)]
    rows = sum(len(r.item_ids) for r in batch)
    if rows > limits.MAX_RECORDS_PER_MESSAGE:
        raise invalid(f"a PushRecords message holds {rows} rows; at most {limits.MAX_RECORDS_PER_MESSAGE}")
    sealed_bytes, id_bytes = _sizes(batch)
    if sealed_bytes > limits.MAX_RECORD_BATCH_BYTES:
        raise invalid(
            f"a PushRecords message holds {sealed_bytes} sealed bytes; at most {limits.MAX_RECORD_BATCH_BYTES}"
        )
    if id_bytes > limits.MAX_ITEM_ID_BATCH_BYTES:
        raise invalid(
            f"a PushRecords message holds {id_bytes} bytes of item ids; at most {limits.MAX_ITEM_ID_BATCH_BYTES}"
        )
    return batch


def _sizes(records: Sequence[ReplicaRecord]) -> tuple[int, int]:
    """(sealed bytes, UTF-8 bytes of item ids) of ``records``."""
    return sum(len(r.sealed) for r in records), sum(len("".join(r.item_ids).encode("utf-8")) for r in records)


def _message(record: ReplicaRecord) -> vault_pb2.SealedRecord:
    ids = (
        {"item_ids": record.item_ids, "superseded": record.superseded}
        if record.block
        else {"item_id": record.item_ids[0]}
    )
    return vault_pb2.SealedRecord(
        change_id=record.change_id,
        version=record.version,
        origin_version=record.origin_version,
        via=record.via,
        tombstone=record.tombstone,
        sealed=record.sealed,
        sequence=record.sequence,
        **ids,
    )


class ReplicaHandlers:
    """PushRecords and PullRecords; mixed into :class:`fctkit.server.vault.VaultService`."""

    _storage: Storage
    _replica_quota: int

    def _requested_owner(self, owner_id: str) -> str:
        """The caller's owner; PERMISSION_DENIED when the request names another one."""
        own = current_owner_id()
        if owner_id and owner_id != own:
            raise RpcStatusError("PERMISSION_DENIED", "a device reaches only its own owner's blobs and records")
        return own

    async def PushRecords(self, requests: AsyncIterator[vault_pb2.PushRecordsRequest], context):
        device_id, owner_id = current_device_id(), current_owner_id()
        stored = already = stored_rows = already_rows = 0
        sequences: list[int] = []
        _, last = self._storage.replica_usage(owner_id)
        rows = 0
        async for request in requests:
            batch = _checked_batch(request)
            rows += sum(len(r.item_ids) for r in batch)
            if rows > limits.MAX_RECORDS_PER_PUSH:
                raise invalid(
                    f"a PushRecords call holds at most {limits.MAX_RECORDS_PER_PUSH} rows; push the rest in "
                    f"another call (the {len(sequences)} records stored so far are kept)"
                )
            if not batch:
                continue
            try:
                outcome = self._storage.push_records(owner_id, device_id, batch, timestamp(), self._replica_quota)
            except ReplicaQuotaExceeded as exceeded:
                raise RpcStatusError(
                    "RESOURCE_EXHAUSTED",
                    f"replica quota exceeded: {exceeded}; remove items (tombstones are small) or ask for more",
                ) from None
            stored, already, last = stored + outcome.stored, already + outcome.already_stored, outcome.last_sequence
            stored_rows, already_rows = stored_rows + outcome.stored_rows, already_rows + outcome.already_stored_rows
            sequences += outcome.sequences
        return vault_pb2.PushRecordsResponse(
            stored=stored,
            already_stored=already,
            last_sequence=last,
            sequences=sequences,
            stored_rows=stored_rows,
            already_stored_rows=already_rows,
        )

    async def PullRecords(self, request: vault_pb2.PullRecordsRequest, context):
        owner_id = self._requested_owner(request.owner_id)
        after = counter_field(request.after_sequence, "after_sequence")
        while True:
            records = self._storage.pull_records(
                owner_id, after, limits.MAX_RECORDS_PER_MESSAGE, limits.MAX_RECORD_BATCH_BYTES
            )
            batch: list[ReplicaRecord] = []
            id_bytes = 0
            for record in records:
                id_bytes += _sizes([record])[1]
                if batch and id_bytes > limits.MAX_ITEM_ID_BATCH_BYTES:
                    break
                batch.append(record)
            if not batch:
                return
            after = batch[-1].sequence
            _, last = self._storage.replica_usage(owner_id)
            yield vault_pb2.PullRecordsResponse(records=[_message(r) for r in batch], last_sequence=last)

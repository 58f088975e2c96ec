"""The Vault service's replica RPCs: each owner's replicated, sealed gallery records.

A device pushes its new and changed gallery rows as records sealed under the owner key (the
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
from .storage import ReplicaRecord, Storage
from .validation import counter_field, invalid, text_field, timestamp

VIAS = ("native", "forward", "backward")
_SEALED_OVERHEAD = 28  # nonce (12) + tag (16): the smallest sealed record


def replica_record(message: vault_pb2.SealedRecord, index: int) -> ReplicaRecord:
    """The checked record of a pushed message; INVALID_ARGUMENT naming the field otherwise."""
    field = f"records[{index}]"
    if message.change_id == 0:
        raise invalid(f"{field}.change_id must be positive (the device's idempotency key)")
    counter_field(message.change_id, f"{field}.change_id")
    item_id = text_field(message.item_id, f"{field}.item_id")
    if not item_id:
        raise invalid(f"{field}.item_id is empty")
    if message.tombstone:
        if message.via:
            raise invalid(f"{field}.via must be empty for a tombstone")
    else:
        if message.via not in VIAS:
            raise invalid(f"{field}.via is {message.via!r}; one of {', '.join(VIAS)}")
        if not 0 < message.origin_version <= message.version:
            raise invalid(f"{field}: origin_version {message.origin_version} and version {message.version} "
                          "must satisfy 0 < origin_version <= version")
    if not _SEALED_OVERHEAD <= len(message.sealed) <= limits.MAX_RECORD_BYTES:
        raise invalid(f"{field}.sealed has {len(message.sealed)} bytes; a sealed record has "
                      f"{_SEALED_OVERHEAD} to {limits.MAX_RECORD_BYTES}")
    if message.sequence:
        raise invalid(f"{field}.sequence is set by the server; leave it 0")
    return ReplicaRecord(message.change_id, item_id, message.version, message.origin_version, message.via,
                         message.tombstone, message.sealed)


def _checked_batch(request: vault_pb2.PushRecordsRequest) -> list[ReplicaRecord]:
    records = request.records
    if len(records) > limits.MAX_RECORDS_PER_MESSAGE:
        raise invalid(f"a PushRecords message holds {len(records)} records; at most {limits.MAX_RECORDS_PER_MESSAGE}")
    batch = [replica_record(r, i) for i, r in enumerate(records)]
    sealed_bytes = sum(len(r.sealed) for r in batch)
    if sealed_bytes > limits.MAX_RECORD_BATCH_BYTES:
        raise invalid(f"a PushRecords message holds {sealed_bytes} sealed bytes; at most {limits.MAX_RECORD_BATCH_BYTES}")
    return batch


def _message(record: ReplicaRecord) -> vault_pb2.SealedRecord:
    return vault_pb2.SealedRecord(
        change_id=record.change_id, item_id=record.item_id, version=record.version,
        origin_version=record.origin_version, via=record.via, tombstone=record.tombstone,
        sealed=record.sealed, sequence=record.sequence,
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

    def _check_replica_quota(self, owner_id: str, batch: Sequence[ReplicaRecord]) -> None:
        used, _ = self._storage.replica_usage(owner_id)
        extra = sum(len(r.sealed) for r in batch)
        if used + extra > self._replica_quota:
            raise RpcStatusError("RESOURCE_EXHAUSTED", f"replica quota exceeded: {used} sealed bytes stored + {extra} "
                                 f"new > {self._replica_quota}; remove items (tombstones are small) or ask for more")

    async def PushRecords(self, requests: AsyncIterator[vault_pb2.PushRecordsRequest], context):
        device_id, owner_id = current_device_id(), current_owner_id()
        stored = already = 0
        sequences: list[int] = []
        _, last = self._storage.replica_usage(owner_id)
        async for request in requests:
            batch = _checked_batch(request)
            if len(sequences) + len(batch) > limits.MAX_RECORDS_PER_PUSH:
                raise invalid(f"a PushRecords call holds at most {limits.MAX_RECORDS_PER_PUSH} records; push the rest in "
                              f"another call (the {len(sequences)} stored so far are kept)")
            if not batch:
                continue
            self._check_replica_quota(owner_id, batch)
            outcome = self._storage.push_records(owner_id, device_id, batch, timestamp())
            stored, already, last = stored + outcome.stored, already + outcome.already_stored, outcome.last_sequence
            sequences += outcome.sequences
        return vault_pb2.PushRecordsResponse(stored=stored, already_stored=already, last_sequence=last, sequences=sequences)

    async def PullRecords(self, request: vault_pb2.PullRecordsRequest, context):
        owner_id = self._requested_owner(request.owner_id)
        after = counter_field(request.after_sequence, "after_sequence")
        while True:
            records = self._storage.pull_records(owner_id, after, limits.MAX_RECORDS_PER_MESSAGE)
            batch, size = [], 0
            for record in records:
                if batch and size + len(record.sealed) > limits.MAX_RECORD_BATCH_BYTES:
                    break
                batch.append(record)
                size += len(record.sealed)
            if not batch:
                return
            after = batch[-1].sequence
            _, last = self._storage.replica_usage(owner_id)
            yield vault_pb2.PullRecordsResponse(records=[_message(r) for r in batch], last_sequence=last)

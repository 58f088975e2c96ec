"""The Vault service: each owner's end-to-end encrypted image blobs and gallery replica.

The server stores exactly the bytes it receives (ciphertext; it never sees a key), names them
by SHA-256 and lets a device reach only its owner's (any device of the owner reaches every
blob of the owner; the uploading device is recorded for audit). A blob is stored once per
owner, whichever devices upload it, and any device of the owner may delete it. The quota is
per owner and counts unfinished uploads at their announced size (:mod:`.upload_sessions`).
The replica RPCs live in :mod:`fctkit.server.replica`.

An interrupted upload stays in the storage's unfinished uploads (:mod:`.partial_uploads`: a
file under ``DATA/tmp/uploads``, or part objects in the bucket) and can be resumed by any device
of the owner, through any replica, (Stat tells how much arrived) until it has been idle for the server's
``partial_upload_ttl_s`` (only arriving bytes count as activity, not headers); then
:meth:`VaultService.sweep_uploads` gives its bytes back. The call receiving an upload holds its
lease in the database (:class:`UploadLease`), so on one replica or across many: an upload in
progress is never removed, a second upload of the same blob by the same owner while one runs
gets ABORTED (retryable), and a Delete leaves it alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator

from fctkit.errors import RpcStatusError
from fctkit.protos import limits, vault_pb2, vault_pb2_grpc
from fctkit.protos.bundle import file_sha256

from .auth import current_device_id, current_owner_id
from .database import storage_unreachable
from .partial_uploads import IncompleteUpload
from .replica import ReplicaHandlers
from .storage import BlobRecord, Storage
from .streams import Sink, check_offset, file_chunks, open_stored, read_header, receive_chunks
from .upload_sessions import LEASE_STALE_S
from .validation import chunk_size, invalid, page_size, sha256_field, text_field, timestamp

LEASE_RENEW_S = LEASE_STALE_S / 5  # how often a call renews its upload's lease
_RUNNING = "an upload of this blob is in progress (from this or another device of the owner, on any replica)"


def _blob_info(record: BlobRecord) -> vault_pb2.BlobInfo:
    return vault_pb2.BlobInfo(
        sha256=record.sha256, size=record.size, item_id=record.item_id, created_at=record.created_at
    )


class UploadLease:
    """One call's hold on an unfinished upload (owner, SHA-256), in the database: taken before
    the call changes its bytes, renewed every :data:`LEASE_RENEW_S` while the call runs, given
    back when it ends. Its :meth:`guarding` sink counts the bytes that arrive (they restart the
    upload's idle clock) and refuses them once the lease was lost (this replica stalled past
    :data:`LEASE_STALE_S` and another call took the upload over)."""

    def __init__(self, storage: Storage, owner_id: str, sha256: str) -> None:
        self._storage, self.owner_id, self.sha256 = storage, owner_id, sha256
        self.token = uuid.uuid4().hex
        self.had_reservation = False
        self.received = 0
        self._renewed_at = 0
        self._lost = False

    def take(self, device_id: str) -> bool:
        taken = self._storage.begin_upload(self.owner_id, self.sha256, device_id, self.token, time.time())
        self.had_reservation = bool(taken)
        return taken is not None

    def renew(self) -> None:
        arrived, self._renewed_at = self.received > self._renewed_at, self.received
        self._lost = not self._storage.renew_upload(self.owner_id, self.sha256, self.token, time.time(), arrived)

    async def keep(self) -> None:
        """Renew until cancelled or lost; a database that cannot be reached now is tried again next time."""
        while not self._lost:
            await asyncio.sleep(LEASE_RENEW_S)
            try:
                self.renew()
            except Exception as exc:
                if not storage_unreachable(exc):
                    raise

    def end(self) -> None:
        self._storage.end_upload(self.owner_id, self.sha256, self.token, time.time(), self.received > 0)

    def check(self) -> None:
        if self._lost:
            raise RpcStatusError(
                "ABORTED", "another call took this upload over while this one stalled; call Stat, then resume"
            )

    def guarding(self, sink: Sink) -> _LeasedSink:
        return _LeasedSink(self, sink)


class _LeasedSink:
    """``sink`` while ``lease`` holds: writes refused once it was lost, counted otherwise."""

    def __init__(self, lease: UploadLease, sink: Sink) -> None:
        self._lease, self._sink = lease, sink

    async def write(self, data: bytes) -> None:
        self._lease.check()
        await self._sink.write(data)
        self._lease.received += len(data)


class VaultService(ReplicaHandlers, vault_pb2_grpc.VaultServicer):
    def __init__(
        self,
        storage: Storage,
        *,
        quota_bytes: int,
        max_blob_bytes: int,
        partial_upload_ttl_s: float = 86400.0,
        replica_quota_bytes: int = 1 << 30,
    ) -> None:
        self._storage = storage
        self._replica_quota = replica_quota_bytes
        self._quota = quota_bytes
        self._max_blob = max_blob_bytes
        self._partial_ttl = partial_upload_ttl_s

    def sweep_uploads(self, now: float | None = None) -> int:
        """End the reservations of uploads idle (no bytes arrived) longer than the TTL that no call
        is receiving, and remove every partial upload without a reservation (expired, deleted, or
        begun by a revoked device); returns how many went. One replica sweeps at a time (the
        others return 0)."""
        now = time.time() if now is None else now
        with self._storage.single_flight("sweep-uploads") as mine:
            if not mine:
                return 0
            self._storage.expire_uploads(now - self._partial_ttl, now - LEASE_STALE_S)
            return self._storage.partials.sweep(self._storage.reserved_uploads)

    def _own_blob(self, owner_id: str, sha256: str) -> BlobRecord | None:
        """The owner's blob, None when nobody stores it; PERMISSION_DENIED when only other owners do."""
        record = self._storage.owner_blob(owner_id, sha256)
        if record is None and self._storage.blob_held_by_other_owner(owner_id, sha256):
            raise RpcStatusError("PERMISSION_DENIED", "this blob belongs to another owner")
        return record

    def _reserve(self, owner_id: str, device_id: str, sha256: str, size: int) -> None:
        reservation = self._storage.reserve_upload(owner_id, device_id, sha256, size, time.time(), self._quota)
        if not reservation.fits:
            raise RpcStatusError(
                "RESOURCE_EXHAUSTED",
                f"vault quota exceeded: {reservation.stored} bytes stored + {reservation.reserved} held by unfinished "
                f"uploads + {size} new > {self._quota}; delete blobs, or finish or delete unfinished uploads (they "
                f"also expire after {self._partial_ttl:g} s idle)",
            )

    @contextlib.asynccontextmanager
    async def _leased(self, owner_id: str, sha256: str, device_id: str) -> AsyncIterator[UploadLease | None]:
        """The upload's lease for this call (None while another call holds it), kept until the call ends."""
        lease = UploadLease(self._storage, owner_id, sha256)
        if not lease.take(device_id):
            yield None
            return
        keeper = asyncio.create_task(lease.keep())
        try:
            yield lease
        finally:
            keeper.cancel()
            lease.end()  # first: awaiting a keeper that failed re-raises its error
            with contextlib.suppress(asyncio.CancelledError):
                await keeper

    async def Upload(self, requests, context):
        device_id, owner_id = current_device_id(), current_owner_id()
        header = await read_header(requests)
        sha256 = sha256_field(header.sha256, "header.sha256")
        if not 0 < header.size <= self._max_blob:
            raise invalid(f"header.size is {header.size}; blobs hold 1 to {self._max_blob} bytes")
        if header.offset > header.size:
            raise invalid(
                f"header.offset {header.offset} is past header.size {header.size}; send the blob's real size "
                "and resume from the bytes the server holds (Stat), or from 0"
            )
        item_id = text_field(header.item_id, "header.item_id")
        existing = self._own_blob(owner_id, sha256)
        if existing is not None:
            return self._already_stored(owner_id, existing)
        async with self._leased(owner_id, sha256, device_id) as lease:
            if lease is None:
                raise RpcStatusError("ABORTED", f"{_RUNNING}; retry when it ends")
            partials = self._storage.partials
            held = await asyncio.to_thread(partials.held, owner_id, sha256)
            if header.offset > (received := held or 0):  # checked before reserving: a refused call holds no quota
                raise RpcStatusError(
                    "FAILED_PRECONDITION",
                    f"the server holds {received} bytes of this blob; resume from offset {received}",
                )
            if (
                held is not None
            ):  # what lies past the offset goes before the reservation may shrink (parts past a gap too)
                await asyncio.to_thread(partials.truncate, owner_id, sha256, header.offset)
            self._reserve(owner_id, device_id, sha256, header.size)
            return await self._receive(requests, lease, device_id, header, sha256, item_id)

    async def _receive(self, requests, lease: UploadLease, device_id: str, header, sha256: str, item_id: str):
        owner_id, partials = lease.owner_id, self._storage.partials
        async with partials.writer(owner_id, sha256, header.offset) as sink:
            end = await receive_chunks(requests, lease.guarding(sink), position=header.offset, total=header.size)
        if end != header.size:
            raise invalid(f"the stream ended after {end} of {header.size} bytes; resume from offset {end}")
        lease.check()
        try:
            assembled = await asyncio.to_thread(partials.assemble, owner_id, sha256, header.size)
        except IncompleteUpload as incomplete:
            if (stored := self._storage.owner_blob(owner_id, sha256)) is not None:
                return self._already_stored(
                    owner_id, stored
                )  # the same upload, through another replica, finished first
            raise RpcStatusError("FAILED_PRECONDITION", f"{incomplete}; resume from offset {incomplete.held}") from None
        digest, _ = await asyncio.to_thread(file_sha256, assembled)
        if digest != sha256:
            assembled.unlink(missing_ok=True)
            lease.check()
            await asyncio.to_thread(partials.discard, owner_id, sha256)  # while the lease keeps other calls off it
            self._storage.release_upload(owner_id, sha256, lease.token)
            raise invalid(
                f"the received bytes hash to {digest}, not the announced {sha256}; upload again from offset 0"
            )
        record = BlobRecord(device_id, sha256, header.size, item_id, timestamp(), owner_id)
        await asyncio.to_thread(self._storage.blobs.stage, assembled, sha256)  # the long copy, off the event loop
        self._storage.finish_upload(record, assembled)
        await asyncio.to_thread(partials.finished, owner_id, sha256, assembled)
        used, _ = self._storage.owner_vault_usage(owner_id)
        return vault_pb2.UploadBlobResponse(blob=_blob_info(record), used_bytes=used, quota_bytes=self._quota)

    def _already_stored(self, owner_id: str, record: BlobRecord) -> vault_pb2.UploadBlobResponse:
        used, _ = self._storage.owner_vault_usage(owner_id)
        return vault_pb2.UploadBlobResponse(
            blob=_blob_info(record), already_stored=True, used_bytes=used, quota_bytes=self._quota
        )

    async def Download(self, request, context):
        owner_id = current_owner_id()
        sha256 = sha256_field(request.sha256, "sha256")
        size = chunk_size(request.chunk_size)
        record = self._own_blob(owner_id, sha256)
        if record is None:
            raise RpcStatusError("NOT_FOUND", f"no blob {sha256} in this owner's vault")
        offset = check_offset(request.offset, record.size)
        deleted = RpcStatusError("NOT_FOUND", f"blob {sha256} was deleted from this owner's vault")
        stored = open_stored(lambda: self._storage.blobs.open(sha256, offset), deleted)
        try:
            yield vault_pb2.DownloadBlobResponse(header=_blob_info(record))
            async for response in file_chunks(stored, offset, record.size, size, vault_pb2.DownloadBlobResponse):
                yield response
        finally:
            stored.close()

    async def Stat(self, request, context):
        owner_id = current_owner_id()
        sha256 = sha256_field(request.sha256, "sha256")
        record = self._own_blob(owner_id, sha256)
        if record is not None:
            return vault_pb2.StatBlobResponse(
                state=vault_pb2.BLOB_STATE_STORED, received=record.size, blob=_blob_info(record)
            )
        held = await asyncio.to_thread(self._storage.partials.held, owner_id, sha256)
        if held is not None:
            return vault_pb2.StatBlobResponse(state=vault_pb2.BLOB_STATE_PARTIAL, received=held)
        return vault_pb2.StatBlobResponse(state=vault_pb2.BLOB_STATE_ABSENT)

    async def List(self, request, context):
        owner_id = self._requested_owner(request.owner_id)
        limit = page_size(request.page_size, limits.MAX_BLOBS_PAGE)
        after = sha256_field(request.page_token, "page_token") if request.page_token else ""
        records = self._storage.list_owner_blobs(owner_id, after, limit + 1)
        used, _ = self._storage.owner_vault_usage(owner_id)
        page = records[:limit]
        return vault_pb2.ListBlobsResponse(
            blobs=[_blob_info(r) for r in page],
            next_page_token=page[-1].sha256 if len(records) > limit else "",
            used_bytes=used,
            quota_bytes=self._quota,
        )

    async def Delete(self, request, context):
        owner_id = current_owner_id()
        sha256 = sha256_field(request.sha256, "sha256")
        record = self._storage.owner_blob(owner_id, sha256)
        async with self._leased(owner_id, sha256, current_device_id()) as lease:
            removed_partial = lease is not None and await self._discard_unfinished(lease)
        if record is not None:
            self._storage.delete_owner_blob(owner_id, sha256)
        elif not removed_partial:
            self._own_blob(owner_id, sha256)  # PERMISSION_DENIED when another owner holds it
            running = f"; {_RUNNING}: delete it once that ends" if lease is None else ""
            raise RpcStatusError("NOT_FOUND", f"no blob {sha256} in this owner's vault{running}")
        used, _ = self._storage.owner_vault_usage(owner_id)
        return vault_pb2.DeleteBlobResponse(used_bytes=used)

    async def _discard_unfinished(self, lease: UploadLease) -> bool:
        """Under the lease: remove the unfinished upload's bytes and reservation; whether there was one."""
        held = await asyncio.to_thread(self._storage.partials.held, lease.owner_id, lease.sha256)
        if held is not None:
            await asyncio.to_thread(self._storage.partials.discard, lease.owner_id, lease.sha256)
        self._storage.release_upload(lease.owner_id, lease.sha256, lease.token)
        return held is not None or lease.had_reservation

"""Vault races the outside attack found (issue 19, part 2), driven deterministically: the real
VaultService handlers over real storage (each backend: SQLite and files, PostgreSQL and S3),
stepped message by message so the racing call lands exactly in the window that used to fail."""

from __future__ import annotations

import asyncio
import hashlib
import time

import pytest

from fctkit.errors import RpcStatusError
from fctkit.protos import vault_pb2
from fctkit.protos.common_pb2 import Chunk
from fctkit.server.auth import CALLER, Principal
from fctkit.server.storage import BlobRecord, SqliteStorage
from fctkit.server.vault import VaultService


@pytest.fixture
def vault(tmp_path, open_storage):
    storage = open_storage(tmp_path / "data")
    storage.add_enrolment_code("code", "", "2026-01-01T00:00:00.000000Z", "2099-01-01T00:00:00.000000Z")
    storage.enrol("code", "2026-01-01T00:00:00.000000Z", "dev-1", "phone", "token")
    owner = storage.device_owner("dev-1")
    CALLER.set(Principal("device", "dev-1", owner))
    yield VaultService(storage, quota_bytes=1 << 30, max_blob_bytes=1 << 26), storage, owner
    storage.close()


def stored_blob(storage, owner: str, tmp_path, size: int) -> tuple[str, bytes]:
    data = bytes(range(256)) * (size // 256)
    sha256 = hashlib.sha256(data).hexdigest()
    source = tmp_path / "upload.part"
    source.write_bytes(data)
    storage.add_blob(BlobRecord("dev-1", sha256, len(data), "item", "2026-01-01T00:00:00.000000Z", owner), source)
    return sha256, data


def test_a_download_racing_a_delete_is_complete_or_not_found(vault, tmp_path):
    service, storage, owner = vault
    sha256, data = stored_blob(storage, owner, tmp_path, 1 << 20)

    async def race_after_header() -> bytes:
        stream = service.Download(vault_pb2.DownloadBlobRequest(sha256=sha256, chunk_size=64 << 10), None)
        header = await anext(stream)
        assert header.header.size == len(data)
        assert storage.delete_owner_blob(owner, sha256) and not storage.blobs.has(sha256)  # the delete lands now
        return b"".join([message.chunk.data async for message in stream])

    received = asyncio.run(race_after_header())
    assert hashlib.sha256(received).hexdigest() == sha256  # complete and verified, although deleted meanwhile

    async def download_after_delete() -> None:
        stream = service.Download(vault_pb2.DownloadBlobRequest(sha256=sha256), None)
        await anext(stream)

    with pytest.raises(RpcStatusError) as caught:
        asyncio.run(download_after_delete())
    assert caught.value.code == "NOT_FOUND"


def test_a_blob_whose_file_vanished_between_lookup_and_open_is_not_found(vault, tmp_path):
    service, storage, owner = vault
    sha256, _ = stored_blob(storage, owner, tmp_path, 4096)
    storage.blobs.delete(sha256)  # the record still says it is there: the file went first (a delete mid-way)

    async def download() -> None:
        await anext(service.Download(vault_pb2.DownloadBlobRequest(sha256=sha256), None))

    with pytest.raises(RpcStatusError) as caught:
        asyncio.run(download())
    assert caught.value.code == "NOT_FOUND"


# -- uploads: concurrency, one blob per owner, quota over unfinished uploads, expiry ---------


def test_eight_concurrent_uploads_from_one_device_all_succeed(start_server):
    """Used to fail 4 of 8 with INTERNAL: a new partial evicted the device's uploads in progress."""
    from concurrent.futures import ThreadPoolExecutor

    from tests.server.conftest import enrolled_client

    server = start_server()
    client, _ = enrolled_client(server, name="busy", chunk_size=16 << 10)
    with client:
        for round_ in range(3):
            blobs = [bytes([round_, i]) * (256 << 10) for i in range(8)]
            with ThreadPoolExecutor(8) as pool:
                transfers = list(pool.map(lambda b: client.upload_blob(b, "item"), blobs))
            assert [t.sha256 for t in transfers] == [hashlib.sha256(b).hexdigest() for b in blobs]
        assert len(client.list_blobs()) == 24


def test_two_devices_of_one_owner_store_and_pay_for_a_blob_once(start_server):
    from concurrent.futures import ThreadPoolExecutor

    from tests.server.conftest import enrolled_client

    server = start_server()
    first, enrolment = enrolled_client(server, name="phone", chunk_size=16 << 10)
    second, _ = enrolled_client(server, owner=enrolment.owner_id, name="tablet", chunk_size=16 << 10)
    data = b"the same sealed original" * 40_000
    with first, second, ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda c: c.upload_blob(data, "photo"), (first, second)))
        listed = first.list_blobs()
        assert len(listed) == 1 and len(second.list_blobs()) == 1
        used = first.vault.List(vault_pb2.ListBlobsRequest(), metadata=first._metadata).used_bytes
        assert used == len(data)  # charged once
        first.delete_blob(listed[0].sha256)  # the owner's vault is shared: gone for both devices
        assert second.list_blobs() == []


async def _upload(service: VaultService, data: bytes, *, send: int | None = None):
    """One Upload call sending the header and ``send`` bytes of ``data`` (all by default)."""
    sha256 = hashlib.sha256(data).hexdigest()
    sent = data[: len(data) if send is None else send]

    async def requests():
        yield vault_pb2.UploadBlobRequest(header=vault_pb2.UploadHeader(sha256=sha256, size=len(data), item_id="i"))
        for start in range(0, len(sent), 4096):
            yield vault_pb2.UploadBlobRequest(chunk=Chunk(offset=start, data=sent[start : start + 4096]))

    return await service.Upload(requests(), None)


def test_unfinished_uploads_count_against_the_quota_and_expire(tmp_path, open_storage):
    storage = open_storage(tmp_path / "data")
    storage.add_enrolment_code("code", "", "2026-01-01T00:00:00.000000Z", "2099-01-01T00:00:00.000000Z")
    storage.enrol("code", "2026-01-01T00:00:00.000000Z", "dev-1", "phone", "token")
    owner = storage.device_owner("dev-1")
    CALLER.set(Principal("device", "dev-1", owner))
    service = VaultService(storage, quota_bytes=100_000, max_blob_bytes=100_000, partial_upload_ttl_s=3600)
    first, second = bytes(60_000), b"\x01" * 60_000
    with pytest.raises(RpcStatusError, match="resume from offset 20480"):
        asyncio.run(_upload(service, first, send=20_480))  # an unfinished upload holds its 60,000 bytes
    with pytest.raises(RpcStatusError, match="60000 held by unfinished uploads") as caught:
        asyncio.run(_upload(service, second))
    assert caught.value.code == "RESOURCE_EXHAUSTED"
    assert (
        service.sweep_uploads() == 0 and storage.partials.held(owner, hashlib.sha256(first).hexdigest()) == 20_480
    )  # not idle yet
    assert service.sweep_uploads(now=time.time() + 3601) == 1  # idle past the TTL: bytes given back
    assert asyncio.run(_upload(service, second)).used_bytes == 60_000
    with pytest.raises(RpcStatusError, match="resume from offset"):
        asyncio.run(_upload(service, bytes(30_000), send=4096))
    storage.revoke_device("dev-1", "2026-06-01T00:00:00.000000Z")  # a revoked device's unfinished uploads go too
    assert service.sweep_uploads() == 1 and storage.reserved_uploads() == set()
    storage.close()


def test_duplicate_blob_records_of_one_owner_are_merged_on_upgrade(tmp_path):
    import sqlite3

    storage = SqliteStorage(tmp_path / "data")
    for n in (1, 2):
        storage.add_enrolment_code(
            f"c{n}", "", "2026-01-01T00:00:00.000000Z", "2099-01-01T00:00:00.000000Z", owner_id="own-shared"
        )
        storage.enrol(f"c{n}", "2026-01-01T00:00:00.000000Z", f"dev-{n}", "x", f"t{n}")
    storage.close()
    with sqlite3.connect(tmp_path / "data" / "meta.sqlite3") as db:  # a schema-4 database with the old duplicates
        db.execute("DROP INDEX blobs_one_per_owner")
        for n in (1, 2):
            db.execute("INSERT INTO blobs VALUES (?, ?, 5, 'i', 'now', 'own-shared')", (f"dev-{n}", "ab" * 32))
        db.execute("PRAGMA user_version=4")
    storage = SqliteStorage(tmp_path / "data")
    assert storage.owner_vault_usage("own-shared") == (5, 1)
    storage.close()


def test_a_refused_resume_holds_no_quota(vault):
    """An Upload resuming past what the server holds is FAILED_PRECONDITION and reserves nothing."""
    service, storage, _owner = vault

    async def resume_from_nowhere():
        async def requests():
            header = vault_pb2.UploadHeader(sha256="ab" * 32, size=1000, item_id="i", offset=500)
            yield vault_pb2.UploadBlobRequest(header=header)

        return await service.Upload(requests(), None)

    with pytest.raises(RpcStatusError) as caught:
        asyncio.run(resume_from_nowhere())
    assert caught.value.code == "FAILED_PRECONDITION" and storage.reserved_uploads() == set()

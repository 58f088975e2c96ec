"""Vault races the outside attack found (issue 19, part 2), driven deterministically: the real
VaultService handlers over real SQLite storage and blob files, stepped message by message so
the racing call lands exactly in the window that used to fail."""

from __future__ import annotations

import asyncio
import hashlib

import pytest

from fctkit.errors import RpcStatusError
from fctkit.protos import vault_pb2
from fctkit.server.auth import CALLER, Principal
from fctkit.server.storage import BlobRecord, SqliteStorage
from fctkit.server.vault import VaultService


@pytest.fixture
def vault(tmp_path):
    storage = SqliteStorage(tmp_path / "data")
    storage.add_enrolment_code("code", "", "2026-01-01T00:00:00.000000Z", "2099-01-01T00:00:00.000000Z")
    storage.enrol("code", "2026-01-01T00:00:00.000000Z", "dev-1", "phone", "token")
    owner = storage.device_owner("dev-1")
    CALLER.set(Principal("device", "dev-1", owner))
    yield VaultService(storage, quota_bytes=1 << 30, max_blob_bytes=1 << 26), storage, owner
    storage.close()


def stored_blob(storage: SqliteStorage, owner: str, tmp_path, size: int) -> tuple[str, bytes]:
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

"""Owners and the replica RPCs on a real server: devices of one owner share blobs and records,
other owners get PERMISSION_DENIED; PushRecords assigns gap-free per-owner sequence numbers,
stores a retried push once, refuses malformed records (INVALID_ARGUMENT) and a full replica
quota (RESOURCE_EXHAUSTED); a schema-1 database (before owners) is migrated in place.
Superseded records are compacted away (test_replica_compaction.py)."""

from __future__ import annotations

import hashlib
import sqlite3

import grpc
import pytest

from fctkit.protos import vault_pb2
from fctkit.protos.client import FctkitClient
from fctkit.server.storage import BlobRecord, SqliteStorage

from .conftest import ADMIN_TOKEN, status_code

QUOTA = 4000


@pytest.fixture(scope="module")
def server(start_server):
    return start_server("--replica-quota-bytes", str(QUOTA))


def _device(server, owner: str = "") -> tuple[FctkitClient, str]:
    with FctkitClient(server.target, ADMIN_TOKEN) as admin:
        code = admin.create_enrolment_code(owner=owner)
    assert code.owner_id == (owner or code.owner_id) and code.owner_id.strip()
    enrolment = FctkitClient(server.target).enrol(code.code, f"dev-of-{code.owner_id}")
    assert enrolment.owner_id == code.owner_id
    return FctkitClient(server.target, enrolment.token), enrolment.owner_id


def _record(change_id: int, item: str = "item", size: int = 100, **fields) -> vault_pb2.SealedRecord:
    values = {"version": 1, "origin_version": 1, "via": "native", "sealed": bytes([change_id % 256]) * size, **fields}
    return vault_pb2.SealedRecord(change_id=change_id, item_id=item, **values)


def test_one_owner_shares_blobs_and_records_others_are_refused(server):
    phone, _owner = _device(server, "heidi")
    tablet, _ = _device(server, "heidi")
    stranger, stranger_owner = _device(server)
    assert stranger_owner not in ("", "heidi")
    sha256 = phone.upload_blob(b"sealed original" * 50, "item-1").sha256
    assert tablet.read_blob(sha256) == b"sealed original" * 50  # any device of the owner
    assert [b.sha256 for b in tablet.list_blobs()] == [sha256]
    for call in (
        lambda: stranger.read_blob(sha256),
        lambda: stranger.stat_blob(sha256),
        lambda: stranger.delete_blob(sha256),
        lambda: stranger.list_blobs(owner_id="heidi"),
        lambda: list(stranger.pull_records(owner_id="heidi")),
    ):
        assert status_code(call) == "PERMISSION_DENIED"
    assert stranger.list_blobs() == [] and list(stranger.pull_records()) == []

    first = phone.push_records([_record(1, "a"), _record(2, "b")])
    second = tablet.push_records([_record(1, "c")])  # the same change id from another device is another record
    retried = phone.push_records([_record(2, "b"), _record(3, "d")])
    assert (first.stored, first.last_sequence, second.last_sequence) == (2, 2, 3)
    assert (retried.stored, retried.already_stored, retried.last_sequence) == (1, 1, 4)
    assert (list(first.sequences), list(second.sequences), list(retried.sequences)) == ([1, 2], [3], [2, 4])
    pulled = [r for batch in tablet.pull_records() for r in batch.records]
    assert [(r.sequence, r.item_id) for r in pulled] == [(1, "a"), (2, "b"), (3, "c"), (4, "d")]
    assert [r.item_id for batch in tablet.pull_records(after_sequence=2) for r in batch.records] == ["c", "d"]
    assert pulled[0].sealed == _record(1).sealed
    assert (
        tablet.delete_blob(sha256) == 0 and phone.list_blobs() == []
    )  # the owner's blob, whichever device uploaded it


@pytest.mark.parametrize(
    "bad",
    [
        {"change_id": 0},
        {"item_id": ""},
        {"via": "sideways"},
        {"version": 1, "origin_version": 2},
        {"sealed": b"short"},
        {"sealed": b"x" * (64 * 1024 + 1)},
        {"tombstone": True, "via": "native"},
        {"sequence": 9},
    ],
)
def test_malformed_records_are_invalid_argument(server, bad):
    device, _ = _device(server)
    record = _record(5)
    for name, value in bad.items():
        setattr(record, name, value)
    assert status_code(lambda: device.push_records([record])) == "INVALID_ARGUMENT"
    assert list(device.pull_records()) == []


@pytest.mark.parametrize(
    "bad",
    [
        {"item_ids": ["a", "a"]},
        {"item_ids": ["a", ""]},
        {"item_ids": ["a", "b\x01"]},
        {"item_ids": ["a"], "item_id": "a"},
        {"item_ids": [f"r{i}" for i in range(4097)]},
        {"item_ids": ["a"], "sealed": b"x" * ((1 << 20) + 1)},
        {"item_ids": ["a"], "superseded": [0]},
        {"item_ids": [f"{i:04d}" + "x" * 200 for i in range(2000)]},
    ],
)
def test_malformed_blocks_are_invalid_argument(server, bad):
    device, _ = _device(server)
    record = _record(5, item="")
    for name, value in bad.items():
        field = getattr(record, name)
        if isinstance(value, list):
            field.extend(value)
        else:
            setattr(record, name, value)
    request = vault_pb2.PushRecordsRequest(records=[record])  # one message, past the client's own cutting
    with pytest.raises(grpc.RpcError) as refused:
        device.vault.PushRecords(iter([request]), metadata=device._metadata)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert list(device.pull_records()) == []


def test_replica_quota_is_resource_exhausted_and_stores_nothing_of_the_batch(server):
    device, _ = _device(server)
    assert device.push_records([_record(i, f"item-{i}", size=1000) for i in range(1, 4)]).stored == 3
    assert (
        status_code(lambda: device.push_records([_record(i, f"item-{i}", size=1000) for i in range(4, 6)]))
        == "RESOURCE_EXHAUSTED"
    )
    assert [r.change_id for b in device.pull_records() for r in b.records] == [1, 2, 3]
    too_many = [vault_pb2.PushRecordsRequest(records=[_record(i, size=100) for i in range(10, 4107)])]
    with pytest.raises(grpc.RpcError) as refused:
        device.vault.PushRecords(iter(too_many), metadata=device._metadata)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_a_schema_1_database_gets_owners(tmp_path):
    storage = SqliteStorage(tmp_path / "data")
    storage.add_enrolment_code("code", "", "2026-01-01T00:00:00.000000Z", "2099-01-01T00:00:00.000000Z")
    storage.enrol("code", "2026-01-01T00:00:00.000000Z", "dev-1", "old", "token-hash")
    blob = tmp_path / "blob"
    blob.write_bytes(b"ciphertext")
    sha256 = hashlib.sha256(b"ciphertext").hexdigest()
    storage.add_blob(BlobRecord("dev-1", sha256, 10, "item", "now"), blob)
    storage.close()
    with sqlite3.connect(tmp_path / "data" / "meta.sqlite3") as db:  # back to what schema 1 held
        db.execute("ALTER TABLE enrolment_codes DROP COLUMN owner_id")
        db.execute("UPDATE devices SET owner_id = NULL")
        db.execute("UPDATE blobs SET owner_id = NULL")
        db.execute("DROP TABLE replica_blocks")
        db.execute("DROP TABLE replica_items")
        db.execute("DROP TABLE replica_owners")
        db.execute("PRAGMA user_version=1")
    storage = SqliteStorage(tmp_path / "data")
    owner = storage.device_owner("dev-1")
    assert owner == "own-dev-1" and storage.owner_blob(owner, sha256).device_id == "dev-1"
    assert storage.push_records(owner, "dev-1", [], "now", 1 << 30).last_sequence == 0
    storage.close()


@pytest.mark.sqlite_only  # the handler's limit; 65,536 rows take 30 s more on PostgreSQL
def test_a_push_call_holds_at_most_65536_records(start_server):
    from fctkit.errors import InputError
    from fctkit.protos import limits

    device, _ = _device(start_server())  # the default replica quota (1 GiB)
    with pytest.raises(InputError, match="at most 65536"):
        device.push_records([_record(1, size=28)] * (limits.MAX_RECORDS_PER_PUSH + 1))
    requests = [
        vault_pb2.PushRecordsRequest(records=[_record(i, f"item-{i}", size=28) for i in range(k, k + 4096)])
        for k in range(1, limits.MAX_RECORDS_PER_PUSH + 4097, 4096)
    ]  # 16 full messages and one more
    with pytest.raises(grpc.RpcError) as refused:
        device.vault.PushRecords(iter(requests), metadata=device._metadata)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "65536" in refused.value.details()
    assert (
        len([r for b in device.pull_records() for r in b.records]) == limits.MAX_RECORDS_PER_PUSH
    )  # the first 16 messages stay


def test_enrolment_checks_the_owner_key_id(server):
    with FctkitClient(server.target, ADMIN_TOKEN) as admin:
        codes = [admin.create_enrolment_code(owner="kim").code for _ in range(3)]
    anonymous = FctkitClient(server.target)
    assert anonymous.enrol(codes[0], "first", owner_key_id="a" * 64).owner_id == "kim"  # the first device sets it
    assert status_code(lambda: anonymous.enrol(codes[1], "other key", owner_key_id="b" * 64)) == "FAILED_PRECONDITION"
    assert status_code(lambda: anonymous.enrol(codes[1], "bad id", owner_key_id="not-hex")) == "INVALID_ARGUMENT"
    assert (
        anonymous.enrol(codes[1], "same key", owner_key_id="a" * 64).owner_id == "kim"
    )  # the refused code still works
    assert anonymous.enrol(codes[2], "unchecked").owner_id == "kim"  # clients that send no id are not checked

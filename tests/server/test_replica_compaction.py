"""Replica compaction on a real server: a record that loses to another live record of the same
item on every device that could still pull it (the devices' merge order) gives its bytes back
to the owner's quota and is no longer pulled, while a retried push of it is still answered
with its sequence number. Records at an older version go only once every device of the owner
reports the newer one. A schema-2 database is migrated and compacted in place."""

from __future__ import annotations

import hashlib
import sqlite3
import time

from fctkit.protos import fleet_pb2, vault_pb2
from fctkit.protos.client import FctkitClient
from fctkit.server.storage import ReplicaRecord, SqliteStorage

from .conftest import ADMIN_TOKEN, enrolled_client

IDLE = fleet_pb2.UPGRADE_STATE_IDLE


def _published(server, archives, *versions: int):
    """``server`` with ``versions`` published (devices report only published versions)."""
    with FctkitClient(server.target, ADMIN_TOKEN) as admin:
        for version in versions:
            admin.publish_bundle(archives[version])
    return server


def _devices(server, count: int) -> list[FctkitClient]:
    """``count`` devices of one new owner."""
    first, enrolment = enrolled_client(server, name="device-0")
    return [first, *(enrolled_client(server, enrolment.owner_id, f"device-{k}")[0] for k in range(1, count))]


def _record(
    change_id: int,
    item: str,
    version: int = 1,
    via: str = "native",
    fill: int = 0,
    size: int = 100,
    tombstone: bool = False,
) -> vault_pb2.SealedRecord:
    if tombstone:
        return vault_pb2.SealedRecord(change_id=change_id, item_id=item, tombstone=True, sealed=bytes([fill]) * size)
    return vault_pb2.SealedRecord(
        change_id=change_id, item_id=item, version=version, origin_version=1, via=via, sealed=bytes([fill]) * size
    )


def _sha(record: vault_pb2.SealedRecord) -> str:
    return hashlib.sha256(record.sealed).hexdigest()


def _live(device: FctkitClient) -> list[tuple[int, str, int, str, bool]]:
    return [(r.sequence, r.item_id, r.version, r.via, r.tombstone) for b in device.pull_records() for r in b.records]


def test_same_version_records_keep_only_the_one_every_device_would_keep(start_server):
    phone, tablet = _devices(start_server(), 2)
    low, high = sorted([_record(2, "x", fill=1), _record(3, "x", fill=2)], key=_sha)  # both native at v1
    phone.push_records([_record(1, "x", via="forward", fill=9), high, low])
    assert _live(tablet) == [(3, "x", 1, "native", False)]  # native beats forward; then the smaller SHA-256
    assert [r.sealed for b in tablet.pull_records() for r in b.records] == [low.sealed]
    retried = phone.push_records([_record(1, "x", via="forward", fill=9)])  # superseded, but it was stored once
    assert (retried.stored, retried.already_stored, list(retried.sequences)) == (0, 1, [1])
    tablet.push_records([_record(1, "x", via="forward", fill=7)])  # loses on arrival
    tablet.push_records([_record(2, "x", fill=low.sealed[0])])  # the same bytes again: the first copy stays
    assert _live(phone) == [(3, "x", 1, "native", False)]


def test_a_tombstone_supersedes_every_other_record_of_its_item(start_server):
    phone, tablet = _devices(start_server(), 2)
    phone.push_records([_record(1, "x"), _record(2, "y"), _record(3, "x", version=2, fill=3)])
    tablet.push_records([_record(1, "x", tombstone=True, size=28), _record(2, "x", tombstone=True, size=28)])
    phone.push_records([_record(4, "x", version=3, fill=4)])  # a removed item id is never used again
    assert _live(phone) == [(2, "y", 1, "native", False), (4, "x", 0, "", True)]


def test_older_versions_go_once_every_device_reports_the_newer_one(start_server, archives):
    phone, tablet = _devices(_published(start_server(), archives, 1, 2, 3), 2)
    phone.push_records([_record(1, "x", fill=1), _record(2, "y", fill=2)])
    phone.report(2, 2, IDLE)
    tablet.report(1, 2, IDLE)
    phone.push_records([_record(3, "x", version=2, via="forward", fill=3)])
    assert [s for s, *_ in _live(tablet)] == [1, 2, 3]  # the tablet, still at v1, needs x at v1
    tablet.report(1, 2, fleet_pb2.UPGRADE_STATE_UPGRADING, target_version=2)  # upgrading: still v1
    assert [s for s, *_ in _live(tablet)] == [1, 2, 3]
    tablet.report(2, 2, IDLE)
    assert _live(phone) == [(2, "y", 1, "native", False), (3, "x", 2, "forward", False)]
    phone.report(3, 2, IDLE)  # devices differ again: nothing more goes, nothing comes back
    phone.push_records([_record(4, "y", version=3, fill=4)])
    assert [s for s, *_ in _live(tablet)] == [2, 3, 4]


def test_compaction_gives_the_bytes_back_to_the_quota(start_server):
    (phone,) = _devices(start_server("--replica-quota-bytes", "2500"), 1)
    for change_id in range(1, 30):  # the same item re-pushed 29 times: one record's bytes stay
        phone.push_records([_record(change_id, "x", fill=change_id, size=1000)])
    assert len(_live(phone)) == 1


def test_a_schema_2_database_is_migrated_and_compacted(tmp_path):
    storage = SqliteStorage(tmp_path / "data")
    storage.add_enrolment_code("code", "", "2026-01-01T00:00:00.000000Z", "2099-01-01T00:00:00.000000Z")
    storage.enrol("code", "2026-01-01T00:00:00.000000Z", "dev-1", "old", "token-hash")
    owner = storage.device_owner("dev-1")
    storage.close()
    with sqlite3.connect(tmp_path / "data" / "meta.sqlite3") as db:  # back to what schema 2 held: one row per record
        db.execute("DROP TABLE replica_blocks")
        db.execute("DROP TABLE replica_items")
        db.execute(
            "CREATE TABLE replica_records (owner_id TEXT NOT NULL, sequence INTEGER NOT NULL, device_id TEXT NOT NULL, "
            "change_id INTEGER NOT NULL, item_id TEXT NOT NULL, version INTEGER NOT NULL, origin_version INTEGER NOT NULL, "
            "via TEXT NOT NULL, tombstone INTEGER NOT NULL, sealed BLOB NOT NULL, created_at TEXT NOT NULL, "
            "PRIMARY KEY (owner_id, sequence), UNIQUE (device_id, change_id))"
        )
        db.executemany(
            "INSERT INTO replica_records VALUES (?, ?, 'dev-1', ?, 'x', 1, 1, ?, 0, ?, 'now')",
            [(owner, 1, 1, "native", b"a" * 100), (owner, 2, 2, "forward", b"b" * 100)],
        )
        db.execute("INSERT INTO replica_owners VALUES (?, 2, 200)", (owner,))
        db.execute("PRAGMA user_version=2")
    storage = SqliteStorage(tmp_path / "data")
    assert storage.replica_usage(owner) == (100, 2)
    assert [(r.sequence, r.item_ids, r.via, r.block) for r in storage.pull_records(owner, 0, 10, 1 << 20)] == [
        (1, ("x",), "native", False)
    ]
    again = storage.push_records(
        owner, "dev-1", [ReplicaRecord(2, ("x",), 1, 1, "forward", False, b"b" * 100, block=False)], "now", 1 << 30
    )
    assert (again.stored, again.sequences) == (0, (2,))
    storage.close()


def _block(
    change_id: int,
    items: list[str],
    version: int = 1,
    via: str = "native",
    fill: int = 0,
    size: int = 100,
    tombstone: bool = False,
) -> vault_pb2.SealedRecord:
    header = {} if tombstone else {"version": version, "origin_version": 1, "via": via}
    return vault_pb2.SealedRecord(
        change_id=change_id, item_ids=items, tombstone=tombstone, sealed=bytes([fill]) * size, **header
    )


def test_blocks_are_compacted_row_by_row_and_dropped_when_no_row_is_live(start_server, archives):
    import pytest

    from fctkit.errors import RpcStatusError

    phone, tablet = _devices(_published(start_server("--replica-quota-bytes", "1000"), archives, 1, 2), 2)
    phone.push_records([_block(1, ["a", "b", "c"], fill=1, size=400)])
    tablet.push_records([_block(1, ["b"], tombstone=True, size=28), _record(2, "c", version=2, fill=2, size=28)])
    phone.report(2, 2, IDLE)
    tablet.report(2, 2, IDLE)  # every device at v2: c at v1 is superseded too
    pulled = [(r.sequence, list(r.item_ids), list(r.superseded)) for b in phone.pull_records() for r in b.records]
    assert pulled[0] == (1, ["a", "b", "c"], [1, 2])  # one live row: the block is still pulled, its dead rows named
    with pytest.raises(RpcStatusError) as refused:  # 400 + 28 + 28 stored: a live row keeps its block's bytes
        phone.push_records([_record(9, "z", size=600)])
    assert refused.value.code == "RESOURCE_EXHAUSTED"
    tablet.push_records([_block(3, ["a"], version=2, fill=3, size=28)])
    assert [r.sequence for b in phone.pull_records() for r in b.records] == [2, 3, 4]  # the block is gone from pulls
    retried = phone.push_records([_block(1, ["a", "b", "c"], fill=1, size=400)])  # its entry stays for retries
    assert (retried.stored, retried.already_stored, retried.already_stored_rows, list(retried.sequences)) == (
        0,
        1,
        3,
        [1],
    )
    phone.push_records([_record(9, "z", size=900)])  # and the quota has its bytes back: 3 x 28 + 900 fits
    again = phone.push_records([_record(9, "z", size=900)])  # a retry at a full quota stores nothing new: answered
    assert (again.stored, again.already_stored, list(again.sequences)) == (0, 1, [5])


def test_a_large_replica_is_swept_page_by_page_in_the_background(start_server, archives):
    from fctkit.server.fleet import COMPACTION_PAGE_ITEMS

    phone, tablet = _devices(_published(start_server(), archives, 1, 2), 2)
    items = 2 * COMPACTION_PAGE_ITEMS + 500
    for version in (1, 2):
        records = [_record(version * items + k, f"item-{k:05d}", version=version, size=28) for k in range(items)]
        for start in range(0, items, 4096):
            phone.push_records(records[start : start + 4096])
    phone.report(2, items, IDLE)
    tablet.report(2, items, IDLE)  # the first page now, two more in the background
    deadline = time.monotonic() + 60
    while len(live := _live(tablet)) > items and time.monotonic() < deadline:
        time.sleep(0.1)
    assert len(live) == items and {version for _, _, version, *_ in live} == {2}


def test_the_compaction_queries_look_rows_up_by_item_not_by_scanning_the_owner():
    """A plan that scans an owner's rows makes every push cost the size of the replica (this
    was measured: 0.5 s per 1,000-row block at 100k rows)."""
    from fctkit.server.replica_compaction import CONTESTED, REPLICA_SCHEMA, SUPERSEDED

    db = sqlite3.connect(":memory:")
    for statement in filter(str.strip, REPLICA_SCHEMA.split(";")):
        db.execute(statement)
    db.execute("CREATE TEMP TABLE compacting (item_id TEXT PRIMARY KEY)")
    params = {"owner": "o", "common_version": 1}
    for sql, args in ((CONTESTED, ("o",)), (SUPERSEDED.format(items="AND r.item_id IN ('a')"), params)):
        plan = [row[3] for row in db.execute("EXPLAIN QUERY PLAN " + sql, args)]
        lookups = [step for step in plan if " r " in f" {step} " or " w " in f" {step} "]
        assert lookups and all("replica_live_by_item (owner_id=? AND item_id=?)" in step for step in lookups), plan


def test_a_retried_push_compacts_nothing_else(tmp_path, open_storage):
    """A push that stores nothing new has nothing to compact: it must not sweep the owner's whole
    replica (on PostgreSQL that cost seconds per retry)."""
    from fctkit.server.storage import DeviceReport

    storage = open_storage(tmp_path / "data")
    for n in (1, 2):
        storage.add_enrolment_code(
            f"c{n}", "", "2026-01-01T00:00:00.000000Z", "2099-01-01T00:00:00.000000Z", owner_id="own"
        )
        storage.enrol(f"c{n}", "2026-01-01T00:00:00.000000Z", f"dev-{n}", "x", f"t{n}")
    old = ReplicaRecord(1, ("item",), 1, 1, "native", False, b"\x01" * 40, block=False)
    new = ReplicaRecord(2, ("item",), 2, 1, "forward", False, b"\x02" * 40, block=False)
    storage.push_records("own", "dev-1", [old, new], "now", 1 << 20)
    for n in (1, 2):  # both devices now at v2: the v1 row may go at the owner's next sweep (not run here)
        storage.record_report(f"dev-{n}", DeviceReport(2, 1, 1, 0, 1.0, ""), "now")
    assert storage.push_records("own", "dev-1", [old], "now", 1 << 20).already_stored == 1
    live = [r.sequence for r in storage.pull_records("own", 0, 100, 1 << 20) if not r.superseded]
    assert live == [1, 2]  # the retry swept nothing
    assert storage.compact_replica_page("own", "", 100) == "item"  # the sweep the report asked for does
    assert [r.sequence for r in storage.pull_records("own", 0, 100, 1 << 20)] == [2]
    storage.close()

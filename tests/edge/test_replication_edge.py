"""Owners and encrypted gallery replication against a real server on loopback (tiny bundles).

Two devices of one owner add items concurrently while one upgrades to v2: after syncing their
decrypted galleries are identical; another owner's device is refused everything of the owner;
a wiped device restores an identical gallery from the owner key alone (after the server
compacted the superseded records away); the server's disk holds
no gallery vector; tombstones propagate; a retried push stores nothing twice; a record of a
version not installed waits pending until the upgrade; a tampered record or a wrong owner key
stops the pull with a clear error and nothing stored is lost."""

from __future__ import annotations

import functools
import sqlite3
import threading

import numpy as np
import pytest

from fctkit.edge_runtime import Device
from fctkit.edge_runtime.crypto import read_key_file
from fctkit.edge_runtime.replication import record_message, seal_changes
from fctkit.errors import CorruptRecordError, DeviceKeyError, InputError, RpcStatusError
from fctkit.protos import vault_pb2
from tests.edge.conftest import ADMIN_TOKEN, ServerProcess, enrolment_code, publish
from tests.support.old_galleries import downgrade_to_schema_4


@pytest.fixture
def server(tmp_path, publisher_pub, admin_token_file, tiny_bundles):
    process = ServerProcess(tmp_path / "data", publisher_pub, admin_token_file).start()
    publish(process, tiny_bundles[1], tmp_path)
    yield process
    if process.alive():
        process.stop()


def state(device: Device) -> dict[str, tuple]:
    """The decrypted gallery by item id: (version tag, embedding bytes, side-info bytes, label)."""
    rows = device.gallery.load()
    assert not rows.corrupt
    return {
        item: (
            str(tag),
            np.asarray(rows.embeddings[k], "<f4").tobytes(),
            np.asarray(rows.side_infos[k], "<f4").tobytes(),
            rows.labels[k],
        )
        for k, (item, tag) in enumerate(zip(rows.item_ids, rows.tags, strict=True))
    }


@pytest.fixture
def make_device(make_device):
    """The edge conftest's ``make_device`` with 8-row batches (upgrades and merges span batches)."""
    return functools.partial(make_device, batch_size=8)


def enrolled(make_device, server, name: str, owner: str, *, sync: bool = True, **init) -> Device:
    device = make_device(name, **init)
    device.enrol(server.target, enrolment_code(server, owner=owner), device_name=name)
    assert device.settings.owner_id == (owner or device.settings.owner_id)
    if sync:
        device.sync()
    return device


def live_rows(records) -> list[tuple[str, int, str, int]]:
    """(item id, version, via, sequence) of each live row of pulled records (blocks or single-row records)."""
    return [
        (item_id, r.version, r.via, r.sequence)
        for r in records
        for k, item_id in enumerate(r.item_ids or [r.item_id])
        if k not in set(r.superseded)
    ]


def converge(*devices: Device, rounds: int = 2) -> None:
    for _ in range(rounds):
        for device in devices:
            device.sync()


def test_two_devices_of_one_owner_converge_while_one_upgrades(server, tiny_bundles, make_device, images, tmp_path):
    alice = enrolled(make_device, server, "alice-phone", "alice", health_sample=0)  # as the tablet's, below
    key_file = alice.export_owner_key(tmp_path / "alice.owner-key", "correct horse")
    with pytest.raises(DeviceKeyError, match="wrong passphrase"):
        Device.init(tmp_path / "thief", owner_key_file=key_file, owner_key_passphrase="guess")
    tablet = enrolled(
        make_device,
        server,
        "alice-tablet",
        "alice",
        owner_key_file=key_file,
        owner_key_passphrase="correct horse",
        health_sample=0,
    )  # no health check: it would backfill every adapted row of this small gallery
    errors: list[BaseException] = []

    def adding(device: Device, prefix: str, seed: int, upgrade_midway: bool) -> None:
        try:
            for batch in range(4):
                device.add(
                    images(5, seed=seed + batch),
                    item_ids=[f"{prefix}{batch}-{i}" for i in range(5)],
                    labels=[f"{prefix}-label"] * 5,
                )
                if upgrade_midway and batch == 1:
                    publish(server, tiny_bundles[2], tmp_path)
                    assert device.sync().installed_after == 2  # the upgrade, while the other keeps adding
                else:
                    device.sync()
        except BaseException as exc:  # reported by the main thread
            errors.append(exc)

    threads = [
        threading.Thread(target=adding, args=(alice, "a", 10, False)),
        threading.Thread(target=adding, args=(tablet, "t", 50, True)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=300)
    assert not errors, errors
    converge(alice, tablet)
    expected = state(alice)
    assert len(expected) == 40 and state(tablet) == expected
    tags = {tag for tag, *_ in expected.values()}
    assert "v1->v2 (forward)" in tags and tags <= {"v1->v2 (forward)", "v2"}  # adapted, or added after the upgrade
    assert alice.status()["replica"]["unpushed"] == 0 and alice.status()["replica"]["pending"] == 0

    # backfill on the tablet re-embeds originals the phone uploaded, then replicates them
    adapted = [item for item, (tag, *_) in expected.items() if tag == "v1->v2 (forward)"]
    assert any(item.startswith("a") for item in adapted)  # rows whose originals the phone uploaded
    assert tablet.backfill(40, order="random").backfilled == len(adapted)
    converge(tablet, alice)
    assert state(alice) == state(tablet) and {tag for tag, *_ in state(alice).values()} == {"v2"}
    with alice.client() as client:  # both devices report v2: the server keeps one record per item
        live = live_rows(r for batch in client.pull_records() for r in batch.records)
    assert len(live) == 40 and {(version, via) for _, version, via, _ in live} == {(2, "native")}

    # the server's disk holds no float32 vector of the gallery, only ciphertext
    on_disk = b"".join(p.read_bytes() for p in server.data_dir.rglob("*") if p.is_file())
    for _, embedding, side_info, _ in state(alice).values():
        assert embedding not in on_disk and side_info not in on_disk

    # another owner's device reaches nothing of alice's
    mallory = enrolled(make_device, server, "mallory", "")
    assert mallory.settings.owner_id != "alice" and len(mallory.gallery) == 0
    sha256 = alice.gallery.replica_log.vault_sha256("a0-0")
    with mallory.client() as client:
        assert client.list_blobs() == []
        for attempt in (
            lambda: client.list_blobs(owner_id="alice"),
            lambda: client.read_blob(sha256),
            lambda: list(client.pull_records(owner_id="alice")),
            lambda: client.delete_blob(sha256),
        ):
            with pytest.raises(RpcStatusError) as refused:
                attempt()
            assert refused.value.code == "PERMISSION_DENIED"
        assert [r for batch in client.pull_records() for r in batch.records] == []

    # a wiped device: only the exported owner key, a new code for the owner, one sync
    restored = enrolled(
        make_device, server, "alice-new-phone", "alice", owner_key_file=key_file, owner_key_passphrase="correct horse"
    )
    assert restored.version == 2 and state(restored) == state(alice)
    assert restored.status()["replica"]["unpushed"] == 0  # nothing re-embedded, nothing to push back
    np.testing.assert_array_equal(restored.fetch_original("t3-4"), images(5, seed=53)[4])


def test_tombstones_propagate_and_removed_ids_stay_removed(server, make_device, images):
    one, two = enrolled(make_device, server, "one", "bob"), None
    one.add(images(6, seed=1), item_ids=[f"x{i}" for i in range(6)])
    one.sync()
    two = enrolled(make_device, server, "two", "bob", owner_key_file=_export(one), owner_key_passphrase="pw")
    assert set(state(two)) == {f"x{i}" for i in range(6)}
    originals = {item: one.gallery.replica_log.vault_sha256(item) for item in ("x1", "x4")}
    assert two.remove(["x1", "x4"]) == 2
    assert two.sync().replication.originals_deleted == 2  # after the tombstones were acknowledged
    converge(two, one)
    assert set(state(one)) == set(state(two)) == {"x0", "x2", "x3", "x5"}
    with one.client() as client:
        assert not set(originals.values()) & {b.sha256 for b in client.list_blobs()} and len(client.list_blobs()) == 4
    with pytest.raises(InputError, match="never used again"):
        one.add(images(1, seed=9), item_ids=["x1"])


def _export(device: Device) -> str:
    path = device.root.parent / f"{device.root.name}.owner-key"
    if not path.exists():
        device.export_owner_key(path, "pw")
    return str(path)


def _all_records(device: Device) -> list:
    with device.client() as client:
        return [r for batch in client.pull_records() for r in batch.records]


def test_a_retried_push_never_duplicates(server, make_device, images):
    device = enrolled(make_device, server, "retry", "carol")
    device.add(images(7, seed=2), item_ids=[f"r{i}" for i in range(7)], upload=True)
    assert seal_changes(device.parts) == 7
    records = [record_message(b) for b in device.gallery.replica_log.outgoing(100)]
    assert len(records) == 1 and len(records[0].item_ids) == 7  # one block
    with device.client() as client:
        first = client.push_records(records)  # the acknowledgement is lost: the device never marks them pushed
        again = client.push_records(records)
    assert (first.stored, first.already_stored, again.stored, again.already_stored) == (1, 0, 0, 1)
    assert (first.stored_rows, first.already_stored_rows, again.stored_rows, again.already_stored_rows) == (7, 0, 0, 7)
    assert again.last_sequence == first.last_sequence == 1 and list(again.sequences) == list(first.sequences) == [1]
    result = device.sync().replication  # the device's own retry
    assert (result.pushed, result.already_stored, result.unpushed) == (0, 7, 0)
    rows = live_rows(_all_records(device))
    assert [sequence for *_, sequence in rows] == [1] * 7 and len({item for item, *_ in rows}) == 7


def test_a_revoked_device_keeps_its_gallery_and_comes_back_with_a_new_code(server, make_device, images):
    from fctkit.protos.client import FctkitClient

    phone = enrolled(make_device, server, "phone", "erin")
    phone.add(images(5, seed=7), item_ids=[f"p{i}" for i in range(5)])
    phone.sync()
    before = state(phone)
    with FctkitClient(server.target, ADMIN_TOKEN) as admin:
        admin.revoke_device(phone.settings.device_id)
    with pytest.raises(RpcStatusError, match="revoked"):
        phone.add(images(2, seed=8), item_ids=["q0", "q1"])  # stored and queued; only the upload is refused
    with pytest.raises(RpcStatusError, match="revoked") as refused:
        phone.sync()
    assert refused.value.code == "UNAUTHENTICATED" and set(state(phone)) == {*before, "q0", "q1"}  # nothing lost
    assert phone.gallery.replica_log.outbox_size() == 2
    phone.enrol(server.target, enrolment_code(server, owner="erin"), device_name="phone")
    phone.sync()  # the change made while revoked goes out under the new token
    assert {item for item, *_ in live_rows(_all_records(phone))} == {*before, "q0", "q1"}


def test_a_record_of_a_version_not_installed_waits_pending(server, tiny_bundles, make_device, images, tmp_path):
    early = enrolled(make_device, server, "early", "dave")
    late = enrolled(make_device, server, "late", "dave", owner_key_file=_export(early), owner_key_passphrase="pw")
    late.add(images(4, seed=3), item_ids=[f"l{i}" for i in range(4)])
    late.sync()
    publish(server, tiny_bundles[2], tmp_path)
    early.sync()  # v2: pulls late's v1 rows, moves them to v2 itself, pushes
    early.add(images(3, seed=4), item_ids=[f"e{i}" for i in range(3)])
    early.sync()
    deferred = late.sync(upgrade=False)  # v2 downloaded, not installed: v2 records wait
    assert late.version == 1 and deferred.replication.still_pending == 7
    assert set(state(late)) == {f"l{i}" for i in range(4)}
    assert {m.item_id for m in late.query(images(3, seed=4), k=10)[0]} <= {f"l{i}" for i in range(4)}
    late.sync()  # the upgrade, then the pending records
    assert late.status()["replica"]["pending"] == 0
    converge(late, early)
    assert state(late) == state(early) and len(state(late)) == 7


def test_tampered_records_and_a_wrong_owner_key_lose_nothing(server, make_device, images):
    from fctkit.edge_runtime.crypto import new_key, write_key_file

    source = enrolled(make_device, server, "source", "erin")
    source.add(images(5, seed=5), item_ids=[f"s{i}" for i in range(5)])
    source.sync()
    # a device with a key of its own is refused at enrolment; the code stays usable
    code = enrolment_code(server, owner="erin")
    stranger = make_device("stranger")
    with pytest.raises(RpcStatusError) as refused:
        stranger.enrol(server.target, code, device_name="stranger")
    assert refused.value.code == "FAILED_PRECONDITION" and "--import-key" in refused.value.details
    assert stranger.settings.owner_id is None and not (stranger.root / "token").exists()
    friend = make_device("friend", owner_key_file=_export(source), owner_key_passphrase="pw")
    friend.enrol(server.target, code, device_name="friend")
    friend.sync()
    assert friend.status()["owner_key_id"] == source.status()["owner_key_id"] and len(state(friend)) == 5

    # an owner key swapped after enrolment: the pull stops at the first record, nothing is lost
    swapped = enrolled(
        make_device, server, "swapped", "erin", owner_key_file=_export(source), owner_key_passphrase="pw"
    )
    swapped.close()
    (swapped.root / "owner.key").unlink()
    write_key_file(swapped.root / "owner.key", new_key(), kind="owner")
    swapped = Device.open(swapped.root)
    swapped.add(images(2, seed=6), item_ids=["own0", "own1"], upload=False)
    source.add(images(1, seed=7), item_ids=["late"])
    source.sync()
    before, cursor = state(swapped), swapped.gallery.replica_log.replica_cursor
    with pytest.raises(CorruptRecordError, match="another owner's key"):
        swapped.sync()
    assert state(swapped) == before and swapped.gallery.replica_log.replica_cursor == cursor
    swapped.close()

    # a record tampered with on the server: authentication fails, the cursor stays before it
    kept = state(friend)
    with sqlite3.connect(server.data_dir / "meta.sqlite3") as db:
        sealed, sequence = db.execute(
            "SELECT b.sealed, b.sequence FROM replica_blocks b JOIN replica_items i "
            "USING (owner_id, sequence) WHERE i.item_id = 'late'"
        ).fetchone()
        tampered = bytearray(sealed)
        tampered[-3] ^= 0x01
        db.execute(
            "UPDATE replica_blocks SET sealed = ? WHERE sequence = ? AND owner_id = 'erin'", (bytes(tampered), sequence)
        )
    with pytest.raises(CorruptRecordError, match="authentication failed"):
        friend.sync()
    assert state(friend) == kept and friend.gallery.replica_log.replica_cursor == sequence - 1


def test_cli_owner_key_export_import_restore_and_status(server, tmp_path, images, publisher_pub, monkeypatch):
    import json

    from click.testing import CliRunner

    from fctkit.cli import cli
    from tests.edge.conftest import device_cli

    def admin_code(owner: str) -> str:
        result = CliRunner().invoke(
            cli,
            ["admin", "--server", server.target, "enrol-code", "--owner", owner],
            env={"FCTKIT_ADMIN_TOKEN": ADMIN_TOKEN},
        )
        assert result.exit_code == 0, result.output
        return result.output.splitlines()[0]

    def run(*args: str) -> dict:
        done = device_cli(*args)
        assert done.returncode == 0, (args, done.stderr)
        return json.loads(done.stdout) if done.stdout.strip().startswith("{") else {}

    monkeypatch.setenv("FCTKIT_TEST_OWNER_PASS", "pass phrase")  # the subprocesses inherit it
    first, second, key = tmp_path / "first", tmp_path / "second", tmp_path / "owner.key"
    np.savez(tmp_path / "add.npz", images=images(3, seed=8), ids=np.array(["p0", "p1", "p2"]))
    run("init", "--dir", str(first), "--publisher-key", str(publisher_pub))
    assert (
        run("enrol", "--dir", str(first), "--server", server.target, "--code", admin_code("frank"))["owner_id"]
        == "frank"
    )
    run("sync", "--dir", str(first), "--quiet")
    run("add", "--dir", str(first), str(tmp_path / "add.npz"))
    assert run("sync", "--dir", str(first), "--quiet")["replication"]["pushed"] == 3
    run("export-key", "--dir", str(first), str(key), "--key-passphrase-env", "FCTKIT_TEST_OWNER_PASS")
    assert json.loads(key.read_text())["kind"] == "owner" and "pass phrase" not in key.read_text()
    run("init", "--dir", str(second), "--import-key", str(key), "--key-passphrase-env", "FCTKIT_TEST_OWNER_PASS")
    run("enrol", "--dir", str(second), "--server", server.target, "--code", admin_code("frank"), "--trust-on-first-use")
    skipped = run("sync", "--dir", str(second), "--quiet", "--no-replicate")
    assert skipped["replication"] is None
    run("sync", "--dir", str(second), "--quiet")
    status = run("status", "--dir", str(second))
    assert status["owner_id"] == "frank" and status["rows"] == 3
    assert status["replica"] == {"cursor": 1, "unpushed": 0, "pending": 0, "tombstones": 0}  # one block of 3 rows
    assert run("remove", "--dir", str(second), "p1")["removed"] == 1
    assert run("status", "--dir", str(second))["replica"]["unpushed"] == 1


def test_a_gallery_and_device_from_before_owners_are_migrated_and_replicate(
    server, tiny_bundles, make_device, images, tmp_path
):
    device = make_device("old")
    device.upgrade(tiny_bundles[1])  # installed offline, rows added before any server
    device.add(images(4, seed=12), item_ids=[f"old{i}" for i in range(4)], upload=False)
    root = device.root
    device.close()
    # make it a schema-1 gallery in a device directory without an owner key
    downgrade_to_schema_4(root / "gallery.sqlite", read_key_file(root / "device.key"))
    with sqlite3.connect(root / "gallery.sqlite") as db:
        for table in ("changes", "tombstones", "pending_records", "row_extras"):  # schema 5's, after the downgrade
            db.execute(f"DROP TABLE {table}")
        db.execute("ALTER TABLE items DROP COLUMN record_sha256")
        db.execute("ALTER TABLE meta DROP COLUMN mac")
        db.execute("DELETE FROM meta WHERE key = 'row_count'")
        db.execute("UPDATE meta SET value = '1' WHERE key = 'schema_version'")
        db.execute("DELETE FROM meta WHERE key = 'replica_cursor'")
    (root / "owner.key").unlink()
    with Device.open(root) as device:
        assert (root / "owner.key").exists() and device.gallery.meta("schema_version") == "6"
        assert device.status()["replica"] == {"cursor": 0, "unpushed": 4, "pending": 0, "tombstones": 0}
        device.progress = False
        device.enrol(server.target, enrolment_code(server, owner="ivan"), device_name="old")
        assert device.sync().replication.pushed == 4
        expected = state(device)
        key_file = device.export_owner_key(tmp_path / "ivan.key", "pw")
    twin = enrolled(make_device, server, "twin", "ivan", owner_key_file=key_file, owner_key_passphrase="pw")
    assert state(twin) == expected


def test_rows_of_an_older_version_are_moved_by_the_installed_adapters(
    server, tiny_bundles, make_device, images, tmp_path
):
    """A device that installed v3 directly pulls v1 rows: the direct 1->3 adapter of its bundle
    moves them (as an upgrade would) and it pushes them; the v1 device, upgraded, adopts them."""
    old = enrolled(make_device, server, "stays-at-v1", "judy")
    old.add(images(5, seed=13), item_ids=[f"o{i}" for i in range(5)])
    old.sync()
    publish(server, tiny_bundles[2], tmp_path)
    publish(server, tiny_bundles[3], tmp_path)
    new = enrolled(make_device, server, "starts-at-v3", "judy", owner_key_file=_export(old), owner_key_passphrase="pw")
    assert new.version == 3 and new.installed_versions() == [3]
    assert {tag for tag, *_ in state(new).values()} == {"v1->v3 (forward)"}
    moved = new.gallery.load()
    engine = new.engine(3)
    direct = next(a for a in engine.manifest.artifacts if a.role == "forward" and a.source_version == 1)
    originals = old.gallery.load()
    np.testing.assert_allclose(
        moved.embeddings, engine.run(direct, originals.embeddings, originals.side_infos), rtol=1e-5, atol=1e-6
    )
    assert new.status()["replica"]["unpushed"] == 0  # pushed back by the restoring sync
    assert old.sync().hops == "v1 -> v3"
    converge(old, new)
    assert state(old) == state(new)


def test_a_schema_5_gallery_pushes_its_sealed_records_as_they_were_and_keeps_its_pending_ones(
    server, make_device, images
):
    """Changes sealed before blocks keep their bytes and change ids (the server may hold them
    already: a lost acknowledgement), and a single-row record kept pending stays pending."""
    from fctkit.edge_runtime.gallery.rows import VersionTag
    from fctkit.edge_runtime.records import RowContent, seal_record
    from tests.support.old_galleries import downgrade_to_schema_5

    device = enrolled(make_device, server, "old-phone", "kim")
    device.add(images(5, seed=20), item_ids=[f"k{i}" for i in range(5)], upload=False)
    rows, root, owner = device.gallery.load(), device.root, device.parts.owner_sealer
    device.close()
    downgrade_to_schema_5(root / "gallery.sqlite", read_key_file(root / "device.key"))
    old_records = {
        item: seal_record(
            owner, "kim", item, rows.tags[k], RowContent(rows.embeddings[k], rows.side_infos[k], rows.labels[k], None)
        )
        for k, item in enumerate(rows.item_ids)
        if item in ("k0", "k1", "k2")
    }
    future = seal_record(
        owner,
        "kim",
        "later",
        VersionTag(9, 9, "native"),
        RowContent(rows.embeddings[0], rows.side_infos[0], None, None),
    )
    with sqlite3.connect(root / "gallery.sqlite") as db:
        for item, sealed in old_records.items():
            db.execute(
                "UPDATE changes SET sealed = ?, version = 1, origin_version = 1, via = 'native' WHERE item_id = ?",
                (sealed, item),
            )
        db.execute("INSERT INTO pending_records VALUES (99, 'later', 9, 9, 'native', ?)", (future,))
        change_k0 = db.execute("SELECT change_id FROM changes WHERE item_id = 'k0'").fetchone()[0]
    with Device.open(root) as device:
        assert device.gallery.meta("schema_version") == "6"
        assert device.status()["replica"] == {"cursor": 0, "unpushed": 5, "pending": 1, "tombstones": 0}
        with (
            device.client() as client
        ):  # k0's record reached the server before the migration; its acknowledgement was lost
            client.push_records(
                [
                    vault_pb2.SealedRecord(
                        change_id=change_k0,
                        item_id="k0",
                        version=1,
                        origin_version=1,
                        via="native",
                        sealed=old_records["k0"],
                    )
                ]
            )
        result = device.sync().replication
        assert (result.pushed, result.already_stored, result.unpushed, result.still_pending) == (4, 1, 0, 1)
        expected, records, key_file = state(device), _all_records(device), _export(device)
    assert sorted((r.item_id, r.sealed) for r in records if r.item_id) == sorted(
        old_records.items()
    )  # sent as they were
    assert sorted(item for item, *_ in live_rows(records)) == [f"k{i}" for i in range(5)]
    twin = enrolled(make_device, server, "twin", "kim", owner_key_file=key_file, owner_key_passphrase="pw")
    assert state(twin) == expected

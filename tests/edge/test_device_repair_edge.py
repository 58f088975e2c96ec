"""Damage the device cannot hide, and repair in one step (issue 19 part 3): authenticated gallery
settings, an authenticated row count, SQLite errors as kit errors, `fctkit device repair`."""

from __future__ import annotations

import json
import sqlite3

import numpy as np
import pytest

from fctkit.edge_runtime import Device
from fctkit.errors import DeviceKeyError, GalleryDamagedError, GalleryError
from tests.edge.conftest import device_cli
from tests.edge.test_replication_edge import enrolled, server, state  # noqa: F401 (server is a fixture)
from tests.support.device_damage import fctkit


def _filled(make_device, tiny_bundles, images, name="dev", n=12) -> Device:
    device = make_device(name)
    device.upgrade(tiny_bundles[1])
    _add_in_blocks(device, images(n, seed=5), "it", upload=False)
    return device


def _add_in_blocks(device: Device, batch: np.ndarray, prefix: str, *, upload: bool = True, per_block: int = 4) -> None:
    """One add call (one sealed block) per ``per_block`` items, so damage to a block is local to its rows."""
    for first in range(0, len(batch), per_block):
        ids = range(first, min(first + per_block, len(batch)))
        device.add(
            batch[first : first + per_block],
            item_ids=[f"{prefix}{i:02d}" for i in ids],
            labels=[f"L{i}" for i in ids],
            upload=upload,
        )


def _sql(device: Device, *statements: str) -> None:
    root = device.root
    device.close()
    with sqlite3.connect(root / "gallery.sqlite") as db:
        for statement in statements:
            db.execute(statement)


def _answers(device: Device, queries: np.ndarray) -> list[list[str]]:
    return [[m.item_id for m in found] for found in device.query(queries, k=4)]


@pytest.mark.parametrize(
    "edit, searched",
    [
        ("UPDATE meta SET value = '0' WHERE key = 'query_version'", True),
        ("DELETE FROM meta WHERE key = 'query_version'", True),
        ("UPDATE meta SET mac = x'00' WHERE key = 'live_vectors'", True),
        ("UPDATE meta SET value = '7' WHERE key = 'replica_cursor'", False),
        ("UPDATE meta SET value = '13' WHERE key = 'row_count'", True),
    ],
)
def test_a_damaged_setting_is_reported_never_used_and_repair_derives_it_again(
    make_device, tiny_bundles, images, edit, searched
):
    device = _filled(make_device, tiny_bundles, images)
    queries = images(3, seed=9)
    before, root = _answers(device, queries), device.root
    _sql(device, edit)
    with Device.open(root) as damaged:
        status = damaged.status()
        assert status["damaged_settings"] and "repair" in status["next"]
        assert damaged.check()["damaged"] >= 1
        if searched:
            with pytest.raises(GalleryDamagedError, match="failed authentication or are missing"):
                damaged.query(queries)
        else:  # a setting searches do not read: the answers stay right, status and check report it
            assert _answers(damaged, queries) == before
        with pytest.raises(GalleryDamagedError):  # the kit's own advice never installs over a damaged gallery
            damaged.upgrade(tiny_bundles[2])
        assert damaged.installed_versions() == [1]
        report = damaged.repair()
        assert report["damaged_after"] == 0 and set(report["settings_restored"]) <= set(status["damaged_settings"])
        assert _answers(damaged, queries) == before
        assert damaged.upgrade(tiny_bundles[2]) == 12 and damaged.check()["damaged"] == 0


def _dump(root) -> list[str]:
    with sqlite3.connect(f"file:{root / 'gallery.sqlite'}?mode=ro", uri=True) as db:
        return list(db.iterdump())


@pytest.mark.parametrize(
    "edit",
    [  # one bit of '6': '2' and '4' name schemas whose migrations would run on this file, '7' none at all
        "UPDATE meta SET value = '2' WHERE key = 'schema_version'",
        "UPDATE meta SET value = '4' WHERE key = 'schema_version'",
        "UPDATE meta SET value = '7' WHERE key = 'schema_version'",
        "UPDATE meta SET value = '4', mac = substr(mac, 2) WHERE key = 'schema_version'",  # its MAC damaged too
    ],
)
def test_a_damaged_schema_version_is_a_damaged_setting_not_sqlite_damage(make_device, tiny_bundles, images, edit):
    device = _filled(make_device, tiny_bundles, images)
    queries = images(3, seed=9)
    before, root = _answers(device, queries), device.root
    _sql(device, edit)
    damaged_file = _dump(root)
    with Device.open(root) as damaged:  # the file's own tables say it is at the current schema: nothing migrates
        assert _answers(damaged, queries) == before
        report = damaged.check()
        assert report["damaged_settings"] == ["schema_version"] and "sqlite_integrity" not in report
        assert "schema_version" in damaged.status()["damaged_settings"]
    assert _dump(root) == damaged_file  # opening, querying and checking wrote nothing
    checked = fctkit("device", "check", "--dir", str(root))
    assert checked.code == 3 and "SQLite" not in checked.stdout + checked.stderr, checked
    repaired = fctkit("device", "repair", "--dir", str(root))
    assert repaired.code == 0 and json.loads(repaired.stdout)["settings_restored"] == {"schema_version": "6"}
    with Device.open(root) as again:
        assert again.check()["damaged"] == 0 and _answers(again, queries) == before


def test_a_schema_version_neither_its_mac_nor_the_tables_vouch_for_says_so(make_device, tiny_bundles, images):
    device = _filled(make_device, tiny_bundles, images)
    root = device.root
    _sql(
        device,
        "UPDATE meta SET value = '4', mac = substr(mac, 2) WHERE key = 'schema_version'",
        "CREATE TABLE pending_records (sequence INTEGER PRIMARY KEY)",  # as an older schema's file holds
    )
    run = fctkit("device", "check", "--dir", str(root))
    assert run.code == 2 and "schema version record is damaged (it reads '4'" in run.stderr, run
    assert "SQLite" not in run.stderr and "`fctkit device repair --dir DIR` prints the steps" in run.stderr
    run = fctkit("device", "repair", "--dir", str(root))
    assert run.code == 2 and "schema version record is damaged" in run.stderr and "prints the steps" not in run.stderr
    assert f"rebuild it from the owner's replica: `mv {root} {root}.damaged`" in run.stderr, run


def test_a_damaged_essential_setting_names_itself_and_a_wrong_key_stays_a_key_error(
    make_device, tiny_bundles, images, tmp_path
):
    device = _filled(make_device, tiny_bundles, images)
    root = device.root
    # both of the first two characters changed, whatever the random id begins with: one damaged character
    # is recovered through the MAC by design (GallerySettings.recovered), two are not
    _sql(
        device,
        "UPDATE meta SET value = (CASE WHEN substr(value, 1, 1) = '0' THEN '1' ELSE '0' END) || "
        "(CASE WHEN substr(value, 2, 1) = '0' THEN '1' ELSE '0' END) || substr(value, 3) WHERE key = 'gallery_id'",
    )
    with pytest.raises(GalleryDamagedError, match=r"gallery_id.*rebuild it from the owner's replica") as caught:
        Device.open(root)
    assert caught.value.settings == ("gallery_id",)
    other = make_device("other")
    other.close()
    (tmp_path / "other" / "gallery.sqlite").unlink()
    (tmp_path / "other" / "gallery.sqlite").write_bytes((tmp_path / "dev" / "gallery.sqlite").read_bytes())
    with pytest.raises(DeviceKeyError, match="not sealed with this device key"):
        Device.open(tmp_path / "other")


def test_a_damaged_block_and_a_block_gone_are_reported_by_query_status_and_check(make_device, tiny_bundles, images):
    device = _filled(make_device, tiny_bundles, images)  # rows 1-4, 5-8, 9-12 in blocks 1, 2, 3
    root = device.root
    _sql(
        device,
        "UPDATE vector_blocks SET embedding = zeroblob(length(embedding)) WHERE block_id = 1",
        "DELETE FROM vector_blocks WHERE block_id = 3",
    )
    with Device.open(root) as damaged:
        assert len(damaged.query(images(1, seed=1), k=20)[0]) == 4
        assert [r[0] for r in damaged.damaged_rows()] == [1, 2, 3, 4] and damaged.missing_rows() == 4
        status = damaged.status()
        assert status["damaged_rows"] == 4 and status["missing_rows"] == 4
        report = damaged.check()  # with the per-row table, the rows of the block gone are named too
        assert [r[0] for r in report["damaged_rows"]] == [1, 2, 3, 4, 9, 10, 11, 12] and report["damaged"] == 8
        assert "vectors are missing" in report["damaged_rows"][-1][2]
    proc = device_cli("query", "--dir", str(root), "-k", "3", _npy(root, images(1, seed=1)))
    assert proc.returncode == 3 and "4 damaged row(s)" in proc.stderr and "4 row(s) are gone" in proc.stderr
    proc = device_cli("status", "--dir", str(root))
    assert proc.returncode == 3 and '"missing_rows": 4' in proc.stdout
    # not enrolled: repair removes what no replica can restore, in one step, and says so
    proc = device_cli("repair", "--dir", str(root))
    assert proc.returncode == 0, proc.stderr
    assert '"rows_removed": [\n    "it00"' in proc.stdout and "not enrolled" in proc.stdout
    with Device.open(root) as repaired:
        assert repaired.check()["damaged"] == 0 and len(repaired.gallery) == 4
        assert (
            repaired.gallery._db.execute("SELECT COUNT(*) FROM vector_blocks").fetchone()[0] == 1
        )  # the dead block is gone


def test_repair_brings_damaged_and_missing_rows_back_from_the_owners_replica(server, make_device, images):  # noqa: F811
    device = enrolled(make_device, server, "phone", "olga")
    _add_in_blocks(device, images(12, seed=4), "p")
    device.sync()
    expected, root = state(device), device.root
    _sql(
        device,
        "UPDATE vector_blocks SET embedding = zeroblob(length(embedding)) WHERE block_id = 1",
        "DELETE FROM items WHERE row_id = 7",
        "DELETE FROM vector_blocks WHERE block_id = 3",
    )
    with Device.open(root) as damaged:
        damaged.progress = False
        report = damaged.repair()
        lost = ["p00", "p01", "p02", "p03", "p06", "p08", "p09", "p10", "p11"]  # block 1, row 7's entry, block 3
        assert sorted(report["rows_forgotten"]) == lost and report["rows_missing"] == 0
        assert sorted(report["rows_restored"]) == lost and report["rows_removed"] == [] and report["damaged_after"] == 0
        assert state(damaged) == expected  # bit for bit, the missing row included
        assert damaged.sync().replication.pushed == 0  # nothing to push again: the records were the owner's own


def test_sqlite_damage_is_a_kit_error_never_a_traceback(make_device, tiny_bundles, images):
    device = _filled(make_device, tiny_bundles, images, n=200)
    root = device.root
    device.close()
    path = root / "gallery.sqlite"
    data = bytearray(path.read_bytes())
    page = 16384
    data[3 * page : 4 * page] = bytes([0xA5]) * page  # one b-tree page of garbage
    path.write_bytes(bytes(data))
    with pytest.raises(GalleryError) as caught, Device.open(root) as damaged:
        damaged.query(images(1))
        damaged.check()
    assert "damaged" in str(caught.value) or "fail" in str(caught.value)


def _npy(root, array) -> str:
    path = root.parent / "queries.npy"
    np.save(path, array)
    return str(path)


def test_an_upgrade_stopped_by_a_damaged_row_goes_on_after_repair(make_device, tiny_bundles, images):
    device = make_device("upgrading", batch_size=4)
    device.upgrade(tiny_bundles[1])
    _add_in_blocks(device, images(12, seed=5), "it", upload=False)
    root = device.root
    _sql(device, "UPDATE vector_blocks SET embedding = zeroblob(length(embedding)) WHERE block_id = 2")
    with Device.open(root) as damaged:
        damaged.progress = False
        with pytest.raises(GalleryError, match=r"row 5 \('it04'\) cannot be upgraded.*fctkit device repair"):
            damaged.upgrade(tiny_bundles[2])
        assert damaged.gallery.upgrade_state is not None  # stopped mid-way, resumable
        report = damaged.repair()
        assert report["rows_removed"] == ["it04", "it05", "it06", "it07"] and report["damaged_after"] == 0
        damaged.upgrade()
        assert damaged.version == 2 and damaged.gallery.tag_counts() == {"v1->v2 (forward)": 8}


def test_rows_the_replica_lacks_are_embedded_again_from_their_vault_originals(server, make_device, images):  # noqa: F811
    device = enrolled(make_device, server, "camera", "vera")
    _add_in_blocks(device, images(12, seed=6), "v")  # originals uploaded to the vault; no replica push yet
    expected, root = state(device), device.root
    _sql(device, "UPDATE vector_blocks SET embedding = zeroblob(length(embedding)) WHERE block_id = 2")
    with Device.open(root) as damaged:
        damaged.progress = False
        report = damaged.repair()
        lost = ["v04", "v05", "v06", "v07"]
        assert report["rows_forgotten"] == lost and report["rows_restored_from_vault"] == lost
        assert report["rows_restored"] == lost and report["rows_removed"] == [] and report["damaged_after"] == 0
        restored = state(damaged)
        assert set(restored) == set(expected)
        for item, (tag, embedding, side_info, label) in expected.items():  # the same model on the same originals
            assert restored[item][0] == tag and restored[item][3] == label
            assert np.allclose(np.frombuffer(restored[item][1], "<f4"), np.frombuffer(embedding, "<f4"), atol=1e-6)
            assert np.allclose(np.frombuffer(restored[item][2], "<f4"), np.frombuffer(side_info, "<f4"), atol=1e-6)
        assert damaged.gallery.replica_log.outbox_size() == 0  # the originals are not uploaded again
        assert damaged.gallery.replica_log.vault_sha256("v05") is not None


def test_the_rebuild_imports_an_unwrapped_owner_key_without_asking_for_a_passphrase(make_device, tmp_path):
    old = make_device("old")  # no passphrase: owner.key is stored unwrapped
    old.close()
    run = fctkit("device", "init", "--dir", str(tmp_path / "new"), "--import-key", str(old.root / "owner.key"))
    assert run.code == 0 and "passphrase" not in run.stdout + run.stderr, run
    assert json.loads(run.stdout)["owner_key_imported"] is True
    with Device.open(tmp_path / "new") as new, Device.open(old.root) as again:
        assert new.owner_key() == again.owner_key()

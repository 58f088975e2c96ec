"""Byte-level damage on the device's read paths (issue 34 section 2): every damaged value is
reported by `check` and `status`, named by row or setting, repaired where the device alone can,
and never a traceback or a silent wrong answer."""

from __future__ import annotations

import sqlite3
from pathlib import Path

import numpy as np
import pytest

import fctkit.edge_runtime.upgrade as upgrade_module
from fctkit.edge_runtime import Device
from fctkit.edge_runtime.sqlite_file import transaction
from fctkit.errors import GalleryDamagedError, GalleryError
from tests.edge.conftest import device_cli
from tests.edge.test_device_repair_edge import _add_in_blocks, _npy, _sql
from tests.edge.test_replication_edge import enrolled, server, state  # noqa: F401 (server is a fixture)


def _device(make_device, tiny_bundles, images, name: str = "dev", n: int = 12, **settings) -> Device:
    """v1 and ``n`` rows, four per block (block k holds rows 4k+1..4k+4, items it00..), originals queued."""
    device = make_device(name, **settings)
    device.upgrade(tiny_bundles[1])
    _add_in_blocks(device, images(n, seed=5), "it", upload=False)
    return device


def _answers(device: Device, queries: np.ndarray) -> list[list[tuple[str, str | None]]]:
    return [[(m.item_id, m.label) for m in found] for found in device.query(queries, k=12)]


def _text(raw: bytes) -> str:
    """SQL for ``raw`` stored as TEXT whatever its bytes (as a flipped byte leaves a text column)."""
    return f"CAST(x'{raw.hex()}' AS TEXT)"


class _Stop(Exception):
    pass


def _staged(device: Device, bundle: Path, monkeypatch) -> None:
    """Start a forward upgrade to ``bundle`` and stop it after its first committed batch (a crash)."""
    run = upgrade_module.run_upgrade

    def stopping(*args, **kwargs):
        def on_batch(rows: int) -> None:
            raise _Stop

        return run(*args, **{**kwargs, "on_batch": on_batch})

    monkeypatch.setattr(upgrade_module, "run_upgrade", stopping)
    with pytest.raises(_Stop):
        device.upgrade(bundle)
    monkeypatch.setattr(upgrade_module, "run_upgrade", run)
    assert device.gallery.upgrade_state is not None


def test_a_separator_byte_in_a_blocks_item_ids_damages_that_block_only(make_device, tiny_bundles, images):
    device = _device(make_device, tiny_bundles, images)
    queries, root = images(2, seed=9), device.root
    before = _answers(device, queries)
    device.close()
    with sqlite3.connect(root / "gallery.sqlite") as db:
        item_ids = db.execute("SELECT item_ids FROM vector_blocks WHERE block_id = 2").fetchone()[0]
        assert item_ids == b"it04\0it05\0it06\0it07"
        db.execute("UPDATE vector_blocks SET item_ids = ? WHERE block_id = 2", (item_ids.replace(b"\0", b"\1", 1),))
    with Device.open(root) as damaged:
        damaged.progress = False
        kept = [[m for m in found if m[0] not in ("it04", "it05", "it06", "it07")] for found in before]
        assert _answers(damaged, queries) == kept  # the other blocks answer as before
        report = damaged.check()
        assert [(r, i) for r, i, _ in report["damaged_rows"]] == [(5, "it04"), (6, "it05"), (7, "it06"), (8, "it07")]
        assert "item ids" in report["damaged_rows"][0][2]
        assert damaged.status()["damaged_rows"] == 4
        repaired = damaged.repair()
        assert repaired["rows_removed"] == ["it04", "it05", "it06", "it07"] and repaired["damaged_after"] == 0


@pytest.mark.parametrize("name", [b"it05", b"it00"])  # one bit of 'it04': a name of its block, or of another block
def test_a_damaged_name_in_a_blocks_item_ids_costs_its_rows_and_repair_names_every_one(
    make_device, tiny_bundles, images, name
):
    device = _device(make_device, tiny_bundles, images)
    root = device.root
    device.close()
    with sqlite3.connect(root / "gallery.sqlite") as db:
        item_ids = db.execute("SELECT item_ids FROM vector_blocks WHERE block_id = 2").fetchone()[0]
        db.execute("UPDATE vector_blocks SET item_ids = ? WHERE block_id = 2", (item_ids.replace(b"it04", name),))
    block = ["it04", "it05", "it06", "it07"]
    with Device.open(root) as damaged:
        damaged.progress = False
        named = dict.fromkeys((r, i) for r, i, _ in damaged.check()["damaged_rows"])  # each field fails
        assert list(named) == list(zip(range(5, 9), block, strict=True))
        report = damaged.repair()
        assert report["rows_forgotten"] == block and report["rows_removed"] == block
        assert list(report["forgotten_because"]) == block and report["damaged_after"] == 0
        assert sorted(damaged.gallery.load().item_ids) == [f"it{i:02d}" for i in range(12) if i not in range(4, 8)]


@pytest.mark.parametrize(
    "edit",
    [
        "UPDATE items SET item_id = {bad} WHERE row_id = 6",
        "UPDATE items SET item_id = CAST(x'697405ff' AS BLOB) WHERE row_id = 6",
    ],
)
def test_an_item_id_that_is_not_utf8_names_its_row_and_repair_sets_it_back(make_device, tiny_bundles, images, edit):
    device = _device(make_device, tiny_bundles, images)
    root = device.root
    _sql(device, edit.format(bad=_text(b"it\xff5")))
    with Device.open(root) as damaged:
        damaged.progress = False
        report = damaged.check()
        assert [r for r, _, _ in report["damaged_rows"]] == [6]
        repaired = damaged.repair()  # its block authenticates the item id: the row is kept, its entry set back
        assert repaired["damaged_after"] == 0 and repaired["rows_forgotten"] == [] and len(damaged.gallery) == 12
        assert "it05" in damaged.gallery.load().item_ids


@pytest.mark.parametrize("stored", ["text", "blob"])
def test_a_queued_original_whose_item_id_is_not_utf8_is_reported_and_dropped(make_device, tiny_bundles, images, stored):
    device = _device(make_device, tiny_bundles, images)
    root = device.root
    value = _text(b"it\xff3") if stored == "text" else "CAST(x'6974ff33' AS BLOB)"
    _sql(device, f"UPDATE outbox SET item_id = {value} WHERE item_id = 'it03'")
    with Device.open(root) as damaged:
        damaged.progress = False
        report = damaged.check()
        assert [name for name, _ in report["damaged_queued_originals"]] == ["it\udcff3"]
        repaired = damaged.repair()
        assert repaired["queued_originals_dropped"] == ["it\udcff3"] and repaired["damaged_after"] == 0
        assert damaged.gallery.replica_log.outbox_size() == 11


@pytest.mark.parametrize("key", ["query_version", "row_count", "replica_cursor", "live_vectors"])
@pytest.mark.parametrize("stored", ["text", "blob"])
def test_a_damaged_setting_name_is_dropped_and_the_setting_derived_without_a_server(
    make_device, tiny_bundles, images, key, stored
):
    device = _device(make_device, tiny_bundles, images)
    queries, root = images(2, seed=9), device.root
    before = _answers(device, queries)
    raw = key.encode()[:3] + b"\xff" + key.encode()[4:]
    value = _text(raw) if stored == "text" else f"CAST(x'{key.encode().hex()}' AS BLOB)"
    _sql(device, f"UPDATE meta SET key = {value} WHERE key = '{key}'")
    with Device.open(root) as damaged:
        damaged.progress = False
        named = damaged.status()["damaged_settings"]
        assert named == sorted(
            {key, raw.decode("utf-8", "surrogateescape") if stored == "text" else key}
        )  # missing, and as read
        assert damaged.check()["damaged_settings"] == named
        repaired = damaged.repair()  # no server: derived or dropped, never "rebuild from the replica"
        assert repaired["damaged_after"] == 0 and damaged.gallery.settings.damaged() == []
        assert _answers(damaged, queries) == before


@pytest.mark.parametrize(
    "edit, table",
    [
        ("UPDATE sqlite_sequence SET seq = seq - 1 WHERE name = 'vector_blocks'", "vector_blocks"),
        ("UPDATE sqlite_sequence SET name = 'vector_blockz' WHERE name = 'vector_blocks'", "vector_blocks"),
        (
            "UPDATE sqlite_sequence SET seq = 9223372036854775807 WHERE name = 'changes'",
            "changes",
        ),  # SQLite: "disk is full"
    ],
)
def test_a_damaged_id_counter_is_found_repaired_and_add_says_so(make_device, tiny_bundles, images, edit, table):
    device = _device(make_device, tiny_bundles, images)
    root = device.root
    _sql(device, edit)
    with Device.open(root) as damaged:
        damaged.progress = False
        with pytest.raises(GalleryDamagedError, match=r"sqlite_sequence.*fctkit device repair"):
            damaged.add(images(2, seed=11), item_ids=["new0", "new1"], upload=False)
        assert len(damaged.gallery) == 12  # nothing was written
        assert damaged.check()["damaged_id_counters"] == [table]
        assert damaged.repair()["damaged_after"] == 0
        damaged.add(images(2, seed=11), item_ids=["new0", "new1"], upload=False)
        assert damaged.check()["damaged"] == 0 and len(damaged.gallery) == 14


def test_a_label_that_fails_to_open_is_reported_by_query_and_check(make_device, tiny_bundles, images):
    device = _device(make_device, tiny_bundles, images)
    root = device.root
    query = images(1, seed=5)[:1]  # it00 itself: its label is in the answer
    _sql(device, "UPDATE items SET label = CAST(zeroblob(length(label)) AS BLOB) WHERE row_id = 1")
    proc = device_cli("query", "--dir", str(root), _npy(root, query), "-k", "3")
    assert proc.returncode == 3, proc.stderr
    assert '"item_id": "it00"' in proc.stdout and "row 1" in proc.stderr and "label" in proc.stderr
    with Device.open(root) as damaged:
        assert [r for r, _, _ in damaged.check()["damaged_rows"]] == [1]


@pytest.mark.parametrize(
    "edit, reported",
    [
        ("UPDATE vectors_0 SET block_id = 3 WHERE row_id = 2", [2]),  # row 2 lives in block 1
        ("UPDATE vectors_0 SET version = 2 WHERE row_id = 2", [2]),
        ("DELETE FROM vectors_0 WHERE row_id = 2", [2]),
        ("UPDATE vectors_0 SET row_id = 99 WHERE row_id = 2", [2, 99]),
    ],
)
def test_a_damaged_row_pointer_is_found_and_repair_points_it_back(make_device, tiny_bundles, images, edit, reported):
    device = _device(make_device, tiny_bundles, images)
    queries, root = images(2, seed=9), device.root
    before = _answers(device, queries)
    _sql(device, edit)
    with Device.open(root) as damaged:
        damaged.progress = False
        assert _answers(damaged, queries) == before  # its vectors are intact: it keeps answering
        assert damaged.check()["damaged_row_pointers"] == reported and damaged.status()["damaged"] == len(reported)
        with pytest.raises(GalleryError, match=r"point to the wrong vectors.*fctkit device repair"):
            damaged.upgrade(tiny_bundles[2])  # it would skip or lose the row
        report = damaged.repair()
        assert report["rows_forgotten"] == [] and report["damaged_after"] == 0 and _answers(damaged, queries) == before
        assert damaged.upgrade() == 12 and damaged.gallery.tag_counts() == {"v1->v2 (forward)": 12}


def test_damaged_staged_rows_are_found_and_staged_again_from_their_live_rows(
    make_device, tiny_bundles, images, monkeypatch
):
    device = _device(make_device, tiny_bundles, images, n=24, batch_size=8)
    root = device.root
    _staged(device, tiny_bundles[2], monkeypatch)
    staged = device.gallery._db.execute("SELECT COUNT(*) FROM vectors_1").fetchone()[0]
    assert staged >= 8
    _sql(device, "UPDATE vector_blocks SET embedding = zeroblob(length(embedding)) WHERE vector_set = 'vectors_1'")
    with Device.open(root) as damaged:
        damaged.progress = False
        report = damaged.check()
        assert len(report["damaged_staged_rows"]) == staged and report["damaged_rows"] == []
        damaged.upgrade()  # the resume stages them again rather than switching them live
        assert damaged.version == 2 and len(damaged.gallery) == 24
        assert damaged.gallery.tag_counts() == {"v1->v2 (forward)": 24} and damaged.check()["damaged"] == 0


def test_index_damage_is_reported_by_sqlite_and_repair_rebuilds_the_index(make_device, tiny_bundles, images):
    device = _device(make_device, tiny_bundles, images)
    root = device.root
    device.close()
    path = root / "gallery.sqlite"
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        page, size = db.execute(
            "SELECT rootpage, (SELECT page_size FROM pragma_page_size) FROM sqlite_master "
            "WHERE name = 'sqlite_autoindex_items_1'"
        ).fetchone()
    data = bytearray(path.read_bytes())
    at = data.index(b"it05", (page - 1) * size, page * size)
    data[at + 3] = ord("z")  # the index's key for it05 now reads it0z: the table and its index disagree
    path.write_bytes(bytes(data))
    with Device.open(root) as damaged:
        damaged.progress = False
        report = damaged.check()
        assert "index" in " ".join(report["sqlite_integrity"]) and "fctkit device repair" in report["next"]
        assert damaged.status()["damaged"] >= 1
        assert damaged.repair()["damaged_after"] == 0
        assert damaged.gallery.sqlite_problems() == []


def _garbage_page(root: Path, table: str) -> None:
    """Overwrite the root page of ``table`` in the gallery file with garbage (b-tree damage)."""
    path = root / "gallery.sqlite"
    with sqlite3.connect(path) as db:
        db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        page, size = db.execute(
            "SELECT rootpage, (SELECT page_size FROM pragma_page_size) FROM sqlite_master WHERE name = ?", (table,)
        ).fetchone()
    data = bytearray(path.read_bytes())
    data[(page - 1) * size : page * size] = b"\xa5" * size
    path.write_bytes(bytes(data))


def test_a_repair_that_cannot_finish_says_what_to_do_instead_and_status_exits_3(make_device, tiny_bundles, images):
    device = _device(make_device, tiny_bundles, images)
    root = device.root
    device.close()
    _garbage_page(root, "outbox")
    check = device_cli("check", "--dir", str(root))
    assert check.returncode == 3 and '"sqlite_integrity"' in check.stdout and "restore a backup" in check.stdout
    assert device_cli("status", "--dir", str(root)).returncode == 3
    repair = device_cli("repair", "--dir", str(root))
    assert repair.returncode == 2 and "could not finish" in repair.stderr and "malformed" in repair.stderr
    assert "restore a backup" in repair.stderr and "device repair" not in repair.stderr
    help_text = device_cli("--help").stdout
    assert "Exit codes" in help_text and "3    damage reported" in help_text


def test_status_exits_3_whenever_check_reports_damage(make_device, tiny_bundles, images):
    device = _device(make_device, tiny_bundles, images)
    root = device.root
    _sql(device, "UPDATE outbox SET blob = CAST(zeroblob(length(blob)) AS BLOB) WHERE item_id = 'it02'")
    status = device_cli("status", "--dir", str(root))
    check = device_cli("check", "--dir", str(root))
    assert check.returncode == 3 and status.returncode == 3, status.stdout


def test_repair_on_an_enrolled_device_with_a_pointer_moved_to_a_free_row_id(server, make_device, images):  # noqa: F811
    device = enrolled(make_device, server, "phone", "pia")
    _add_in_blocks(device, images(12, seed=4), "p")
    device.sync()
    expected, root = state(device), device.root
    _sql(device, "UPDATE vectors_0 SET row_id = 13 WHERE row_id = 5")  # one bit: the next free row id
    with Device.open(root) as damaged:
        damaged.progress = False
        assert damaged.check()["damaged_row_pointers"] == [5, 13]
        report = damaged.repair()
        assert report["rows_forgotten"] == [] and report["damaged_after"] == 0 and state(damaged) == expected
        damaged.add(images(2, seed=8), item_ids=["q0", "q1"])  # new rows take free row ids
        assert damaged.check()["damaged"] == 0 and len(damaged.gallery) == 14


@pytest.mark.parametrize("key", ["schema_version", "gallery_id", "key_check", "query_version"])
@pytest.mark.parametrize("part", ["key", "value", "mac"])
def test_an_essential_setting_with_one_damaged_byte_still_opens_and_repair_seals_it_again(
    make_device, tiny_bundles, images, key, part
):
    device = _device(make_device, tiny_bundles, images)
    queries, root = images(2, seed=9), device.root
    before = _answers(device, queries)
    device.close()
    with sqlite3.connect(root / "gallery.sqlite") as db:
        value = db.execute(f"SELECT CAST({part} AS BLOB) FROM meta WHERE key = ?", (key,)).fetchone()[0]
        damaged = bytearray(value)
        damaged[len(damaged) // 2] ^= 0x01  # the MAC vouches for the setting it was
        db.execute(
            f"UPDATE meta SET {part} = {'?' if part == 'mac' else 'CAST(? AS TEXT)'} WHERE key = ?",
            (bytes(damaged), key),
        )
    with Device.open(root) as opened:
        opened.progress = False
        assert key in opened.check()["damaged_settings"]
        report = opened.repair()
        assert (
            report["damaged_after"] == 0
            and opened.gallery.settings.damaged() == []
            and _answers(opened, queries) == before
        )


def test_a_gallery_whose_every_block_fails_is_reported_by_status_and_check(make_device, tiny_bundles, images):
    device = make_device("one-block")
    device.upgrade(tiny_bundles[1])
    device.add(images(6, seed=5), item_ids=[f"it{i}" for i in range(6)], upload=False)  # one block
    root = device.root
    _sql(device, "UPDATE vector_blocks SET embedding = zeroblob(length(embedding))")
    with Device.open(root) as damaged:
        assert damaged.status()["damaged_rows"] == 6 and len(damaged.check()["damaged_rows"]) == 6


def test_a_row_id_doubled_by_a_damaged_block_costs_that_block_only_and_the_upgrade_goes_on(
    make_device, tiny_bundles, images
):
    device = _device(make_device, tiny_bundles, images)
    root = device.root
    device.close()
    with sqlite3.connect(root / "gallery.sqlite") as db:
        row_ids = np.frombuffer(
            db.execute("SELECT row_ids FROM vector_blocks WHERE block_id = 3").fetchone()[0], "<i8"
        ).copy()
        row_ids[0] = 2  # row 9's id now reads 2, a row of block 1
        db.execute("UPDATE vector_blocks SET row_ids = ? WHERE block_id = 3", (row_ids.tobytes(),))
    with Device.open(root) as damaged:
        damaged.progress = False
        assert [r for r, _, _ in damaged.check()["damaged_rows"]] == [9, 10, 11, 12]
        report = damaged.repair()
        assert report["rows_removed"] == ["it08", "it09", "it10", "it11"] and report["damaged_after"] == 0
        assert damaged.gallery._db.execute("SELECT block_id FROM vector_blocks").fetchall() == [(1,), (2,)]  # it went
        assert damaged.upgrade(tiny_bundles[2]) == 8 and damaged.gallery.tag_counts() == {"v1->v2 (forward)": 8}


def test_a_matched_row_whose_items_entry_is_gone_is_reported_not_answered_with_a_null_label(
    make_device, tiny_bundles, images
):
    device = _device(make_device, tiny_bundles, images)
    root = device.root
    _sql(device, "DELETE FROM items WHERE row_id = 1")  # as a damaged b-tree page of `items` can leave it: not found
    proc = device_cli("query", "--dir", str(root), _npy(root, images(1, seed=5)[:1]), "-k", "3")
    assert proc.returncode == 3, proc.stderr
    assert '"item_id": "it00"' in proc.stdout and "row 1" in proc.stderr and "items table" in proc.stderr


def test_a_constraint_no_caller_expected_is_damage_and_writes_nothing(make_device, tiny_bundles, images):
    device = _device(make_device, tiny_bundles, images)
    gallery = device.gallery
    queued = gallery.replica_log.outbox()
    with (
        pytest.raises(GalleryDamagedError, match=r"a table and its index disagree.*nothing was written"),
        transaction(gallery._db) as db,
    ):
        db.execute("DELETE FROM outbox WHERE item_id = ?", (queued[1][0],))
        db.execute(
            "INSERT INTO outbox VALUES (?, ?)", queued[0]
        )  # as a flipped outbox page makes repair's writes collide
    assert gallery.replica_log.outbox() == queued


def test_a_repair_that_cannot_open_the_file_does_not_advise_repair(make_device, tiny_bundles, images):
    device = _device(make_device, tiny_bundles, images)
    root = device.root
    _sql(
        device,
        "PRAGMA writable_schema = ON",
        "UPDATE sqlite_schema SET sql = 'CREATE TABLE row_extras (' WHERE name = 'row_extras'",
    )
    assert device_cli("status", "--dir", str(root)).returncode != 0
    repair = device_cli("repair", "--dir", str(root))
    assert repair.returncode == 2 and "could not finish" in repair.stderr and "malformed" in repair.stderr
    assert "restore a backup" in repair.stderr and "device repair" not in repair.stderr


def test_a_file_sqlite_cannot_read_leaves_no_connection_open(make_device, tiny_bundles, images):
    """The failed open's connection is closed at once, not when the garbage collector meets the
    error's frames (it then deleted the -shm file under a copy being removed: a race)."""
    device = _device(make_device, tiny_bundles, images)
    root = device.root
    device.close()
    with open(root / "gallery.sqlite", "r+b") as fh:
        fh.write(b"not an SQLite fil")  # the header: every statement fails, the first one included
    with pytest.raises(GalleryDamagedError) as failed:
        Device.open(root)
    held, exc = [], failed.value
    while exc is not None:
        tb = exc.__traceback__
        while tb is not None:
            held += [v for v in tb.tb_frame.f_locals.values() if isinstance(v, sqlite3.Connection)]
            tb = tb.tb_next
        exc = exc.__context__
    assert held, "the test no longer reaches the connection it checks"
    for connection in held:
        with pytest.raises(sqlite3.ProgrammingError, match="closed"):
            connection.execute("SELECT 1")

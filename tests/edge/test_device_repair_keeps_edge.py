"""`fctkit device repair` never deletes what it can keep (issue 34, section 2): a damaged
side-info block costs the side-info only, re-derived from the rows' originals where they are at
hand and otherwise marked lost (an upgrade that needs it names the rows)."""

from __future__ import annotations

import base64
import json
import sqlite3

import numpy as np
import pytest

from fctkit.edge_runtime import Device
from fctkit.errors import GalleryError
from tests.edge.conftest import flip_stored_byte
from tests.edge.test_replication_edge import enrolled, server, state  # noqa: F401 (server is a fixture)
from tests.support.device_damage import fctkit

ROWS = 1000


def _device_with_queued_originals(make_device, tiny_bundles, images, name: str, n: int = ROWS) -> Device:
    """A device without a server: ``n`` rows in one block, each original queued on the device."""
    device = make_device(name)
    device.upgrade(tiny_bundles[1])
    device.add(
        images(n, seed=11),
        item_ids=[f"r{i:04d}" for i in range(n)],
        labels=[f"L{i % 7}" for i in range(n)],
        upload=False,
    )
    return device


def _flip_side_info(device: Device, *, drop_queued: bool = False) -> None:
    root = device.root
    device.close()
    with sqlite3.connect(root / "gallery.sqlite") as db:
        assert flip_stored_byte(db, "vector_blocks", "side_info", "1", 40) == 1
        if drop_queued:  # as if they had been uploaded to a vault this device cannot reach now
            db.execute("DELETE FROM outbox")


def _last_change(root) -> int:
    with sqlite3.connect(root / "gallery.sqlite") as db:
        return db.execute("SELECT MAX(rowid) FROM changes").fetchone()[0]


def _answers(device: Device, queries: np.ndarray) -> list[list[tuple[str, float]]]:
    return [[(m.item_id, round(m.distance, 5)) for m in found] for found in device.query(queries, k=5)]


def test_a_damaged_side_info_block_costs_no_row_and_its_side_info_is_embedded_again(make_device, tiny_bundles, images):
    device = _device_with_queued_originals(make_device, tiny_bundles, images, "keeps")
    queries, root = images(40, seed=12), device.root
    before, answers = state(device), _answers(device, queries)
    _flip_side_info(device)
    with Device.open(root) as damaged:
        damaged.progress = False
        assert len(damaged.check()["damaged_rows"]) == ROWS  # the damage is seen...
        assert _answers(damaged, queries) == answers  # ...though queries are still right
        report = damaged.repair()
        assert report["rows_forgotten"] == [] and report["rows_removed"] == [] and report["forgotten_because"] == {}
        assert report["side_info_restored"] == sorted(before) and report["side_info_lost"] == []
        assert report["damaged_after"] == 0 and len(damaged.gallery) == ROWS
        assert _answers(damaged, queries) == answers
        after = state(damaged)
        assert set(after) == set(before)
        for item, (tag, embedding, side_info, label) in before.items():  # the same ψ model on the same originals
            assert after[item][0] == tag and after[item][1] == embedding and after[item][3] == label
            assert np.allclose(np.frombuffer(after[item][2], "<f4"), np.frombuffer(side_info, "<f4"), atol=1e-6)
        assert damaged.gallery.replica_log.outbox_size() == ROWS  # the originals stay queued for the vault
        damaged.upgrade(tiny_bundles[2])
        assert damaged.gallery.tag_counts() == {"v1->v2 (forward)": ROWS}


def test_rows_without_their_original_keep_answering_and_the_upgrade_names_them(make_device, tiny_bundles, images):
    device = _device_with_queued_originals(make_device, tiny_bundles, images, "marks", n=30)
    queries, root = images(10, seed=13), device.root
    answers = _answers(device, queries)
    _flip_side_info(device, drop_queued=True)
    with Device.open(root) as damaged:
        damaged.progress = False
        logged = _last_change(root)
        report = damaged.repair()
        assert report["rows_forgotten"] == [] and report["side_info_restored"] == []
        assert report["side_info_lost"] == [f"r{i:04d}" for i in range(30)]
        assert len(damaged.gallery) == 30 and _answers(damaged, queries) == answers
        assert _last_change(root) == logged  # the NaN side-info is not logged for the owner's other devices
        status = damaged.status()
        assert status["side_info_lost"]["rows"] == 30 and status["side_info_lost"]["items"][0] == "r0000"
        assert "damaged" not in status and damaged.check()["damaged"] == 0  # marked, not damage: repair converged
        with pytest.raises(
            GalleryError, match=r"30 item\(s\) cannot be upgraded \('r0000', .* and 20 more\).*side_info_lost"
        ):
            damaged.upgrade(tiny_bundles[2])
        assert len(damaged.gallery) == 30


def test_the_reasons_are_given_per_row_and_the_report_lists_each_item_once(make_device, tiny_bundles, images):
    device = _device_with_queued_originals(make_device, tiny_bundles, images, "both", n=6)
    root = device.root
    device.close()
    with sqlite3.connect(root / "gallery.sqlite") as db:  # both fields of the block fail: the embedding is lost
        flip_stored_byte(db, "vector_blocks", "side_info", "1", 40)
        flip_stored_byte(db, "vector_blocks", "embedding", "1", 40)
    with Device.open(root) as damaged:
        damaged.progress = False
        report = damaged.repair()
    ids = [f"r{i:04d}" for i in range(6)]
    assert report["rows_forgotten"] == ids and report["rows_removed"] == ids
    assert set(report["forgotten_because"]) == set(ids) and all(
        "block 1" in r for r in report["forgotten_because"].values()
    )


def test_a_damaged_list_of_removed_rows_costs_no_row_and_brings_no_removed_row_back(make_device, tiny_bundles, images):
    device = _device_with_queued_originals(make_device, tiny_bundles, images, "dead", n=30)
    device.remove(["r0003", "r0004"])
    queries, root = images(10, seed=14), device.root
    answers = _answers(device, queries)
    device.close()
    with sqlite3.connect(root / "gallery.sqlite") as db:
        assert flip_stored_byte(db, "vector_blocks", "dead_mac", "1", 3) == 1
    with Device.open(root) as damaged:
        damaged.progress = False
        assert len(damaged.check()["damaged_rows"]) == 28
        report = damaged.repair()
        alive = [f"r{i:04d}" for i in range(30) if i not in (3, 4)]
        assert report["rows_forgotten"] == [] and report["rows_sealed_again"] == alive and report["damaged_after"] == 0
        assert len(damaged.gallery) == 28 and _answers(damaged, queries) == answers
        assert sorted(damaged.searchable()[1].item_ids) == alive  # the removed rows stay removed


def test_rows_named_by_bytes_that_are_not_utf8_are_repaired_without_a_traceback(make_device, tiny_bundles, images):
    device = _device_with_queued_originals(make_device, tiny_bundles, images, "names", n=8)
    root = device.root
    device.close()
    with sqlite3.connect(
        root / "gallery.sqlite"
    ) as db:  # 'r0002' -> 'r\xb9002': not UTF-8, and the block fails to open
        (names,) = db.execute("SELECT item_ids FROM vector_blocks").fetchone()
        db.execute("UPDATE vector_blocks SET item_ids = ?", (names.replace(b"r0002", b"r\xb9002"),))
    with Device.open(root) as damaged:
        damaged.progress = False
        report = damaged.repair()
        assert (
            len(report["rows_forgotten"]) == 8
            and len(report["forgotten_because"]) == 8
            and report["damaged_after"] == 0
        )
        assert len(damaged.gallery) == 0 and "r0000" in report["rows_removed"]


def test_side_info_comes_back_from_the_vault_originals_when_none_is_queued(server, make_device, images):  # noqa: F811
    device = enrolled(make_device, server, "vaulted", "")
    device.add(images(12, seed=15), item_ids=[f"v{i:02d}" for i in range(12)])  # uploaded: nothing stays queued
    assert device.gallery.replica_log.outbox_size() == 0
    before, root = state(device), device.root
    _flip_side_info(device)
    with Device.open(root) as damaged:
        damaged.progress = False
        report = damaged.repair()
        assert (
            report["side_info_restored"] == sorted(before)
            and report["side_info_lost"] == []
            and report["rows_forgotten"] == []
        )
        after = state(damaged)
        for item, (tag, embedding, side_info, _label) in before.items():
            assert after[item][:2] == (tag, embedding)
            assert np.allclose(np.frombuffer(after[item][2], "<f4"), np.frombuffer(side_info, "<f4"), atol=1e-6)


@pytest.mark.parametrize(
    "column, edit, label_kept",
    [
        (
            "label",
            "UPDATE items SET label = substr(label, 1, 20) || x'00' || substr(label, 22) WHERE row_id = 7",
            False,
        ),
        ("item_id", "UPDATE items SET item_id = 'intruder' WHERE row_id = 7", True),
        ("origin_version", "UPDATE items SET origin_version = 7 WHERE row_id = 7", True),
    ],
)
def test_a_damaged_per_row_entry_costs_at_most_the_label(make_device, tiny_bundles, images, column, edit, label_kept):
    device = _device_with_queued_originals(make_device, tiny_bundles, images, f"entry-{column}", n=20)
    queries, root = images(6, seed=16), device.root
    answers, labels = _answers(device, queries), dict(zip(device.gallery.load().item_ids, device.gallery.load().labels))
    device.close()
    with sqlite3.connect(root / "gallery.sqlite") as db:
        db.execute(edit)
    with Device.open(root) as damaged:
        damaged.progress = False
        assert [r[1] for r in damaged.check()["damaged_rows"]] in (["r0006"], ["intruder"])
        report = damaged.repair()
        assert report["rows_forgotten"] == [] and report["labels_dropped"] == ([] if label_kept else ["r0006"])
        assert report["damaged_after"] == 0 and _answers(damaged, queries) == answers
        rows = damaged.gallery.load()
        assert dict(zip(rows.item_ids, rows.labels)) == {**labels, **({} if label_kept else {"r0006": None})}


def test_a_damaged_side_info_width_costs_nothing_when_the_originals_are_at_hand(make_device, tiny_bundles, images):
    device = _device_with_queued_originals(make_device, tiny_bundles, images, "width", n=30)
    before, root = state(device), device.root
    device.close()
    with sqlite3.connect(
        root / "gallery.sqlite"
    ) as db:  # the width column is not sealed; the record it describes fails
        db.execute("UPDATE vector_blocks SET side_info_width = side_info_width + 1")
    with Device.open(root) as damaged:
        damaged.progress = False
        report = damaged.repair()
        assert (
            report["side_info_restored"] == sorted(before)
            and report["side_info_lost"] == []
            and report["damaged_after"] == 0
        )
        after = state(damaged)  # the same model on the same originals, at the model's own width
        for item, (tag, embedding, side_info, label) in before.items():
            assert after[item][:2] == (tag, embedding) and after[item][3] == label
            assert np.allclose(np.frombuffer(after[item][2], "<f4"), np.frombuffer(side_info, "<f4"), atol=1e-6)
        damaged.upgrade(tiny_bundles[2])
        assert damaged.gallery.tag_counts() == {"v1->v2 (forward)": 30}


def test_the_side_info_of_adapted_rows_comes_back_along_their_path(make_device, tiny_bundles, images):
    device = _device_with_queued_originals(make_device, tiny_bundles, images, "adapted", n=40)
    device.upgrade(tiny_bundles[2])  # v1 rows moved by v2's adapters: their ψ went through g
    before, root = state(device), device.root
    assert {tag for tag, *_ in before.values()} == {"v1->v2 (forward)"}
    _flip_side_info(device)
    with Device.open(root) as damaged:
        damaged.progress = False
        report = damaged.repair()
        assert (
            report["side_info_restored"] == sorted(before)
            and report["side_info_lost"] == []
            and report["damaged_after"] == 0
        )
        after = state(damaged)
        for item, (tag, embedding, side_info, _label) in before.items():
            assert after[item][:2] == (tag, embedding)
            assert np.allclose(np.frombuffer(after[item][2], "<f4"), np.frombuffer(side_info, "<f4"), atol=1e-5)
        damaged.upgrade(tiny_bundles[3])
        assert damaged.version == 3 and len(damaged.gallery) == 40


def _damage_key_file(path) -> None:
    """Two bytes: one in the name of the "check" field (its checksum then looks absent), one in the key."""
    body = json.loads(path.read_text())
    key = bytearray(base64.b64decode(body["key"]))
    key[5] ^= 0x10
    damaged = {**body, "key": base64.b64encode(bytes(key)).decode()}
    path.write_text(json.dumps(damaged).replace('"check"', '"chdck"'))


def test_repair_refuses_an_owner_key_it_cannot_authenticate_and_keeps_every_queued_original(
    make_device, tiny_bundles, images, tmp_path
):
    device = _device_with_queued_originals(make_device, tiny_bundles, images, "owner-key", n=300)
    root = device.root
    device.close()
    np.save(tmp_path / "q.npy", images(4, seed=17))
    answers = fctkit("device", "query", "--dir", str(root), str(tmp_path / "q.npy")).stdout
    genuine = (root / "owner.key").read_bytes()
    _damage_key_file(root / "owner.key")
    asked = fctkit("device", "query", "--dir", str(root), str(tmp_path / "q.npy"))
    assert (asked.code, asked.stdout) == (0, answers)  # queries do not need the owner key
    checked = fctkit("device", "check", "--dir", str(root))
    assert checked.code == 3 and "owner.key is damaged" in checked.stdout
    repaired = fctkit("device", "repair", "--dir", str(root))
    assert repaired.code == 2 and "nothing was changed" in repaired.stderr and "300 queued" in repaired.stderr
    (root / "owner.key").write_bytes(genuine)
    status = fctkit("device", "status", "--dir", str(root))
    assert status.code == 0 and json.loads(status.stdout)["queued_uploads"] == 300
    repaired = fctkit("device", "repair", "--dir", str(root))
    assert repaired.code == 0 and json.loads(repaired.stdout)["queued_originals_dropped"] == []


@pytest.mark.parametrize(
    "removed, edit",
    [
        ((), "UPDATE items SET row_id = row_id | 64 WHERE row_id = 6"),  # one bit: row 6 -> 70, an id no row has
        (("r0001",), "UPDATE items SET row_id = row_id & ~4 WHERE row_id = 6"),  # row 6 -> 2, a removed row's id
    ],
)
def test_one_bit_of_a_row_id_costs_no_row_and_its_entry_moves_back(make_device, tiny_bundles, images, removed, edit):
    device = _device_with_queued_originals(make_device, tiny_bundles, images, "row-id", n=12)
    device.remove(list(removed))
    queries, root = images(6, seed=18), device.root
    before, answers = state(device), _answers(device, queries)
    device.close()
    with sqlite3.connect(root / "gallery.sqlite") as db:
        db.execute(edit)
    with Device.open(root) as damaged:
        damaged.progress = False
        assert {item for _, item, _ in damaged.check()["damaged_rows"]} == {"r0005"}
        report = damaged.repair()
        assert report["row_ids_restored"] == ["r0005"] and report["labels_dropped"] == []
        assert report["rows_forgotten"] == [] and report["rows_removed"] == [] and report["damaged_after"] == 0
        assert state(damaged) == before and _answers(damaged, queries) == answers  # labels included
        kept = 12 - len(removed)
        assert len(damaged.gallery) == kept and damaged.gallery.replica_log.outbox_size() == kept


def test_a_row_id_whose_block_fails_too_is_removed_and_named_once(make_device, tiny_bundles, images):
    device = _device_with_queued_originals(make_device, tiny_bundles, images, "row-id-lost", n=12)
    root = device.root
    device.close()
    with sqlite3.connect(root / "gallery.sqlite") as db:  # nothing authenticates the row any more: it is lost
        db.execute("UPDATE items SET row_id = row_id | 64 WHERE row_id = 6")
        flip_stored_byte(db, "vector_blocks", "embedding", "1", 40)
    with Device.open(root) as damaged:
        damaged.progress = False
        report = damaged.repair()
    ids = [f"r{i:04d}" for i in range(12)]
    assert report["row_ids_restored"] == [] and sorted(report["rows_removed"]) == ids
    assert sorted(report["rows_forgotten"]) == ids and report["damaged_after"] == 0

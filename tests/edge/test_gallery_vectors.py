"""The block-sealed gallery (schema 5, issue 22) through :class:`Gallery`: blocks per add, dead
lists on removal, compaction, exact bulk loads, and damage that stays inside its block."""

from __future__ import annotations

import numpy as np
import pytest

from fctkit.edge_runtime.gallery import Gallery
from fctkit.edge_runtime.gallery.rows import NewRow, UpgradedRows, VersionTag
from fctkit.errors import InputError

KEY = bytes(range(32))
V1 = VersionTag(1, 1, "native")


def _rows(first: int, n: int, seed: int = 0) -> list[NewRow]:
    rng = np.random.default_rng(seed + first)
    return [
        NewRow(
            f"item-{first + i}",
            rng.standard_normal(6).astype(np.float32),
            rng.standard_normal(2).astype(np.float32),
            f"L{first + i}",
        )
        for i in range(n)
    ]


@pytest.fixture
def gallery(tmp_path):
    with Gallery.create(tmp_path / "g.sqlite", KEY) as g:
        g.set_meta({"query_version": "1"})
        for first in (0, 10, 20):  # blocks 1, 2, 3 of ten rows each
            g.add_rows(_rows(first, 10), V1)
        yield g


def _blocks(g: Gallery) -> list[tuple[int, int, int]]:
    """(block id, rows, dead rows) of every block."""
    return [
        (b, len(r) // 8, len(d) // 8)
        for b, r, d in g._db.execute("SELECT block_id, row_ids, dead FROM vector_blocks ORDER BY block_id")
    ]


def _vectors(rows: list[NewRow]) -> np.ndarray:
    return np.stack([r.embedding for r in rows])


def test_one_block_per_add_and_an_exact_bulk_load(gallery):
    assert _blocks(gallery) == [(1, 10, 0), (2, 10, 0), (3, 10, 0)]
    loaded = gallery.load()
    assert loaded.row_ids.tolist() == list(range(1, 31)) and loaded.item_ids == [f"item-{i}" for i in range(30)]
    assert np.array_equal(loaded.embeddings, _vectors(_rows(0, 10) + _rows(10, 10) + _rows(20, 10)))
    assert loaded.labels == [f"L{i}" for i in range(30)] and not loaded.corrupt and loaded.missing == 0


def test_removal_marks_rows_dead_then_compacts_then_drops_the_block(gallery):
    gallery.delete_rows(["item-0", "item-1", "item-2", "item-3"])
    assert _blocks(gallery)[0] == (1, 10, 4)  # four of ten dead: kept, with an authenticated dead list
    gallery.delete_rows(["item-4", "item-5"])
    assert _blocks(gallery) == [(2, 10, 0), (3, 10, 0), (4, 4, 0)]  # more than half dead: rewritten as block 4
    gallery.delete_rows(["item-6", "item-7", "item-8", "item-9"])
    assert _blocks(gallery) == [(2, 10, 0), (3, 10, 0)]  # nothing alive: gone
    loaded = gallery.load()
    assert loaded.item_ids == [f"item-{i}" for i in range(10, 30)] and len(gallery) == 20 and loaded.missing == 0
    assert np.array_equal(loaded.embeddings, _vectors(_rows(10, 10) + _rows(20, 10)))
    assert gallery._vectors.audit("vectors_0") == {"rows_without_block": 0, "block_rows_without_pointer": 0}


def test_block_ids_are_never_reused(gallery):
    gallery.delete_rows([f"item-{i}" for i in range(20, 30)])
    gallery.add_rows(_rows(30, 5), V1)
    assert [b for b, _, _ in _blocks(gallery)] == [1, 2, 4]  # block 3, emptied at once, is dropped; 4 is new


def test_in_place_upgrades_move_rows_to_new_blocks_and_free_the_old(gallery):
    loaded = gallery.load()
    v2 = VersionTag(1, 2, "backward")
    batch = UpgradedRows(
        loaded.row_ids[:10].tolist(), loaded.item_ids[:10], V1, v2, loaded.embeddings[:10] * 2, loaded.side_infos[:10]
    )
    gallery.write_upgrades([batch], staged=False)
    assert _blocks(gallery) == [(2, 10, 0), (3, 10, 0), (4, 10, 0)]
    after = gallery.load()
    assert np.array_equal(after.embeddings[:10], loaded.embeddings[:10] * 2) and after.tags[:10] == [v2] * 10
    assert gallery.tag_counts() == {"v1": 20, "v1->v2 (backward)": 10}


def test_a_tampered_dead_list_makes_the_blocks_rows_damaged_not_resurrected(gallery):
    gallery.delete_rows(["item-0"])
    gallery._db.execute("UPDATE vector_blocks SET dead = x'' WHERE block_id = 1")  # bring item-0 back
    loaded = gallery.load()
    assert [r for r, _, _ in loaded.corrupt] == list(
        range(1, 11)
    ) and "removed rows fails authentication" in loaded.corrupt[0][2]
    assert "item-0" not in loaded.item_ids and len(loaded) == 20
    gallery.forget_rows([(r, i) for r, i, _ in loaded.corrupt])  # what repair does: the block goes with its rows
    assert [b for b, _, _ in _blocks(gallery)] == [2, 3] and not gallery.load().corrupt


def test_a_flipped_byte_damages_one_block_only_and_nothing_wrong_is_returned(gallery):
    sealed = bytearray(gallery._db.execute("SELECT embedding FROM vector_blocks WHERE block_id = 2").fetchone()[0])
    sealed[30] ^= 0x01
    gallery._db.execute("UPDATE vector_blocks SET embedding = ? WHERE block_id = 2", (bytes(sealed),))
    loaded = gallery.load()
    assert [r for r, _, _ in loaded.corrupt] == list(range(11, 21))
    assert loaded.item_ids == [f"item-{i}" for i in list(range(10)) + list(range(20, 30))]
    assert np.array_equal(loaded.embeddings, _vectors(_rows(0, 10) + _rows(20, 10)))


def test_a_swapped_item_id_in_the_per_row_table_is_damage(gallery):
    gallery._db.execute("UPDATE items SET item_id = 'item-x' WHERE row_id = 3")
    loaded = gallery.load()
    assert [(r, i) for r, i, _ in loaded.corrupt] == [(3, "item-2")] and "does not match its block" in loaded.corrupt[
        0
    ][2]


def test_item_ids_with_nul_are_refused_before_anything_is_written(gallery):
    with pytest.raises(InputError, match="NUL"):
        gallery.add_rows([NewRow("bad\0id", np.zeros(6, np.float32), np.zeros(2, np.float32))], V1)
    assert len(gallery) == 30 and len(_blocks(gallery)) == 3


def test_a_forward_switch_carries_blocks_already_in_the_target_space(gallery):
    v2 = VersionTag(1, 2, "forward")
    loaded = gallery.load()
    batches = [UpgradedRows(loaded.row_ids.tolist(), loaded.item_ids, V1, v2, loaded.embeddings + 1, loaded.side_infos)]
    gallery.write_upgrades(batches, staged=True)
    assert gallery.load().tags == [V1] * 30  # queries see the old vectors until the switch
    gallery.switch_to(2, {"upgrade": None})
    after = gallery.load()
    assert after.tags == [v2] * 30 and np.array_equal(after.embeddings, loaded.embeddings + 1)
    assert {s for (s,) in gallery._db.execute("SELECT vector_set FROM vector_blocks")} == {"vectors_1"}


def test_adding_no_rows_writes_no_block(gallery):
    assert gallery.add_rows([], V1) == [] and len(_blocks(gallery)) == 3 and len(gallery) == 30

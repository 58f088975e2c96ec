"""Sealed vector blocks (issue 22's first part): real AES-256-GCM; every way a block or its
row-id list can be altered fails to open, and opening many blocks into one matrix keeps
damage to the blocks that carry it."""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import pytest

from fctkit.edge_runtime.crypto import Sealer
from fctkit.edge_runtime.gallery.blocks import (
    BlockSealer,
    SealedBlock,
    block_slices,
    check_item_ids,
    decode_item_ids,
    encode_item_ids,
)
from fctkit.edge_runtime.gallery.rows import VersionTag
from fctkit.errors import CorruptRecordError, GalleryError, InputError

TAG = VersionTag(1, 2, "forward")
KEY = bytes(range(32))


@pytest.fixture
def sealer() -> BlockSealer:
    return BlockSealer(Sealer(KEY), b"gallery-a")


def _block(
    sealer: BlockSealer, block_id: int = 7, rows: int = 5, width: int = 4, first_row: int = 10
) -> tuple[SealedBlock, np.ndarray]:
    values = np.random.default_rng(block_id).standard_normal((rows, width)).astype(np.float32)
    row_ids = np.arange(first_row, first_row + rows)
    return sealer.seal(
        block_id, "embedding", TAG, row_ids, encode_item_ids([f"item-{r}" for r in row_ids]), values
    ), values


def test_a_block_opens_to_the_exact_values(sealer: BlockSealer) -> None:
    block, values = _block(sealer)
    assert np.array_equal(sealer.open(block), values)
    assert len(block.sealed) == values.nbytes + 12 + 16  # one nonce and one tag for the whole block


@pytest.mark.parametrize(
    "change",
    [
        "flipped byte",
        "truncated",
        "another block id",
        "another field",
        "another tag",
        "row ids reordered",
        "a row id dropped",
        "a row id changed",
        "an item id changed",
        "another width",
        "another gallery",
        "another key",
    ],
)
def test_every_alteration_fails_to_open(sealer: BlockSealer, change: str) -> None:
    block, _ = _block(sealer)
    opener = sealer
    if change == "flipped byte":
        sealed = bytearray(block.sealed)
        sealed[40] ^= 1
        block = replace(block, sealed=bytes(sealed))
    elif change == "truncated":
        block = replace(block, sealed=block.sealed[:-20])
    elif change == "another block id":
        block = replace(block, block_id=8)
    elif change == "another field":
        block = replace(block, field="side_info")
    elif change == "another tag":
        block = replace(block, tag=VersionTag(1, 1, "native"))
    elif change == "row ids reordered":
        block = replace(block, row_ids=block.row_ids[::-1].copy())
    elif change == "a row id dropped":
        block = replace(block, row_ids=block.row_ids[:-1])
    elif change == "a row id changed":
        block = replace(block, row_ids=block.row_ids + np.array([0, 0, 0, 0, 100]))
    elif change == "an item id changed":
        block = replace(block, item_ids=block.item_ids.replace(b"item-12", b"item-99"))
    elif change == "another width":
        block = replace(block, width=2)
    elif change == "another gallery":
        opener = BlockSealer(Sealer(KEY), b"gallery-b")
    else:
        opener = BlockSealer(Sealer(os.urandom(32)), b"gallery-a")
    with pytest.raises(CorruptRecordError, match="block"):
        opener.open(block)


def test_bad_blocks_are_refused_before_sealing(sealer: BlockSealer) -> None:
    with pytest.raises(GalleryError, match="repeated"):
        sealer.seal(1, "embedding", TAG, np.array([3, 3]), b"a\0b", np.zeros((2, 4)))
    with pytest.raises(GalleryError, match="one row of values per id"):
        sealer.seal(1, "embedding", TAG, np.array([3, 4]), b"a\0b", np.zeros((3, 4)))
    with pytest.raises(GalleryError, match="at least one"):
        sealer.seal(1, "embedding", TAG, np.array([], dtype=np.int64), b"", np.zeros((0, 4)))


def test_open_into_places_rows_by_id_skips_deleted_rows_and_keeps_damage_local(sealer: BlockSealer) -> None:
    first, first_values = _block(sealer, block_id=1, rows=4, first_row=1)  # rows 1-4
    second, second_values = _block(sealer, block_id=2, rows=4, first_row=5)  # rows 5-8
    third, _ = _block(sealer, block_id=3, rows=3, first_row=9)  # rows 9-11, damaged below
    third = replace(third, sealed=third.sealed[:-1] + bytes([third.sealed[-1] ^ 1]))
    live = np.array([1, 2, 4, 5, 6, 7, 8, 9, 10, 11])  # row 3 deleted since
    out = np.full((len(live), 4), np.nan, dtype=np.float32)
    filled, failed = sealer.open_into([second, third, first], live, out)  # any block order
    assert [b.block_id for b, _ in failed] == [3] and "authentication failed" in failed[0][1]
    assert filled.tolist() == [True] * 7 + [False] * 3
    assert np.array_equal(out[:3], first_values[[0, 1, 3]])
    assert np.array_equal(out[3:7], second_values)
    assert np.isnan(out[7:]).all()  # nothing is made up for the damaged block's rows


def test_open_into_refuses_a_block_of_another_width(sealer: BlockSealer) -> None:
    block, _ = _block(sealer, width=3)
    filled, failed = sealer.open_into([block], block.row_ids, np.zeros((5, 4), dtype=np.float32))
    assert not filled.any() and "3 values per row, not 4" in failed[0][1]


def test_block_slices_cover_every_row_once() -> None:
    assert [(s.start, s.stop) for s in block_slices(10, 4)] == [(0, 4), (4, 8), (8, 10)]
    assert list(block_slices(0, 4)) == []
    with pytest.raises(GalleryError):
        list(block_slices(3, 0))


def test_item_ids_round_trip_and_nul_is_refused() -> None:
    ids = ["a", "ünï", "x y", "\udcff"]
    assert decode_item_ids(encode_item_ids(ids)) == ids
    with pytest.raises(InputError, match="NUL"):
        check_item_ids(["ok", "bad\0id"])


def test_open_into_authenticates_blocks_of_zero_width(sealer: BlockSealer) -> None:
    """A version without side-info stores (rows, 0) side-info blocks: still sealed and checked."""
    block, _ = _block(sealer, width=0)
    filled, failed = sealer.open_into([block], block.row_ids, np.zeros((5, 0), dtype=np.float32))
    assert filled.all() and not failed
    damaged = replace(block, sealed=block.sealed[:-1] + bytes([block.sealed[-1] ^ 1]))
    filled, failed = sealer.open_into([damaged], block.row_ids, np.zeros((5, 0), dtype=np.float32))
    assert not filled.any() and "authentication failed" in failed[0][1]

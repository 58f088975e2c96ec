"""Replica blocks (``FCTB1``): rows sealed together under the owner key open only as exactly the
rows, in the order, version tag and owner they were sealed for; blocks cut for pushing stay
within the wire limits whatever the labels and item ids."""

from __future__ import annotations

import os

import numpy as np
import pytest

from fctkit.edge_runtime.crypto import Sealer
from fctkit.edge_runtime.gallery.replica_log import ReplicaRows
from fctkit.edge_runtime.gallery.rows import VersionTag
from fctkit.edge_runtime.records import decode_block, encode_block, open_block, seal_block
from fctkit.edge_runtime.replication import block_parts
from fctkit.errors import CorruptRecordError
from fctkit.protos import limits

OWNER = Sealer(os.urandom(32))
TAG = VersionTag(1, 2, "forward")


def rows(count: int, dim: int = 8, label: str | None = "cat", item: str = "item-{k}") -> ReplicaRows:
    rng = np.random.default_rng(count)
    return ReplicaRows(
        tuple(item.format(k=k) for k in range(count)),
        rng.standard_normal((count, dim), dtype=np.float32),
        rng.standard_normal((count, 3), dtype=np.float32),
        [label if k % 2 else None for k in range(count)],
        [os.urandom(32).hex() if k % 3 else None for k in range(count)],
    )


def test_a_block_opens_to_exactly_its_rows():
    block = rows(5)
    opened = open_block(OWNER, "alice", block.item_ids, TAG, seal_block(OWNER, "alice", TAG, block))
    assert (
        opened.item_ids == block.item_ids
        and opened.labels == block.labels
        and opened.vault_sha256s == block.vault_sha256s
    )
    np.testing.assert_array_equal(opened.embeddings, block.embeddings)
    np.testing.assert_array_equal(opened.side_infos, block.side_infos)


@pytest.mark.parametrize(
    "change",
    ["reordered", "dropped", "added", "renamed", "other tag", "other owner", "tombstone", "truncated", "flipped byte"],
)
def test_a_block_read_as_anything_else_fails_authentication(change):
    block = rows(4)
    sealed = seal_block(OWNER, "alice", TAG, block)
    ids, tag, owner = block.item_ids, TAG, "alice"
    if change == "reordered":
        ids = (ids[1], ids[0], *ids[2:])
    elif change == "dropped":
        ids = ids[:-1]
    elif change == "added":
        ids = (*ids, "item-9")
    elif change == "renamed":
        ids = ("item-x", *ids[1:])
    elif change == "other tag":
        tag = VersionTag(2, 2, "native")
    elif change == "other owner":
        owner = "mallory"
    elif change == "tombstone":
        tag = None
    elif change == "truncated":
        sealed = sealed[:-1]
    else:
        sealed = sealed[:40] + bytes([sealed[40] ^ 1]) + sealed[41:]
    with pytest.raises(CorruptRecordError):
        open_block(OWNER, owner, ids, tag, sealed)


def test_tombstones_seal_no_vectors_and_bind_their_items():
    sealed = seal_block(OWNER, "alice", None, ReplicaRows.tombstones(["a", "b"]))
    assert open_block(OWNER, "alice", ("a", "b"), None, sealed) is None
    assert len(sealed) == 28  # nonce + tag: no plaintext
    with pytest.raises(CorruptRecordError):
        open_block(OWNER, "alice", ("a", "c"), None, sealed)


@pytest.mark.parametrize("cut", [1, 20, 200])
def test_malformed_content_that_authenticates_is_refused_clearly(cut):
    """A device with the owner key could seal garbage: decoding names the problem instead of crashing."""
    data = encode_block(rows(3))
    with pytest.raises(CorruptRecordError, match="malformed"):
        decode_block(data[:-cut], ("a", "b", "c"), "block")
    with pytest.raises(CorruptRecordError, match="malformed"):
        decode_block(data, ("a", "b"), "block")  # a row count that does not match the item ids


def test_blocks_are_cut_within_the_wire_limits():
    wide = rows(3000, dim=128, label="a label of some length " * 4, item="item-{k}-" + "é" * 120)
    parts = block_parts(wide)
    assert [i for part in parts for i in part.item_ids] == list(wide.item_ids)  # every row once, in order
    for part in parts:
        assert 0 < len(part) <= limits.MAX_BLOCK_ROWS
        assert len(seal_block(OWNER, "alice", TAG, part)) <= limits.MAX_RECORD_BATCH_BYTES
        assert len("".join(part.item_ids).encode("utf-8")) <= limits.MAX_ITEM_ID_BATCH_BYTES
    many = block_parts(rows(10_000, dim=2, label=None))
    assert [len(part) for part in many] == [4096, 4096, 1808]

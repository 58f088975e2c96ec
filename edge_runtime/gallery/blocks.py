"""Vector blocks: the rows of one field in one version tag, sealed as one record.

The sealing of the block-sealed gallery (schema 5); the blocks' table is :mod:`.vectors`.

A block holds the float32 values of ``n`` rows of one field (``embedding``, ``side_info``, …)
in one version tag, sealed with AES-256-GCM under the device key: one cipher call, one nonce
and one authenticated-data build per block instead of per row, which is what makes bulk
opens run near the cipher's own speed. The row ids stay in plaintext beside the ciphertext (the
gallery must know which rows a block holds without the key), and so do the rows' item ids; the
authenticated data binds both: ``gallery id | block id | field | tag | rows | width |
SHA-256(row ids) | SHA-256(item ids)``. A block moved to another id, gallery, field or tag, with
a row id or item id added, dropped, changed or reordered, or with its ciphertext truncated,
fails to open. Block ids are never reused (a rewritten block
gets a new id), so an old ciphertext cannot stand in for a newer block of the same id.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from fctkit.errors import CorruptRecordError, GalleryError, InputError

from ..crypto import Sealer
from .rows import VersionTag

ROW_ID_DTYPE = np.dtype("<i8")
VALUE_DTYPE = np.dtype("<f4")


@dataclass(frozen=True)
class SealedBlock:
    """One sealed block as stored: which rows it holds (plaintext) and their sealed values."""

    block_id: int
    field: str
    tag: VersionTag
    row_ids: np.ndarray  # int64, in the order of the block's rows
    item_ids: bytes  # the rows' item ids in the same order (:func:`encode_item_ids`)
    width: int  # values per row
    sealed: bytes

    @property
    def row_id_bytes(self) -> bytes:
        return np.ascontiguousarray(self.row_ids, dtype=ROW_ID_DTYPE).tobytes()


class BlockSealer:
    """Seals and opens the vector blocks of one gallery (its id is in every block's authenticated data)."""

    def __init__(self, sealer: Sealer, gallery_id: bytes) -> None:
        self._sealer = sealer
        self._gallery_id = gallery_id

    def seal(
        self, block_id: int, field: str, tag: VersionTag, row_ids: np.ndarray, item_ids: bytes, values: np.ndarray
    ) -> SealedBlock:
        """Seal ``values`` (one row per id of ``row_ids``, unique ids; ``item_ids`` encoded by
        :func:`encode_item_ids`) as block ``block_id``."""
        row_ids = np.asarray(row_ids, dtype=ROW_ID_DTYPE)
        values = np.asarray(values)
        if values.ndim != 2 or len(values) != len(row_ids) or not len(row_ids):
            raise GalleryError(
                f"block {block_id}: {values.shape} values for {len(row_ids)} row ids (one row of values per id, at least one)"
            )
        if len(np.unique(row_ids)) != len(row_ids):
            raise GalleryError(f"block {block_id}: a row id is repeated")
        plaintext = np.ascontiguousarray(values, dtype=VALUE_DTYPE).tobytes()
        unsealed = SealedBlock(block_id, field, tag, row_ids, item_ids, values.shape[1], b"")
        return SealedBlock(
            block_id, field, tag, row_ids, item_ids, values.shape[1], self._sealer.seal(plaintext, self._aad(unsealed))
        )

    def open(self, block: SealedBlock) -> np.ndarray:
        """The block's values, ``(rows, width)`` float32; :class:`CorruptRecordError` when the
        block or its row ids were modified, moved, truncated or sealed under another key."""
        what = _described(block)
        plaintext = self._sealer.open(block.sealed, self._aad(block), what)
        if len(plaintext) != len(block.row_ids) * block.width * VALUE_DTYPE.itemsize:  # cannot happen unless sealed so
            raise CorruptRecordError(
                f"{what}: {len(plaintext)} bytes do not hold {len(block.row_ids)} x {block.width} values"
            )
        return np.frombuffer(plaintext, dtype=VALUE_DTYPE).reshape(len(block.row_ids), block.width)

    def open_into(
        self, blocks: Iterable[SealedBlock], row_ids: np.ndarray, out: np.ndarray
    ) -> tuple[np.ndarray, list[tuple[SealedBlock, str]]]:
        """Open ``blocks`` straight into ``out``, whose rows are those of ``row_ids`` (ascending):
        a block's row ``r`` goes to ``out[i]`` where ``row_ids[i] == r``; rows not in ``row_ids``
        (deleted since) are skipped. Vectorised per block, no per-row Python. Returns a mask of
        the rows filled and the blocks that failed to open with the reason, so damage stays
        local to its blocks."""
        row_ids = np.asarray(row_ids, dtype=ROW_ID_DTYPE)
        filled = np.zeros(len(row_ids), dtype=bool)
        failed: list[tuple[SealedBlock, str]] = []
        for block in blocks:
            at = np.minimum(np.searchsorted(row_ids, block.row_ids), max(len(row_ids) - 1, 0))
            live = (row_ids[at] == block.row_ids) if len(row_ids) else np.zeros(len(block.row_ids), dtype=bool)
            try:
                if block.width != out.shape[1]:
                    raise CorruptRecordError(
                        f"block {block.block_id}: {block.width} values per row, not {out.shape[1]}"
                    )
                if _consecutive(at, live) and out.dtype == VALUE_DTYPE and out.flags.c_contiguous and out.shape[1]:
                    self._open_straight_into(block, out[at[0] : at[0] + len(at)])  # the common case: no copy at all
                else:
                    out[at[live]] = self.open(block)[live]
            except CorruptRecordError as exc:
                failed.append((block, str(exc)))
                continue
            filled[at[live]] = True
        return filled, failed

    def _open_straight_into(self, block: SealedBlock, rows: np.ndarray) -> None:
        try:
            self._sealer.open_into(block.sealed, self._aad(block), rows.data.cast("B"), _described(block))
        except CorruptRecordError:
            rows[:] = np.nan  # what failed to authenticate is not left looking like values
            raise

    def _aad(self, block: SealedBlock) -> bytes:
        tag = block.tag
        return b"fctkit-gallery-block/1|%s|%d|%s|%d|%d|%s|%d|%d|%s|%s" % (
            self._gallery_id,
            block.block_id,
            block.field.encode(),
            tag.origin_version,
            tag.version,
            tag.via.encode(),
            len(block.row_ids),
            block.width,
            hashlib.sha256(block.row_id_bytes).digest(),
            hashlib.sha256(block.item_ids).digest(),
        )


def _described(block: SealedBlock) -> str:
    return f"block {block.block_id} ({block.field}, {block.tag}, {len(block.row_ids)} rows)"


def _consecutive(at: np.ndarray, live: np.ndarray) -> bool:
    """Whether every row of a block is wanted, in consecutive output rows in the block's order."""
    return (
        bool(len(at))
        and bool(live.all())
        and int(at[-1]) - int(at[0]) == len(at) - 1
        and bool((np.diff(at) == 1).all())
    )


def encode_item_ids(item_ids: Sequence[str]) -> bytes:
    """Item ids as one NUL-separated UTF-8 string (item ids never hold NUL: :func:`check_item_ids`)."""
    return "\0".join(item_ids).encode("utf-8", "surrogateescape")


def decode_item_ids(encoded: bytes) -> list[str]:
    return encoded.decode("utf-8", "surrogateescape").split("\0")


def check_item_ids(item_ids: Iterable[str]) -> None:
    """Item ids the gallery can store: non-empty strings without NUL."""
    for item_id in item_ids:
        if not isinstance(item_id, str) or not item_id or "\0" in item_id:
            raise InputError(
                f"item id {item_id!r} cannot be stored: item ids are non-empty strings without NUL characters"
            )


def block_slices(rows: int, block_rows: int) -> Iterator[slice]:
    """Consecutive slices of at most ``block_rows`` rows covering ``rows`` rows."""
    if block_rows < 1:
        raise GalleryError(f"a block holds at least one row, not {block_rows}")
    for first in range(0, rows, block_rows):
        yield slice(first, min(first + block_rows, rows))

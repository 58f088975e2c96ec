"""Replicated gallery records: rows' states, sealed under the owner key.

A record carries in plaintext what the server checks and orders by — item id(s), version tag
(origin version, version, via) and a tombstone flag — and, sealed with AES-256-GCM under the
owner key, the rows' content. Devices push **blocks**: up to 4,096 rows of one version tag (or
tombstones) in one sealed record, so each block costs one cipher call, not one per row::

    FCTB1 | u32 rows | u32 embedding width | u32 side-info width
          | u8[rows] has label | u32[rows] label lengths (LE) | the labels' UTF-8
          | u8[rows] has vault blob | 32 bytes per row: the vault blob's SHA-256 (zeros if none)
          | embeddings rows x width (float32 LE) | side-info rows x width (float32 LE)

The authenticated data binds the owner id, the block's row count and the SHA-256 of its item
ids in order, version, origin version, via and the tombstone flag, so the server (or anyone)
can neither read a block, nor edit it, nor re-label it into another version, item or owner,
nor move, drop or reorder its rows. A tombstone block seals an empty plaintext.

Single-row records (``FCTR1``, AAD over one item id) were what devices pushed before blocks;
servers keep them, devices still open them::

    FCTR1 | u16 len + vault blob SHA-256 (hex, may be empty) | u8 has label | u32 len + label
          | u32 len + embedding (float32 LE) | side-info (float32 LE, the rest)

**Merge order** (:func:`beats`): for one item id, a tombstone beats everything (a removed
item id is never used again); then the higher version; at equal versions an image-embedded
row ('native', or 'backward' in unified mode) beats an adapted one ('forward'); at equal
rank the record whose sealed bytes have the smaller SHA-256 wins. Every device applies the
same total order to the same records, so all devices of an owner converge to the same row
whatever order they see the records in.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass

import numpy as np

from fctkit.errors import CorruptRecordError

from .crypto import Sealer
from .gallery.replica_log import ReplicaRows
from .gallery.rows import VersionTag

MAGIC = b"FCTR1"
BLOCK_MAGIC = b"FCTB1"
_VIA_RANK = {"forward": 0, "native": 1, "backward": 1}


@dataclass(frozen=True)
class RowContent:
    """What a record seals: the row's vectors, label and the vault blob of its original."""

    embedding: np.ndarray
    side_info: np.ndarray
    label: str | None
    vault_sha256: str | None


@dataclass(frozen=True)
class RecordHeader:
    """A record's plaintext fields (``tag`` None for a tombstone) and the SHA-256 of its sealed bytes."""

    item_id: str
    tag: VersionTag | None
    sha256: str

    @property
    def tombstone(self) -> bool:
        return self.tag is None

    @property
    def rank(self) -> tuple[int, int, int]:
        if self.tag is None:
            return (1, 0, 0)
        return (0, self.tag.version, _VIA_RANK[self.tag.via])


def beats(incoming: RecordHeader, local_tag: VersionTag | None, local_sha256: str | None) -> bool:
    """Whether ``incoming`` (not a tombstone's target) replaces a local row in state
    ``local_tag`` (None: no row) whose content is the record ``local_sha256`` (None: a local
    change not sealed yet, which an equal-rank record replaces: pushing it could only tie)."""
    if local_tag is None:
        return True  # no row here
    local = RecordHeader("", local_tag, local_sha256 or "")
    if incoming.rank != local.rank:
        return incoming.rank > local.rank
    return local_sha256 is None or incoming.sha256 < local_sha256


def record_aad(owner_id: str, item_id: str, tag: VersionTag | None) -> bytes:
    fields = (
        [owner_id, item_id, True]
        if tag is None
        else [owner_id, item_id, False, tag.version, tag.origin_version, tag.via]
    )
    return b"fctkit-record/1|" + json.dumps(fields, separators=(",", ":")).encode("utf-8")


def encode_content(content: RowContent) -> bytes:
    sha = (content.vault_sha256 or "").encode("ascii")
    label = b"" if content.label is None else content.label.encode("utf-8")
    embedding = np.ascontiguousarray(content.embedding, dtype="<f4").tobytes()
    side_info = np.ascontiguousarray(content.side_info, dtype="<f4").tobytes()
    return b"".join(
        (
            MAGIC,
            struct.pack(">H", len(sha)),
            sha,
            struct.pack(">BI", content.label is not None, len(label)),
            label,
            struct.pack(">I", len(embedding)),
            embedding,
            side_info,
        )
    )


def decode_content(data: bytes, what: str) -> RowContent:
    try:
        if not data.startswith(MAGIC):
            raise ValueError("no FCTR1 header")
        position = len(MAGIC)
        (sha_len,) = struct.unpack_from(">H", data, position)
        position += 2
        sha = data[position : position + sha_len].decode("ascii")
        position += sha_len
        has_label, label_len = struct.unpack_from(">BI", data, position)
        position += 5
        label = data[position : position + label_len].decode("utf-8") if has_label else None
        position += label_len
        (embedding_len,) = struct.unpack_from(">I", data, position)
        position += 4
        embedding = data[position : position + embedding_len]
        side_info = data[position + embedding_len :]
        if len(embedding) != embedding_len or embedding_len % 4 or len(side_info) % 4:
            raise ValueError("truncated vectors")
    except (ValueError, struct.error, UnicodeDecodeError) as exc:
        raise CorruptRecordError(f"{what}: authenticated but malformed content ({exc})") from exc
    return RowContent(
        np.frombuffer(embedding, "<f4").astype(np.float32),
        np.frombuffer(side_info, "<f4").astype(np.float32),
        label,
        sha or None,
    )


def seal_record(
    owner: Sealer, owner_id: str, item_id: str, tag: VersionTag | None, content: RowContent | None
) -> bytes:
    """The sealed bytes of a row state (``tag``/``content`` None: a tombstone)."""
    return owner.seal(b"" if content is None else encode_content(content), record_aad(owner_id, item_id, tag))


def open_record(owner: Sealer, owner_id: str, item_id: str, tag: VersionTag | None, sealed: bytes) -> RowContent | None:
    """The content of a record (None for a tombstone); :class:`CorruptRecordError` when it was
    altered, re-labelled, or sealed under another owner key."""
    what = f"replica record of item {item_id!r} ({'tombstone' if tag is None else tag})"
    plaintext = _open_sealed(owner, sealed, record_aad(owner_id, item_id, tag), what)
    return None if tag is None else decode_content(plaintext, what)


def _open_sealed(owner: Sealer, sealed: bytes, aad: bytes, what: str) -> bytes:
    try:
        return owner.open(sealed, aad, what)
    except CorruptRecordError as exc:
        raise CorruptRecordError(
            f"{exc}; if every record fails, this device holds another owner's key: "
            "import the owner's key (`fctkit device init --import-key`)"
        ) from None


def sealed_sha256(sealed: bytes) -> str:
    return hashlib.sha256(sealed).hexdigest()


# -- blocks ---------------------------------------------------------------------------------


def block_aad(owner_id: str, item_ids: tuple[str, ...], tag: VersionTag | None) -> bytes:
    rows = [owner_id, len(item_ids), hashlib.sha256("\0".join(item_ids).encode("utf-8")).hexdigest()]
    fields = [*rows, True] if tag is None else [*rows, False, tag.version, tag.origin_version, tag.via]
    return b"fctkit-block/1|" + json.dumps(fields, separators=(",", ":")).encode("utf-8")


def encode_block(rows: ReplicaRows) -> bytes:
    count, (embedding_width, side_width) = len(rows.item_ids), (rows.embeddings.shape[1], rows.side_infos.shape[1])
    labels = [b"" if label is None else label.encode("utf-8") for label in rows.labels]
    shas = [bytes.fromhex(sha) if sha else bytes(32) for sha in rows.vault_sha256s]
    return b"".join(
        (
            BLOCK_MAGIC,
            struct.pack(">III", count, embedding_width, side_width),
            np.array([label is not None for label in rows.labels], np.uint8).tobytes(),
            np.array([len(label) for label in labels], "<u4").tobytes(),
            *labels,
            np.array([bool(sha) for sha in rows.vault_sha256s], np.uint8).tobytes(),
            *shas,
            np.ascontiguousarray(rows.embeddings, "<f4").tobytes(),
            np.ascontiguousarray(rows.side_infos, "<f4").tobytes(),
        )
    )


def decode_block(data: bytes, item_ids: tuple[str, ...], what: str) -> ReplicaRows:
    try:
        if not data.startswith(BLOCK_MAGIC):
            raise ValueError("no FCTB1 header")
        count, embedding_width, side_width = struct.unpack_from(">III", data, len(BLOCK_MAGIC))
        if count != len(item_ids):
            raise ValueError(f"{count} rows for {len(item_ids)} item ids")
        reader = _Reader(data, len(BLOCK_MAGIC) + 12)
        has_label = reader.array(np.uint8, count).astype(bool)
        ends = np.cumsum(reader.array("<u4", count), dtype=np.int64)
        text = reader.take(int(ends[-1]) if count else 0)
        starts = ends - (np.diff(ends, prepend=0) if count else 0)
        labels = [
            text[a:b].decode("utf-8") if flag else None
            for a, b, flag in zip(starts.tolist(), ends.tolist(), has_label.tolist())
        ]
        has_sha = reader.array(np.uint8, count).astype(bool).tolist()
        shas = reader.take(32 * count)
        vault = [shas[32 * k : 32 * k + 32].hex() if flag else None for k, flag in enumerate(has_sha)]
        embeddings = reader.array("<f4", count * embedding_width).reshape(count, embedding_width)
        side_infos = reader.array("<f4", count * side_width).reshape(count, side_width)
        if reader.position != len(data):
            raise ValueError(f"{len(data) - reader.position} bytes after the vectors")
    except (ValueError, struct.error, UnicodeDecodeError) as exc:
        raise CorruptRecordError(f"{what}: authenticated but malformed content ({exc})") from exc
    return ReplicaRows(item_ids, embeddings.astype(np.float32), side_infos.astype(np.float32), labels, vault)


class _Reader:
    """Consecutive fields of a buffer; ValueError when it ends too soon."""

    def __init__(self, data: bytes, position: int) -> None:
        self.data, self.position = memoryview(data), position

    def take(self, size: int) -> bytes:
        if self.position + size > len(self.data):
            raise ValueError("truncated")
        self.position += size
        return bytes(self.data[self.position - size : self.position])

    def array(self, dtype, count: int) -> np.ndarray:
        return np.frombuffer(self.take(np.dtype(dtype).itemsize * count), dtype)


def seal_block(owner: Sealer, owner_id: str, tag: VersionTag | None, rows: ReplicaRows) -> bytes:
    """The sealed bytes of a block of rows (``tag`` None: tombstones, whose vectors are not sealed)."""
    return owner.seal(b"" if tag is None else encode_block(rows), block_aad(owner_id, rows.item_ids, tag))


def open_block(
    owner: Sealer,
    owner_id: str,
    item_ids: tuple[str, ...],
    tag: VersionTag | None,
    sealed: bytes,
    *,
    block: bool = True,
) -> ReplicaRows | None:
    """The rows of a record (None for tombstones): a block, or (``block`` False) a single-row
    record; :class:`CorruptRecordError` when it was altered, re-labelled, or sealed under
    another owner key."""
    if not block:
        content = open_record(owner, owner_id, item_ids[0], tag, sealed)
        if content is None:
            return None
        return ReplicaRows(
            item_ids, content.embedding[None], content.side_info[None], [content.label], [content.vault_sha256]
        )
    what = f"replica block of {len(item_ids)} rows from item {item_ids[0]!r} ({'tombstones' if tag is None else tag})"
    plaintext = _open_sealed(owner, sealed, block_aad(owner_id, item_ids, tag), what)
    return None if tag is None else decode_block(plaintext, item_ids, what)

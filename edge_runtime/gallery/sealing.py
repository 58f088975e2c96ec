"""The gallery's per-row records sealed under the device key (:mod:`.store`): labels, per-row
extras (:mod:`.extras`), and the vectors of galleries up to schema 4 (re-sealed as blocks
when opened, :mod:`.block_migration`; schema 5 keeps vectors in :mod:`.vectors`).

Every record is sealed with AES-256-GCM under the device key; its authenticated data is
``gallery id | row id | item id | origin | version | via | field``. A modified, truncated,
swapped or replayed record fails to open and is reported as corrupt; the other rows load.
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Sequence

import numpy as np

from fctkit.errors import CorruptRecordError, GalleryError

from ..crypto import Sealer
from .rows import LoadedRows, VersionTag


class RowSealer:
    """Seals and opens the records of one gallery (its id is in every record's authenticated data)."""

    def __init__(self, sealer: Sealer, gallery_id: bytes) -> None:
        self._sealer = sealer
        self._gallery_id = gallery_id

    def seal_values(
        self, row_ids: Sequence[int], item_ids: Sequence[str], tag: VersionTag, field_name: str, values: np.ndarray
    ) -> list[bytes]:
        """One sealed record per row: its row of ``values`` as float32, bound to ``field_name``."""
        block = np.ascontiguousarray(values, dtype="<f4").reshape(len(row_ids), -1)
        raw, width = block.tobytes(), block.shape[1] * 4
        plaintexts = [raw[i * width : (i + 1) * width] for i in range(len(row_ids))]
        aads = [_aad(self._gallery_id, r, i, tag, field_name) for r, i in zip(row_ids, item_ids, strict=True)]
        return self._sealer.seal_many(plaintexts, aads)

    def seal_labels(
        self, row_ids: Sequence[int], item_ids: Sequence[str], origins: Sequence[int], labels: Sequence[str | None]
    ) -> list[bytes | None]:
        """Each row's sealed label (None where it has none), all nonces drawn at once."""
        present = [k for k, label in enumerate(labels) if label is not None]
        sealed = self._sealer.seal_many(
            [label.encode("utf-8") for label in labels if label is not None],  # the rows of ``present``
            [_aad(self._gallery_id, row_ids[k], item_ids[k], _label_tag(origins[k]), "label") for k in present],
        )
        found: list[bytes | None] = [None] * len(labels)
        for k, record in zip(present, sealed, strict=True):
            found[k] = record
        return found

    def open_label(self, row_id: int, item_id: str, origin_version: int, sealed: bytes) -> str:
        """A row's label (:class:`CorruptRecordError` when it fails to open)."""
        if not isinstance(sealed, bytes):  # a damaged column read back as another type
            raise CorruptRecordError(f"row {row_id} label: its sealed bytes were damaged")
        aad = _aad(self._gallery_id, row_id, item_id, _label_tag(origin_version), "label")
        return self._sealer.open(sealed, aad, f"row {row_id} label").decode("utf-8")

    def open_rows(
        self, cursor: Iterable[tuple], *, with_labels: bool, fields: tuple[str, str | None] = ("embedding", "side_info")
    ) -> LoadedRows:
        """Open the (row id, item id, origin, version, via, first, second, label) records of
        ``cursor``; ``fields`` names the AAD fields of the first and second sealed values (the
        second None: there is none)."""
        first_field, second_field = fields
        row_ids, item_ids, tags, embeddings, side_infos, labels, corrupt = [], [], [], [], [], [], []
        gid, open_ = self._gallery_id, self._sealer.open
        known_tags: dict[tuple, VersionTag] = {}
        for row_id, item_id, origin, version, via, emb, side, label in cursor:
            tag = known_tags.get((origin, version, via))
            try:
                if emb is None:
                    raise CorruptRecordError(f"row {row_id}: its vectors are missing from the gallery file")
                if tag is None:
                    tag = known_tags[(origin, version, via)] = VersionTag(origin, version, via)
                e = open_(emb, _aad(gid, row_id, item_id, tag, first_field), f"row {row_id} {first_field}")
                s = (
                    b""
                    if second_field is None
                    else open_(side, _aad(gid, row_id, item_id, tag, second_field), f"row {row_id} {second_field}")
                )
                text = None
                if with_labels and label is not None:
                    text = open_(
                        label, _aad(gid, row_id, item_id, _label_tag(origin), "label"), f"row {row_id} label"
                    ).decode("utf-8")
            except (CorruptRecordError, GalleryError, TypeError) as exc:  # a damaged record or version tag
                corrupt.append((row_id, item_id, str(exc)))
                continue
            row_ids.append(row_id)
            item_ids.append(item_id)
            tags.append(tag)
            embeddings.append(e)
            side_infos.append(s)
            labels.append(text)
        return LoadedRows(
            row_ids=np.asarray(row_ids, dtype=np.int64),
            item_ids=item_ids,
            tags=tags,
            embeddings=_stack(embeddings),
            side_infos=_stack(side_infos),
            labels=labels,
            corrupt=corrupt,
        )


def _aad(gallery_id: bytes, row_id: int, item_id: str, tag: VersionTag, field_name: str) -> bytes:
    if not isinstance(item_id, str) or not all(
        isinstance(n, int) for n in (row_id, tag.origin_version, tag.version)
    ):  # damaged plaintext columns
        raise CorruptRecordError(f"row {row_id!r}: its row id or item id is damaged ({item_id!r})")
    return b"fctkit-gallery/1|%s|%d|%s|%d|%d|%s|%s" % (
        gallery_id,
        row_id,
        item_id.encode("utf-8", "surrogateescape"),
        tag.origin_version,
        tag.version,
        tag.via.encode(),
        field_name.encode(),
    )


@functools.cache
def _label_tag(origin_version: int) -> VersionTag:
    # labels never change across versions: bound to the row and its origin only
    return VersionTag(origin_version, origin_version, "native")


def _stack(vectors: list[bytes]) -> np.ndarray:
    """An (n, d) float32 array; when rows of different spaces have different dims, an
    object array of 1-D vectors (use :func:`~.rows.take_rows` to get a dense block of one space)."""
    if not vectors:
        return np.zeros((0, 0), dtype=np.float32)
    if len({len(v) for v in vectors}) == 1:
        return np.frombuffer(b"".join(vectors), dtype="<f4").reshape(len(vectors), -1).astype(np.float32, copy=False)
    ragged = np.empty(len(vectors), dtype=object)
    ragged[:] = [np.frombuffer(v, dtype="<f4") for v in vectors]
    return ragged

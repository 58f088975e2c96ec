"""The gallery's row values (:mod:`.store`): version tags, rows to add, loaded and upgraded rows."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

from fctkit.errors import GalleryError

VIAS = ("native", "forward", "backward")


@dataclass(frozen=True)
class VersionTag:
    """Which space a row's vectors are in (see :mod:`.store`)."""

    origin_version: int
    version: int
    via: str

    def __post_init__(self) -> None:
        if self.via not in VIAS:
            raise GalleryError(f"version tag via={self.via!r} is not one of {', '.join(VIAS)}")

    def __str__(self) -> str:
        if self.via == "native":
            return f"v{self.version}"
        if self.origin_version == self.version:
            return f"v{self.version} ({self.via})"
        return f"v{self.origin_version}->v{self.version} ({self.via})"


@dataclass(frozen=True)
class NewRow:
    item_id: str
    embedding: np.ndarray
    side_info: np.ndarray
    label: str | None = None


@dataclass
class LoadedRows:
    """The decrypted gallery (the rows that opened) and the rows that did not."""

    row_ids: np.ndarray
    item_ids: list[str]
    tags: list[VersionTag]
    embeddings: np.ndarray
    side_infos: np.ndarray
    labels: list[str | None]
    corrupt: list[tuple[int, str, str]] = field(default_factory=list)  # (row id, item id, reason)
    missing: int = 0  # rows the authenticated row count has but the file no longer holds

    def __len__(self) -> int:
        return len(self.item_ids)

    def subset(self, keep: Sequence[int]) -> LoadedRows:
        """The rows at positions ``keep`` (damage counts unchanged)."""
        return LoadedRows(
            row_ids=self.row_ids[list(keep)],
            item_ids=[self.item_ids[i] for i in keep],
            tags=[self.tags[i] for i in keep],
            embeddings=take_rows(self.embeddings, keep),
            side_infos=self.side_infos[list(keep)],
            labels=[self.labels[i] for i in keep],
            corrupt=self.corrupt,
            missing=self.missing,
        )


@dataclass(frozen=True)
class UpgradedRows:
    """New vectors for a batch of rows, all computed from the same (guarded) tag."""

    row_ids: Sequence[int]
    item_ids: Sequence[str]
    old_tag: VersionTag
    new_tag: VersionTag
    embeddings: np.ndarray
    side_infos: np.ndarray


def tag_name(origin: int, version: int, via: str) -> str:
    try:
        return str(VersionTag(origin, version, via))
    except (GalleryError, TypeError):
        return f"damaged tag (origin {origin!r}, version {version!r}, via {via!r})"


def rows_by_tag(tags: Sequence[VersionTag]) -> dict[VersionTag, list[int]]:
    """The positions of each tag's rows in ``tags``, tags in (origin, version, via) order (one pass)."""
    found: dict[VersionTag, list[int]] = {}
    for i, tag in enumerate(tags):
        found.setdefault(tag, []).append(i)
    return {tag: found[tag] for tag in sorted(found, key=lambda t: (t.origin_version, t.version, t.via))}


def take_rows(vectors: np.ndarray, rows: Sequence[int]) -> np.ndarray:
    """The dense (len(rows), d) float32 block of ``vectors`` (dense or ragged) at ``rows``
    (all of a dense ``vectors``, in order: ``vectors`` itself, not a copy)."""
    if vectors.dtype != object and len(rows) == len(vectors) and list(rows) == list(range(len(vectors))):
        return vectors
    picked = vectors[list(rows)]
    if picked.dtype == object:
        if len({len(v) for v in picked}) > 1:
            raise GalleryError("the selected rows have vectors of different dims (rows of different spaces)")
        return np.stack(list(picked)).astype(np.float32, copy=False) if len(picked) else np.zeros((0, 0), np.float32)
    return picked

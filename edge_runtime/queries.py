"""Search over a device's gallery: the rows queries are compared with, decrypted and indexed once
per gallery change, and the query embedded and scored the way the installed version says (plain,
transition scoring, hubness offsets, or "compatible" mode's common prefix)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

from .bundle_store import InstalledBundles
from .compatible_search import comparable_dims, compatible_rows
from .engine import Items
from .gallery import Gallery
from .gallery.rows import LoadedRows, take_rows
from .scoring import Scoring, TransitionState, prepared_queries, scoring_of, searched_rows
from .search import ExactIndex


@dataclass(frozen=True)
class Match:
    item_id: str
    distance: float
    label: str | None
    tag: str


class GallerySearch:
    """Searches ``gallery`` with the engines of ``bundles`` (faiss or numpy per ``backend``)."""

    def __init__(self, gallery: Gallery, bundles: InstalledBundles, backend: str) -> None:
        self.gallery, self.bundles, self.backend = gallery, bundles, backend
        self._cache: tuple[tuple[Any, ...], ExactIndex, LoadedRows, Scoring] | None = None
        #: (row id, item id, reason) of the matches of the last query whose label failed to open
        self.damaged_labels: list[tuple[int, str, str]] = []

    def reset(self) -> None:
        """Rows changed in a way the gallery's change marker may not show: load them again."""
        self._cache = None

    @property
    def transition(self) -> TransitionState | None:
        return TransitionState.from_json(self.gallery.meta("transition"))

    def end_transition(self) -> bool:
        """Delete the rows' previous embeddings (one transaction) and unload the previous
        version's graph; returns whether a transition was in progress."""
        transition = self.transition
        if transition is None:
            return False
        self.gallery.extras.drop("previous_embedding", {"transition": None})
        if transition.previous_version != self.gallery.query_version:
            self.bundles.unload(transition.previous_version)
        self._cache = None
        return True

    def query_vectors(self, images: Items, version: int) -> np.ndarray:
        """Query images (arrays, or raw items for a bundle that declares preprocessing, embedded
        as queries) in the query space of ``version``: φ_v, Q(φ_v) when the bundle has a query
        map, or B(φ_v) in unified mode."""
        engine = self.bundles.engine(version)
        vectors = engine.embed(images if engine.takes_items else np.asarray(images), purpose="query")
        mapping = engine.unified_backward() or engine.query_map()
        return vectors if mapping is None else engine.run(mapping, vectors)

    def query(self, images: Items, k: int) -> list[list[Match]]:
        version, index, rows, scoring = self.searchable()
        vectors = self.query_vectors(images, version)
        if scoring.kind == "transition" and len(index):
            vectors = prepared_queries(scoring, vectors, self.query_vectors(images, scoring.previous_version))
        elif scoring.kind == "hubness" and len(index):
            vectors = prepared_queries(scoring, vectors)
        if (
            len(index)
            and vectors.shape[1] > index.vectors.shape[1]
            and self.bundles.engine(version).manifest.mode == "compatible"
        ):
            vectors = vectors[:, : index.vectors.shape[1]]  # the prefix older rows are compared on (BT²)
        found = index.search(vectors, k)
        self.damaged_labels = []  # reported like damaged rows: never a silent "label": null
        matched = {
            int(rows.row_ids[j]): rows.item_ids[j] for idx in found.indices for j in idx
        }  # labels of matches only
        labels = self.gallery.labels(matched, self.damaged_labels)
        self.damaged_labels += [
            (row_id, item_id, "its per-row entry cannot be found in the items table (the file is damaged)")
            for row_id, item_id in matched.items()
            if row_id not in labels
        ]
        return [
            [
                Match(rows.item_ids[j], float(d), labels.get(int(rows.row_ids[j])), str(rows.tags[j]))
                for j, d in zip(idx, dist, strict=True)
            ]
            for idx, dist in zip(found.indices, found.distances, strict=True)
        ]

    def searchable(self) -> tuple[int, ExactIndex, LoadedRows, Scoring]:
        """The installed version, its searchable rows and how they are scored, loaded again if
        an upgrade switched versions between reading the version and loading the rows."""
        while True:
            version = self.gallery.query_version
            transition = self.transition
            if transition is not None and transition.expired():
                self.end_transition()  # the manifest's time limit
                continue
            key = (version, *self.gallery.change_marker())
            if self._cache is not None and self._cache[0] == key:
                return (version, *self._cache[1:])
            loaded = self.gallery.load(with_labels=False, with_side_info=False)  # labels of matches only, no side-info
            if self.gallery.query_version == version:
                self._cache = (key, *self._indexed(version, loaded, transition))

    def _indexed(
        self, version: int, loaded: LoadedRows, transition: TransitionState | None
    ) -> tuple[ExactIndex, LoadedRows, Scoring]:
        manifest = self.bundles.engine(version).manifest
        if manifest.mode == "compatible":  # older versions' rows as stored, on the common prefix
            keep, vectors = compatible_rows(
                [t.version for t in loaded.tags], loaded.embeddings, comparable_dims(self.bundles.manifest, version)
            )
            loaded = loaded.subset(keep) if len(keep) != len(loaded) else loaded
            return ExactIndex(vectors, manifest.distance, self.backend), loaded, Scoring()
        if manifest.mode != "unified":
            keep = [i for i, t in enumerate(loaded.tags) if t.version == version]
            if len(keep) != len(loaded):
                loaded = loaded.subset(keep)
        scoring = scoring_of(manifest, transition)
        if scoring.kind != "plain" and len(loaded):
            previous_dim = (
                self.bundles.engine(scoring.previous_version).manifest.embedding_dim if scoring.previous_version else 0
            )
            vectors = searched_rows(self.gallery, loaded, scoring, self.bundles.engine(version), previous_dim)
            return ExactIndex(vectors, "inner", self.backend), loaded, scoring
        vectors = take_rows(loaded.embeddings, range(len(loaded))) if len(loaded) else np.zeros((0, 1), np.float32)
        return ExactIndex(vectors, manifest.distance, self.backend), loaded, scoring

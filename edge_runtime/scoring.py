"""How a device scores a query against its rows, when the bundle declares more than plain
nearest neighbours (:mod:`fctkit.protos.search_policy`).

Each scoring becomes one exact inner-product search over prepared vectors (unit vectors ``x̂``):

- **transition** (weight ``w``)::

      row   = [√w·ĝ_prev, √(1−w)·ĝ]          query = [√w·q̂_prev, √(1−w)·q̂]
      q·row = w·cos(q_prev, g_prev) + (1−w)·cos(q, g)

  ``q_prev``/``g_prev`` are the query and the row in the previous version's space (its embed
  graph, the row's previous embedding). A row without a previous embedding (replicated from
  another device during the transition, or whose previous record failed to open) is
  ``[0, ĝ/√(1−w)]``, so it scores ``cos(q, g)`` alone.
- **hubness** (β)::

      row = [ĝ, −β·r(g)]    query = [q̂, 1]    q·row = cos(q, g) − β·r(g)

- **transition over a hubness offset** (a bundle that declares both; ``β > 0`` in a transition
  :class:`Scoring`): the transition vectors with the offset as a last column, ``−(1−w)·β·r(g)``
  (``−β·r(g)`` for a row without a previous embedding) against a query's ``1``, so
  ``q·row = w·cos(q_prev, g_prev) + (1−w)·(cos(q, g) − β·r(g))``. When the transition ends,
  the bundle's hubness scoring goes on alone.

A match's distance is ``1 − score``.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass

import numpy as np

from fctkit.errors import GalleryError
from fctkit.protos.bundle import Manifest

from .engine import Engine
from .gallery import Gallery
from .gallery.rows import LoadedRows, take_rows
from .search import normalise

SECONDS_PER_DAY = 86400.0


@dataclass(frozen=True)
class TransitionState:
    """A transition in progress, as the gallery's ``meta.transition`` records it."""

    version: int
    previous_version: int
    weight: float
    started_at: float
    max_days: float

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str | None) -> TransitionState | None:
        if not text:
            return None
        try:
            return cls(**json.loads(text))
        except (TypeError, ValueError) as exc:
            raise GalleryError(f"the gallery's transition record is damaged ({exc}); end the transition") from exc

    def expired(self, now: float | None = None) -> bool:
        """The manifest's time limit has passed (``max_days`` 0: never)."""
        now = time.time() if now is None else now
        return self.max_days > 0 and now - self.started_at >= self.max_days * SECONDS_PER_DAY


@dataclass(frozen=True)
class Scoring:
    """``kind``: "plain" (the bundle's distance), "transition" or "hubness"; ``beta`` > 0 with
    "transition": the bundle's hubness offset inside the transition's adapted score."""

    kind: str = "plain"
    weight: float = 0.0
    beta: float = 0.0
    previous_version: int = 0

    @property
    def name(self) -> str:
        """What a device's status calls it: the kind, ``transition+hubness`` for both."""
        return f"{self.kind}+hubness" if self.kind == "transition" and self.beta > 0 else self.kind


def aligned(
    row_ids: np.ndarray, extras: LoadedRows, width: int, tags: list | None = None
) -> tuple[np.ndarray, np.ndarray]:
    """``extras``' values (``width`` each) in the order of the sorted ``row_ids`` (zeros where
    a row has none) and the mask of rows that have one; with ``tags`` (the rows' tags), an
    extra counts only when it was bound to its row's tag."""
    values = np.zeros((len(row_ids), width), dtype=np.float32)
    if not len(row_ids) or not len(extras):
        return values, np.zeros(len(row_ids), dtype=bool)
    position = np.minimum(np.searchsorted(row_ids, extras.row_ids), len(row_ids) - 1)
    found = row_ids[position] == extras.row_ids
    if tags is not None:
        found &= np.array([tags[p] == t for p, t in zip(position, extras.tags, strict=True)])
    if extras.embeddings.shape[1] != width:
        raise GalleryError(
            f"stored extras are {extras.embeddings.shape[1]}-d where {width}-d were expected; end the transition"
        )
    values[position[found]] = extras.embeddings[found]
    present = np.zeros(len(row_ids), dtype=bool)
    present[position[found]] = True
    return values, present


def prepared_rows(
    scoring: Scoring,
    rows: np.ndarray,
    previous: np.ndarray | None = None,
    has_previous: np.ndarray | None = None,
    offsets: np.ndarray | None = None,
) -> np.ndarray:
    """The row vectors the inner-product search compares (see the module docstring)."""
    rows = normalise(np.asarray(rows, dtype=np.float32))
    if scoring.kind == "hubness":
        return np.hstack([rows, -scoring.beta * np.asarray(offsets, np.float32).reshape(-1, 1)]).astype(np.float32)
    if scoring.kind != "transition":
        raise GalleryError(f"no prepared rows for {scoring.kind!r} scoring")
    w = scoring.weight
    assert previous is not None and has_previous is not None  # transition rows come with their previous vectors
    previous_part = np.sqrt(w) * normalise(previous) * has_previous[:, None]
    current_part = rows * np.where(has_previous, np.sqrt(1.0 - w), 1.0 / np.sqrt(1.0 - w))[:, None]
    parts = [previous_part, current_part]
    if scoring.beta > 0:
        offset_part = -scoring.beta * np.asarray(offsets, np.float32) * np.where(has_previous, 1.0 - w, 1.0)
        parts.append(offset_part.reshape(-1, 1))
    return np.hstack(parts).astype(np.float32)


def prepared_queries(scoring: Scoring, queries: np.ndarray, previous_queries: np.ndarray | None = None) -> np.ndarray:
    """The query vectors that go with :func:`prepared_rows`."""
    queries = normalise(np.asarray(queries, dtype=np.float32))
    ones = [np.ones((len(queries), 1), np.float32)] if scoring.beta > 0 else []
    if scoring.kind == "hubness":
        return np.hstack([queries, *ones])
    w = scoring.weight
    assert previous_queries is not None  # transition queries come with the previous version's
    return np.hstack([np.sqrt(w) * normalise(previous_queries), np.sqrt(1.0 - w) * queries, *ones]).astype(np.float32)


# -- what the device keeps for them ---------------------------------------------------------


def transition_for(target: Manifest, previous: Manifest | None, leaving_version: int) -> TransitionState | None:
    """The transition an upgrade to ``target`` begins, when the bundle declares one from the
    version the device leaves and that version's (installed) bundle searched by cosine in forward mode."""
    policy = target.transition
    if policy is None or previous is None or policy.previous_version != leaving_version:
        return None
    if previous.mode != "forward" or previous.distance != "cosine":
        return None
    return TransitionState(target.version, leaving_version, policy.weight, time.time(), policy.max_days)


def scoring_of(manifest: Manifest, transition: TransitionState | None) -> Scoring:
    """How queries to ``manifest``'s version are scored now."""
    if transition is not None and transition.version == manifest.version and not transition.expired():
        beta = manifest.hubness.beta if manifest.hubness is not None else 0.0
        return Scoring("transition", weight=transition.weight, beta=beta, previous_version=transition.previous_version)
    if manifest.hubness is not None:
        return Scoring("hubness", beta=manifest.hubness.beta)
    return Scoring()


def hubness_offsets(engine: Engine, embeddings: np.ndarray) -> np.ndarray:
    """r(row) for rows of ``engine``'s version, by the bundle's hubness graph."""
    return engine.run(engine.manifest.artifact("hubness"), embeddings)[:, 0]


def store_hubness_offsets(gallery: Gallery, engine: Engine) -> int:
    """Compute and keep the offsets of the rows in ``engine``'s space that have none for their
    current tag (rows added, upgraded, backfilled or replicated since); returns how many."""
    if engine.manifest.hubness is None:
        return 0
    missing = gallery.extras.rows_missing("hubness_offset", engine.manifest.version)
    if not len(missing):
        return 0
    offsets = hubness_offsets(engine, take_rows(missing.embeddings, range(len(missing))))
    return gallery.extras.put("hubness_offset", missing, offsets[:, None])


def searched_rows(
    gallery: Gallery, rows: LoadedRows, scoring: Scoring, engine: Engine, previous_dim: int
) -> np.ndarray:
    """The prepared row vectors of ``rows`` (all in ``engine``'s space) for ``scoring``:
    previous embeddings or stored offsets read from the gallery; an offset that is missing or
    fails to open is computed again here (not stored)."""
    embeddings = take_rows(rows.embeddings, range(len(rows)))
    offsets = _row_offsets(gallery, rows, engine, embeddings) if scoring.beta > 0 else None
    if scoring.kind == "transition":
        previous, has_previous = aligned(rows.row_ids, gallery.extras.load("previous_embedding"), previous_dim)
        return prepared_rows(scoring, embeddings, previous, has_previous, offsets)
    return prepared_rows(scoring, embeddings, offsets=offsets)


def _row_offsets(gallery: Gallery, rows: LoadedRows, engine: Engine, embeddings: np.ndarray) -> np.ndarray:
    stored, has_offset = aligned(rows.row_ids, gallery.extras.load("hubness_offset"), 1, tags=rows.tags)
    offsets = stored[:, 0]
    if not has_offset.all():
        offsets[~has_offset] = hubness_offsets(engine, embeddings[~has_offset])
    return offsets

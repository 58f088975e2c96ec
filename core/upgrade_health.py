"""Sampled fidelity: a label-free health signal of an upgraded gallery, computed on the device.

After an upgrade the gallery holds h(φ_old(x)) for every row. The device re-embeds a small
random sample of its rows with the new model, φ_new(x), exactly as backfill does, and
:func:`upgrade_health` measures how well the adapted rows match the new model's own geometry:

- the cosine between h(φ_old(x)) and φ_new(x) on each sampled row (mean and 10th percentile);
- self-retrieval: the rank of each sampled row's φ_new(x) among the *whole* adapted gallery by
  the bundle's distance — is the row's own adapted vector its nearest? — as R@1 and the mean
  reciprocal rank. The gallery is scanned in blocks (never an N×N matrix), so N may be 1M rows.

Agreement between old-space and adapted-space neighbourhoods cannot serve: any orthogonal map
keeps every inner product, so a completely wrong rotation would score a perfect overlap. This
signal compares with φ_new itself.

:func:`streamed_health` measures the same over a gallery read block by block (the device's
:mod:`.upgrade_check` reads its adapted rows a page at a time). :func:`sample_rows` draws the
sample deterministically from a seed and the row ids.

Privacy: only the aggregates of :class:`UpgradeHealth` (sample size, mean and 10th-percentile
cosine, R@1, mean reciprocal rank, median rank, the gallery's row count) are meant to leave the device. No vector, row id, sampled
position or per-row value is part of it.

:func:`expected_health` is what the exporter records in each release (the manifest's
``health_expectation``): the same measures, with the same sample size, on the evaluation split's
adapted gallery cut to several sizes, over repeated samples — what a device of that size should
report when the release behaves as it did on the server's data. Self-retrieval depends on the
gallery's size (more rows, more rows that can come first), so the expectation is kept per size and
read at each device's own.

Numpy only (and :mod:`fctkit.errors`): the device imports it without torch, and so does the exporter.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import numpy as np

from fctkit.errors import InputError

# The distances of a bundle manifest (fctkit.protos.bundle_vocabulary.Distance).
METRICS = ("cosine", "l2")
DEFAULT_BLOCK_ROWS = 16_384
#: rows a device re-embeds after each upgrade unless its device.json says otherwise, and the sample
#: size each release's expectation is measured with
DEFAULT_SAMPLE_SIZE = 32


@dataclass(frozen=True)
class UpgradeHealth:
    """The aggregates one upgrade reports: what leaves the device, and nothing more."""

    sample_size: int
    mean_cosine: float
    p10_cosine: float
    recall_at_1: float
    mean_reciprocal_rank: float
    median_rank: float
    gallery_rows: int


def sample_rows(row_ids: Sequence[str], size: int, seed: int) -> np.ndarray:
    """Positions (ascending) into ``row_ids`` of the ``size`` rows whose ids have the smallest
    keyed hash under ``seed``: the same seed and ids give the same rows whatever their order,
    and adding rows changes the sample only where a new id hashes lower."""
    ids = [str(row_id) for row_id in row_ids]
    if not 1 <= size <= len(ids):
        raise InputError(
            f"a health sample of {size} rows cannot be drawn from {len(ids)} rows; ask for between 1 and {len(ids)}"
        )
    if not 0 <= seed < 2**64:
        raise InputError(f"the sample seed must be in [0, 2**64), got {seed}")
    if len(set(ids)) != len(ids):
        raise InputError("row ids repeat; each gallery row needs a distinct id to draw a health sample")
    key = seed.to_bytes(8, "little")
    hashes = np.fromiter(
        (int.from_bytes(hashlib.blake2b(i.encode(), key=key, digest_size=8).digest(), "little") for i in ids),
        dtype=np.uint64,
        count=len(ids),
    )
    return np.sort(np.argsort(hashes, kind="stable")[:size])


def upgrade_health(
    adapted: np.ndarray,
    sample: np.ndarray,
    reembedded: np.ndarray,
    metric: str,
    *,
    block_rows: int = DEFAULT_BLOCK_ROWS,
) -> UpgradeHealth:
    """The health of ``adapted`` (N×d, the gallery's rows after the upgrade) measured on the
    rows at positions ``sample`` (k distinct), whose new-model embeddings are ``reembedded``
    (k×d, in the order of ``sample``). ``metric``: the bundle's distance, "cosine" or "l2"."""
    adapted, sample, reembedded = _checked(adapted, sample, reembedded, metric, block_rows)
    return _health(_array_blocks(adapted, block_rows), sample, adapted[sample], reembedded, metric)


def streamed_health(
    blocks: Iterable[tuple[np.ndarray, np.ndarray]],
    sample: np.ndarray,
    sampled: np.ndarray,
    reembedded: np.ndarray,
    metric: str,
) -> UpgradeHealth:
    """:func:`upgrade_health` over a gallery read block by block (one block held at a time).
    ``blocks`` yields (keys, vectors): each row's key — its position or row id, ascending
    through the gallery (the order ties are broken in) — and its adapted vector; ``sample``
    holds the sampled rows' keys, ``sampled`` their adapted vectors and ``reembedded`` their
    new-model embeddings (both k×d, in the order of ``sample``)."""
    if metric not in METRICS:
        raise InputError(f"metric {metric!r} is not one of {', '.join(METRICS)} (the bundle manifest's distance)")
    sampled = np.asarray(sampled)
    if sampled.ndim != 2 or not sampled.shape[1] or not np.isfinite(sampled).all():
        raise InputError(f"the sampled rows' adapted vectors must be a finite k×d array, got shape {sampled.shape}")
    sample = _checked_keys(sample)
    if len(sample) != len(sampled):
        raise InputError(f"{len(sample)} sampled keys do not match {len(sampled)} sampled adapted vectors")
    return _health(blocks, sample, sampled, _checked_reembedded(reembedded, sampled.shape), metric)


#: the measures :func:`expected_health` records (every field of :class:`UpgradeHealth` that is a measure)
MEASURES = ("mean_cosine", "p10_cosine", "recall_at_1", "mean_reciprocal_rank", "median_rank")


def expected_health(
    adapted: np.ndarray,
    reembedded: np.ndarray,
    metric: str,
    *,
    sample_size: int,
    draws: int = 16,
    seed: int = 0,
    smallest: int = 64,
) -> tuple[tuple[int, ...], dict[str, tuple[tuple[float, ...], tuple[float, ...]]]]:
    """What a device should report for an upgrade that behaves as ``adapted`` (N×d, the adapted
    evaluation gallery) does against ``reembedded`` (N×d, the same items embedded by the new model).

    For gallery sizes from ``smallest`` up to N, each ×4 the last (and N itself), ``draws`` times:
    cut a random gallery of that size, draw ``sample_size`` rows of it and measure them as a device
    would (:func:`upgrade_health`). Returns the sizes and, per measure of :data:`MEASURES`, the mean
    and standard deviation over the draws at each size."""
    adapted, reembedded = np.asarray(adapted), np.asarray(reembedded)
    if adapted.ndim != 2 or adapted.shape != reembedded.shape:
        raise InputError(
            f"the adapted gallery {adapted.shape} and its new-model embeddings {reembedded.shape} must be N×d alike"
        )
    if not 1 <= sample_size <= len(adapted) or draws < 2:
        raise InputError(
            f"an expectation needs 1 <= sample_size ({sample_size}) <= {len(adapted)} rows and at least 2 draws ({draws})"
        )
    sizes = []
    size = min(max(smallest, sample_size), len(adapted))
    while size < len(adapted):
        sizes.append(size)
        size *= 4
    sizes.append(len(adapted))
    rng = np.random.default_rng(seed)
    found: dict[str, list[list[float]]] = {m: [] for m in MEASURES}
    for size in sizes:
        runs = []
        for _ in range(draws):
            gallery = np.sort(rng.choice(len(adapted), size, replace=False))
            sample = np.sort(rng.choice(size, min(sample_size, size), replace=False))
            runs.append(upgrade_health(adapted[gallery], sample, reembedded[gallery[sample]], metric))
        for measure in MEASURES:
            found[measure].append([float(getattr(run, measure)) for run in runs])
    return tuple(sizes), {
        m: (tuple(float(np.mean(v)) for v in values), tuple(float(np.std(v)) for v in values))
        for m, values in found.items()
    }


def self_retrieval_ranks(
    adapted: np.ndarray,
    sample: np.ndarray,
    reembedded: np.ndarray,
    metric: str,
    *,
    block_rows: int = DEFAULT_BLOCK_ROWS,
) -> np.ndarray:
    """Rank (1 = nearest) of each sampled row's own adapted vector when ``reembedded[i]``
    queries the whole adapted gallery by ``metric``; a tie counts against the row when the
    other row comes first in the gallery (as the device's search breaks ties)."""
    adapted, sample, reembedded = _checked(adapted, sample, reembedded, metric, block_rows)
    return _ranks(_array_blocks(adapted, block_rows), sample, adapted[sample], reembedded, metric)


def _health(
    blocks: Iterable[tuple[np.ndarray, np.ndarray]],
    sample: np.ndarray,
    sampled: np.ndarray,
    reembedded: np.ndarray,
    metric: str,
) -> UpgradeHealth:
    rows = [0]
    ranks = _ranks(_counted(blocks, rows), sample, sampled, reembedded, metric)
    # clipped: rounding can put a row's cosine with itself a hair past 1, outside what a report may carry
    cosines = np.clip(np.einsum("ij,ij->i", _unit(sampled), _unit(reembedded)), -1.0, 1.0)
    return UpgradeHealth(
        sample_size=len(ranks),
        mean_cosine=float(cosines.mean()),
        p10_cosine=float(np.percentile(cosines, 10)),
        recall_at_1=float(np.mean(ranks == 1)),
        mean_reciprocal_rank=float(np.mean(1.0 / ranks)),
        median_rank=float(np.median(ranks)),
        gallery_rows=rows[0],
    )


def _counted(
    blocks: Iterable[tuple[np.ndarray, np.ndarray]], rows: list[int]
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """``blocks`` as they are, adding each block's row count to ``rows[0]``."""
    for keys, block in blocks:
        rows[0] += len(block)
        yield keys, block


def _array_blocks(adapted: np.ndarray, block_rows: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    for first in range(0, len(adapted), block_rows):
        block = adapted[first : first + block_rows]
        yield np.arange(first, first + len(block)), block


def _ranks(
    blocks: Iterable[tuple[np.ndarray, np.ndarray]],
    sample: np.ndarray,
    sampled: np.ndarray,
    reembedded: np.ndarray,
    metric: str,
) -> np.ndarray:
    queries = _unit(reembedded) if metric == "cosine" else reembedded.astype(np.float64)
    own = np.diagonal(_scores(queries, sampled, metric)).copy()
    ahead = np.zeros(len(sample), dtype=np.int64)
    for keys, block in blocks:
        if block.ndim != 2 or block.shape[1] != sampled.shape[1]:
            raise InputError(
                f"a gallery block of shape {block.shape} does not match the sampled rows' dimension "
                f"{sampled.shape[1]}; measure rows of one space only"
            )
        if not np.isfinite(block).all():
            bad = int(keys[np.flatnonzero(~np.isfinite(block).all(axis=1))[0]])
            raise InputError(
                f"adapted gallery row {bad} holds NaN or inf; repair the gallery before measuring its health"
            )
        scores = _scores(queries, block, metric)
        earlier = keys[None, :] < sample[:, None]
        better = (scores > own[:, None]) | ((scores == own[:, None]) & earlier)
        better[keys[None, :] == sample[:, None]] = False
        ahead += better.sum(axis=1)
    return ahead + 1


def _scores(queries: np.ndarray, rows: np.ndarray, metric: str) -> np.ndarray:
    """Similarity of each query to each row (higher = nearer), float64: cosine of unit vectors,
    or −‖q − g‖² + ‖q‖² (the query's own norm is the same for every row, so it is left out)."""
    if metric == "cosine":
        cosines: np.ndarray = queries @ _unit(rows).T
        return cosines
    rows = rows.astype(np.float64)
    scores: np.ndarray = 2.0 * (queries @ rows.T) - np.einsum("ij,ij->i", rows, rows)[None, :]
    return scores


def _unit(x: np.ndarray) -> np.ndarray:
    """Rows scaled to unit length in float64 (any finite float32 row: no overflow); zero rows stay zero."""
    x = np.asarray(x, dtype=np.float64)
    norms = np.sqrt(np.einsum("ij,ij->i", x, x))
    return x / np.where(norms > 0, norms, 1.0)[:, None]


def _checked(
    adapted: np.ndarray, sample: np.ndarray, reembedded: np.ndarray, metric: str, block_rows: int
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    if metric not in METRICS:
        raise InputError(f"metric {metric!r} is not one of {', '.join(METRICS)} (the bundle manifest's distance)")
    if block_rows < 1:
        raise InputError(f"block_rows must be >= 1, got {block_rows}")
    adapted, reembedded = np.asarray(adapted), np.asarray(reembedded)
    if adapted.ndim != 2 or not adapted.shape[0] or not adapted.shape[1]:
        raise InputError(f"the adapted gallery must be a non-empty N×d array, got shape {adapted.shape}")
    sample = _checked_sample(sample, len(adapted))
    return adapted, sample, _checked_reembedded(reembedded, (len(sample), adapted.shape[1]))


def _checked_reembedded(reembedded: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    reembedded = np.asarray(reembedded)
    if reembedded.shape != shape:
        raise InputError(
            f"re-embedded vectors of shape {reembedded.shape} do not match {shape[0]} sampled rows "
            f"of dimension {shape[1]}; re-embed each sampled row with the new model"
        )
    if not np.isfinite(reembedded).all():
        raise InputError("re-embedded vectors hold NaN or inf; the new model failed on a sampled row")
    return reembedded


def _checked_sample(sample: np.ndarray, rows: int) -> np.ndarray:
    sample = _checked_keys(sample)
    if len(sample) > rows:
        raise InputError(f"a sample of {len(sample)} rows is larger than the gallery's {rows} rows")
    if sample.min() < 0 or sample.max() >= rows:
        raise InputError(f"sample positions must lie in [0, {rows}); got {int(sample.min())}..{int(sample.max())}")
    return sample


def _checked_keys(sample: np.ndarray) -> np.ndarray:
    sample = np.asarray(sample)
    if sample.ndim != 1 or not len(sample):
        raise InputError(f"the sample must be a non-empty 1-D array of row positions, got shape {sample.shape}")
    if not np.issubdtype(sample.dtype, np.integer):
        raise InputError(f"sample positions must be integers, got dtype {sample.dtype}")
    if len(np.unique(sample)) != len(sample):
        raise InputError("sample positions repeat; draw distinct rows (sample_rows does)")
    return sample.astype(np.int64)

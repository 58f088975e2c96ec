"""Search in ``compatible`` mode: a version trained to be compatible (BCT, BT², CoReS) answers
queries against the rows of the versions it is compatible with, as they are stored — the
upgrade only switches the query model and never rewrites a row.

Which rows: those of the query version and of every installed ancestor reached through
``compatible`` bundles' parents. On how many dims: a bundle's
:attr:`~fctkit.protos.bundle.Manifest.compatible_dims` (its ``compatible_prefix_dim``, BT²'s
old-compatible block; else its whole embedding) says how many leading dims of its embedding
its parents' rows are compared on; along a chain the smallest applies. When the searchable rows
come from several versions, every row and the query are compared on the smallest prefix among
them (one metric for the whole ranking); when all rows are of the query version, on all dims.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from fctkit.errors import GalleryError
from fctkit.protos.bundle import Manifest

ManifestOf = Callable[[int], "Manifest | None"]


def comparable_dims(manifest_of: ManifestOf, version: int) -> dict[int, int]:
    """Version → leading dims of ``version``'s embedding its rows are compared on, for
    ``version`` itself and every installed ancestor reached through compatible bundles
    (``manifest_of(v)`` is None when v is not installed)."""
    manifest = manifest_of(version)
    if manifest is None:
        raise GalleryError(f"bundle v{version} is not installed")
    dims = {version: manifest.embedding_dim}
    frontier = [(manifest, manifest.embedding_dim)]
    while frontier:
        child, child_dims = frontier.pop()
        if child.mode != "compatible":
            continue
        for parent in child.parents:
            parent_manifest = manifest_of(parent)
            if parent_manifest is None:
                continue
            prefix = min(child_dims, child.compatible_dims)
            if prefix > dims.get(parent, 0):
                dims[parent] = prefix
                frontier.append((parent_manifest, prefix))
    return dims


def compatible_rows(
    versions: Sequence[int], embeddings: np.ndarray, dims: dict[int, int]
) -> tuple[list[int], np.ndarray]:
    """The positions of the rows (by their version tag) searchable under ``dims`` and their
    vectors, all cut to the common prefix (``embeddings`` dense or ragged)."""
    keep = [i for i, v in enumerate(versions) if v in dims]
    if not keep:
        return [], np.zeros((0, 1), np.float32)
    prefix = min(dims[versions[i]] for i in keep)
    if embeddings.dtype != object and embeddings.shape[1] >= prefix:
        return keep, np.ascontiguousarray(embeddings[keep, :prefix], dtype=np.float32)
    short = [i for i in keep if len(embeddings[i]) < prefix]
    if short:
        raise GalleryError(
            f"row {short[0]} has {len(embeddings[short[0]])} dims, fewer than the {prefix} its version is "
            "compared on; the gallery does not match the installed bundles"
        )
    return keep, np.stack([np.asarray(embeddings[i][:prefix], dtype=np.float32) for i in keep])

"""Datasets behind one interface (numpy only, no torch).

- :func:`load_dataset` gives image datasets as float32 ``(N, 1, H, W)`` in ``[0, 1]`` with
  int64 labels: ``digits`` (scikit-learn's bundled 8x8 digits) and ``fashion-mnist`` (the idx
  files of the Debian package ``dataset-fashion-mnist``).
- :func:`load_features` / :func:`load_feature_versions` read pre-extracted embeddings, one
  ``.npz`` per model version, so any model's features can be used.
- :func:`make_splits`, :func:`class_subset`, :func:`old_class_subset` give deterministic,
  stratified index sets and the FCT protocol's class subsets.
"""

from __future__ import annotations

import dataclasses
import gzip
import math
import os
import shutil
import subprocess
import zipfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any, Literal

import numpy as np

from fctkit.errors import DataUnavailableError, DependencyError, InputError
from fctkit.feature_checks import check_features, validate_labels

DATASET_NAMES = ("digits", "fashion-mnist")
DatasetPart = Literal["all", "train", "test"]

FASHION_MNIST_PACKAGE = "dataset-fashion-mnist"
FASHION_MNIST_ENV = "FCTKIT_FASHION_MNIST_DIR"
FASHION_MNIST_DIRS = (Path("/usr/share/datasets/fashion-mnist"), Path("/usr/share/dataset-fashion-mnist"))
FASHION_MNIST_CLASSES = (
    "T-shirt/top",
    "Trouser",
    "Pullover",
    "Dress",
    "Coat",
    "Sandal",
    "Shirt",
    "Sneaker",
    "Bag",
    "Ankle boot",
)
_FASHION_MNIST_FILES = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}


@dataclasses.dataclass(frozen=True)
class ImageDataset:
    """Grey images ``(N, 1, H, W)`` float32 in [0, 1] with int64 class labels ``(N,)``."""

    name: str
    images: np.ndarray
    labels: np.ndarray
    class_names: tuple[str, ...]

    @property
    def n_classes(self) -> int:
        return len(self.class_names)

    def __len__(self) -> int:
        return len(self.labels)

    def subset(self, indices: np.ndarray) -> ImageDataset:
        """The items at ``indices`` (e.g. a split or a class subset), same class names."""
        return dataclasses.replace(self, images=self.images[indices], labels=self.labels[indices])


def load_dataset(name: str, part: DatasetPart = "all", root: str | Path | None = None) -> ImageDataset:
    """Load an image dataset by name.

    ``part`` selects the official train or test portion where the dataset has one
    (fashion-mnist: 60,000 / 10,000; ``all`` = both, train first); digits has only ``all``.
    ``root`` overrides where fashion-mnist's idx files are looked for.
    """
    if part not in ("all", "train", "test"):
        raise InputError(f"part must be 'all', 'train' or 'test', got {part!r}")
    if name == "digits":
        if part != "all":
            raise InputError("the digits dataset has no official train/test parts; use part='all' and make_splits()")
        return _load_digits()
    if name == "fashion-mnist":
        return _load_fashion_mnist(part, root)
    raise InputError(f"unknown dataset {name!r}; choose one of {', '.join(DATASET_NAMES)} or bring features as .npz")


def _load_digits() -> ImageDataset:
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise DependencyError(
            "the digits dataset needs scikit-learn: pip install 'fctkit[train]' -c constraints.txt"
        ) from exc
    bunch = load_digits()
    images = (bunch.images.astype(np.float32) / 16.0)[:, None, :, :]
    labels = bunch.target.astype(np.int64)
    return ImageDataset("digits", images, labels, tuple(str(c) for c in range(10)))


def find_fashion_mnist(root: str | Path | None = None) -> Path:
    """The folder holding fashion-mnist's idx files: ``root``, ``$FCTKIT_FASHION_MNIST_DIR``,
    the Debian package's files (``dpkg -L``), or the usual /usr/share paths."""
    candidates = [Path(root)] if root is not None else []
    if os.environ.get(FASHION_MNIST_ENV):
        candidates.append(Path(os.environ[FASHION_MNIST_ENV]))
    candidates += _dpkg_dirs(FASHION_MNIST_PACKAGE) + list(FASHION_MNIST_DIRS)
    for folder in candidates:
        if _idx_path(folder, _FASHION_MNIST_FILES["train"][0]) is not None:
            return folder
    searched = ", ".join(str(c) for c in dict.fromkeys(candidates))
    raise DataUnavailableError(
        f"fashion-mnist idx files not found (searched {searched}); install them with "
        f"`apt-get install {FASHION_MNIST_PACKAGE}` or point {FASHION_MNIST_ENV} at a folder holding "
        f"train-images-idx3-ubyte[.gz] and its siblings"
    )


def _dpkg_dirs(package: str) -> list[Path]:
    if shutil.which("dpkg") is None:
        return []
    try:
        listing = subprocess.run(["dpkg", "-L", package], capture_output=True, text=True, timeout=20, check=False)
    except (OSError, subprocess.SubprocessError):
        return []
    if listing.returncode != 0:
        return []
    return list(dict.fromkeys(Path(line).parent for line in listing.stdout.splitlines() if "-idx" in line))


def _idx_path(folder: Path, stem: str) -> Path | None:
    for candidate in (folder / stem, folder / f"{stem}.gz"):
        if candidate.is_file():
            return candidate
    return None


def _load_fashion_mnist(part: DatasetPart, root: str | Path | None) -> ImageDataset:
    folder = find_fashion_mnist(root)
    parts = ("train", "test") if part == "all" else (part,)
    images, labels = [], []
    for name in parts:
        image_stem, label_stem = _FASHION_MNIST_FILES[name]
        image_path, label_path = _idx_path(folder, image_stem), _idx_path(folder, label_stem)
        if image_path is None or label_path is None:
            raise DataUnavailableError(
                f"{folder}: {image_stem} or {label_stem} is missing; reinstall with "
                f"`apt-get install --reinstall {FASHION_MNIST_PACKAGE}`"
            )
        part_images, part_labels = read_idx(image_path), read_idx(label_path)
        if part_images.ndim != 3 or part_labels.ndim != 1 or len(part_images) != len(part_labels):
            raise InputError(
                f"{image_path} / {label_path}: expected (N,H,W) images and (N,) labels, "
                f"got {part_images.shape} and {part_labels.shape}"
            )
        images.append(part_images)
        labels.append(part_labels)
    all_images = (np.concatenate(images).astype(np.float32) / 255.0)[:, None, :, :]
    all_labels = np.concatenate(labels).astype(np.int64)
    if all_labels.min() < 0 or all_labels.max() >= len(FASHION_MNIST_CLASSES):
        raise InputError(f"{folder}: fashion-mnist labels outside 0..9; the files are damaged, reinstall the package")
    return ImageDataset("fashion-mnist", all_images, all_labels, FASHION_MNIST_CLASSES)


_IDX_DTYPES: dict[int, np.dtype[Any]] = {
    code: np.dtype(kind)
    for code, kind in {0x08: "u1", 0x09: "i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}.items()
}


def read_idx(path: str | Path) -> np.ndarray:
    """Read one idx file (the MNIST format), gzip'd or not, checking its header against its size."""
    path = Path(path)
    try:
        with path.open("rb") as fh:
            raw = fh.read()
        if raw[:2] == b"\x1f\x8b":
            raw = gzip.decompress(raw)
    except (OSError, EOFError) as exc:
        raise InputError(f"{path}: cannot read idx file ({exc}); the file is truncated or damaged") from exc
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise InputError(f"{path}: not an idx file (bad magic number)")
    dtype, ndim = _IDX_DTYPES[raw[2]], raw[3]
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise InputError(f"{path}: truncated idx header")
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    expected = header + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) != expected:
        raise InputError(
            f"{path}: idx header promises {expected} bytes for shape {shape}, file has {len(raw)}; "
            f"the file is truncated or damaged"
        )
    return np.frombuffer(raw, dtype=dtype, offset=header).reshape(shape).astype(dtype.newbyteorder("="))


def validate_images(images: np.ndarray, where: str = "images") -> np.ndarray:
    """Check that ``images`` is a non-empty finite (N, C, H, W) array; return it as float32."""
    images = np.asarray(images)
    if images.ndim == 3:
        raise InputError(f"{where}: got shape {images.shape}; add the channel axis: images[:, None] for (N, 1, H, W)")
    if images.ndim != 4 or min(images.shape) == 0:
        raise InputError(f"{where}: expected a non-empty (N, C, H, W) array, got shape {images.shape}")
    if not np.issubdtype(images.dtype, np.number):
        raise InputError(f"{where}: expected numbers, got dtype {images.dtype}")
    images = images.astype(np.float32, copy=False)
    if not np.isfinite(images).all():
        raise InputError(f"{where}: contains NaN or inf; clean the data first")
    return images


# --------------------------------------------------------------------------- pre-extracted features


@dataclasses.dataclass(frozen=True)
class FeatureSet:
    """Embeddings of one model version: ``embeddings`` (N, d) float32, ``labels`` (N,) int64,
    optional ``ids`` (N,) and ``side_info`` (N, d_side) float32."""

    embeddings: np.ndarray
    labels: np.ndarray
    ids: np.ndarray | None = None
    side_info: np.ndarray | None = None
    source: str = ""

    @property
    def dim(self) -> int:
        return int(self.embeddings.shape[1])

    def __len__(self) -> int:
        return len(self.labels)

    def subset(self, indices: np.ndarray) -> FeatureSet:
        pick = lambda a: None if a is None else a[indices]  # noqa: E731
        return dataclasses.replace(
            self,
            embeddings=self.embeddings[indices],
            labels=self.labels[indices],
            ids=pick(self.ids),
            side_info=pick(self.side_info),
        )


FEATURE_KEYS = ("embeddings", "labels", "ids", "side_info")


def save_features(
    path: str | Path,
    embeddings: np.ndarray,
    labels: np.ndarray,
    *,
    ids: np.ndarray | None = None,
    side_info: np.ndarray | None = None,
) -> Path:
    """Write a feature ``.npz`` that :func:`load_features` reads back (validated before writing)."""
    features = _validated_features(str(path), embeddings, labels, ids, side_info)
    arrays = {k: getattr(features, k) for k in FEATURE_KEYS if getattr(features, k) is not None}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **arrays)
    return path if path.suffix == ".npz" else path.with_name(path.name + ".npz")


def load_features(path: str | Path) -> FeatureSet:
    """Read and validate one version's features from a ``.npz`` (keys: ``embeddings``, ``labels``,
    optional ``ids``, ``side_info``; any other key is an error so a misspelt key is never ignored)."""
    path = Path(path)
    if not path.is_file():
        raise DataUnavailableError(f"feature file not found: {path}")
    try:
        with np.load(path, allow_pickle=False) as npz:
            unknown = sorted(set(npz.files) - set(FEATURE_KEYS))
            if unknown:
                raise InputError(f"{path}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(FEATURE_KEYS)}")
            missing = [k for k in ("embeddings", "labels") if k not in npz.files]
            if missing:
                raise InputError(
                    f"{path}: missing key(s) {', '.join(missing)}; save with "
                    f"np.savez(path, embeddings=(N,d) array, labels=(N,) array)"
                )
            arrays = {k: npz[k] for k in npz.files}
    except InputError:
        raise
    except (OSError, ValueError, EOFError, zipfile.BadZipFile) as exc:
        raise InputError(
            f"{path}: not a readable .npz ({exc}); the file is truncated, damaged, or holds "
            f"pickled objects (not allowed)"
        ) from exc
    return _validated_features(
        str(path), arrays["embeddings"], arrays["labels"], arrays.get("ids"), arrays.get("side_info")
    )


def _validated_features(
    source: str, embeddings: np.ndarray, labels: np.ndarray, ids: np.ndarray | None, side_info: np.ndarray | None
) -> FeatureSet:
    embeddings = _feature_matrix(f"{source}: embeddings", embeddings)
    labels = validate_labels(labels, len(embeddings), f"{source}: labels")
    if ids is not None:
        ids = np.asarray(ids)
        if ids.shape != (len(embeddings),):
            raise InputError(f"{source}: ids must have shape ({len(embeddings)},), got {ids.shape}")
        if len(np.unique(ids)) != len(ids):
            raise InputError(f"{source}: ids are not unique; each item needs its own id")
    if side_info is not None:
        side_info = _feature_matrix(f"{source}: side_info", side_info)
        if len(side_info) != len(embeddings):
            raise InputError(f"{source}: side_info has {len(side_info)} rows for {len(embeddings)} embeddings")
    return FeatureSet(embeddings, labels, ids, side_info, source)


def _feature_matrix(name: str, array: np.ndarray) -> np.ndarray:
    array = check_features(name, array)
    if array.shape[1] == 0:
        raise InputError(f"{name}: has 0 dims; save the (N, d) feature matrix itself")
    return array


def load_feature_versions(paths: Sequence[str | Path]) -> list[FeatureSet]:
    """Load several versions' features and check they describe the same items in the same order
    (same labels; same ids where ids are given). Dims may differ between versions."""
    if not paths:
        raise InputError("no feature files given; pass one .npz per model version")
    versions = [load_features(p) for p in paths]
    first = versions[0]
    for other in versions[1:]:
        if len(other) != len(first):
            raise InputError(
                f"{other.source} has {len(other)} items but {first.source} has {len(first)}; "
                f"every version must embed the same items in the same order"
            )
        if not np.array_equal(other.labels, first.labels):
            row = int(np.flatnonzero(other.labels != first.labels)[0])
            raise InputError(
                f"{other.source} and {first.source} disagree on the label of row {row}; "
                f"the files must list the same items in the same order"
            )
        if (first.ids is None) != (other.ids is None):
            raise InputError(
                f"{first.source} and {other.source}: ids are given in one file only; give them in all or none"
            )
        if first.ids is not None and other.ids is not None and not np.array_equal(other.ids, first.ids):
            row = int(np.flatnonzero(other.ids != first.ids)[0])
            raise InputError(
                f"{other.source} and {first.source} disagree on the id of row {row}; "
                f"the files must list the same items in the same order"
            )
    return versions


# --------------------------------------------------------------------------- splits and class subsets


@dataclasses.dataclass(frozen=True)
class Splits:
    """Disjoint index arrays into one dataset (each sorted ascending)."""

    train: np.ndarray
    query: np.ndarray
    gallery: np.ndarray


def make_splits(labels: np.ndarray, seed: int, *, train_fraction: float = 0.6, query_fraction: float = 0.2) -> Splits:
    """Deterministic stratified train / query / gallery split of ``labels``.

    Per class, ``train_fraction`` of the items go to train, ``query_fraction`` to query and the
    rest to gallery (rounded per class, so class proportions are kept in every split). The
    defaults suit small data like digits: 60 / 20 / 20. ``query_fraction=0`` leaves query empty
    for evaluations that use the gallery as its own query set with leave-one-out.
    """
    labels = validate_labels(labels)
    if not (0 <= train_fraction < 1 and 0 <= query_fraction < 1 and train_fraction + query_fraction < 1):
        raise InputError(
            f"need 0 <= train_fraction, query_fraction and train_fraction + query_fraction < 1; "
            f"got {train_fraction} and {query_fraction}"
        )
    rng = np.random.default_rng(seed)
    parts: tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]] = ([], [], [])
    for cls in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == cls))
        n_train = round(len(members) * train_fraction)
        n_query = round(len(members) * query_fraction)
        n_query = min(n_query, len(members) - n_train)
        for bucket, chunk in zip(parts, np.split(members, [n_train, n_train + n_query])):
            bucket.append(chunk)
    train, query, gallery = (np.sort(np.concatenate(bucket)).astype(np.int64) for bucket in parts)
    if len(gallery) == 0:
        raise InputError("the gallery split is empty; lower train_fraction/query_fraction or use more data")
    return Splits(train, query, gallery)


def first_classes(labels: np.ndarray, n_classes: int) -> np.ndarray:
    """The ``n_classes`` smallest class values present in ``labels`` (sorted)."""
    classes = np.unique(validate_labels(labels))
    if not 1 <= n_classes <= len(classes):
        raise InputError(f"n_classes must be in 1..{len(classes)} (the classes present), got {n_classes}")
    return classes[:n_classes]


def class_subset(labels: np.ndarray, n_classes: int) -> np.ndarray:
    """Indices of the items whose class is among the first ``n_classes`` classes (sorted by value);
    e.g. a chain v1: 4 classes, v2: 7, v3: 10."""
    return np.flatnonzero(np.isin(labels, first_classes(labels, n_classes))).astype(np.int64)


def old_class_subset(labels: np.ndarray, fraction: float = 0.5) -> np.ndarray:
    """Indices of the items the old model may see under the FCT protocol: the first
    ``fraction`` of the classes (classes 0..K/2-1 for the default 0.5; at least one class)."""
    if not 0 < fraction <= 1:
        raise InputError(f"fraction must be in (0, 1], got {fraction}")
    n_present = len(np.unique(validate_labels(labels)))
    return class_subset(labels, max(1, math.floor(n_present * fraction + 1e-9)))

"""Datasets, idx reader, feature .npz files, splits and class subsets (numpy only)."""

from __future__ import annotations

import gzip

import numpy as np
import pytest

from fctkit.errors import DataUnavailableError, InputError
from fctkit.trainer import datasets
from fctkit.trainer.datasets import (
    class_subset,
    find_fashion_mnist,
    load_dataset,
    load_feature_versions,
    load_features,
    make_splits,
    old_class_subset,
    read_idx,
    save_features,
)


@pytest.fixture(scope="module")
def digits():
    return load_dataset("digits")


def test_digits_shapes_range_and_labels(digits):
    assert digits.images.shape == (1797, 1, 8, 8)
    assert digits.images.dtype == np.float32 and digits.labels.dtype == np.int64
    assert digits.images.min() == 0.0 and digits.images.max() == 1.0
    assert np.array_equal(np.unique(digits.labels), np.arange(10))
    assert digits.n_classes == 10 and len(digits) == 1797
    assert np.bincount(digits.labels).min() >= 170


def test_unknown_dataset_and_part_are_errors():
    with pytest.raises(InputError, match="unknown dataset"):
        load_dataset("cifar")
    with pytest.raises(InputError, match="no official train/test"):
        load_dataset("digits", part="train")
    with pytest.raises(InputError, match="part must be"):
        load_dataset("digits", part="val")


def _write_idx(path, array: np.ndarray, compress: bool) -> None:
    codes = {np.dtype(np.uint8): 0x08, np.dtype(">i4"): 0x0C}
    header = bytes([0, 0, codes[array.dtype], array.ndim]) + np.asarray(array.shape, dtype=">u4").tobytes()
    raw = header + array.tobytes()
    path.write_bytes(gzip.compress(raw) if compress else raw)


def _fake_fashion_mnist(folder, n_train: int = 12, n_test: int = 5, compress: bool = True) -> None:
    rng = np.random.default_rng(0)
    suffix = ".gz" if compress else ""
    for part, n in (("train", n_train), ("t10k", n_test)):
        _write_idx(
            folder / f"{part}-images-idx3-ubyte{suffix}", rng.integers(0, 256, (n, 28, 28), dtype=np.uint8), compress
        )
        _write_idx(folder / f"{part}-labels-idx1-ubyte{suffix}", (np.arange(n) % 10).astype(np.uint8), compress)


@pytest.mark.parametrize("compress", [True, False])
def test_fashion_mnist_reader_on_idx_files(tmp_path, compress):
    _fake_fashion_mnist(tmp_path, compress=compress)
    full = load_dataset("fashion-mnist", root=tmp_path)
    assert full.images.shape == (17, 1, 28, 28) and full.images.dtype == np.float32
    assert full.images.min() >= 0.0 and full.images.max() <= 1.0
    assert np.array_equal(full.labels[:12], np.arange(12) % 10)
    test = load_dataset("fashion-mnist", part="test", root=tmp_path)
    assert np.array_equal(test.images, full.images[12:])
    assert full.class_names[0] == "T-shirt/top" and full.n_classes == 10


def test_read_idx_rejects_truncated_and_foreign_files(tmp_path):
    good = tmp_path / "x-idx1-ubyte"
    _write_idx(good, np.arange(40, dtype=">i4"), compress=False)
    assert np.array_equal(read_idx(good), np.arange(40))
    truncated = tmp_path / "t"
    truncated.write_bytes(good.read_bytes()[:-3])
    with pytest.raises(InputError, match="truncated"):
        read_idx(truncated)
    broken_gzip = tmp_path / "t.gz"
    broken_gzip.write_bytes(gzip.compress(good.read_bytes())[:-10])
    with pytest.raises(InputError, match="truncated or damaged"):
        read_idx(broken_gzip)
    foreign = tmp_path / "f"
    foreign.write_bytes(b"PK\x03\x04 not an idx file")
    with pytest.raises(InputError, match="bad magic"):
        read_idx(foreign)


def test_missing_fashion_mnist_names_the_debian_package(tmp_path, monkeypatch):
    # Simulate a machine without the package: no dpkg listing, no default folder.
    monkeypatch.setattr(datasets, "_dpkg_dirs", lambda package: [])
    monkeypatch.setattr(datasets, "FASHION_MNIST_DIRS", (tmp_path / "absent",))
    monkeypatch.delenv(datasets.FASHION_MNIST_ENV, raising=False)
    with pytest.raises(DataUnavailableError, match="apt-get install dataset-fashion-mnist"):
        load_dataset("fashion-mnist")
    _fake_fashion_mnist(tmp_path)
    monkeypatch.setenv(datasets.FASHION_MNIST_ENV, str(tmp_path))
    assert find_fashion_mnist() == tmp_path


def test_installed_fashion_mnist_test_part():
    try:
        find_fashion_mnist()
    except DataUnavailableError:
        pytest.skip("Debian package dataset-fashion-mnist is not installed")
    test = load_dataset("fashion-mnist", part="test")
    assert test.images.shape == (10000, 1, 28, 28)
    assert np.array_equal(np.bincount(test.labels), np.full(10, 1000))
    assert test.images.max() == 1.0 and test.images.min() == 0.0


# --------------------------------------------------------------------------- features


def _features(n: int = 20, d: int = 6, seed: int = 0):
    rng = np.random.default_rng(seed)
    return rng.normal(size=(n, d)).astype(np.float32), np.arange(n) % 4


def test_features_round_trip_with_optional_arrays(tmp_path):
    emb, labels = _features()
    side = np.ones((20, 3), dtype=np.float64)
    path = save_features(tmp_path / "v1.npz", emb, labels, ids=np.arange(100, 120), side_info=side)
    loaded = load_features(path)
    assert np.array_equal(loaded.embeddings, emb) and loaded.embeddings.dtype == np.float32
    assert np.array_equal(loaded.labels, labels) and loaded.labels.dtype == np.int64
    assert np.array_equal(loaded.ids, np.arange(100, 120))
    assert loaded.side_info.dtype == np.float32 and loaded.side_info.shape == (20, 3)
    assert loaded.dim == 6 and len(loaded) == 20
    part = loaded.subset(np.array([3, 5]))
    assert np.array_equal(part.ids, [103, 105]) and part.side_info.shape == (2, 3)
    bare = load_features(save_features(tmp_path / "bare.npz", emb, labels))
    assert bare.ids is None and bare.side_info is None


def _npz(tmp_path, name: str = "bad.npz", **arrays):
    path = tmp_path / name
    np.savez(path, **arrays)
    return path


@pytest.mark.parametrize(
    ("arrays", "message"),
    [
        ({"labels": np.arange(4)}, "missing key"),
        ({"embeddings": np.zeros((4, 2)), "labels": np.arange(4), "label": np.arange(4)}, "unknown key"),
        ({"embeddings": np.zeros(4), "labels": np.arange(4)}, "2-D"),
        ({"embeddings": np.zeros((4, 0)), "labels": np.arange(4)}, "0 dims"),
        ({"embeddings": np.zeros((0, 3)), "labels": np.arange(0)}, "empty"),
        ({"embeddings": np.array([[0.0, np.nan]] * 4), "labels": np.arange(4)}, "NaN or inf"),
        ({"embeddings": np.zeros((4, 2)), "labels": np.arange(3)}, "3 labels for 4 items"),
        ({"embeddings": np.zeros((4, 2)), "labels": np.array([0.5, 1, 2, 3])}, "integer class labels"),
        ({"embeddings": np.zeros((4, 2)), "labels": np.arange(4), "ids": np.array([1, 1, 2, 3])}, "not unique"),
        ({"embeddings": np.zeros((4, 2)), "labels": np.arange(4), "ids": np.arange(3)}, "ids must have shape"),
        ({"embeddings": np.zeros((4, 2)), "labels": np.arange(4), "side_info": np.full((4, 2), np.inf)}, "NaN or inf"),
        ({"embeddings": np.zeros((4, 2)), "labels": np.arange(4), "side_info": np.zeros((3, 2))}, "3 rows for 4"),
        ({"embeddings": np.array([["a", "b"]] * 4), "labels": np.arange(4)}, "real numbers"),
    ],
)
def test_bad_feature_files_are_rejected(tmp_path, arrays, message):
    with pytest.raises(InputError, match=message):
        load_features(_npz(tmp_path, **arrays))


def test_unreadable_feature_files(tmp_path):
    with pytest.raises(DataUnavailableError, match="not found"):
        load_features(tmp_path / "nope.npz")
    good = save_features(tmp_path / "good.npz", *_features())
    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(good.read_bytes()[: good.stat().st_size // 2])
    with pytest.raises(InputError, match=r"not a readable .npz"):
        load_features(truncated)
    pickled = _npz(tmp_path, "pickled.npz", embeddings=np.array([object()] * 4), labels=np.arange(4))
    with pytest.raises(InputError, match=r"not a readable .npz"):
        load_features(pickled)


def test_feature_versions_must_describe_the_same_items(tmp_path):
    emb, labels = _features()
    v1 = save_features(tmp_path / "v1.npz", emb, labels)
    v2 = save_features(tmp_path / "v2.npz", np.hstack([emb, emb]), labels)
    versions = load_feature_versions([v1, v2])
    assert [v.dim for v in versions] == [6, 12]
    swapped = labels.copy()
    swapped[[0, 1]] = swapped[[1, 0]]
    with pytest.raises(InputError, match="label of row 0"):
        load_feature_versions([v1, save_features(tmp_path / "v3.npz", emb, swapped)])
    with pytest.raises(InputError, match="has 19 items"):
        load_feature_versions([v1, save_features(tmp_path / "v4.npz", emb[:19], labels[:19])])
    with_ids = save_features(tmp_path / "v5.npz", emb, labels, ids=np.arange(20))
    with pytest.raises(InputError, match="ids are given in one file only"):
        load_feature_versions([v1, with_ids])
    other_ids = save_features(tmp_path / "v6.npz", emb, labels, ids=np.arange(20)[::-1])
    with pytest.raises(InputError, match="id of row 0"):
        load_feature_versions([with_ids, other_ids])
    with pytest.raises(InputError, match="no feature files"):
        load_feature_versions([])


# --------------------------------------------------------------------------- splits and subsets


def test_splits_are_deterministic_disjoint_complete_and_stratified(digits):
    splits = make_splits(digits.labels, seed=3)
    again = make_splits(digits.labels, seed=3)
    other = make_splits(digits.labels, seed=4)
    for name in ("train", "query", "gallery"):
        assert np.array_equal(getattr(splits, name), getattr(again, name))
    assert not np.array_equal(splits.train, other.train)
    union = np.concatenate([splits.train, splits.query, splits.gallery])
    assert len(union) == len(np.unique(union)) == len(digits)
    counts = np.bincount(digits.labels)
    for part, fraction in ((splits.train, 0.6), (splits.query, 0.2), (splits.gallery, 0.2)):
        per_class = np.bincount(digits.labels[part], minlength=10)
        assert np.all(np.abs(per_class - counts * fraction) <= 1.0)


def test_splits_options_and_errors(digits):
    no_query = make_splits(digits.labels, seed=0, train_fraction=0.5, query_fraction=0.0)
    assert len(no_query.query) == 0 and len(no_query.train) + len(no_query.gallery) == len(digits)
    with pytest.raises(InputError, match="train_fraction"):
        make_splits(digits.labels, seed=0, train_fraction=0.7, query_fraction=0.3)
    with pytest.raises(InputError, match="non-empty"):
        make_splits(np.array([], dtype=int), seed=0)


def test_old_class_subset_is_the_first_half_of_the_classes(digits):
    old = old_class_subset(digits.labels)
    assert np.array_equal(np.unique(digits.labels[old]), np.arange(5))
    assert np.array_equal(old, np.flatnonzero(digits.labels < 5))
    shifted = digits.labels + 3  # classes 3..12: the old model sees 3..7
    assert np.array_equal(np.unique(shifted[old_class_subset(shifted)]), np.arange(3, 8))
    assert np.array_equal(np.unique(digits.labels[old_class_subset(digits.labels, 0.3)]), np.arange(3))
    with pytest.raises(InputError, match="fraction"):
        old_class_subset(digits.labels, 0.0)


def test_class_subsets_for_a_chain(digits):
    chain = [class_subset(digits.labels, n) for n in (4, 7, 10)]
    for subset, n in zip(chain, (4, 7, 10)):
        assert np.array_equal(np.unique(digits.labels[subset]), np.arange(n))
        assert np.array_equal(subset, np.flatnonzero(digits.labels < n))
    assert set(chain[0]) < set(chain[1]) < set(chain[2])
    with pytest.raises(InputError, match=r"n_classes must be in 1..10"):
        class_subset(digits.labels, 11)


def test_datasets_and_the_trainer_package_import_without_torch():
    import subprocess
    import sys

    probe = (
        "import sys, fctkit.trainer, fctkit.trainer.datasets, fctkit.trainer.cka\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
        "fctkit.trainer.train_backbone\n"
        "assert 'torch' in sys.modules"
    )
    subprocess.run([sys.executable, "-c", probe], check=True)

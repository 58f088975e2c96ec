"""Demo backbones on digits: training quality, determinism, save/load, bad input."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from fctkit.config import from_mapping
from fctkit.errors import ConfigError, DataUnavailableError, InputError
from fctkit.trainer.backbones import (
    Backbone,
    BackboneConfig,
    extract_features,
    load_backbone,
    random_shift,
    save_backbone,
    train_backbone,
)
from fctkit.trainer.datasets import load_dataset, make_splits, old_class_subset
from fctkit.trainer.evaluation import evaluate_retrieval
from fctkit.trainer.torch_utils import resolve_device, save_checkpoint
from tests.support.seeds import seed

OLD = BackboneConfig(architecture="small", embedding_dim=32, progress=False)
NEW = BackboneConfig(architecture="wide", embedding_dim=64, progress=False)


@pytest.fixture(scope="module")
def data():
    digits = load_dataset("digits")
    splits = make_splits(digits.labels, seed=seed())
    train = digits.subset(splits.train)
    return {
        "train": train,
        "old_train": train.subset(old_class_subset(train.labels)),
        "query": digits.subset(splits.query),
        "gallery": digits.subset(splits.gallery),
    }


@pytest.fixture(scope="module")
def old_model(data):
    return train_backbone(data["old_train"].images, data["old_train"].labels, OLD, seed=seed(), device="cpu")


@pytest.fixture(scope="module")
def new_model(data):
    return train_backbone(data["train"].images, data["train"].labels, NEW, seed=seed(), device="cpu")


def _top1(model, query, gallery) -> float:
    result = evaluate_retrieval(
        extract_features(model, query.images),
        query.labels,
        extract_features(model, gallery.images),
        gallery.labels,
        topk=(1,),
    )
    return result.cmc[1]


def _old_classes(dataset):
    return dataset.subset(old_class_subset(dataset.labels))


def test_new_backbone_retrieves_held_out_digits(new_model, data):
    # Measured 0.994 (seed 0); chance is ~0.1, raw pixels give 0.972.
    assert _top1(new_model, data["query"], data["gallery"]) > 0.97
    assert new_model.classes == tuple(range(10))


def test_old_backbone_is_good_on_its_classes_only(old_model, new_model, data):
    # Measured: old classes 0.989, all classes 0.836 (it never saw classes 5-9).
    old_on_old = _top1(old_model, _old_classes(data["query"]), _old_classes(data["gallery"]))
    old_on_all = _top1(old_model, data["query"], data["gallery"])
    assert old_on_old > 0.95
    assert old_on_all < _top1(new_model, data["query"], data["gallery"]) - 0.1
    assert old_model.classes == (0, 1, 2, 3, 4)
    held_out = _old_classes(data["query"])
    predicted = old_model.predict_labels(held_out.images)
    assert set(np.unique(predicted)) <= set(range(5))
    assert (predicted == held_out.labels).mean() > 0.93


def test_embedding_dims_and_28x28_input(old_model, new_model, data):
    assert extract_features(old_model, data["query"].images[:7]).shape == (7, 32)
    assert extract_features(new_model, data["query"].images[:7]).shape == (7, 64)
    big = np.kron(data["train"].images[:40], np.ones((1, 1, 3, 3), dtype=np.float32))[:, :, :28, :28]
    config = dataclasses.replace(OLD, epochs=1, embedding_dim=16)
    model = train_backbone(big, data["train"].labels[:40], config, seed=0, device="cpu")
    assert extract_features(model, big).shape == (40, 16)
    assert model.classify(torch.from_numpy(big[:3])).shape == (3, len(np.unique(data["train"].labels[:40])))


def test_normalized_embedding_option(data):
    config = dataclasses.replace(OLD, epochs=1, normalize_embedding=True)
    model = train_backbone(data["old_train"].images[:64], data["old_train"].labels[:64], config, seed=0, device="cpu")
    norms = np.linalg.norm(extract_features(model, data["query"].images[:20]), axis=1)
    assert np.allclose(norms, 1.0, atol=1e-5)


def test_same_seed_gives_identical_weights(data):
    images, labels = data["old_train"].images[:200], data["old_train"].labels[:200]
    config = dataclasses.replace(OLD, epochs=3)
    first, again = (train_backbone(images, labels, config, seed=7, device="cpu") for _ in range(2))
    other = train_backbone(images, labels, config, seed=8, device="cpu")
    state, state_again, state_other = first.state_dict(), again.state_dict(), other.state_dict()
    assert all(torch.equal(state[k], state_again[k]) for k in state)
    assert not all(torch.equal(state[k], state_other[k]) for k in state)


def test_save_load_round_trip_gives_identical_features(old_model, data, tmp_path):
    path = save_backbone(old_model, tmp_path / "old.pt")
    loaded = load_backbone(path)
    assert loaded.config == old_model.config and loaded.classes == old_model.classes
    assert np.array_equal(
        extract_features(loaded, data["query"].images), extract_features(old_model, data["query"].images)
    )


def test_damaged_or_foreign_model_files(old_model, tmp_path):
    with pytest.raises(DataUnavailableError, match="not found"):
        load_backbone(tmp_path / "missing.pt")
    good = save_backbone(old_model, tmp_path / "old.pt")
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[:2000])
    with pytest.raises(InputError, match="truncated or damaged"):
        load_backbone(truncated)
    foreign = save_checkpoint(tmp_path / "side.pt", "fctkit.side_info", {}, {})
    with pytest.raises(InputError, match=r"expected a 'fctkit.backbone' file"):
        load_backbone(foreign)
    state = old_model.state_dict()
    state.pop("classifier.bias")
    meta = {"config": dataclasses.asdict(old_model.config), "classes": list(old_model.classes), "in_channels": 1}
    with pytest.raises(InputError, match="do not fit"):
        load_backbone(save_checkpoint(tmp_path / "partial.pt", "fctkit.backbone", state, meta))
    with pytest.raises(InputError, match=r"incomplete fctkit.backbone metadata"):
        load_backbone(
            save_checkpoint(
                tmp_path / "no-classes.pt",
                "fctkit.backbone",
                old_model.state_dict(),
                {k: v for k, v in meta.items() if k != "classes"},
            )
        )
    meta["config"]["depth"] = 3
    with pytest.raises(ConfigError, match="unknown key"):
        load_backbone(save_checkpoint(tmp_path / "extra.pt", "fctkit.backbone", old_model.state_dict(), meta))


def test_bad_training_input(data):
    images, labels = data["old_train"].images[:20], data["old_train"].labels[:20]
    with pytest.raises(InputError, match=r"images\[:, None\]"):
        train_backbone(images[:, 0], labels, OLD)
    nan_images = images.copy()
    nan_images[3, 0, 2, 2] = np.nan
    with pytest.raises(InputError, match="NaN"):
        train_backbone(nan_images, labels, OLD)
    with pytest.raises(InputError, match="must match one to one"):
        train_backbone(images, labels[:-1], OLD)
    with pytest.raises(InputError, match="at least 2 classes"):
        train_backbone(images, np.zeros(20, dtype=int), OLD)
    model = Backbone(OLD, (0, 1))
    with pytest.raises(InputError, match=r"\(N, 1, H, W\)"):
        model(torch.zeros(2, 3, 8, 8))


def test_config_validation():
    assert from_mapping(BackboneConfig, {"architecture": "wide", "embedding_dim": 48}).embedding_dim == 48
    with pytest.raises(ConfigError, match="unknown key"):
        from_mapping(BackboneConfig, {"arch": "wide"})
    with pytest.raises(ConfigError, match="not one of"):
        from_mapping(BackboneConfig, {"architecture": "resnet"})
    with pytest.raises(ConfigError):
        BackboneConfig(embedding_dim=0)


def test_random_shift_moves_content_without_changing_mass():
    torch.manual_seed(0)
    x = torch.zeros(64, 1, 8, 8)
    x[:, :, 3:5, 3:5] = 1.0
    shifted = random_shift(x, 1)
    assert torch.equal(shifted.sum(dim=(1, 2, 3)), x.sum(dim=(1, 2, 3)))
    assert not torch.equal(shifted, x)
    assert torch.equal(random_shift(x, 0), x)


def test_device_selection():
    assert resolve_device("cpu").type == "cpu"
    with pytest.raises(ConfigError, match="unknown device"):
        resolve_device("tpu")
    if torch.cuda.is_available():
        assert resolve_device("auto").type == "cuda"
    else:
        assert resolve_device("auto").type == "cpu"
        with pytest.raises(ConfigError, match="no CUDA device"):
            resolve_device("cuda")

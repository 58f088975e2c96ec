"""The backbones' cosine (normalised-softmax) classifier option, on digits."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fctkit.config import from_mapping
from fctkit.errors import ConfigError
from fctkit.trainer.backbones import (
    BackboneConfig,
    CosineClassifier,
    extract_features,
    load_backbone,
    save_backbone,
    train_backbone,
)
from fctkit.trainer.datasets import load_dataset, make_splits, old_class_subset
from fctkit.trainer.evaluation import evaluate_retrieval
from tests.support.seeds import seed

COSINE = BackboneConfig(
    architecture="small", embedding_dim=32, classifier="cosine", normalize_embedding=True, progress=False
)


def test_cosine_logits_are_scaled_cosines():
    torch.manual_seed(0)
    head = CosineClassifier(dim=6, n_classes=4, scale=10.0)
    x = torch.randn(5, 6)
    expected = 10.0 * (x / x.norm(dim=1, keepdim=True)) @ (head.weight / head.weight.norm(dim=1, keepdim=True)).T
    assert torch.allclose(head(x), expected, atol=1e-6)
    assert torch.allclose(head(3.0 * x), head(x), atol=1e-5)  # depends on directions only
    assert head(x).abs().max() <= 10.0 + 1e-5
    assert not hasattr(head, "bias") or head.bias is None


@pytest.fixture(scope="module")
def digits_old():
    digits = load_dataset("digits")
    splits = make_splits(digits.labels, seed=seed())
    train, query, gallery = (digits.subset(index) for index in (splits.train, splits.query, splits.gallery))
    return tuple(d.subset(old_class_subset(d.labels)) for d in (train, query, gallery))


def test_cosine_backbone_trains_saves_and_loads(digits_old, tmp_path):
    train, query, gallery = digits_old
    model = train_backbone(train.images, train.labels, COSINE, seed=seed(), device="cpu")
    assert isinstance(model.classifier, CosineClassifier)
    # Measured 0.99+ on the old classes (seed 0); an untrained encoder is far lower.
    predicted = model.predict_labels(query.images)
    assert (predicted == query.labels).mean() > 0.93
    features = extract_features(model, query.images)
    assert np.allclose(np.linalg.norm(features, axis=1), 1.0, atol=1e-5)
    top1 = evaluate_retrieval(
        features, query.labels, extract_features(model, gallery.images), gallery.labels, topk=(1,)
    ).top1
    assert top1 > 0.93
    loaded = load_backbone(save_backbone(model, tmp_path / "cosine.pt"))
    assert loaded.config.classifier == "cosine" and isinstance(loaded.classifier, CosineClassifier)
    assert np.array_equal(loaded.predict_labels(query.images), predicted)


def test_classifier_config_validation():
    assert from_mapping(BackboneConfig, {"classifier": "cosine", "classifier_scale": 8.0}).classifier_scale == 8.0
    with pytest.raises(ConfigError, match=r"not one of|classifier must be"):
        from_mapping(BackboneConfig, {"classifier": "arcface"})
    with pytest.raises(ConfigError, match="classifier_scale"):
        BackboneConfig(classifier_scale=0.0)

"""`fctkit train-compatible`'s evaluation protocols ("trained" vs "held-out" classes) and the
CoReS + HOC loss, on small synthetic inputs (no training)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from fctkit.config import from_mapping
from fctkit.errors import ConfigError
from fctkit.trainer.backbones import BackboneConfig
from fctkit.trainer.compatible_config import CompatibleConfig
from fctkit.trainer.compatible_losses import hoc_loss
from fctkit.trainer.compatible_models import cores_backbone
from fctkit.trainer.compatible_sequence import SequenceRun


def _run(tmp_path, evaluation_classes: str, counts: tuple[int, ...]) -> SequenceRun:
    rng = np.random.default_rng(0)
    labels = np.tile(np.arange(10), 6)  # six items per class: four train, two evaluation
    train, evaluation = np.arange(40), np.arange(40, 60)
    config = from_mapping(CompatibleConfig, {"evaluation_classes": evaluation_classes, "upgrade": list(counts)})
    images = rng.normal(size=(len(labels), 1, 8, 8)).astype(np.float32)
    return SequenceRun(config, "upgrade", counts, images, labels, train, evaluation, 10, tmp_path, log=lambda _: None)


def test_trained_protocol_evaluates_the_last_versions_classes(tmp_path):
    run = _run(tmp_path, "trained", (3, 6))
    assert set(run.labels[run.eval_index]) == set(range(6))
    assert set(run.labels[run.train]) == set(range(6))


def test_held_out_protocol_evaluates_only_classes_no_version_trains_on(tmp_path):
    run = _run(tmp_path, "held-out", (3, 6))
    assert set(run.labels[run.eval_index]) == {6, 7, 8, 9}
    assert set(run.labels[run.train]) == set(range(6))
    assert not set(run.labels[run.eval_index]) & set(run.labels[np.concatenate(run.version_items)])


def test_held_out_protocol_needs_classes_left_out(tmp_path):
    with pytest.raises(ConfigError, match="fewer than 2 evaluation classes"):
        _run(tmp_path, "held-out", (5, 10))
    with pytest.raises(ConfigError, match="evaluation_classes"):
        from_mapping(CompatibleConfig, {"evaluation_classes": "unseen"})
    with pytest.raises(ConfigError, match="hoc_weight"):
        from_mapping(CompatibleConfig, {"cores": {"hoc_weight": 1.5}})


def _reference_hoc(
    new: torch.Tensor,
    old: torch.Tensor,
    logits_ce: torch.Tensor,
    targets: torch.Tensor,
    labels: torch.Tensor,
    weight: float,
    scale: float,
) -> torch.Tensor:
    """The loss written out per anchor: -log(e^{s·cos(old_i, new_i)} / Σ_{j: j = i or y_j ≠ y_i} e^{s·cos(old_i, new_j)})."""
    old, new = F.normalize(old, dim=1), F.normalize(new, dim=1)
    terms = []
    for i in range(len(labels)):
        allowed = [j for j in range(len(labels)) if j == i or labels[j] != labels[i]]
        sims = torch.stack([scale * old[i] @ new[j] for j in allowed])
        terms.append(-(scale * old[i] @ new[i]) + torch.logsumexp(sims, 0))
    return (1 - weight) * F.cross_entropy(logits_ce, targets) + weight * torch.stack(terms).mean()


def test_hoc_loss_matches_the_written_out_infonce_and_ignores_same_class_pairs():
    torch.manual_seed(0)
    config = BackboneConfig(architecture="small", width=4)
    previous, net = cores_backbone(config, 7, 1), cores_backbone(config, 7, 1)
    x = torch.randn(8, 1, 8, 8)
    labels = torch.tensor([0, 0, 1, 1, 2, 2, 3, 4])
    loss = hoc_loss(previous.eval(), weight=0.9, scale=10.0)
    value = loss(net, x, labels, labels)
    features = net.encoder.features(x)
    with torch.no_grad():
        old = previous.encoder.features(x)
    expected = _reference_hoc(features, old, net.classifier(features), labels, labels, 0.9, 10.0)
    torch.testing.assert_close(value, expected)

    # only the new net learns: the previous version gets no gradient
    value.backward()
    assert all(p.grad is None for p in previous.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in net.parameters())
    # weight 0: the plain CoReS cross-entropy through the fixed simplex
    torch.testing.assert_close(
        hoc_loss(previous, 0.0, 10.0)(net, x, labels, labels), F.cross_entropy(net.classify(x), labels)
    )


def test_first_version_items_makes_a_data_growth_upgrade(tmp_path):
    with pytest.raises(ConfigError, match="strictly growing"):
        from_mapping(CompatibleConfig, {"upgrade": [6, 6]})
    with pytest.raises(ConfigError, match="first_version_items"):
        from_mapping(CompatibleConfig, {"first_version_items": 0.0})
    with pytest.raises(ConfigError, match="strictly growing"):  # only the first step may keep the classes
        from_mapping(CompatibleConfig, {"first_version_items": 0.5, "sequence": [4, 6, 6]})
    rng = np.random.default_rng(0)
    labels = np.tile(np.arange(10), 20)
    config = from_mapping(
        CompatibleConfig, {"upgrade": [10, 10], "first_version_items": 0.25, "evaluation_classes": "trained"}
    )
    run = SequenceRun(
        config,
        "upgrade",
        (10, 10),
        rng.normal(size=(200, 1, 8, 8)),
        labels,
        np.arange(150),
        np.arange(150, 200),
        10,
        tmp_path,
        log=lambda _: None,
    )
    first, second = run.version_items
    assert set(first) < set(second) and set(second) == set(range(150))
    assert all(np.sum(labels[first] == c) == round(0.25 * 15) for c in range(10))  # stratified
    assert set(run.labels[run.eval_index]) == set(range(10))


def test_first_version_items_too_small_for_a_class_is_a_config_error(tmp_path):
    labels = np.tile(np.arange(10), 20)
    config = from_mapping(CompatibleConfig, {"upgrade": [10, 10], "first_version_items": 0.05})
    with pytest.raises(ConfigError, match="fewer than 2 images of some class"):
        SequenceRun(
            config,
            "upgrade",
            (10, 10),
            np.zeros((200, 1, 8, 8)),
            labels,
            np.arange(150),
            np.arange(150, 200),
            10,
            tmp_path,
            log=lambda _: None,
        )

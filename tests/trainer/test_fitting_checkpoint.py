"""A training run killed mid-way resumes from its epoch checkpoint and ends with the weights an
uninterrupted run gives (trainer.fitting.fit's ``checkpoint``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fctkit.errors import ConfigError, InputError
from fctkit.trainer.backbones import BackboneConfig, train_backbone
from fctkit.trainer.fitting import TrainConfig, fit


class Stop(Exception):
    pass


def _data(n: int = 96):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((n, 6)).astype(np.float32)
    return x, (x @ rng.standard_normal((6, 2))).astype(np.float32)


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(
        torch.nn.Linear(6, 16), torch.nn.BatchNorm1d(16), torch.nn.ReLU(), torch.nn.Linear(16, 2)
    )


def _loss(model, x, y):
    noise = 0.01 * torch.randn_like(x)  # draws from the global generator, as augmentations do
    return torch.nn.functional.mse_loss(model(x + noise), y)


def _stop_at(epoch: int):
    def hook(model, current):
        if current == epoch:
            raise Stop

    return hook


def test_a_killed_fit_resumes_and_ends_with_the_uninterrupted_weights(tmp_path):
    x, y = _data()
    config = TrainConfig(epochs=6, batch_size=16, warmup_epochs=2, seed=3, device="cpu", progress=False)
    reference = _model()
    expected = fit(reference, [x, y], _loss, config)
    checkpoint = tmp_path / "run.checkpoint"
    model = _model()
    with pytest.raises(Stop):
        fit(model, [x, y], _loss, config, checkpoint=checkpoint, on_epoch_start=_stop_at(4))
    assert checkpoint.is_file()
    resumed = _model(seed=99)  # a fresh process: other initial weights, other global RNG state
    history = fit(resumed, [x, y], _loss, config, checkpoint=checkpoint)
    assert history.train_loss == expected.train_loss and history.best_epoch == expected.best_epoch
    for a, b in zip(resumed.state_dict().values(), reference.state_dict().values(), strict=True):
        assert torch.equal(a, b)
    assert not checkpoint.exists()  # done: nothing left behind


def test_a_checkpoint_of_other_settings_or_a_damaged_one_is_refused(tmp_path):
    x, y = _data()
    config = TrainConfig(epochs=4, batch_size=16, seed=1, device="cpu", progress=False)
    checkpoint = tmp_path / "run.checkpoint"
    with pytest.raises(Stop):
        fit(_model(), [x, y], _loss, config, checkpoint=checkpoint, on_epoch_start=_stop_at(2))
    with pytest.raises(ConfigError, match=r"other settings or data.*delete it"):
        fit(
            _model(),
            [x, y],
            _loss,
            TrainConfig(epochs=4, batch_size=16, seed=2, device="cpu", progress=False),
            checkpoint=checkpoint,
        )
    checkpoint.write_bytes(checkpoint.read_bytes()[:100])
    with pytest.raises(InputError, match=r"cannot be read.*delete it"):
        fit(_model(), [x, y], _loss, config, checkpoint=checkpoint)


def test_train_backbone_takes_a_checkpoint(tmp_path):
    rng = np.random.default_rng(2)
    images = rng.random((64, 1, 8, 8), dtype=np.float32)
    labels = np.arange(64) % 2
    config = BackboneConfig(architecture="small", embedding_dim=4, epochs=2, warmup_epochs=0, batch_size=16)
    plain = train_backbone(images, labels, config, seed=0, device="cpu")
    checkpointed = train_backbone(images, labels, config, seed=0, device="cpu", checkpoint=tmp_path / "b.checkpoint")
    assert all(
        torch.equal(a, b) for a, b in zip(plain.state_dict().values(), checkpointed.state_dict().values(), strict=True)
    )
    assert not (tmp_path / "b.checkpoint").exists()

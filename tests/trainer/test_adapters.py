"""FCT and FastFill adapters; save/load of every adapter kind; input validation."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import spearmanr

from fctkit.errors import ConfigError, DataUnavailableError, InputError
from fctkit.trainer.adapter_base import Adapter, adapter_kinds, load_adapter
from fctkit.trainer.adapters import FastFillAdapter, FCTAdapter
from fctkit.trainer.closed_form import ClosedFormAdapter
from fctkit.trainer.evaluation import evaluate_retrieval
from fctkit.trainer.lambda_orth import LambdaOrthAdapter
from fctkit.trainer.losses import heteroscedastic_mse
from fctkit.trainer.query_map import QueryMap, fit_jointly
from fctkit.trainer.residual import ResidualAdapter
from tests.support.seeds import seed as suite_seed


def small_config(
    side_info: bool = True, epochs: int = 15, seed: int | None = None, mixer_width: int = 128, **extra
) -> dict:
    train = {
        "epochs": epochs,
        "batch_size": 64,
        "warmup_epochs": 1,
        "lr": 1e-3,
        "seed": suite_seed() if seed is None else seed,
        "device": "cpu",
        "progress": False,
    }
    return {"side_info": side_info, "branch_width": 64, "mixer_width": mixer_width, "train": train, **extra}


def two_factor_data(n: int = 1200, seed: int = 1) -> dict[str, np.ndarray]:
    """old sees factor z1 only, side-info sees z2 only, the new embedding depends on both."""
    rng = np.random.default_rng(seed)
    z1, z2 = rng.normal(size=(n, 8)), rng.normal(size=(n, 8))
    old = np.tanh(z1 @ rng.normal(size=(8, 16)))
    side = z2 @ rng.normal(size=(8, 8))
    new = np.maximum(np.hstack([z1, z2]) @ rng.normal(size=(16, 24)), 0.0)
    return {k: v.astype(np.float32) for k, v in {"old": old, "side": side, "new": new}.items()}


def test_fct_learns_a_nonlinear_map_far_better_than_chance(digits_views):
    d = digits_views
    adapter, history = FCTAdapter.fit(d.old[d.train], d.new[d.train], config=small_config(side_info=False))
    adapted = adapter.transform(d.old[d.test])
    new = d.new[d.test]
    r2 = 1.0 - ((adapted - new) ** 2).sum() / ((new - new.mean(0)) ** 2).sum()
    top1 = evaluate_retrieval(new, d.labels[d.test], adapted, d.labels[d.test], leave_one_out=True).top1
    assert r2 > 0.5
    assert top1 > 0.6  # chance is ~0.1 with 10 balanced classes
    assert history.train_loss[-1] < history.train_loss[0]


def test_batchnorm_statistics_are_frozen_from_half_way():
    data = two_factor_data(n=300)
    snapshots: list[torch.Tensor] = []

    def record(model, epoch):
        snapshots.append(model.old_branch[1].running_mean.clone())

    adapter, _ = FCTAdapter.fit(data["old"], data["new"], data["side"], small_config(epochs=6), on_epoch_start=record)
    final = adapter.old_branch[1].running_mean
    # epochs 0-2 update the statistics, from epoch 3 (= 6 / 2) on they stay put
    assert not torch.equal(snapshots[1], snapshots[2])
    assert not torch.equal(snapshots[2], snapshots[3])
    for later in snapshots[4:]:
        assert torch.equal(later, snapshots[3])
    assert torch.equal(final, snapshots[3])
    assert adapter.batchnorm_frozen and not adapter.training


def test_side_info_helps_when_it_carries_what_the_old_embedding_lacks():
    data = two_factor_data()
    train, test = slice(0, 1000), slice(1000, None)
    errors = {}
    for side_info in (True, False):
        config = small_config(side_info, mixer_width=256)
        adapter, _ = FCTAdapter.fit(data["old"][train], data["new"][train], data["side"][train], config)
        errors[side_info] = float(
            ((adapter.transform(data["old"][test], data["side"][test]) - data["new"][test]) ** 2).mean()
        )
    assert errors[True] < 0.6 * errors[False]


def test_without_side_info_the_model_has_only_the_old_branch():
    data = two_factor_data(n=200)
    adapter, _ = FCTAdapter.fit(data["old"], data["new"], data["side"], small_config(side_info=False, epochs=2))
    assert adapter.side_branch is None and adapter.d_side == 0
    assert adapter.input_names == ("old",) and adapter.input_dims == {"old": 16}
    assert adapter.mixer[0].in_features == 64  # branch width, not 2x
    np.testing.assert_array_equal(adapter.transform(data["old"]), adapter.transform(data["old"], data["side"]))
    with pytest.raises(InputError, match="no side-info input"):
        adapter(torch.zeros(2, 16), torch.zeros(2, 8))
    assert adapter(torch.zeros(2, 16), torch.zeros(2, 0)).shape == (2, 24)
    with_side, _ = FCTAdapter.fit(data["old"], data["new"], data["side"], small_config(epochs=1))
    assert with_side.input_names == ("old", "side") and with_side.mixer[0].in_features == 128
    empty_side, _ = FCTAdapter.fit(data["old"], data["new"], data["side"][:, :0], small_config(epochs=1))
    assert empty_side.side_branch is None and empty_side.input_names == ("old",)


def test_g_maps_to_the_new_side_info_space():
    data = two_factor_data(n=200)
    new_side = data["side"][:, :5] * 2.0
    g, _ = FCTAdapter.fit(data["old"], new_side, data["side"], small_config(epochs=2))
    assert g.transform(data["old"], data["side"]).shape == (200, 5)
    assert g.dims() == {"d_old": 16, "d_side": 8, "d_out": 5}


def test_same_seed_gives_identical_weights_and_another_seed_does_not():
    data = two_factor_data(n=200)
    runs = [
        FCTAdapter.fit(data["old"], data["new"], data["side"], small_config(epochs=2, seed=s))[0] for s in (3, 3, 4)
    ]
    weights = [r.head.weight.detach() for r in runs]
    assert torch.equal(weights[0], weights[1])
    assert not torch.allclose(weights[0], weights[2])


def heteroscedastic_data(n: int = 1200, seed: int = 2) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(n, 8))
    noise_scale = np.exp(x[:, 0])  # the noise of the target grows with the first input coordinate
    target = np.tanh(x @ rng.normal(size=(8, 16))) + 0.3 * noise_scale[:, None] * rng.normal(size=(n, 16))
    return x.astype(np.float32), target.astype(np.float32), noise_scale


def test_fastfill_sigma_follows_the_actual_error():
    x, target, noise_scale = heteroscedastic_data(n=800)
    train, test = slice(0, 600), slice(600, None)
    adapter, _ = FastFillAdapter.fit(x[train], target[train], config=small_config(side_info=False, epochs=10))
    sigma = adapter.uncertainty(x[test])
    error = ((adapter.transform(x[test]) - target[test]) ** 2).sum(axis=1)
    assert sigma.shape == (200,) and (sigma > 0).all()
    assert spearmanr(sigma, error).statistic > 0.4
    assert spearmanr(sigma, noise_scale[test]).statistic > 0.6
    assert not adapter.training  # computing σ leaves the adapter in eval mode


def test_heteroscedastic_loss_is_minimal_where_sigma_squared_is_the_row_mse():
    torch.manual_seed(0)
    prediction, target = torch.randn(5, 7), torch.randn(5, 7)
    row_mse = (prediction - target).pow(2).mean(dim=1)
    log_variance = torch.log(row_mse).requires_grad_()
    heteroscedastic_mse(prediction, target, log_variance).backward()
    assert log_variance.grad.abs().max() < 1e-6
    for shift in (-0.3, 0.3):
        assert heteroscedastic_mse(prediction, target, log_variance.detach() + shift) > heteroscedastic_mse(
            prediction, target, log_variance.detach()
        )


def test_fastfill_discriminative_term_uses_the_frozen_classifier(digits_views):
    d = digits_views
    torch.manual_seed(0)
    classifier = torch.nn.Linear(d.new.shape[1], 10)
    before = classifier.weight.detach().clone()
    rows = d.train[:600]
    old, new, labels = d.old[rows], d.new[rows], d.labels[rows]
    config = small_config(side_info=False, epochs=6, discriminative_weight=1.0)
    with_term, _ = FastFillAdapter.fit(old, new, config=config, classifier=classifier, labels=labels)
    without, _ = FastFillAdapter.fit(old, new, config=config)
    assert torch.equal(classifier.weight, before) and classifier.weight.requires_grad and classifier.training

    @torch.no_grad()
    def cross_entropy(adapter: FastFillAdapter) -> float:
        logits = classifier(torch.from_numpy(adapter.transform(old)))
        return float(torch.nn.functional.cross_entropy(logits, torch.from_numpy(labels)))

    assert cross_entropy(with_term) < cross_entropy(without) - 0.1
    with pytest.raises(InputError, match="both classifier= and labels="):
        FastFillAdapter.fit(old, new, config=config, classifier=classifier)


def fitted_adapters() -> dict[str, Adapter]:
    data = two_factor_data(n=160)
    old, new, side = data["old"], data["new"], data["side"]
    labels = (np.arange(160) % 4).astype(np.int64)
    lambda_train = {"epochs": 2, "batch_size": 32, "progress": False, "device": "cpu"}
    return {
        "fct": FCTAdapter.fit(old, new, side, small_config(epochs=2))[0],
        "fct-no-side": FCTAdapter.fit(old, new, None, small_config(side_info=False, epochs=2))[0],
        "fastfill": FastFillAdapter.fit(old, new, side, small_config(epochs=2))[0],
        "lambda-orth-orthogonal-mlp": LambdaOrthAdapter.fit(
            old, new, labels, {"forward": "mlp", "hidden_width": 32, "train": lambda_train}
        )[0],
        "lambda-orth-lambda": LambdaOrthAdapter.fit(
            old, new, None, {"backward": "lambda", "lam": 0.0, "train": lambda_train}
        )[0],
        "closed-form-ls": ClosedFormAdapter.fit(old, new, {"ridge": 0.1})[0],
        "closed-form-procrustes": ClosedFormAdapter.fit(old, new, {"method": "procrustes"})[0],
        **{
            f"residual-{form}": ResidualAdapter.fit(
                old, new, side, {"form": form, "width": 16, "rank": 4, "train": lambda_train}
            )[0]
            for form in ("linear", "low_rank", "mlp")
        },
        "query-map": fit_jointly(
            ResidualAdapter.fit(old, new, None, {"side_info": False, "train": lambda_train})[0],
            new,
            old,
            None,
            new,
            {"width": 8, "train": lambda_train},
        )[0],
    }


def outputs_of(adapter: Adapter, data: dict[str, np.ndarray]) -> list[np.ndarray]:
    if isinstance(adapter, FastFillAdapter):
        return [adapter.transform(data["old"], data["side"]), adapter.uncertainty(data["old"], data["side"])]
    if isinstance(adapter, FCTAdapter):
        return [adapter.transform(data["old"], data["side"])]
    if isinstance(adapter, LambdaOrthAdapter):
        return [adapter.transform(data["old"]), adapter.transform_new(data["new"])]
    if isinstance(adapter, ResidualAdapter):
        return [adapter.transform(data["old"], data["side"] if adapter.d_side else None)]
    if isinstance(adapter, QueryMap):
        return [adapter.transform(data["new"])]
    return [adapter.transform(data["old"])]


def test_save_load_round_trip_gives_identical_outputs_for_every_kind(tmp_path):
    data = two_factor_data(n=50, seed=9)
    adapters = fitted_adapters()
    assert {type(a).kind for a in adapters.values()} == set(adapter_kinds())
    for name, adapter in adapters.items():
        path = adapter.save(tmp_path / f"{name}.pt")
        loaded = load_adapter(path)
        assert type(loaded) is type(adapter) and loaded.config == adapter.config
        assert loaded.dims() == adapter.dims() and loaded.metrics == adapter.metrics
        for before, after in zip(outputs_of(adapter, data), outputs_of(loaded, data)):
            np.testing.assert_array_equal(before, after)
        assert isinstance(type(adapter).load(path), type(adapter))


def test_loading_bad_files_raises_kit_errors(tmp_path):
    adapter = ClosedFormAdapter.fit(np.eye(4, dtype=np.float32), np.eye(4, dtype=np.float32))[0]
    good = adapter.save(tmp_path / "good.pt")
    truncated = tmp_path / "truncated.pt"
    truncated.write_bytes(good.read_bytes()[:200])
    foreign = tmp_path / "foreign.pt"
    torch.save({"weights": torch.zeros(3)}, foreign)
    for path, message in [(truncated, "not a readable"), (foreign, "expected a 'fctkit.adapter' file")]:
        with pytest.raises(InputError, match=message):
            load_adapter(path)
    with pytest.raises(DataUnavailableError, match="not found"):
        load_adapter(tmp_path / "missing.pt")
    with pytest.raises(InputError, match="holds a 'closed_form' adapter"):
        FCTAdapter.load(good)
    for key, value, message in [
        ("dims", {"d_old": 4, "d_new": 5}, "do not fit"),
        ("adapter_kind", "nope", "unknown adapter kind"),
        ("config", {"method": "qr"}, "does not match"),
    ]:
        payload = torch.load(good, weights_only=True)
        payload["meta"][key] = value
        torch.save(payload, tmp_path / "tampered.pt")
        with pytest.raises(InputError, match=message):
            load_adapter(tmp_path / "tampered.pt")


def test_bad_inputs_raise_input_error():
    data = two_factor_data(n=100)
    old, new, side = data["old"], data["new"], data["side"]
    bad_old = old.copy()
    bad_old[3, 2] = np.nan
    config = small_config(epochs=1)
    cases = [
        (lambda: FCTAdapter.fit(bad_old, new, side, config), "NaN"),
        (lambda: FCTAdapter.fit(old, new[:50], side, config), "rows must be aligned"),
        (lambda: FCTAdapter.fit(old, new, None, config), "no side-info features"),
        (lambda: FCTAdapter.fit(old[0], new, side, config), "2-D"),
        (lambda: FCTAdapter.fit(old[:0], new[:0], side[:0], config), "empty"),
    ]
    for call, message in cases:
        with pytest.raises(InputError, match=message):
            call()
    adapter, _ = FCTAdapter.fit(old, new, side, config)
    with pytest.raises(InputError, match="expected 16 dims"):
        adapter.transform(old[:, :10], side)
    with pytest.raises(InputError, match="side: features are missing"):
        adapter.transform(old)
    with pytest.raises(ConfigError, match="unknown key"):
        FCTAdapter.fit(old, new, side, {**config, "mixer_widht": 3})


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (TrainConfig.device = 'cuda')")
def test_adapters_train_on_cuda_and_load_back_on_cpu(tmp_path):
    data = two_factor_data(n=300)
    cuda_train = {"epochs": 2, "batch_size": 64, "device": "cuda", "progress": False}
    fitted = [
        FCTAdapter.fit(data["old"], data["new"], data["side"], {**small_config(), "train": cuda_train})[0],
        FastFillAdapter.fit(data["old"], data["new"], data["side"], {**small_config(), "train": cuda_train})[0],
        LambdaOrthAdapter.fit(data["old"], data["new"], None, {"forward": "mlp", "train": cuda_train})[0],
    ]
    for index, adapter in enumerate(fitted):
        assert adapter.device.type == "cuda"
        on_cpu = load_adapter(adapter.save(tmp_path / f"{index}.pt"))
        assert on_cpu.device.type == "cpu"
        for gpu_output, cpu_output in zip(outputs_of(adapter, data), outputs_of(on_cpu, data)):
            np.testing.assert_allclose(gpu_output, cpu_output, rtol=1e-4, atol=1e-4)

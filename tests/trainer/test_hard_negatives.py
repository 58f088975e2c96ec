"""The query-positives training's optional terms: mined hard negatives (old-model neighbours of
each pair's positive, ranked below it) and the KL towards the new model's ranking of the batch."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fctkit.errors import ConfigError
from fctkit.trainer import synthetic_instance_task
from fctkit.trainer.fitting import TrainConfig
from fctkit.trainer.losses import info_nce, info_nce_with_negatives, neighbourhood_kl
from fctkit.trainer.query_map import MinedNegatives, QueryPositivesConfig, fit_jointly
from fctkit.trainer.residual import ResidualAdapter
from tests.support.seeds import seed


def test_masked_negatives_change_nothing_and_a_negative_like_the_positive_costs():
    generator = torch.Generator().manual_seed(seed())
    query, candidates, extra = (torch.randn(8, 16, generator=generator) for _ in range(3))
    none_valid = torch.zeros(8, 8, dtype=torch.bool)
    assert torch.allclose(
        info_nce_with_negatives(query, candidates, extra, none_valid, 0.1), info_nce(query, candidates, 0.1)
    )
    copies = candidates.clone()  # each query's own positive offered again as a "negative"
    all_valid = torch.ones(8, 8, dtype=torch.bool)
    assert info_nce_with_negatives(query, candidates, copies, all_valid, 0.1) > info_nce(query, candidates, 0.1) + 0.1


def test_the_neighbourhood_kl_is_zero_only_when_the_rankings_agree():
    generator = torch.Generator().manual_seed(seed())
    query, teacher = torch.randn(8, 16, generator=generator), torch.randn(8, 16, generator=generator)
    assert neighbourhood_kl(query, teacher, teacher, 0.05).abs() < 1e-6
    assert neighbourhood_kl(query, 2 * teacher, teacher, 0.05).abs() < 1e-6  # cosine: scale does not matter
    assert neighbourhood_kl(query, torch.randn(8, 16, generator=generator), teacher, 0.05) > 0.1


def test_mined_negatives_are_the_nearest_other_rows_by_the_old_model():
    rows = np.random.default_rng(seed()).standard_normal((50, 6))
    mined = MinedNegatives.nearest(rows, None, np.array([3, 7, 3]), 4)
    unit = rows / np.linalg.norm(rows, axis=1, keepdims=True)
    for pair, item in enumerate([3, 7, 3]):
        cosines = unit @ unit[item]
        cosines[item] = -np.inf
        assert set(mined.rows[pair]) == set(np.argsort(-cosines)[:4])
    assert mined.positive.tolist() == [3, 7, 3]


def test_training_with_hard_negatives_and_distillation_runs_and_moves_the_adapter():
    task = synthetic_instance_task(n_train=600, n_eval=100, seed=seed(), query_view=0.5)
    train = task.train
    items = train.positives.indices
    fitted = {}
    for name, options in {"plain": {}, "mined": {"hard_negatives": 4, "distill_weight": 1.0}}.items():
        torch.manual_seed(seed())
        adapter, _ = ResidualAdapter.fit(
            train.gallery.old,
            train.gallery.new,
            None,
            {"side_info": False, "train": {"progress": False, "device": "cpu", "epochs": 2, "seed": seed()}},
        )
        config = QueryPositivesConfig(train=TrainConfig(epochs=2, progress=False, device="cpu", seed=seed()), **options)
        negatives = MinedNegatives.nearest(train.gallery.old, None, items, 4) if options else None
        fit_jointly(
            adapter, train.query.new, train.gallery.old[items], None, train.gallery.new[items], config, negatives
        )
        fitted[name] = adapter.transform(task.evaluation.gallery.old)
    assert np.isfinite(fitted["mined"]).all() and not np.allclose(fitted["plain"], fitted["mined"], atol=1e-4)


def test_the_options_are_checked():
    with pytest.raises(ConfigError, match="hard_negatives and distill_weight must be >= 0"):
        QueryPositivesConfig(hard_negatives=-1)
    with pytest.raises(ConfigError, match="hard_negatives and distill_weight must be >= 0"):
        QueryPositivesConfig(distill_weight=-0.5)

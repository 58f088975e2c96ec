"""CoReS's ECC selection validates on training items that no version trains on."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from fctkit.errors import ConfigError
from fctkit.trainer.compatible_config import load_compatible_config
from fctkit.trainer.compatible_sequence import SequenceRun
from fctkit.trainer.run_data import load_image_splits


def _run(tmp_path: Path, **overrides) -> SequenceRun:
    config = load_compatible_config("configs/digits-compatible.toml", {"progress": False, "device": "cpu", **overrides})
    splits = load_image_splits(config)
    return SequenceRun(
        config,
        "upgrade",
        config.upgrade,
        splits.images,
        splits.labels,
        splits.train,
        splits.evaluation,
        splits.n_classes,
        tmp_path,
        lambda _: None,
    )


def test_validation_items_are_held_out_of_every_version(tmp_path):
    run = _run(tmp_path)
    held_out = run._cores_validation_items()
    assert set(held_out.tolist()) <= set(run.train.tolist())
    assert len(held_out) == round(0.1 * len(run.version_items[-1]))
    assert not set(held_out.tolist()) & set(run.eval_index.tolist())
    for items in run.version_items:  # every version has validation images of each of its classes
        val = items[np.isin(items, held_out)]
        assert set(run.labels[val].tolist()) == set(run.labels[items].tolist())
    np.testing.assert_array_equal(held_out, _run(tmp_path)._cores_validation_items())  # seeded


def test_no_validation_split_is_a_config_error(tmp_path):
    with pytest.raises(ConfigError, match="val_fraction"):
        _run(tmp_path, **{"old_backbone.val_fraction": 0.0})._cores_validation_items()
    assert len(_run(tmp_path, **{"cores.ecc_selection": False})._cores_validation_items()) == 0

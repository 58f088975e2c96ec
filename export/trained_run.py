"""A ``fctkit train`` output folder as export reads it: config, gate, saved features and models.

The folder's JSON and ``.npz`` files are read with errors that say how to repair the run
(train it again); :func:`read_run_json` serves every run folder export reads, including a
``fctkit train-compatible`` one.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, Literal, cast

import numpy as np

from fctkit.errors import DataUnavailableError, InputError

CHAIN_VERSIONS = 3


@dataclass(frozen=True)
class TrainedRun:
    """A ``fctkit train`` output folder, read lazily: config, gate, features, models."""

    root: Path

    @classmethod
    def open(cls, run_dir: str | os.PathLike[str]) -> TrainedRun:
        root = Path(run_dir)
        for name in ("config.json", "gate.json", "features/eval.npz"):
            if not (root / name).is_file():
                raise DataUnavailableError(
                    f"{root} is not a complete `fctkit train` run: {name} is missing; run "
                    f"`fctkit train --config CONFIG --out {root}` first"
                )
        return cls(root)

    @cached_property
    def config(self) -> Any:
        """The run's :class:`~fctkit.trainer.pipeline_config.PipelineConfig` (from config.json)."""
        from fctkit.config import from_mapping
        from fctkit.trainer.pipeline_config import PipelineConfig

        return from_mapping(PipelineConfig, read_run_json(self.root / "config.json"), where=f"{self.root}/config.json")

    @cached_property
    def gate(self) -> dict[str, Any]:
        return read_run_json(self.root / "gate.json")

    @property
    def features_mode(self) -> bool:
        """Trained on pre-extracted features (a task or a features file): no backbones of its own."""
        return self.config.data.name in ("features", "task")

    @property
    def distance(self) -> Literal["l2", "cosine"]:
        return cast(Literal["l2", "cosine"], self.config.evaluation.distance)  # validated by the run's config

    @cached_property
    def eval_features(self) -> dict[str, np.ndarray]:
        """``old``, ``side``, ``new`` and (class-level runs) ``labels`` of the evaluation gallery."""
        return _read_run_npz(self.root / "features" / "eval.npz", ("old", "side", "new"), optional=("labels",))

    @cached_property
    def chain_features(self) -> dict[str, np.ndarray]:
        """``v{v}_embedding``, ``v{v}_side`` (v = 1..3) and ``labels`` of the evaluation split."""
        keys = ("labels", *(f"v{v}_{kind}" for v in range(1, CHAIN_VERSIONS + 1) for kind in ("embedding", "side")))
        return _read_run_npz(self.root / "features" / "chain_eval.npz", keys)

    @cached_property
    def eval_images(self) -> np.ndarray:
        """The evaluation split's images, rebuilt deterministically from the run's config."""
        if self.config.data.name == "features":
            raise InputError(
                f"{self.root} was trained on pre-extracted features: it has no backbones to put in a bundle's "
                "embed role; export needs a run on image data (digits, fashion-mnist)"
            )
        from fctkit.trainer.run_data import load_image_splits

        splits = load_image_splits(self.config)
        labels = splits.labels[splits.evaluation]
        if not np.array_equal(labels, self.eval_features["labels"]):
            raise InputError(
                f"{self.root}: the evaluation split rebuilt from config.json does not match features/eval.npz "
                "(the dataset or the split code changed since the run); train the run again"
            )
        return cast(np.ndarray, splits.images[splits.evaluation])

    def load(self, relative: str) -> Any:
        """A saved model or adapter (``models/….pt`` or ``adapters/….pt``) on the CPU."""
        from fctkit.trainer import load_adapter, load_backbone, load_side_info

        path = self.root / relative
        if not path.is_file():
            raise DataUnavailableError(
                f"{path} is missing: this run did not train it (check its config) or is incomplete"
            )
        if relative.startswith("adapters/"):
            return load_adapter(path)
        return load_side_info(path) if relative.endswith("side_info.pt") else load_backbone(path)

    def variant(self, key: str, forward_transform: Any = None) -> Any:
        """The run's variant ``key`` (``residual+query-positives+hubness+transition``, …) as the
        trainer judged it — :class:`~fctkit.trainer.searches.Transition`, ``Hubness``,
        ``WithQueryMap`` or the adapter — rebuilt from the run's files, ready for
        :func:`~fctkit.trainer.searches.scored_retrieval`. ``forward_transform`` replaces the
        forward adapter's ``transform`` in this loaded copy (e.g. a quantised graph's)."""
        from fctkit.trainer.searches import Hubness, Transition, WithQueryMap

        from .variants import Variant

        variant = Variant.parse(key, self.gate["ecc"])
        forward = self.load(variant.adapter_file)
        if forward_transform is not None:
            forward.transform = forward_transform  # an instance attribute: this loaded copy only
        base = WithQueryMap(forward, self.load(variant.query_map_file)) if variant.query_map else forward
        if variant.hubness:
            reference = np.load(self.root / "adapters" / f"{key}.reference.npy", allow_pickle=False)
            base = Hubness(base, float(self.gate["hubness_beta"][key]), reference, int(self.gate["hubness_k"]))
        if variant.transition:
            return Transition(base, float(self.gate["transition_weight"][key]))
        return base


def read_run_json(path: Path) -> dict[str, Any]:
    """The JSON object in a run folder's file; :class:`InputError` when it is unreadable or not an object."""
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read {path}: {exc}; the run folder is damaged, train again") from exc
    if not isinstance(data, dict):
        raise InputError(f"{path} does not hold a JSON object; the run folder is damaged, train again")
    return data


def _read_run_npz(path: Path, keys: Sequence[str], optional: Sequence[str] = ()) -> dict[str, np.ndarray]:
    if not path.is_file():
        raise DataUnavailableError(
            f"{path} is missing: train the run again (with `[chain] enabled = true` for chain features)"
        )
    try:
        with np.load(path, allow_pickle=False) as data:
            missing = sorted(set(keys) - set(data.files))
            if missing:
                raise InputError(f"{path} lacks {', '.join(missing)}; train the run again with this fctkit version")
            return {k: np.asarray(data[k]) for k in (*keys, *(k for k in optional if k in data.files))}
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read {path}: {exc}; the run folder is damaged, train again") from exc


__all__ = ["CHAIN_VERSIONS", "TrainedRun", "read_run_json"]

"""The configuration of a `fctkit train` run (:mod:`.pipeline`): one TOML file whose sections
are the run's stages and methods, checked for combinations the run cannot do."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from fctkit.config import load_config
from fctkit.errors import ConfigError

from .adapters import FastFillConfig, FCTConfig
from .backbones import BackboneConfig
from .fitting import CLASS_LEVEL_BATCH_SIZE
from .lambda_orth import LambdaOrthConfig
from .method_names import METHOD_LABELS
from .query_map import QueryMapConfig, QueryPositivesConfig
from .residual import ResidualConfig
from .run_data import DataConfig
from .searches import EvaluationConfig
from .selection import SelectionConfig, batch_candidates
from .side_info import SideInfoConfig


@dataclasses.dataclass
class BackfillConfig:
    orderings: tuple[str, ...] = ("random", "uncertainty", "class-mean-l2", "class-mean-cosine", "kmeans")
    steps: int = 10


@dataclasses.dataclass
class ChainConfig:
    enabled: bool = False
    classes: tuple[int, ...] = (4, 7, 10)  # classes seen by v1, v2, v3


@dataclasses.dataclass
class TransitionConfig:
    """Transition scoring: while a device still holds the old model and its rows' old vectors,
    it may rank by ``w·cos_old + (1 − w)·cos_adapted``; ``w`` is chosen on held-out training data."""

    enabled: bool | None = None  # None: on for an instance-level task searched by cosine (see PipelineConfig.for_task)
    weights: tuple[float, ...] = (0.0, 0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9)

    def __post_init__(self) -> None:
        if not self.weights or any(not 0.0 <= w <= 1.0 for w in self.weights):
            raise ConfigError("transition.weights must be fractions in [0, 1]")


@dataclasses.dataclass
class HubnessConfig:
    """A per-item hubness offset r(g) (CSLS-style, :mod:`.hubness`): rank by cos − β·r, with r
    from the task's training queries and β chosen on held-out training data."""

    enabled: bool | None = None  # None: on for an instance-level task searched by cosine (see PipelineConfig.for_task)
    k: int = 10
    betas: tuple[float, ...] = (0.0, 0.25, 0.5, 1.0, 1.5, 2.0)

    def __post_init__(self) -> None:
        if self.k < 1 or not self.betas or any(b < 0 for b in self.betas):
            raise ConfigError("hubness.k must be >= 1 and hubness.betas non-empty and >= 0")


@dataclasses.dataclass
class PipelineConfig:
    seed: int = 0
    device: str = "auto"
    progress: bool = True
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    old_backbone: BackboneConfig = dataclasses.field(default_factory=lambda: BackboneConfig(architecture="small"))
    new_backbone: BackboneConfig = dataclasses.field(
        default_factory=lambda: BackboneConfig(architecture="wide", embedding_dim=64)
    )
    side_info: SideInfoConfig = dataclasses.field(default_factory=SideInfoConfig)
    methods: tuple[
        str, ...
    ] = ()  # () = the defaults for the data: all methods, or INSTANCE_METHODS for an instance-level task
    fct: FCTConfig = dataclasses.field(default_factory=FCTConfig)
    residual: ResidualConfig = dataclasses.field(default_factory=ResidualConfig)
    selection: SelectionConfig = dataclasses.field(default_factory=SelectionConfig)
    query_map: QueryMapConfig = dataclasses.field(default_factory=QueryMapConfig)
    query_positives: QueryPositivesConfig = dataclasses.field(default_factory=QueryPositivesConfig)
    transition: TransitionConfig = dataclasses.field(default_factory=TransitionConfig)
    hubness: HubnessConfig = dataclasses.field(default_factory=HubnessConfig)
    fastfill: FastFillConfig = dataclasses.field(default_factory=FastFillConfig)
    lambda_orth: LambdaOrthConfig = dataclasses.field(default_factory=LambdaOrthConfig)
    lambda_orth_relaxed: LambdaOrthConfig = dataclasses.field(
        default_factory=lambda: LambdaOrthConfig(backward="lambda")
    )
    evaluation: EvaluationConfig = dataclasses.field(default_factory=EvaluationConfig)
    backfill: BackfillConfig = dataclasses.field(default_factory=BackfillConfig)
    chain: ChainConfig = dataclasses.field(default_factory=ChainConfig)

    def __post_init__(self) -> None:
        unknown = sorted(set(self.methods) - set(METHOD_LABELS))
        if unknown:
            raise ConfigError(f"methods: unknown {', '.join(unknown)}; choose from {', '.join(METHOD_LABELS)}")
        for name in ("transition", "hubness"):
            if getattr(self, name).enabled and (self.data.name != "task" or self.evaluation.distance != "cosine"):
                raise ConfigError(
                    f"{name} works on cosine scores of a retrieval task: set data.name = 'task' "
                    "and evaluation.distance = 'cosine'"
                )
        for joint in (self.query_map, self.query_positives):
            if joint.enabled and self.data.name != "task":
                raise ConfigError(
                    f"{joint.section} needs a retrieval task (data.name = 'task'): it learns from the task's positives"
                )
        if self.chain.enabled and self.data.name in ("features", "task"):
            raise ConfigError(
                "chain needs image data (it trains v1/v2/v3 backbones); disable chain for features and tasks"
            )

    def for_task(self, level: str | None, rows: int = 0, pairs: int = 0) -> PipelineConfig:
        """This config with the options left unset (``None``) decided for the run's data: for an
        instance-level task, training on query positives, and — when it is searched by cosine —
        the hubness offset and transition scoring are on (what the README recommends there; they
        cost evaluations, not fits); for anything else they are off.

        Unset batch sizes follow the data: on an instance-level task the residual adapter starts
        from the first of ``selection.batch_sizes`` that leaves enough steps an epoch on ``rows``
        training gallery items (query-positives training likewise on ``pairs`` (query, positive)
        pairs; :func:`.selection.batch_candidates`), and the settings search may pick another;
        elsewhere batches hold 256."""
        instance = level == "instance"
        scored = instance and self.evaluation.distance == "cosine"
        decided = {"query_positives": instance, "hubness": scored, "transition": scored}
        changes: dict[str, Any] = {
            name: dataclasses.replace(getattr(self, name), enabled=on)
            for name, on in decided.items()
            if getattr(self, name).enabled is None
        }
        for name, count in (("residual", rows), ("query_positives", pairs), ("query_map", pairs)):
            section = changes.get(name, getattr(self, name))
            if section.train.batch_size is None:
                batch_size = (
                    batch_candidates(count, self.selection.batch_sizes, section.train.val_fraction)[0]
                    if instance
                    else CLASS_LEVEL_BATCH_SIZE
                )
                changes[name] = dataclasses.replace(
                    section, train=dataclasses.replace(section.train, batch_size=batch_size)
                )
        return dataclasses.replace(self, **changes) if changes else self


def load_pipeline_config(path: str | Path | None = None, overrides: dict[str, Any] | None = None) -> PipelineConfig:
    """A config from a TOML file (unknown keys are errors) with optional dotted-key overrides."""
    return load_config(PipelineConfig, path, overrides)

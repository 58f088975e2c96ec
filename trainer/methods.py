"""How a `fctkit train` run fits its adapter methods (named in :mod:`.method_names`): which
methods it runs, the config each is fitted with, and the one function that fits any of them
on aligned training features."""

from __future__ import annotations

import dataclasses
from typing import Any

from .adapter_base import Adapter
from .adapters import FastFillAdapter, FCTAdapter
from .closed_form import ClosedFormAdapter, ClosedFormConfig
from .lambda_orth import LambdaOrthAdapter
from .method_names import INSTANCE_METHODS, METHOD_LABELS
from .pipeline_config import PipelineConfig
from .residual import ResidualAdapter
from .searches import Features
from .tasks import RetrievalTask


def run_methods(config: PipelineConfig, task: RetrievalTask | None) -> tuple[str, ...]:
    if config.methods:
        return config.methods
    return INSTANCE_METHODS if task is not None and task.level == "instance" else tuple(METHOD_LABELS)


def method_config(config: PipelineConfig, method: str, has_side: bool, level: str) -> Any:
    """The method's config as the run fits it: seeded by the run, side-info when the data has
    it (and the method's ``side_info`` is not turned off), and the objective ``auto`` resolved
    (MSE for class level, InfoNCE for instance level)."""
    if method in ("least-squares", "procrustes"):
        return ClosedFormConfig(method="least_squares" if method == "least-squares" else "procrustes")
    section = {
        "fct": config.fct,
        "fct-no-side-info": config.fct,
        "fastfill": config.fastfill,
        "residual": config.residual,
        "lambda-orth": config.lambda_orth,
        "lambda-orth-relaxed": config.lambda_orth_relaxed,
    }[method]
    section = run_seeded(config, section)
    if method in ("fct", "fct-no-side-info", "fastfill", "residual"):
        section = dataclasses.replace(
            section, side_info=section.side_info and has_side and method != "fct-no-side-info"
        )
    if method in ("fct", "fct-no-side-info") and section.objective.kind == "auto":
        section = dataclasses.replace(
            section, objective=dataclasses.replace(section.objective, kind="infonce" if level == "instance" else "mse")
        )
    return section


def fit_method(method: str, section: Any, train: Features) -> Adapter:
    """Fit one method on aligned training features (old, side → new)."""
    side = train.side if getattr(section, "side_info", False) and train.side.shape[1] else None
    if method in ("fct", "fct-no-side-info"):
        return FCTAdapter.fit(train.old, train.new, side, section)[0]
    if method == "fastfill":
        return FastFillAdapter.fit(train.old, train.new, side, section)[0]
    if method == "residual":
        return ResidualAdapter.fit(train.old, train.new, side, section)[0]
    if method in ("least-squares", "procrustes"):
        return ClosedFormAdapter.fit(train.old, train.new, section)[0]
    return LambdaOrthAdapter.fit(train.old, train.new, train.labels, section)[0]


def run_seeded(config: PipelineConfig, section: Any) -> Any:
    """A method's config whose training seed is offset by the run's ``seed``, so that changing
    the run's seed changes every stage (a method's own ``train.seed`` stays an offset)."""
    return dataclasses.replace(section, train=dataclasses.replace(section.train, seed=section.train.seed + config.seed))


def quiet_training(section: Any) -> Any:
    return (
        dataclasses.replace(section, train=dataclasses.replace(section.train, progress=False))
        if hasattr(section, "train")
        else section
    )

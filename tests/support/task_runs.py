"""`fctkit train` on the synthetic instance-level task, as the trainer and export tests run it."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from fctkit.trainer import save_task, synthetic_instance_task
from fctkit.trainer.pipeline import PipelineResult, run_pipeline
from fctkit.trainer.pipeline_config import load_pipeline_config

from .seeds import seed


def synthetic_task_run(out: Path, *, n_train: int, n_eval: int, **overrides: Any) -> PipelineResult:
    """Save the synthetic task under ``out`` and train residual and least squares on it (with
    transition scoring and hubness judged); ``overrides`` are further config keys."""
    task = save_task(out / "task.npz", synthetic_instance_task(n_train=n_train, n_eval=n_eval, seed=seed()))
    config = load_pipeline_config(
        None,
        {
            "seed": seed(),
            "data.name": "task",
            "data.task": str(task),
            "progress": False,
            "device": "cpu",
            "evaluation.distance": "cosine",
            "methods": ["residual", "least-squares"],
            "transition.enabled": True,
            "hubness.enabled": True,
            **overrides,
        },
    )
    return run_pipeline(config, out / "run", log=lambda _: None)

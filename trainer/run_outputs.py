"""What a training run (`fctkit train`, `fctkit train-compatible`) writes and shows besides its
report: its JSON files, and no progress bars when the run is quiet."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Protocol


class RunConfig(Protocol):
    """A run's config (:class:`.pipeline_config.PipelineConfig`, :class:`.compatible_config.CompatibleConfig`)."""

    progress: bool


def write_json(path: Path, data: Any) -> Path:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, default=float) + "\n")
    return path


def quiet_progress(config: RunConfig) -> None:
    """With a run config's ``progress`` off, turn off each section's own: a backbone's or
    side-info model's ``progress`` and an adapter's ``train.progress``."""
    if config.progress:
        return
    for section in vars(config).values():
        if hasattr(section, "progress"):
            section.progress = False
        elif hasattr(getattr(section, "train", None), "progress"):
            section.train.progress = False


__all__ = ["quiet_progress", "write_json"]

"""What a training run (`fctkit train`, `fctkit train-compatible`) writes and shows besides its
report: its JSON files, how long each stage took, and no progress bars when the run is quiet."""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Callable, Iterator
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


class StageClock:
    """Wall-clock seconds per stage of a run, logged as each starts and kept for its report."""

    def __init__(self, log: Callable[[str], None]) -> None:
        self.log = log
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def stage(self, name: str) -> Iterator[None]:
        self.log(name)
        started = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[name] = self.seconds.get(name, 0.0) + time.perf_counter() - started

    def report_to(self, report: Any) -> None:
        """One report fact per stage, ``time: <stage>`` = seconds, and the total."""
        for name, seconds in self.seconds.items():
            report.add_fact(f"time: {name}", f"{seconds:.1f} s")
        report.add_fact("time: all stages above", f"{sum(self.seconds.values()):.1f} s")


__all__ = ["StageClock", "quiet_progress", "write_json"]

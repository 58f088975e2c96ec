"""What a demo run is asked for: the data (each with its demo-sized training config), the
adapter method of v2, the fleet's size and the backfill."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fctkit.errors import InputError

_ADAPTER_TRAINING = {"epochs": 40, "batch_size": 128, "lr": 2e-3, "warmup_epochs": 3}
#: Demo-sized training runs (small widths: seconds per stage on 2 cores).
DEMO_CONFIGS: dict[str, dict[str, Any]] = {
    "digits": {
        "data": {"name": "digits"},
        "old_backbone": {"architecture": "small", "embedding_dim": 32, "width": 8, "epochs": 20},
        "new_backbone": {"architecture": "wide", "embedding_dim": 64, "width": 8, "epochs": 20},
        "side_info": {"kind": "simclr", "dim": 16, "width": 8, "epochs": 25},
        "fct": {"branch_width": 64, "mixer_width": 256, "train": _ADAPTER_TRAINING},
        "fastfill": {"branch_width": 64, "mixer_width": 256, "train": _ADAPTER_TRAINING},
    },
    "fashion-mnist": {
        "data": {"name": "fashion-mnist", "max_items": 6000},
        "old_backbone": {"architecture": "small", "embedding_dim": 64, "width": 16, "epochs": 8},
        "new_backbone": {"architecture": "wide", "embedding_dim": 128, "width": 16, "epochs": 8},
        "side_info": {"kind": "simclr", "dim": 32, "width": 16, "epochs": 10},
        "fct": {"branch_width": 128, "mixer_width": 512, "train": {**_ADAPTER_TRAINING, "epochs": 30}},
        "fastfill": {"branch_width": 128, "mixer_width": 512, "train": {**_ADAPTER_TRAINING, "epochs": 30}},
    },
}
DEMO_METHODS = ("fct", "fastfill", "least-squares", "procrustes")


@dataclass
class DemoOptions:
    data: str = "digits"
    devices: int = 3
    out: Path = Path("runs/demo")
    method: str = "fct"
    backfill_fraction: float = 0.3
    backfill_order: str = "class-mean-l2"
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        if self.data not in DEMO_CONFIGS:
            raise InputError(f"--data {self.data!r}: choose one of {', '.join(DEMO_CONFIGS)}")
        if self.method not in DEMO_METHODS:
            raise InputError(f"--method {self.method!r}: the demo runs forward-mode methods: {', '.join(DEMO_METHODS)}")
        if not 1 <= self.devices <= 32:
            raise InputError(f"--devices must be between 1 and 32, got {self.devices}")
        if not 0 < self.backfill_fraction <= 1:
            raise InputError(f"--backfill-fraction must be in (0, 1], got {self.backfill_fraction}")
        self.out = Path(self.out)


__all__ = ["DEMO_CONFIGS", "DEMO_METHODS", "DemoOptions"]

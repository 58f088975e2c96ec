"""Rebuild ``synthetic-instance.npz``, the example task file of the README (1,000 training and
400 evaluation items of :func:`fctkit.trainer.synthetic_instance_task`, seed 0, stored as
float16 to keep the repository small; the kit reads any float width).

    python examples/tasks/make_synthetic_example.py
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from fctkit.trainer import synthetic_instance_task
from fctkit.trainer.tasks import task_arrays, task_from_arrays

OUT = Path(__file__).with_name("synthetic-instance.npz")


def main() -> None:
    arrays = {
        key: value.astype(np.float16) if value.dtype == np.float32 else value
        for key, value in task_arrays(synthetic_instance_task(n_train=1000, n_eval=400, seed=0)).items()
    }
    task_from_arrays(arrays, str(OUT))  # validate before writing
    np.savez(OUT, **arrays)
    print(f"wrote {OUT} ({OUT.stat().st_size // 1024} KiB)")


if __name__ == "__main__":
    main()

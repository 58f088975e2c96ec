"""A real, small `fctkit train-compatible` run on digits for tests, built once per ``tmp_dir``
and content hash (the config and the trainer sources), shared across test modules and
processes like :func:`tests.support.releases.digits_release`::

    from tests.support.compatible_run import digits_compatible_run
    from tests.support.releases import shared_folder

    @pytest.fixture(scope="session")
    def compatible_run(tmp_path_factory):
        return digits_compatible_run(shared_folder(tmp_path_factory))

The run is ``configs/digits-compatible.toml``: one upgrade, classes 0–4 → 0–9, independent,
BCT, BT², CoReS (+ HOC) and the FCT / λ-orth adapters; one torch thread, about 40 s of CPU.
:func:`digits_data_growth_run` is ``configs/digits-data-growth.toml`` (v1 on a fifth of the
images, v2 on all, same classes) with CoReS and CoReS + HOC only, about 20 s.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tests.support.releases import build_once
from tests.support.seeds import TEST_SEED

CONFIGS = Path(__file__).resolve().parents[2] / "configs"
#: Every test run: progress bars off, on the CPU, the suite's seed.
RUN_SETTINGS = {"progress": False, "device": "cpu", "seed": TEST_SEED}


def digits_compatible_run(tmp_dir: Path) -> Path:
    """The run folder (models/, gate.json, results.json, config.json, report.md)."""
    return _run(tmp_dir, CONFIGS / "digits-compatible.toml", {})


def digits_data_growth_run(tmp_dir: Path) -> Path:
    """The data-growth run's folder (as :func:`digits_compatible_run`)."""
    return _run(
        tmp_dir, CONFIGS / "digits-data-growth.toml", {"methods": ["independent", "cores", "cores-hoc"], "adapters": []}
    )


def _run(tmp_dir: Path, config_file: Path, overrides: dict) -> Path:
    overrides = {**RUN_SETTINGS, **overrides}
    key = _content_key(config_file, overrides)
    folder = Path(tmp_dir) / f"{config_file.stem}-{key[:16]}"
    build_once(folder, key, lambda staging: _build(config_file, overrides, staging))
    return folder


def _build(config_file: Path, overrides: dict, staging: Path) -> None:
    from fctkit.trainer.compatible_comparison import run_compatible
    from fctkit.trainer.compatible_config import load_compatible_config

    run_compatible(load_compatible_config(config_file, overrides), staging, log=lambda _: None)


def _content_key(config_file: Path, overrides: dict) -> str:
    import fctkit.trainer

    digest = hashlib.sha256(config_file.read_bytes() + json.dumps(overrides, sort_keys=True).encode())
    digest.update(Path(__file__).read_bytes())
    for path in sorted(Path(fctkit.trainer.__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()

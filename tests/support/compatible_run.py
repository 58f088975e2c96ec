"""A real, small `fctkit train-compatible` run on digits for tests, built once per ``tmp_dir``
and content hash (the config and the trainer sources), shared across test modules and
processes like :func:`tests.support.releases.digits_release`::

    from tests.support.compatible_run import digits_compatible_run

    @pytest.fixture(scope="session")
    def compatible_run(tmp_path_factory):
        return digits_compatible_run(tmp_path_factory.getbasetemp())

The run is ``configs/digits-compatible.toml``: one upgrade, classes 0–4 → 0–9, independent,
BCT, BT², CoReS and the FCT / λ-orth adapters; one torch thread, about 40 s of CPU.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tests.support.releases import build_once

#: The digits config the tests train (with progress bars off, on the CPU).
CONFIG_FILE = Path(__file__).resolve().parents[2] / "configs" / "digits-compatible.toml"
OVERRIDES = {"progress": False, "device": "cpu"}


def digits_compatible_run(tmp_dir: Path) -> Path:
    """The run folder (models/, gate.json, results.json, config.json, report.md)."""
    key = _content_key()
    folder = Path(tmp_dir) / f"digits-compatible-{key[:16]}"
    build_once(folder, key, _build)
    return folder


def _build(staging: Path) -> None:
    from fctkit.trainer.compatible import load_compatible_config, run_compatible

    run_compatible(load_compatible_config(CONFIG_FILE, OVERRIDES), staging, log=lambda _: None)


def _content_key() -> str:
    import fctkit.trainer

    digest = hashlib.sha256(CONFIG_FILE.read_bytes() + json.dumps(OVERRIDES, sort_keys=True).encode())
    digest.update(Path(__file__).read_bytes())
    for path in sorted(Path(fctkit.trainer.__file__).parent.glob("*.py")):
        digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()

"""A real, small signed release for tests: a tiny digits chain run exported as v1, v2, v3.

Use it from any test module (pytest's importlib mode finds ``tests.support`` from the
repository root)::

    from tests.support.releases import digits_release, shared_folder

    @pytest.fixture(scope="session")
    def release(tmp_path_factory):
        return digits_release(shared_folder(tmp_path_factory))

:func:`digits_release` trains :data:`TINY_DIGITS_CONFIG` (small widths and epochs, one
torch thread: tens of seconds on 2 shared cores), exports the chain release with
:func:`fctkit.export.release.build_release` and caches the result under ``tmp_dir`` in a
folder named by a hash of its content (the config and the trainer/export/format sources),
so every module that passes the same ``tmp_dir`` shares one build, also across processes
(a file lock serialises concurrent builders). The tiny run passes its FCT gates, every chain
hop's included, with margin in seeds 0-7 (``FCTKIT_TEST_SEED``): the bundles are genuine, not
forced. Its λ-orth (relaxed) gate does not hold in every seed: see :func:`unified_override`.

The bundles: v1 (embed φ1, side_info ψ1), v2 (embed φ2, side_info ψ2, forward h2 1→2,
side_forward g2 1→2), v3 (embed φ3, side_info ψ3, forward h3 2→3, forward h13 1→3), all in
forward mode with l2 distance. ``Release.eval_features`` holds the evaluation split the run
measured its figures on: ``images`` (N, 1, 8, 8), ``labels``, and per version ``v{v}_embedding``
and ``v{v}_side``; ``Release.chain_gate`` the run's chain figures (``v1/v1``, ``v2/h2(v1)``,
``hop_by_hop``, ``direct``, … each ``{top1, top5, mAP}``, and ``ecc`` per hop).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from tests.support.seeds import TEST_SEED

_ADAPTER_TRAINING = {"epochs": 40, "batch_size": 64, "lr": 3e-3, "warmup_epochs": 2, "progress": False}

#: The tiny digits run behind the test release (a `fctkit train` config as a mapping).
TINY_DIGITS_CONFIG: dict = {
    "seed": TEST_SEED,
    "device": "cpu",
    "progress": False,
    "methods": ["fct", "fastfill", "lambda-orth", "lambda-orth-relaxed"],
    # 25 epochs, not 15: with 15 the chain's first hop (4 -> 7 classes) held ECC by -0.013 ... +0.058
    # over seeds 0-7 (failing seed 1); with 25 by +0.025 ... +0.128 (seeds 0-7; BENCHMARKS.md)
    "old_backbone": {"architecture": "small", "embedding_dim": 16, "width": 4, "epochs": 25},
    "new_backbone": {"architecture": "wide", "embedding_dim": 24, "width": 4, "epochs": 25},
    "side_info": {"kind": "simclr", "dim": 8, "width": 4, "projection_dim": 16, "epochs": 15},
    "fct": {"branch_width": 32, "mixer_width": 64, "train": _ADAPTER_TRAINING},
    "fastfill": {"branch_width": 32, "mixer_width": 64, "train": _ADAPTER_TRAINING},
    "lambda_orth": {"train": _ADAPTER_TRAINING},
    "lambda_orth_relaxed": {"backward": "lambda", "train": {**_ADAPTER_TRAINING, "epochs": 80, "lr": 1e-2}},
    "backfill": {"orderings": ["random"], "steps": 4},
    "chain": {"enabled": True, "classes": [4, 7, 10]},
}
VERSIONS = (1, 2, 3)
#: λ-orth (relaxed)'s ECC on the tiny run depends on the seed: it fails where the tiny v1 is
#: strong (seed 3: B_λ(new)/F(old) 0.846 vs old/old 0.862), so tests of the unified release's
#: mechanics export it with the override on the record when the run's gate fails.
UNIFIED_METHOD = "lambda-orth-relaxed"
_COMPLETE = "COMPLETE"


@dataclass(frozen=True)
class Release:
    """A built test release; every path lies inside the cache folder (treat it as read-only:
    copy a bundle before tampering with it)."""

    run_dir: Path
    public_key_path: Path
    private_key_path: Path
    bundle_dirs: dict[int, Path]
    bundle_archives: dict[int, Path]
    eval_features: dict[str, np.ndarray]
    chain_gate: dict


_BUILT: dict[Path, Release] = {}


def digits_release(tmp_dir: Path) -> Release:
    """The tiny digits chain release, built once per ``tmp_dir`` and content hash."""
    key = _content_key()
    folder = Path(tmp_dir) / f"digits-release-{key[:16]}"
    if folder not in _BUILT:
        build_once(folder, key, _build)
        _BUILT[folder] = _load(folder)
    return _BUILT[folder]


def unified_override(run_dir: Path) -> dict:
    """``force`` / ``force_reason`` for exporting the run's :data:`UNIFIED_METHOD`: none when its
    ECC gate passed."""
    if json.loads((Path(run_dir) / "gate.json").read_text())["ecc"][UNIFIED_METHOD]:
        return {}
    return {"force": True, "force_reason": f"tests: the tiny run's {UNIFIED_METHOD} ECC depends on the seed"}


def shared_folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where a session's builds are cached: its base temporary folder or, under pytest-xdist, the
    folder above every worker's, so that one worker builds and the others wait for its result."""
    base = tmp_path_factory.getbasetemp()
    return base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base


def build_once(folder: Path, content_key: str, build: Callable[[Path], None]) -> None:
    """Make ``folder`` with ``build(staging)`` unless a complete build is already there.

    Builders in other processes wait on a file lock; the build runs in a staging folder (one
    torch thread: tiny models run several times faster on busy shared cores) that is renamed
    into place with a completion marker, so an interrupted build leaves nothing half-made."""
    import torch

    with _locked(folder.with_name(folder.name + ".lock")):
        if (folder / _COMPLETE).is_file():
            return
        shutil.rmtree(folder, ignore_errors=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{folder.name}.", dir=folder.parent))
        threads = torch.get_num_threads()
        torch.set_num_threads(1)
        try:
            build(staging)
            (staging / _COMPLETE).write_text(content_key + "\n")
            os.rename(staging, folder)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        finally:
            torch.set_num_threads(threads)


def _build(staging: Path) -> None:
    from fctkit.config import from_mapping
    from fctkit.export.keys import generate_keys, load_private_key
    from fctkit.export.release import build_release
    from fctkit.export.trained_run import TrainedRun
    from fctkit.trainer.pipeline import run_pipeline
    from fctkit.trainer.pipeline_config import PipelineConfig

    run_pipeline(from_mapping(PipelineConfig, TINY_DIGITS_CONFIG), staging / "run", log=lambda _: None)
    private_path, _ = generate_keys(staging / "keys")
    build_release(staging / "run", staging / "bundles", private_key=load_private_key(private_path), chain=True)
    run = TrainedRun.open(staging / "run")
    np.savez(staging / "eval.npz", images=run.eval_images, **run.chain_features)


def _load(folder: Path) -> Release:
    with np.load(folder / "eval.npz", allow_pickle=False) as data:
        features = {k: np.asarray(data[k]) for k in data.files}
    gate = json.loads((folder / "run" / "gate.json").read_text())
    return Release(
        run_dir=folder / "run",
        public_key_path=folder / "keys" / "publisher.pub",
        private_key_path=folder / "keys" / "publisher.key",
        bundle_dirs={v: folder / "bundles" / f"v{v}" for v in VERSIONS},
        bundle_archives={v: folder / "bundles" / f"v{v}.tar" for v in VERSIONS},
        eval_features=features,
        chain_gate=gate["chain"],
    )


def _content_key() -> str:
    """Hash of the config and of every source file that shapes the release."""
    import fctkit
    import fctkit.export
    import fctkit.protos
    import fctkit.trainer

    digest = hashlib.sha256(json.dumps(TINY_DIGITS_CONFIG, sort_keys=True).encode())
    digest.update(Path(__file__).read_bytes())
    for package in (fctkit, fctkit.trainer, fctkit.export, fctkit.protos):
        for path in sorted(Path(package.__file__).parent.glob("*.py")):
            digest.update(path.name.encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)

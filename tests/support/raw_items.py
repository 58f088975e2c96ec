"""What the raw-item tests (image files, texts) share: a features-mode run on the features a
team's own pipeline computed, the `fctkit device` CLI with torch blocked, and the ONNX
reference of a bundle's forward adapter."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np

from fctkit.trainer.pipeline import run_pipeline
from fctkit.trainer.pipeline_config import load_pipeline_config

from .seeds import seed


def features_run(out: Path, old: np.ndarray, new: np.ndarray, labels: np.ndarray) -> Path:
    """Train least squares from ``old`` to ``new`` features (a features-mode run); its folder."""
    out.mkdir(parents=True, exist_ok=True)
    np.savez(out / "old.npz", embeddings=old.astype(np.float32), labels=labels)
    np.savez(out / "new.npz", embeddings=new.astype(np.float32), labels=labels)
    config = load_pipeline_config(
        None,
        {
            "seed": seed(),
            "data.name": "features",
            "data.old_features": str(out / "old.npz"),
            "data.new_features": str(out / "new.npz"),
            "methods": ["least-squares"],
            "progress": False,
            "device": "cpu",
            "backfill.steps": 2,
            "evaluation.distance": "cosine",
        },
    )
    run_pipeline(config, out / "run", log=lambda _: None)
    return out / "run"


def device_cli(*args: str) -> subprocess.CompletedProcess:
    """`fctkit device ARGS` in a fresh interpreter where importing torch fails."""
    from tests.foundation.test_packaging import BLOCK_TORCH

    code = BLOCK_TORCH + "from fctkit.cli import main\nmain(sys.argv[1:])\nassert 'torch' not in sys.modules\n"
    return subprocess.run([sys.executable, "-c", code, "device", *args], capture_output=True, text=True)


def device_ok(*args: str) -> str:
    done = device_cli(*args)
    assert done.returncode == 0, (args, done.stderr)
    return done.stdout


def onnx_forward(bundle: Path, rows: np.ndarray) -> np.ndarray:
    """The bundle's forward adapter run by ONNX Runtime on ``rows`` (the reference of the upgrade)."""
    import onnxruntime as ort

    (graph,) = bundle.glob("forward_*.onnx")
    session = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
    return session.run(None, {session.get_inputs()[0].name: rows.astype(np.float32)})[0]


def unit(x: np.ndarray) -> np.ndarray:
    return x / np.linalg.norm(x, axis=1, keepdims=True)

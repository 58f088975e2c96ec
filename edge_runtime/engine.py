"""Run a verified bundle's ONNX graphs with ONNX Runtime.

Execution providers are tried in the order TensorRT → CUDA → CPU among those requested and
installed; ONNX Runtime silently falls back to CPU when a GPU provider cannot start, so the
provider actually in use is read back from the session (:attr:`Engine.providers_in_use`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from fctkit.errors import ConfigError, InputError, require
from fctkit.protos.bundle import Artifact, VerifiedBundle

PROVIDER_NAMES = {
    "tensorrt": "TensorrtExecutionProvider",
    "cuda": "CUDAExecutionProvider",
    "cpu": "CPUExecutionProvider",
}
PREFERENCE = ("tensorrt", "cuda", "cpu")


@dataclass(frozen=True)
class EngineConfig:
    """``providers``: which of tensorrt/cuda/cpu may be used (tried in that order; CPU is
    always the last resort); ``batch_size``: rows per ONNX Runtime call; ``threads``: intra-op
    threads (0: ONNX Runtime's default)."""

    providers: tuple[str, ...] = PREFERENCE
    batch_size: int = 1024
    threads: int = 0

    def __post_init__(self) -> None:
        unknown = [p for p in self.providers if p not in PROVIDER_NAMES]
        if unknown or not self.providers:
            raise ConfigError(f"providers {unknown or '[]'}: choose among {', '.join(PREFERENCE)}")
        if self.batch_size < 1:
            raise ConfigError(f"batch_size must be >= 1, got {self.batch_size}")
        if self.threads < 0:
            raise ConfigError(f"threads must be >= 0, got {self.threads}")


def select_providers(requested: Sequence[str], available: Sequence[str]) -> list[str]:
    """ONNX Runtime provider names to pass, in preference order, CPU always last."""
    chosen = [PROVIDER_NAMES[p] for p in PREFERENCE if p in requested and PROVIDER_NAMES[p] in available]
    if PROVIDER_NAMES["cpu"] not in chosen:
        chosen.append(PROVIDER_NAMES["cpu"])
    return chosen


class Engine:
    """The graphs of one verified bundle, loaded on first use from the verified bytes."""

    def __init__(self, bundle: VerifiedBundle, config: EngineConfig | None = None) -> None:
        self.bundle = bundle
        self.manifest = bundle.manifest
        self.config = config or EngineConfig()
        self._ort = require("onnxruntime", "cpu")
        self._sessions: dict[str, object] = {}
        self.providers_in_use: dict[str, str] = {}

    def session(self, artifact: Artifact):
        if artifact.name not in self._sessions:
            ort = self._ort
            options = ort.SessionOptions()
            options.intra_op_num_threads = self.config.threads
            options.inter_op_num_threads = 1
            providers = select_providers(self.config.providers, ort.get_available_providers())
            session = ort.InferenceSession(self.bundle.read_artifact(artifact), sess_options=options, providers=providers)
            self._sessions[artifact.name] = session
            self.providers_in_use[artifact.name] = session.get_providers()[0]
        return self._sessions[artifact.name]

    @property
    def provider(self) -> str:
        """The provider running the embed graph (the one queries use)."""
        self.session(self.manifest.artifact("embed"))
        return self.providers_in_use[self.manifest.artifact("embed").name]

    def run(self, artifact: Artifact, *inputs: np.ndarray, progress: Callable[[int], None] | None = None) -> np.ndarray:
        """Run ``artifact`` on ``inputs`` (one array per graph input, same number of rows) in
        batches of ``config.batch_size``; returns the first output as float32."""
        if len(inputs) != len(artifact.inputs):
            raise InputError(f"{artifact.name} takes {len(artifact.inputs)} input(s) ({', '.join(s.name for s in artifact.inputs)}), got {len(inputs)}")
        arrays = [_conform(x, spec.shape, spec.name, artifact.name) for x, spec in zip(inputs, artifact.inputs, strict=True)]
        rows = arrays[0].shape[0]
        if any(a.shape[0] != rows for a in arrays):
            raise InputError(f"{artifact.name}: inputs have different numbers of rows {[a.shape[0] for a in arrays]}")
        session = self.session(artifact)
        names = [spec.name for spec in artifact.inputs]
        output = artifact.outputs[0].name
        out_dim = artifact.outputs[0].shape[1:]
        result = np.empty((rows, *out_dim), dtype=np.float32)
        step = self.config.batch_size
        for start in range(0, rows, step):
            feed = {name: a[start:start + step] for name, a in zip(names, arrays, strict=True)}
            result[start:start + step] = session.run([output], feed)[0]
            if progress is not None:
                progress(min(step, rows - start))
        return result

    def unified_backward(self) -> Artifact | None:
        """The B graph that queries and new rows go through in unified mode; None in other
        modes and for the first version of a unified line (its own space is the stable one)."""
        if self.manifest.mode != "unified":
            return None
        backward = [a for a in self.manifest.artifacts if a.role == "backward"]
        if len(backward) > 1:
            raise InputError(f"bundle v{self.manifest.version} has {len(backward)} backward graphs; a device uses one")
        return backward[0] if backward else None

    def embed(self, images: np.ndarray) -> np.ndarray:
        return self.run(self.manifest.artifact("embed"), images)

    def query_map(self) -> Artifact | None:
        """The map Q a query embedding goes through before search (forward mode), if the bundle has one."""
        maps = [a for a in self.manifest.artifacts if a.role == "query_map"]
        return maps[0] if maps else None

    def side_info(self, images: np.ndarray) -> np.ndarray:
        """ψ(images), or zero-width vectors when the bundle has no side-info model."""
        if self.manifest.side_info_dim == 0:
            return np.zeros((len(images), 0), dtype=np.float32)
        return self.run(self.manifest.artifact("side_info"), images)


def _conform(x: np.ndarray, shape: tuple, name: str, graph: str) -> np.ndarray:
    """``x`` as a float32 array of the graph input's shape (items reshaped when they hold the
    same number of values); wrong sizes, NaN and inf are refused."""
    x = np.asarray(x)
    if x.ndim == 0 or x.shape[0] == 0:
        raise InputError(f"{graph}: input {name!r} is empty; give at least one row")
    per_item = math.prod(shape[1:])
    if math.prod(x.shape[1:]) != per_item:
        raise InputError(f"{graph}: input {name!r} expects items of shape {tuple(shape[1:])}, got {x.shape[1:]}")
    if not np.issubdtype(x.dtype, np.number):
        raise InputError(f"{graph}: input {name!r} must be numeric, got {x.dtype}")
    x = np.ascontiguousarray(x, dtype=np.float32).reshape((x.shape[0], *shape[1:]))
    if not np.isfinite(x).all():
        raise InputError(f"{graph}: input {name!r} holds NaN or inf values; clean the data first")
    return x

"""Run a verified bundle's ONNX graphs with ONNX Runtime.

Execution providers are tried in the order TensorRT → CUDA → CPU among those requested and
installed; ONNX Runtime silently falls back to CPU when a GPU provider cannot start, so the
provider actually in use is read back from the session (:attr:`Engine.providers_in_use`).
Bundles carry ONNX graphs only (no TensorRT engine files): a device with a GPU may run them
through ONNX Runtime's TensorRT or CUDA provider, a device without one runs them on the CPU.

A bundle that declares preprocessing (:mod:`fctkit.protos.preprocessing_spec`) takes raw items
(image file bytes, texts) in :meth:`Engine.embed` and :meth:`Engine.side_info`, turned into
its graphs' inputs by :mod:`fctkit.protos.preprocessing`; others take arrays as they are.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias, cast

import numpy as np

from fctkit.errors import ConfigError, InputError, ItemError, require
from fctkit.protos.bundle import Artifact, VerifiedBundle
from fctkit.protos.preprocessing import Embedded, ItemProblem, Preprocessor, Purpose

#: what the embedding graphs take: an array (N, ...) of inputs, or, for a bundle that declares
#: preprocessing, a list of raw items (image file bytes, texts)
Items: TypeAlias = Any

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
        self._preprocessors: dict[str, Preprocessor] = {}
        self.providers_in_use: dict[str, str] = {}

    def session(self, artifact: Artifact) -> Any:  # an onnxruntime.InferenceSession
        if artifact.name not in self._sessions:
            ort = self._ort
            options = ort.SessionOptions()
            options.intra_op_num_threads = self.config.threads
            options.inter_op_num_threads = 1
            providers = select_providers(self.config.providers, ort.get_available_providers())
            session = ort.InferenceSession(
                self.bundle.read_artifact(artifact), sess_options=options, providers=providers
            )
            self._sessions[artifact.name] = session
            self.providers_in_use[artifact.name] = session.get_providers()[0]
        return self._sessions[artifact.name]

    @property
    def provider(self) -> str:
        """The provider running the embed graph (the one queries use)."""
        self.session(self.manifest.artifact("embed"))
        return self.providers_in_use[self.manifest.artifact("embed").name]

    def run(
        self, artifact: Artifact, *inputs: np.ndarray, progress: Callable[[int], object] | None = None
    ) -> np.ndarray:
        """Run ``artifact`` on ``inputs`` (one array per graph input, same number of rows) in
        batches of ``config.batch_size``; returns the first output as float32."""
        if len(inputs) != len(artifact.inputs):
            raise InputError(
                f"{artifact.name} takes {len(artifact.inputs)} input(s) ({', '.join(s.name for s in artifact.inputs)}), got {len(inputs)}"
            )
        arrays = [
            _conform(x, spec.shape, spec.name, artifact.name) for x, spec in zip(inputs, artifact.inputs, strict=True)
        ]
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
            feed = {name: a[start : start + step] for name, a in zip(names, arrays, strict=True)}
            result[start : start + step] = session.run([output], feed)[0]
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

    @property
    def takes_items(self) -> bool:
        """Whether the bundle's graphs take raw items (it declares preprocessing), not arrays."""
        return self.manifest.preprocessing is not None

    def preprocessor(self, role: str) -> Preprocessor | None:
        """The role's preprocessing bound to its graph (its tokenizer read from the verified bytes)."""
        declaration = self.manifest.preprocessing.of(role) if self.manifest.preprocessing is not None else None
        if declaration is None:
            return None
        if role not in self._preprocessors:
            tokenizer = getattr(declaration, "tokenizer", None)
            data = self.bundle.read_artifact(tokenizer) if tokenizer is not None else None
            self._preprocessors[role] = Preprocessor(declaration, self.manifest.artifact(role), data)
        return self._preprocessors[role]

    def embed_items(
        self,
        role: str,
        items: Items,
        *,
        purpose: Purpose = "passage",
        keep_going: bool = False,
        progress: Callable[[int], object] | None = None,
    ) -> Embedded:
        """The role's vectors of ``items`` (raw items, or arrays for a bundle without preprocessing),
        with the items its preprocessing cannot take left out and listed (see :class:`Embedded`)."""
        artifact = self.manifest.artifact(role)
        preprocessor = self.preprocessor(role)
        if preprocessor is None:
            return Embedded(self.run(artifact, items, progress=progress), list(range(len(items))), [])
        return preprocessor.embed(
            items,
            self.session(artifact).run,
            purpose=purpose,
            batch_size=self.config.batch_size,
            keep_going=keep_going,
            progress=progress,
        )

    def item_problems(self, items: Items, *, purpose: Purpose = "passage") -> list[tuple[int, str]]:
        """(position, reason) of each raw item a preprocessed role cannot take; runs no graph."""
        problems: dict[int, str] = {}
        for role in ("embed", "side_info"):
            preprocessor = self.preprocessor(role) if role == "embed" or self.manifest.side_info_dim else None
            if preprocessor is None:
                continue
            for index, item in enumerate(items):
                try:
                    preprocessor.prepare(item, purpose)
                except ItemProblem as problem:
                    problems.setdefault(index, str(problem))
        return sorted(problems.items())

    def embed(self, images: Items, *, purpose: Purpose = "passage") -> np.ndarray:
        """φ of ``images`` (arrays, or raw items when the bundle declares preprocessing);
        :class:`ItemError` when a raw item cannot be embedded."""
        return self._vectors("embed", images, purpose)

    def _vectors(self, role: str, items: Items, purpose: Purpose) -> np.ndarray:
        done = self.embed_items(role, items, purpose=purpose)
        if done.bad:
            problems = tuple((f"#{index}", reason) for index, reason in done.bad)
            raise ItemError(
                f"bundle v{self.manifest.version} cannot embed {len(problems)} item(s): "
                + "; ".join(f"item {i} {r}" for i, r in problems[:5]),
                problems,
            )
        assert done.vectors is not None  # None only when a bad item stopped the runs
        return done.vectors

    def row_vectors(self, embeddings: np.ndarray, side_infos: np.ndarray) -> tuple[np.ndarray, np.ndarray, str]:
        """What a gallery row of freshly embedded items holds: (embeddings, side-infos, via).
        Forward mode: φ_v, native; unified mode: B(φ_v), tagged 'backward'."""
        backward = self.unified_backward()
        if backward is None:
            return embeddings, side_infos, "native"
        return self.run(backward, embeddings), side_infos, "backward"

    def query_map(self) -> Artifact | None:
        """The map Q a query embedding goes through before search (forward mode), if the bundle has one."""
        maps = [a for a in self.manifest.artifacts if a.role == "query_map"]
        return maps[0] if maps else None

    def side_info(self, images: Items, *, purpose: Purpose = "passage") -> np.ndarray:
        """ψ(images), or zero-width vectors when the bundle has no side-info model."""
        if self.manifest.side_info_dim == 0:
            return np.zeros((len(images), 0), dtype=np.float32)
        return self._vectors("side_info", images, purpose)


def _conform(x: np.ndarray, shape: tuple[int | None, ...], name: str, graph: str) -> np.ndarray:
    """``x`` as a float32 array of the graph input's shape (items reshaped when they hold the
    same number of values); wrong sizes, NaN and inf are refused."""
    x = np.asarray(x)
    if x.ndim == 0 or x.shape[0] == 0:
        raise InputError(f"{graph}: input {name!r} is empty; give at least one row")
    item_shape = cast(tuple[int, ...], shape[1:])  # a verified bundle's graph inputs are dynamic in the batch only
    per_item = math.prod(item_shape)
    if math.prod(x.shape[1:]) != per_item:
        raise InputError(f"{graph}: input {name!r} expects items of shape {item_shape}, got {x.shape[1:]}")
    if not np.issubdtype(x.dtype, np.number) or np.issubdtype(x.dtype, np.complexfloating):
        raise InputError(f"{graph}: input {name!r} must be real numbers, got {x.dtype}; give real-valued arrays")
    x = np.ascontiguousarray(x, dtype=np.float32).reshape((x.shape[0], *item_shape))
    if not np.isfinite(x).all():
        raise InputError(f"{graph}: input {name!r} holds NaN or inf values; clean the data first")
    return x

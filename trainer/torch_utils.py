"""Small torch helpers shared by every trainer module: seeding, device choice, tensors."""

from __future__ import annotations

import os
import random
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, Literal, Protocol

import numpy as np
import torch
from tqdm.auto import tqdm

from fctkit.errors import ConfigError, DataUnavailableError, InputError

DeviceName = Literal["auto", "cpu", "cuda"]


def set_seed(seed: int) -> torch.Generator:
    """Seed python, numpy and torch; return a torch generator for data order."""
    random.seed(seed)
    np.random.seed(seed % (2**32))
    torch.manual_seed(seed)
    generator = torch.Generator()
    generator.manual_seed(seed)
    return generator


def resolve_device(name: DeviceName | str = "auto") -> torch.device:
    """``auto`` picks CUDA when available, else CPU; asking for CUDA without one is an error."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device 'cuda' requested but no CUDA device is available; use 'cpu' or 'auto'")
    if name not in ("cpu", "cuda"):
        raise ConfigError(f"unknown device {name!r}; use 'auto', 'cpu' or 'cuda'")
    return torch.device(name)


def as_tensor(
    array: np.ndarray, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32
) -> torch.Tensor:
    return torch.as_tensor(np.ascontiguousarray(array), dtype=dtype, device=device)


@torch.no_grad()
def predict(
    module: torch.nn.Module,
    *inputs: np.ndarray,
    batch_size: int = 1024,
    device: torch.device | str = "cpu",
    progress: bool = False,
) -> np.ndarray:
    """Run ``module`` in eval mode over numpy inputs in batches; return a float32 numpy array.
    ``progress`` shows a tqdm bar over the batches (for large inputs)."""
    was_training = module.training
    module.eval()
    module.to(device)
    n = len(inputs[0])
    outputs = []
    for start in tqdm(range(0, n, batch_size), desc="inference", unit="batch", disable=not progress, leave=False):
        batch = [as_tensor(x[start : start + batch_size], device) for x in inputs]
        out = module(*batch)
        if isinstance(out, (tuple, list)):
            out = out[0]
        outputs.append(out.detach().float().cpu().numpy())
    module.train(was_training)
    if not outputs:
        return np.zeros((0,), dtype=np.float32)
    return np.concatenate(outputs).astype(np.float32, copy=False)


CHECKPOINT_VERSION = 1


def save_checkpoint(path: str | Path, kind: str, state_dict: dict[str, torch.Tensor], meta: dict[str, Any]) -> Path:
    """Write weights plus JSON-like metadata (config, classes, ...) atomically to one file.

    ``kind`` names what the file holds (e.g. ``fctkit.backbone``) so that loading a file of
    another kind fails clearly. Only tensors and plain values are stored: the file loads with
    ``torch.load(weights_only=True)``, never unpickling code.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    payload = {
        "kind": kind,
        "checkpoint_version": CHECKPOINT_VERSION,
        "meta": meta,
        "state_dict": {k: v.detach().cpu() for k, v in state_dict.items()},
    }
    partial = path.with_name(path.name + ".partial")
    torch.save(payload, partial)
    os.replace(partial, path)
    return path


def load_checkpoint(path: str | Path, kind: str) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """Read a file written by :func:`save_checkpoint`; return ``(state_dict, meta)``."""
    state, meta, _ = _read_checkpoint(path, (kind,))
    return state, meta


def _read_checkpoint(path: str | Path, kinds: tuple[str, ...]) -> tuple[dict[str, torch.Tensor], dict[str, Any], str]:
    path = Path(path)
    if not path.is_file():
        raise DataUnavailableError(f"model file not found: {path}")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises many types for truncated/foreign files
        raise InputError(
            f"{path}: not a readable fctkit model file ({type(exc).__name__}: {exc}); "
            f"the file is truncated or damaged, re-save it"
        ) from exc
    if not isinstance(payload, dict) or payload.get("kind") not in kinds:
        found = payload.get("kind") if isinstance(payload, dict) else type(payload).__name__
        raise InputError(f"{path}: holds {found!r}, expected a {' or '.join(map(repr, kinds))} file")
    if payload.get("checkpoint_version") != CHECKPOINT_VERSION:
        raise InputError(
            f"{path}: checkpoint version {payload.get('checkpoint_version')!r} is not supported "
            f"(this fctkit reads version {CHECKPOINT_VERSION})"
        )
    if not isinstance(payload.get("state_dict"), dict) or not isinstance(payload.get("meta"), dict):
        raise InputError(f"{path}: incomplete model file (no weights or metadata); re-save it")
    return payload["state_dict"], payload["meta"], payload["kind"]


class SavableModel(Protocol):
    """What :func:`save_model` reads of a module: its weights, and the metadata :func:`load_model`'s
    builders rebuild it from (nn.Module's ``__getattr__`` would type the three as ``Tensor | Module``)."""

    @property
    def config(self) -> Any: ...

    @property
    def classes(self) -> Sequence[int]: ...

    @property
    def in_channels(self) -> int: ...

    def state_dict(self) -> dict[str, Any]: ...


def save_model(path: str | Path, kind: str, model: SavableModel, **extra: Any) -> Path:
    """:func:`save_checkpoint` of a model that carries ``config``, ``classes`` and
    ``in_channels`` (the metadata :func:`load_model`'s builders read), plus ``extra`` metadata."""
    from fctkit.config import to_mapping

    meta = {"config": to_mapping(model.config), "classes": list(model.classes), "in_channels": model.in_channels}
    return save_checkpoint(path, kind, model.state_dict(), {**meta, **extra})


ModelBuilder = Callable[[dict[str, Any], str], torch.nn.Module]


def load_model(path: str | Path, builders: dict[str, ModelBuilder], device: str = "cpu") -> torch.nn.Module:
    """Load a :func:`save_model` file of one of ``builders``' kinds, in eval mode on ``device``:
    ``builders[kind](meta, where)`` makes the module (missing metadata is an :class:`InputError`)."""
    state, meta, kind = _read_checkpoint(path, tuple(builders))
    try:
        model = builders[kind](meta, str(path))
    except (KeyError, TypeError) as exc:
        raise InputError(f"{path}: incomplete {kind} metadata ({exc}); re-save the model") from exc
    load_state(model, state, str(path))
    return model.to(resolve_device(device)).eval()


def load_state(module: torch.nn.Module, state_dict: dict[str, torch.Tensor], where: str) -> None:
    """``module.load_state_dict`` with a kit error when the weights do not fit the module."""
    try:
        module.load_state_dict(state_dict)
    except RuntimeError as exc:
        raise InputError(f"{where}: the weights do not fit the saved config ({exc}); the file is damaged") from exc

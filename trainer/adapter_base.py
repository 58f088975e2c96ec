"""What every adapter shares: the ``kind`` registry and one-file save/load.

An adapter file is a :func:`fctkit.trainer.torch_utils.save_checkpoint` file of kind
``fctkit.adapter`` whose metadata holds ``adapter_kind``, ``config``, ``dims`` (the
constructor's keyword arguments besides the config) and ``metrics``, so :func:`load_adapter`
rebuilds any adapter from its file without the caller knowing the class.
"""

from __future__ import annotations

import dataclasses
import importlib
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from fctkit.config import from_mapping, to_mapping
from fctkit.errors import ConfigError, InputError
from fctkit.feature_checks import check_features

from .torch_utils import load_checkpoint, load_state, predict, save_checkpoint

CHECKPOINT_KIND = "fctkit.adapter"
# Modules that define adapter kinds; imported by load_adapter so that every kind is registered.
_ADAPTER_MODULES = ("adapters", "lambda_orth", "closed_form", "residual", "query_map")
_REGISTRY: dict[str, type[Adapter]] = {}


class Adapter(torch.nn.Module):
    """Base class of every adapter: a torch module with a config dataclass and its dims.

    Subclasses declare ``kind`` (the registry key written into files) and ``config_class``,
    take ``config`` plus the keyword arguments listed in :meth:`dims` in ``__init__``, and
    define ``transform`` (numpy rows in, numpy rows out).
    """

    kind: ClassVar[str]
    config_class: ClassVar[type]
    # every kind defines it, numpy rows in and out: one array, or OldSideAdapter's (old, side).
    # Declared (not defined) here so that nn.Module's __getattr__ does not type it as a Tensor.
    transform: Callable[..., np.ndarray]

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        kind = cls.__dict__.get("kind")
        if kind is not None:
            if kind in _REGISTRY and _REGISTRY[kind] is not cls:
                raise TypeError(f"adapter kind {kind!r} is registered twice")
            _REGISTRY[kind] = cls

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        self.metrics: dict[str, float] = {}

    def dims(self) -> dict[str, int]:
        """The constructor's dimension arguments (written into the file)."""
        raise NotImplementedError

    @property
    def device(self) -> torch.device:
        parameter = next(self.parameters(), None)
        return parameter.device if parameter is not None else torch.device("cpu")

    def _run(self, module: torch.nn.Module, *inputs: np.ndarray) -> np.ndarray:
        """Numpy in, numpy out, in eval mode, on the adapter's device."""
        return predict(module, *inputs, device=self.device)

    def save(self, path: str | Path) -> Path:
        """Write weights, config, dims and metrics to one file (atomically); returns the path."""
        meta = {
            "adapter_kind": self.kind,
            "config": to_mapping(self.config),
            "dims": dict(self.dims()),
            "metrics": {k: float(v) for k, v in self.metrics.items()},
        }
        return save_checkpoint(path, CHECKPOINT_KIND, self.state_dict(), meta)

    @classmethod
    def load(cls, path: str | Path) -> Adapter:
        """Load an adapter file; on a subclass, also check that the file holds that kind."""
        adapter = load_adapter(path)
        if cls is not Adapter and not isinstance(adapter, cls):
            raise InputError(
                f"{path}: holds a {adapter.kind!r} adapter, not a {cls.kind!r} one; use fctkit.trainer.load_adapter"
            )
        return adapter


class OldSideAdapter(Adapter):
    """An adapter h(φ_old[, ψ]) → d_out: side-info ψ is an input only when ``d_side > 0``.

    Its forward signature (also the ONNX one) is ``forward(old[, side])`` with inputs named by
    :attr:`input_names`; a ``side`` argument to a model without side-info is accepted only when
    it is ``None`` or has 0 columns.
    """

    def __init__(self, config: Any, d_old: int, d_side: int, d_out: int) -> None:
        super().__init__(config)
        if d_old < 1 or d_out < 1 or d_side < 0:
            raise InputError(
                f"adapter dims must be positive (d_side may be 0): d_old={d_old}, d_side={d_side}, d_out={d_out}"
            )
        self.d_old, self.d_side, self.d_out = d_old, d_side, d_out

    def dims(self) -> dict[str, int]:
        return {"d_old": self.d_old, "d_side": self.d_side, "d_out": self.d_out}

    @property
    def input_names(self) -> tuple[str, ...]:
        """Names (and order) of the forward inputs: ``("old", "side")`` or ``("old",)``."""
        return ("old", "side") if self.d_side else ("old",)

    @property
    def input_dims(self) -> dict[str, int]:
        return {"old": self.d_old, "side": self.d_side} if self.d_side else {"old": self.d_old}

    def _side_or_none(self, side: torch.Tensor | None) -> torch.Tensor | None:
        """``side`` when this model takes side-info (then it is required), else None."""
        if self.d_side:
            if side is None:
                raise InputError("this adapter was fitted with side-info: pass the side tensor too")
            return side
        if side is not None and side.shape[-1] != 0:
            raise InputError("this adapter has no side-info input: call it with the old embedding only")
        return None

    def transform(self, old: np.ndarray, side: np.ndarray | None = None) -> np.ndarray:
        """Map old embeddings (and side-info) into the target space: numpy in, numpy out."""
        return self._run(self, *self._checked_inputs(old, side))

    def _checked_inputs(self, old: Any, side: Any) -> list[np.ndarray]:
        old = check_features("old", old, dim=self.d_old)
        if not self.d_side:
            return [old]
        return [old, check_features("side", side, dim=self.d_side, rows=len(old))]


def adapter_kinds() -> dict[str, type[Adapter]]:
    """Every registered adapter kind (imports the modules that define them)."""
    for name in _ADAPTER_MODULES:
        importlib.import_module(f"{__package__}.{name}")
    return dict(_REGISTRY)


def load_adapter(path: str | Path) -> Adapter:
    """Rebuild whichever adapter ``path`` holds (CPU, eval mode)."""
    state_dict, meta = load_checkpoint(path, CHECKPOINT_KIND)
    if set(meta) != {"adapter_kind", "config", "dims", "metrics"}:
        raise InputError(
            f"{path}: incomplete adapter file (metadata keys {sorted(meta)}); re-create it with Adapter.save"
        )
    kinds = adapter_kinds()
    cls = kinds.get(meta["adapter_kind"])
    if cls is None:
        raise InputError(f"{path}: unknown adapter kind {meta['adapter_kind']!r}; known: {', '.join(sorted(kinds))}")
    try:
        config: Any = from_mapping(cls.config_class, meta["config"], where=f"{path}:config")
        adapter = cls(config=config, **meta["dims"])
    except (ConfigError, TypeError, ValueError) as exc:
        raise InputError(f"{path}: adapter file does not match its {meta['adapter_kind']!r} definition: {exc}") from exc
    load_state(adapter, state_dict, str(path))
    adapter.metrics = dict(meta["metrics"])
    return adapter.eval()


def config_of(cls: type, config: Any) -> Any:
    """Accept a config dataclass instance, a mapping (built strictly) or None (defaults)."""
    if config is None:
        return cls()
    if isinstance(config, cls):
        return config
    if dataclasses.is_dataclass(config):
        raise ConfigError(f"expected a {cls.__name__}, got a {type(config).__name__}")
    return from_mapping(cls, config)

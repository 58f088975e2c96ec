"""Small torch helpers shared by every trainer module: seeding, device choice, tensors."""

from __future__ import annotations

import random
from typing import Literal

import numpy as np
import torch

from fctkit.errors import ConfigError

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


def as_tensor(array: np.ndarray, device: torch.device | str = "cpu", dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return torch.as_tensor(np.ascontiguousarray(array), dtype=dtype, device=device)


@torch.no_grad()
def predict(module: torch.nn.Module, *inputs: np.ndarray, batch_size: int = 1024, device: torch.device | str = "cpu") -> np.ndarray:
    """Run ``module`` in eval mode over numpy inputs in batches; return a float32 numpy array."""
    was_training = module.training
    module.eval()
    module.to(device)
    n = len(inputs[0])
    outputs = []
    for start in range(0, n, batch_size):
        batch = [as_tensor(x[start : start + batch_size], device) for x in inputs]
        out = module(*batch)
        if isinstance(out, (tuple, list)):
            out = out[0]
        outputs.append(out.detach().float().cpu().numpy())
    module.train(was_training)
    if not outputs:
        return np.zeros((0,), dtype=np.float32)
    return np.concatenate(outputs).astype(np.float32, copy=False)

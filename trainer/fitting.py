"""The one training loop every trainer module uses: Adam, cosine schedule with linear warm-up,
validation split with early stopping (best weights restored), seeded data order, tqdm progress,
and optionally a checkpoint after every epoch from which a killed run resumes.

A caller supplies the model, the tensors, and ``loss_fn(model, *batch) -> scalar loss``.
"""

from __future__ import annotations

import copy
import dataclasses
import math
import os
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from fctkit.errors import ConfigError, InputError

from .torch_utils import as_tensor, resolve_device, set_seed

LossFn = Callable[..., torch.Tensor]


# The batch of a fit whose config leaves it unset (None) and of class-level runs; on an
# instance-level task a run derives it from the task's size (PipelineConfig.for_task).
CLASS_LEVEL_BATCH_SIZE = 256


@dataclasses.dataclass
class TrainConfig:
    epochs: int = 80
    # None: decided by the task's level (PipelineConfig.for_task); a fit outside a run uses the class-level size
    batch_size: int | None = CLASS_LEVEL_BATCH_SIZE
    lr: float = 5e-4
    weight_decay: float = 2.0**-15
    warmup_epochs: int = 5
    val_fraction: float = 0.1
    patience: int = 0  # epochs without validation improvement before stopping; 0 = never stop early
    seed: int = 0
    device: str = "auto"
    progress: bool = True

    def __post_init__(self) -> None:
        if self.epochs < 1 or (self.batch_size is not None and self.batch_size < 1):
            raise ConfigError("epochs and batch_size must be >= 1")
        if not 0.0 <= self.val_fraction < 1.0:
            raise ConfigError("val_fraction must be in [0, 1)")
        if self.lr <= 0:
            raise ConfigError("lr must be > 0")


@dataclasses.dataclass
class History:
    train_loss: list[float] = dataclasses.field(default_factory=list)
    val_loss: list[float] = dataclasses.field(default_factory=list)
    best_epoch: int = -1
    stopped_early: bool = False


def warmup_cosine(epoch_progress: float, total_epochs: int, warmup_epochs: int) -> float:
    """Learning-rate factor at a (fractional) epoch: linear warm-up, then cosine to zero."""
    if warmup_epochs > 0 and epoch_progress < warmup_epochs:
        return (epoch_progress + 1e-3) / warmup_epochs
    span = max(total_epochs - warmup_epochs, 1e-9)
    return 0.5 * (1.0 + math.cos(math.pi * min((epoch_progress - warmup_epochs) / span, 1.0)))


def split_validation(n: int, val_fraction: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    order = np.random.default_rng(seed).permutation(n)
    n_val = round(n * val_fraction)
    if val_fraction > 0 and n_val == 0 and n > 1:
        n_val = 1
    return order[n_val:], order[:n_val]


def fit(
    model: torch.nn.Module,
    arrays: Sequence[np.ndarray],
    loss_fn: LossFn,
    config: TrainConfig,
    *,
    description: str = "training",
    on_epoch_start: Callable[[torch.nn.Module, int], None] | None = None,
    parameters: Sequence[torch.nn.Parameter] | None = None,
    checkpoint: str | os.PathLike | None = None,
) -> History:
    """Train ``model`` in place on ``arrays`` (aligned along axis 0) and return its history.

    ``on_epoch_start(model, epoch)`` lets a method change the model between epochs (e.g. FCT
    freezes BatchNorm statistics from half-way).

    ``checkpoint``: a file the loop's whole state (weights, optimiser, best weights, history,
    random generators) is written to, atomically, after every epoch. Started again with the same
    file, data and config, the loop resumes after the last saved epoch and ends with the weights
    an uninterrupted run gives; the file is deleted when training ends.
    """
    n = len(arrays[0])
    if n < 2 or any(len(a) != n for a in arrays):
        raise InputError(f"training arrays must be aligned and hold at least 2 rows; got {[len(a) for a in arrays]}")
    generator = set_seed(config.seed)
    device = resolve_device(config.device)
    model.to(device)
    train_idx, val_idx = split_validation(n, config.val_fraction, config.seed)
    train = [as_tensor(a[train_idx], device, _dtype_of(a)) for a in arrays]
    val = [as_tensor(a[val_idx], device, _dtype_of(a)) for a in arrays] if len(val_idx) else None

    params = list(parameters) if parameters is not None else [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.Adam(params, lr=config.lr, weight_decay=config.weight_decay)
    batch_size = CLASS_LEVEL_BATCH_SIZE if config.batch_size is None else config.batch_size
    steps_per_epoch = max(1, math.ceil(len(train_idx) / batch_size))
    history = History()
    best_state, best_val, waited, first_epoch = None, math.inf, 0, 0
    fingerprint = {"config": {k: v for k, v in dataclasses.asdict(config).items() if k != "progress"}, "rows": n}
    if checkpoint is not None and Path(checkpoint).is_file():
        saved = _load_checkpoint(Path(checkpoint), fingerprint)
        model.load_state_dict(saved["model"])
        optimizer.load_state_dict(saved["optimizer"])
        history = History(**saved["history"])
        best_state, best_val, waited = saved["best_state"], saved["best_val"], saved["waited"]
        generator.set_state(saved["generator"])
        torch.set_rng_state(saved["torch_rng"])
        first_epoch = saved["epoch"] + 1

    bar = tqdm(
        range(first_epoch, config.epochs),
        desc=description,
        disable=not config.progress,
        leave=False,
        initial=first_epoch,
        total=config.epochs,
    )
    for epoch in bar:
        if on_epoch_start is not None:
            on_epoch_start(model, epoch)
        model.train()
        permutation = torch.randperm(len(train_idx), generator=generator).to(device)
        total = 0.0
        for step in range(steps_per_epoch):
            factor = warmup_cosine(epoch + step / steps_per_epoch, config.epochs, config.warmup_epochs)
            for group in optimizer.param_groups:
                group["lr"] = config.lr * factor
            batch_idx = permutation[step * batch_size : (step + 1) * batch_size]
            if len(batch_idx) < 2:  # BatchNorm cannot train on a single row
                continue
            loss = loss_fn(model, *(t[batch_idx] for t in train))
            if not torch.isfinite(loss):
                raise InputError(
                    f"{description}: loss became {loss.item()} at epoch {epoch}; lower the learning rate or check the inputs for NaN"
                )
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            total += loss.item() * len(batch_idx)
        history.train_loss.append(total / len(train_idx))
        if val is not None:
            val_loss = evaluate_loss(model, val, loss_fn, batch_size)
            history.val_loss.append(val_loss)
            bar.set_postfix(train=f"{history.train_loss[-1]:.4g}", val=f"{val_loss:.4g}")
            if val_loss < best_val - 1e-12:
                best_val, waited, history.best_epoch = val_loss, 0, epoch
                best_state = copy.deepcopy(model.state_dict())
            else:
                waited += 1
                if config.patience and waited >= config.patience:
                    history.stopped_early = True
                    break
        else:
            history.best_epoch = epoch
        if checkpoint is not None:
            _save_checkpoint(
                Path(checkpoint), fingerprint, epoch, model, optimizer, history, best_state, best_val, waited, generator
            )
    if checkpoint is not None:
        Path(checkpoint).unlink(missing_ok=True)
    if best_state is not None:
        model.load_state_dict(best_state)
    model.eval()
    return history


def _save_checkpoint(
    path: Path,
    fingerprint: dict,
    epoch: int,
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    history: History,
    best_state: dict | None,
    best_val: float,
    waited: int,
    generator: torch.Generator,
) -> None:
    state = {
        "fingerprint": fingerprint,
        "epoch": epoch,
        "model": model.state_dict(),
        "optimizer": optimizer.state_dict(),
        "history": dataclasses.asdict(history),
        "best_state": best_state,
        "best_val": best_val,
        "waited": waited,
        "generator": generator.get_state(),
        "torch_rng": torch.get_rng_state(),
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, path)


def _load_checkpoint(path: Path, fingerprint: dict) -> dict:
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:
        raise InputError(
            f"training checkpoint {path} cannot be read ({exc}); delete it to train from the start"
        ) from None
    if saved.get("fingerprint") != fingerprint:
        raise ConfigError(
            f"training checkpoint {path} was written by a run with other settings or data "
            f"({saved.get('fingerprint')}); delete it to train from the start"
        )
    return saved


@torch.no_grad()
def evaluate_loss(model: torch.nn.Module, tensors: Sequence[torch.Tensor], loss_fn: LossFn, batch_size: int) -> float:
    model.eval()
    n = len(tensors[0])
    total = 0.0
    for start in range(0, n, batch_size):
        batch = [t[start : start + batch_size] for t in tensors]
        total += loss_fn(model, *batch).item() * len(batch[0])
    return total / n


def _dtype_of(array: np.ndarray) -> torch.dtype:
    return torch.long if np.issubdtype(array.dtype, np.integer) else torch.float32

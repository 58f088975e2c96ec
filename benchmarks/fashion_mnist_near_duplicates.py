"""Instance-level image retrieval task from Fashion-MNIST: near-duplicate search.

    python benchmarks/fashion_mnist_near_duplicates.py --out runs/bench/fmnist-neardup               # seed 0, full size
    python benchmarks/fashion_mnist_near_duplicates.py --out runs/bench/fmnist-neardup --reuse-models --seed 0
    python benchmarks/fashion_mnist_near_duplicates.py --out /tmp/fmnd-tiny --eval-queries 300 --train-items 500 --epochs-scale 0.1

writes ``<out>/fashion-mnist-near-duplicates-seed<seed>.npz``, a task file in the kit's format
(:mod:`fctkit.trainer.tasks`; read it back with ``fctkit.trainer.tasks.load_task``, fit adapters
on it with ``fctkit train`` and ``data.name = "task"``), and prints the old/old and new/new
baselines of its evaluation split (cosine; R@1, R@5, R@10, MRR). A few facts (counts, dims,
baselines, wall time) go to ``<out>/fashion-mnist-near-duplicates-seed<seed>.summary.json``.

Task: the query is an augmented copy of one image (see :func:`augment`); its one positive is
the original image in the gallery, among all the other gallery images (a class-level match is
*not* enough: the right item is that one image). Level ``instance``, primary metric recall@1.

- evaluation split: the gallery is all 10,000 images of the official *test* part (ids
  ``"test-<index>"``); the queries are one augmented copy of each of ``--eval-queries`` test
  images (default 10,000 = all; ids ``"q-test-<index>"``) chosen with the seed. Nothing is ever
  trained on test images.
- training split: the gallery is ``--train-items`` images (default 10,000) of the official
  *train* part chosen with the seed (ids ``"train-<index>"``), each with one augmented query
  (``"q-train-<index>"``). The backbones below were trained on the train part too — that is
  fine: adapters are fitted on training data, and the evaluation split stays unseen.

Models (the settings of ``configs/fashion-mnist.toml``: its ``old_backbone``, ``new_backbone``,
``side_info`` sections and ``data.old_class_fraction``; ``--epochs-scale`` multiplies their
epochs for quick runs), trained on the 60,000 train images as ``fctkit train`` does:
  old: small CNN (32-d) on the train images of the old classes (the first half, 0-4), seed ``s``;
  new: wider CNN (64-d) on all train images of all 10 classes, seed ``s + 1``;
  ψ:   SimCLR (16-d) on the old-class train images, no labels, seed ``s + 2`` — gallery items only.
They are saved under ``<out>/models/`` (``old_backbone.pt``, ``new_backbone.pt``,
``side_info.pt``, ``models.json``), each as soon as it is trained, and each model's training
checkpoints every epoch, so an interrupted build resumes where it stopped; ``--reuse-models`` requires all three (the seed and
epochs scale must match those recorded in ``models.json``).

Augmentation (numpy + scipy.ndimage only, deterministic from the seed; :func:`augment`):
a random shift by up to ±3 pixels in each direction (zero padding, cropped back to 28×28), a
rotation by an angle uniform in ±10° (``scipy.ndimage.rotate``, ``reshape=False``, ``order=1``,
zeros outside), a contrast change (scaled around the image's mean by a factor uniform in
[0.7, 1.3]), additive Gaussian noise (σ 0.05), then clipping to [0, 1].

Data: the idx files of the Debian package ``dataset-fashion-mnist`` (installed with apt-get
when missing and we are root; otherwise the kit's DataUnavailableError says what to run).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from debian_data import BenchmarkSetupError, ensure_debian_package
from fashion_mnist import fashion_mnist_present
from instance_tasks import build_and_save

from fctkit.errors import InputError

REPO = Path(__file__).resolve().parents[1]
CONFIG = REPO / "configs" / "fashion-mnist.toml"
PACKAGE = "dataset-fashion-mnist"
TASK_NAME = "fashion-mnist-near-duplicates"
N_TEST = 10_000

# augmentation parameters (see augment)
MAX_SHIFT = 3  # pixels, each direction
MAX_ANGLE = 10.0  # degrees, uniform in [-MAX_ANGLE, MAX_ANGLE]
CONTRAST = (0.7, 1.3)  # factor range, scaled around the image mean
NOISE_SIGMA = 0.05  # additive Gaussian noise


_STARTED = time.perf_counter()


def log(message: str) -> None:
    print(f"[{time.perf_counter() - _STARTED:7.1f} s] {message}", flush=True)


# --- data --------------------------------------------------------------------------------------


def ensure_fashion_mnist() -> None:
    """Install the Debian package when missing and we are root; if the files are still missing,
    raise the kit's DataUnavailableError (its message says how to provide them)."""
    from fctkit.trainer.datasets import find_fashion_mnist

    with contextlib.suppress(BenchmarkSetupError, subprocess.CalledProcessError, OSError):
        ensure_debian_package(PACKAGE, fashion_mnist_present, "fashion-mnist idx files")
    find_fashion_mnist()


# --- augmentation ------------------------------------------------------------------------------


def augment(
    images: np.ndarray,
    rng: np.random.Generator,
    *,
    max_shift: int = MAX_SHIFT,
    max_angle: float = MAX_ANGLE,
    contrast: tuple[float, float] = CONTRAST,
    noise_sigma: float = NOISE_SIGMA,
) -> np.ndarray:
    """One augmented copy of each image of ``images`` (N, 1, H, W) float32 in [0, 1].

    Per image, in this order, every random draw from ``rng`` (same rng state → same output):

    1. shift: pad ``max_shift`` zero pixels on every side and crop an H×W window at a random
       offset, i.e. translate by dy, dx uniform in {-max_shift, …, max_shift};
    2. rotation by an angle uniform in [-max_angle, max_angle] degrees about the centre
       (``scipy.ndimage.rotate``, ``reshape=False``, ``order=1``, zeros outside);
    3. contrast: ``mean + f · (x - mean)`` with f uniform in ``contrast`` and the image's mean;
    4. additive Gaussian noise of standard deviation ``noise_sigma``;
    5. clipping to [0, 1].
    """
    from scipy.ndimage import rotate

    images = np.asarray(images, dtype=np.float32)
    if images.ndim != 4:
        raise InputError(f"augment: expected (N, C, H, W) images, got shape {images.shape}")
    n, _, h, w = images.shape
    offsets = rng.integers(0, 2 * max_shift + 1, size=(n, 2))
    angles = rng.uniform(-max_angle, max_angle, size=n)
    factors = rng.uniform(contrast[0], contrast[1], size=n)
    padded = np.pad(images, ((0, 0), (0, 0), (max_shift, max_shift), (max_shift, max_shift)))
    out = np.empty_like(images)
    for i in range(n):
        dy, dx = offsets[i]
        shifted = padded[i, :, dy : dy + h, dx : dx + w]
        out[i] = rotate(shifted, angles[i], axes=(1, 2), reshape=False, order=1, mode="constant", cval=0.0)
    mean = out.mean(axis=(1, 2, 3), keepdims=True)
    out = mean + factors[:, None, None, None].astype(np.float32) * (out - mean)
    out += rng.normal(0.0, noise_sigma, size=out.shape).astype(np.float32)
    return np.clip(out, 0.0, 1.0).astype(np.float32)


# --- models ------------------------------------------------------------------------------------


def scaled(section, scale: float):
    """A backbone / side-info config section with its epochs multiplied by ``scale`` (at least
    one; the warm-up is kept below the scaled epochs)."""
    epochs = max(1, round(section.epochs * scale))
    return dataclasses.replace(section, epochs=epochs, warmup_epochs=min(section.warmup_epochs, max(0, epochs - 1)))


@dataclasses.dataclass
class Models:
    old: object
    new: object
    side: object
    side_kind: str


MODEL_FILES = {"old": "old_backbone.pt", "new": "new_backbone.pt", "side": "side_info.pt"}


def models_meta(config, seed: int, scale: float) -> dict:
    old_cfg, new_cfg, side_cfg = (
        scaled(s, scale) for s in (config.old_backbone, config.new_backbone, config.side_info)
    )
    return {
        "seed": seed,
        "epochs_scale": scale,
        "config": str(CONFIG.relative_to(REPO)),
        "old_class_fraction": config.data.old_class_fraction,
        "epochs": {"old": old_cfg.epochs, "new": new_cfg.epochs, "side": side_cfg.epochs},
    }


def check_models_meta(models_dir: Path, meta: dict) -> None:
    """models.json is written before the first model is trained; a directory holding models of
    another seed or epochs scale is refused rather than mixed with new ones."""
    path = models_dir / "models.json"
    if not path.is_file():
        models_dir.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(meta, indent=2) + "\n")
        return
    found = json.loads(path.read_text())
    if (found.get("seed"), found.get("epochs_scale")) != (meta["seed"], meta["epochs_scale"]):
        raise InputError(
            f"the models in {models_dir} were trained with seed {found.get('seed')} and epochs scale "
            f"{found.get('epochs_scale')}, not seed {meta['seed']} and scale {meta['epochs_scale']}; "
            f"pass those or use another --out"
        )


def train_models(
    config, train_images: np.ndarray, train_labels: np.ndarray, seed: int, scale: float, models_dir: Path
) -> Models:
    """Train the three models, saving each as soon as it is trained; a model already saved in
    ``models_dir`` (by an earlier, interrupted run with the same seed and scale) is loaded instead,
    so a killed build resumes where it stopped."""
    from fctkit.trainer.backbones import load_backbone, save_backbone, train_backbone
    from fctkit.trainer.datasets import old_class_subset
    from fctkit.trainer.side_info import load_side_info, save_side_info, train_side_info
    from fctkit.trainer.torch_utils import resolve_device

    check_models_meta(models_dir, models_meta(config, seed, scale))
    device = str(resolve_device(config.device))
    old_cfg, new_cfg, side_cfg = (
        scaled(s, scale) for s in (config.old_backbone, config.new_backbone, config.side_info)
    )
    old_items = old_class_subset(train_labels, config.data.old_class_fraction)
    old_classes = sorted(set(train_labels[old_items].tolist()))

    def trained(role: str, what: str, train, save, load):
        """``train(checkpoint)``: a killed build resumes mid-model from its epoch checkpoint."""
        path = models_dir / MODEL_FILES[role]
        if path.is_file():
            log(f"{what}: reusing {path}")
            return load(path, device)
        log(what)
        model = train(path.with_name(path.name + ".checkpoint"))
        save(model, path)
        return model

    old = trained(
        "old",
        f"old backbone ({old_cfg.architecture}, {old_cfg.embedding_dim}-d, {old_cfg.epochs} epochs) on "
        f"{len(old_items)} train images of classes {old_classes}",
        lambda ckpt: train_backbone(
            train_images[old_items], train_labels[old_items], old_cfg, seed, config.device, checkpoint=ckpt
        ),
        save_backbone,
        load_backbone,
    )
    new = trained(
        "new",
        f"new backbone ({new_cfg.architecture}, {new_cfg.embedding_dim}-d, {new_cfg.epochs} epochs) on "
        f"{len(train_images)} train images of all {len(np.unique(train_labels))} classes",
        lambda ckpt: train_backbone(train_images, train_labels, new_cfg, seed + 1, config.device, checkpoint=ckpt),
        save_backbone,
        load_backbone,
    )
    side = trained(
        "side",
        f"side-info model ψ ({side_cfg.kind}, {side_cfg.dim}-d, {side_cfg.epochs} epochs) on the "
        f"old-class train images",
        lambda ckpt: train_side_info(
            train_images[old_items], train_labels[old_items], side_cfg, seed + 2, config.device, checkpoint=ckpt
        ),
        save_side_info,
        load_side_info,
    )
    log(f"models in {models_dir}")
    return Models(old, new, side, side_cfg.kind)


def load_models(config, seed: int, scale: float, models_dir: Path) -> Models:
    from fctkit.errors import DataUnavailableError
    from fctkit.trainer.backbones import load_backbone
    from fctkit.trainer.side_info import load_side_info
    from fctkit.trainer.torch_utils import resolve_device

    missing = [
        str(models_dir / name) for name in [*MODEL_FILES.values(), "models.json"] if not (models_dir / name).is_file()
    ]
    if missing:
        raise DataUnavailableError(f"--reuse-models: {', '.join(missing)} missing; run once without --reuse-models")
    check_models_meta(models_dir, models_meta(config, seed, scale))
    device = str(resolve_device(config.device))
    side = load_side_info(models_dir / MODEL_FILES["side"], device)
    log(f"reusing the models in {models_dir} (seed {seed}, epochs scale {scale})")
    return Models(
        load_backbone(models_dir / MODEL_FILES["old"], device),
        load_backbone(models_dir / MODEL_FILES["new"], device),
        side,
        side.kind,
    )


# --- the task ----------------------------------------------------------------------------------


def task_split(
    models: Models,
    gallery_images: np.ndarray,
    gallery_ids: np.ndarray,
    query_images: np.ndarray,
    query_ids: np.ndarray,
    query_to_gallery_row: np.ndarray,
    what: str,
):
    """Embed the gallery (φ_old, φ_new, ψ) and the queries (φ_old, φ_new); query i's one positive
    is gallery row ``query_to_gallery_row[i]``."""
    from fctkit.trainer.backbones import extract_features
    from fctkit.trainer.relevance import Positives
    from fctkit.trainer.side_info import extract_side_info
    from fctkit.trainer.tasks import TaskSet, TaskSplit

    log(f"{what}: embedding {len(gallery_images)} gallery images and {len(query_images)} queries")
    if models.side_kind != "none":
        side = extract_side_info(models.side, gallery_images)
    else:
        side = np.zeros((len(gallery_images), 0), np.float32)
    gallery = TaskSet(
        gallery_ids, extract_features(models.old, gallery_images), extract_features(models.new, gallery_images), side
    )
    query = TaskSet(
        query_ids,
        extract_features(models.old, query_images),
        extract_features(models.new, query_images),
        np.zeros((len(query_images), 0), np.float32),
    )
    positives = Positives.from_lists([[int(row)] for row in query_to_gallery_row], len(gallery_images))
    return TaskSplit(query, gallery, positives)


def build_task(args: argparse.Namespace):
    from fctkit.trainer.datasets import load_dataset
    from fctkit.trainer.pipeline_config import load_pipeline_config
    from fctkit.trainer.tasks import RetrievalTask

    config = load_pipeline_config(CONFIG)
    log(f"loading Fashion-MNIST (config {CONFIG.relative_to(REPO)}, seed {args.seed})")
    train = load_dataset("fashion-mnist", part="train")
    test = load_dataset("fashion-mnist", part="test")
    if len(test) != N_TEST:
        raise InputError(f"expected {N_TEST} fashion-mnist test images, found {len(test)}")
    if args.eval_queries > len(test) or args.train_items > len(train):
        raise InputError(f"--eval-queries must be at most {len(test)} and --train-items at most {len(train)}")

    models_dir = args.out / "models"
    if args.reuse_models:
        models = load_models(config, args.seed, args.epochs_scale, models_dir)
    else:
        models = train_models(config, train.images, train.labels, args.seed, args.epochs_scale, models_dir)

    # independent streams: which items, and how each split's queries are augmented
    pick_eval, pick_train, aug_eval, aug_train = (np.random.default_rng([args.seed, k]) for k in range(4))
    eval_items = np.sort(pick_eval.choice(len(test), size=args.eval_queries, replace=False))
    train_items = np.sort(pick_train.choice(len(train), size=args.train_items, replace=False))

    log(f"augmenting {len(eval_items)} evaluation queries and {len(train_items)} training queries")
    eval_queries = augment(test.images[eval_items], aug_eval)
    train_queries = augment(train.images[train_items], aug_train)

    # evaluation: gallery = every test image in index order, so query i's positive is row eval_items[i]
    evaluation = task_split(
        models,
        test.images,
        np.array([f"test-{i}" for i in range(len(test))]),
        eval_queries,
        np.array([f"q-test-{i}" for i in eval_items]),
        eval_items,
        "evaluation split",
    )
    # training: gallery = the chosen train images, query i ↔ gallery row i
    training = task_split(
        models,
        train.images[train_items],
        np.array([f"train-{i}" for i in train_items]),
        train_queries,
        np.array([f"q-train-{i}" for i in train_items]),
        np.arange(len(train_items)),
        "training split",
    )
    task = RetrievalTask(TASK_NAME, "instance", "recall@1", training, evaluation)
    facts = {
        "seed": args.seed,
        "epochs_scale": args.epochs_scale,
        "models": str(models_dir),
        "eval": {"queries": len(evaluation.query), "gallery": len(evaluation.gallery)},
        "train": {"queries": len(training.query), "gallery": len(training.gallery)},
        "dims": {
            "old": int(evaluation.gallery.old.shape[1]),
            "new": int(evaluation.gallery.new.shape[1]),
            "side": int(evaluation.gallery.side.shape[1]),
        },
        "augmentation": {
            "max_shift": MAX_SHIFT,
            "max_angle": MAX_ANGLE,
            "contrast": list(CONTRAST),
            "noise_sigma": NOISE_SIGMA,
        },
    }
    return task, facts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("runs/bench/fmnist-neardup"))
    parser.add_argument("--seed", type=int, default=0, help="seed of the models, the item choice and the augmentation")
    parser.add_argument("--eval-queries", type=int, default=N_TEST, help="test images queried (gallery: all 10,000)")
    parser.add_argument(
        "--train-items", type=int, default=10_000, help="train images in the training split (one query each)"
    )
    parser.add_argument(
        "--epochs-scale", type=float, default=1.0, help="multiplies the configured backbone and side-info epochs"
    )
    parser.add_argument("--reuse-models", action="store_true", help="load <out>/models/ instead of training")
    args = parser.parse_args(argv)
    if args.eval_queries < 1 or args.train_items < 1 or args.epochs_scale <= 0:
        parser.error("--eval-queries and --train-items must be at least 1, --epochs-scale above 0")

    def build():
        ensure_fashion_mnist()
        return build_task(args)

    return build_and_save(build, args.out / f"{TASK_NAME}-seed{args.seed}.npz")


if __name__ == "__main__":
    sys.exit(main())

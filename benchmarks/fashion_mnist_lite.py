"""Fashion-MNIST with real pretrained backbones: EfficientNet-Lite0 (v1) → Lite2 (v2), ψ = Lite1,
on the 28×28 images upscaled by each model's own preprocessing (224, 260 and 240 px).

    python benchmarks/fashion_mnist_lite.py --out runs/bench/fmnist-lite --seed 0      # both task files (~13 min)
    python benchmarks/photo_side_info.py runs/bench/fmnist-lite/fashion-mnist-lite-near-duplicates-seed0.npz \\
        --out runs/bench/fmnist-lite/side-choice --no-selection                       # residual.ridge, held out
    python benchmarks/instance_tasks.py runs/bench/fmnist-lite/fashion-mnist-lite-near-duplicates-seed0.npz \\
        --out runs/bench/fmnist-lite/near-duplicates --seeds 0 1 2 --methods residual --no-query-map --set selection.enabled=false \\
        --set query_positives.enabled=true --set transition.enabled=true --set hubness.enabled=true --set residual.ridge=0.3
    python benchmarks/instance_tasks.py runs/bench/fmnist-lite/fashion-mnist-lite-classes-seed0.npz \\
        --out runs/bench/fmnist-lite/classes --seeds 0 1 2 --methods residual least-squares --no-query-map \\
        --set transition.enabled=true --set selection.enabled=false --set residual.ridge=0.3

Two tasks from one set of embeddings (each image written as a lossless RGB PNG and embedded the
way a device embeds it: :func:`image_onnx_models.kit_embedder`):

- ``…-near-duplicates-seed<s>.npz`` (instance level, recall@1): the task of
  ``fashion_mnist_near_duplicates.py`` — the query is an augmented copy of one image (its
  :func:`augment`: shift, rotation, contrast, noise), its one positive that image — with these
  backbones in place of the toy CNNs, which kept almost no item identity. Evaluation: a gallery of
  ``--eval-items`` *test* images, ``--eval-queries`` of them queried; training: ``--train-items``
  *train* images, each with its copy.
- ``…-classes-seed<s>.npz`` (class level, top-1): ``--class-queries`` other test images (and as
  many other train images for training) whose relevant gallery items are those of their class.

No backbone was trained on Fashion-MNIST: all three are ImageNet models.
"""

from __future__ import annotations

import argparse
import io
import json
import sys
import time
from pathlib import Path

import numpy as np
from fashion_mnist_near_duplicates import augment, ensure_fashion_mnist
from image_onnx_models import embed_sets, load_exported
from instance_tasks import save_built_task

OLD, NEW, SIDE = "lite0", "lite2", "lite1"


def png_files(images: np.ndarray) -> list[bytes]:
    """(N, 1, 28, 28) floats in [0, 1] as RGB PNG files (lossless; the models take RGB)."""
    from PIL import Image

    files = []
    for image in images:
        buffer = io.BytesIO()
        Image.fromarray(np.round(image[0] * 255).astype(np.uint8), "L").convert("RGB").save(buffer, "PNG")
        files.append(buffer.getvalue())
    return files


def task_set(
    ids: list[str], vectors: dict[tuple[str, str], np.ndarray], part: str, side: bool, labels: np.ndarray | None = None
):
    """The task set of ``ids`` from :func:`image_onnx_models.embed_sets`'s vectors of ``part``."""
    from fctkit.trainer.tasks import TaskSet

    no_side = np.zeros((len(ids), 0), np.float32)
    return TaskSet(
        np.array(ids), vectors[OLD, part], vectors[NEW, part], vectors[SIDE, part] if side else no_side, labels
    )


def build(args: argparse.Namespace) -> None:
    from fctkit.trainer.datasets import load_dataset
    from fctkit.trainer.relevance import Positives
    from fctkit.trainer.tasks import RetrievalTask, TaskSplit

    started = time.perf_counter()
    ensure_fashion_mnist()
    parts = {"train": load_dataset("fashion-mnist", part="train"), "test": load_dataset("fashion-mnist", part="test")}
    models = load_exported(args.out / "models", (OLD, NEW, SIDE))
    sizes = {"test": (args.eval_items, args.eval_queries), "train": (args.train_items, args.train_items)}
    near, classes = {}, {}
    for part, (items, queries) in sizes.items():
        data, rng = parts[part], np.random.default_rng([args.seed, part == "train"])
        drawn = rng.permutation(len(data))[: items + args.class_queries]
        gallery, others = drawn[:items], drawn[items:]
        queried = np.sort(rng.choice(items, size=queries, replace=False))
        sets = {
            "gallery": data.images[gallery],
            "augmented copy": augment(data.images[gallery[queried]], rng),
            "class query": data.images[others],
        }
        vectors = embed_sets(
            models, {f"{part} {name}": png_files(images) for name, images in sets.items()}, args.threads
        )
        ids = [f"{part}-{i}" for i in gallery]
        near[part] = TaskSplit(
            task_set([f"q-{ids[q]}" for q in queried], vectors, f"{part} augmented copy", False),
            task_set(ids, vectors, f"{part} gallery", True),
            Positives.from_lists([[int(q)] for q in queried], items),
        )
        classes[part] = TaskSplit(
            task_set([f"c-{part}-{i}" for i in others], vectors, f"{part} class query", False, data.labels[others]),
            task_set(ids, vectors, f"{part} gallery", True, data.labels[gallery]),
        )
    facts = {
        "seed": args.seed,
        "old": OLD,
        "new": NEW,
        "side": SIDE,
        "eval gallery": args.eval_items,
        "eval queries": args.eval_queries,
        "train pairs": args.train_items,
        "class queries": args.class_queries,
    }
    stem = f"fashion-mnist-lite-{{}}-seed{args.seed}.npz"
    save_built_task(
        args.out / stem.format("near-duplicates"),
        RetrievalTask("fashion-mnist-lite-near-duplicates", "instance", "recall@1", near["train"], near["test"]),
        facts,
        started,
    )
    save_built_task(
        args.out / stem.format("classes"),
        RetrievalTask("fashion-mnist-lite-classes", "class", "top1", classes["train"], classes["test"]),
        dict(facts),
        started,
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--eval-items", type=int, default=2000, help="test images in the evaluation gallery (default %(default)s)"
    )
    parser.add_argument(
        "--eval-queries", type=int, default=500, help="of them queried by an augmented copy (default %(default)s)"
    )
    parser.add_argument(
        "--train-items", type=int, default=1500, help="train images, each with a copy (default %(default)s)"
    )
    parser.add_argument(
        "--class-queries",
        type=int,
        default=500,
        help="other images per split, the class-level queries (default %(default)s)",
    )
    parser.add_argument("--threads", type=int, default=0, help="ONNX Runtime threads (0: its default)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    build(args)
    print(json.dumps({"out": str(args.out)}))
    return 0


if __name__ == "__main__":
    sys.exit(main())

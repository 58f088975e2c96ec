"""Near-duplicate photo search on real photographs: EfficientNet-Lite0 (v1) → Lite2 (v2).

    python benchmarks/photo_near_duplicates.py --out runs/bench/photos --seed 0        # the task files (~17 min)
    python benchmarks/photo_side_info.py runs/bench/photos/photo-near-duplicates-seed0-side-{lite1,simclr}.npz \\
        --out runs/bench/photos/side-choice --no-selection                            # ψ and residual.ridge, held out
    python benchmarks/instance_tasks.py runs/bench/photos/photo-near-duplicates-seed0-side-lite1.npz \\
        --out runs/bench/photos/runs --seeds 0 1 2 --methods residual --no-query-map --set selection.enabled=false \\
        --set query_positives.enabled=true --set transition.enabled=true --set hubness.enabled=true --set residual.ridge=0.3

The photos are the Debian wallpapers (:mod:`photo_data`), split by *source photo* with the seed:
half for evaluation, half for training, so no adapter ever sees a tile of an evaluation photo.

- evaluation: the gallery is ``--eval-items`` tiles of the evaluation photos (JPEG, quality 90);
  the queries are edited copies of the first ``--eval-queries`` of them (crop, small rotation,
  rescale, colour change, JPEG re-compression: :func:`photo_data.edited_copy`), each with that
  tile as its one positive — the other tiles of the same photo, which overlap it at other
  scales, are distractors.
- training: ``--train-items`` tiles of the training photos, each with one edited copy as query.

Every image is embedded the way a device embeds it (the kit's preprocessing, the exported ONNX
graphs of :mod:`image_onnx_models`): old = Lite0 (224 px), new = Lite2 (260 px), and two side-info
candidates ψ for the gallery: Lite1 (240 px), and SimCLR trained on the training photos' tiles
(:mod:`photo_side_info`; nothing of the evaluation photos). One task file per ψ is written
(``…-side-lite1.npz``, ``…-side-simclr.npz``; the kit's task format, level ``instance``, primary
metric recall@1), and ``…-vectors.npz`` keeps every embedding so a rebuild embeds nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np
from debian_data import BenchmarkSetupError
from image_onnx_models import ExportedImageModel, embed_sets, load_exported
from photo_data import debian_photos, edited_copy, jpeg_bytes, photo_tiles, split_photos

OLD, NEW, SIDE_CANDIDATES = "lite0", "lite2", ("lite1", "simclr")


@dataclasses.dataclass(frozen=True)
class PhotoItems:
    """Gallery tiles (JPEG bytes) and the edited copies of the first ``len(query_ids)`` of them."""

    ids: list[str]
    files: list[bytes]
    query_ids: list[str]
    query_files: list[bytes]


def photo_items(photos, count: int, queries: int, seed: int) -> PhotoItems:
    """``count`` tiles of ``photos`` drawn with ``seed``, and edited copies of ``queries`` of them
    (drawn too). Two passes over the photos, so only the drawn tiles are ever held."""
    rng = np.random.default_rng(seed)
    every = [tile_id for photo in photos for tile_id, _ in photo_tiles(photo)]
    if count > len(every):
        raise BenchmarkSetupError(f"{count} tiles asked for, these {len(photos)} photos give {len(every)}")
    drawn = [every[i] for i in sorted(rng.choice(len(every), size=count, replace=False))]
    queried = {drawn[q] for q in rng.choice(count, size=queries, replace=False)}
    wanted, files, edits = set(drawn), {}, {}
    edit_rng = np.random.default_rng(seed + 1)
    for photo in photos:
        for tile_id, tile in photo_tiles(photo):
            if tile_id in wanted:
                files[tile_id] = jpeg_bytes(tile)
                if tile_id in queried:
                    edits[tile_id] = edited_copy(tile, edit_rng)
    query_ids = [i for i in drawn if i in queried]
    return PhotoItems(drawn, [files[i] for i in drawn], query_ids, [edits[i] for i in query_ids])


def photo_split(
    seed: int, eval_items: int, eval_queries: int, train_items: int, eval_fraction: float = 0.5
) -> tuple[PhotoItems, PhotoItems]:
    """(training items, evaluation items) from disjoint source photos; every training tile has a query."""
    train_photos, eval_photos = split_photos(debian_photos(), eval_fraction, seed)
    return photo_items(train_photos, train_items, train_items, seed + 100), photo_items(
        eval_photos, eval_items, eval_queries, seed
    )


def embed_items(
    models: Mapping[str, ExportedImageModel],
    items: PhotoItems,
    threads: int = 0,
    log=lambda message: print(message, flush=True),
) -> dict[tuple[str, str], np.ndarray]:
    """Every model's vectors of the gallery tiles and of the queries, by (model name, 'gallery'|'query')."""
    return embed_sets(models, {"gallery": items.files, "query": items.query_files}, threads, log)


def photo_task(
    train: PhotoItems,
    evaluation: PhotoItems,
    vectors_train: Mapping,
    vectors_eval: Mapping,
    old: str = OLD,
    new: str = NEW,
    side: str | None = "lite1",
    name: str = "photo-near-duplicates",
) -> Any:
    """The instance-level task (kit format): each query's one positive is the tile it was edited from."""
    from fctkit.trainer.relevance import Positives
    from fctkit.trainer.tasks import RetrievalTask, TaskSet, TaskSplit

    def split(items: PhotoItems, vectors: Mapping, prefix: str) -> TaskSplit:
        position = {item_id: row for row, item_id in enumerate(items.ids)}
        n, nq = len(items.ids), len(items.query_ids)
        side_vectors = vectors[side, "gallery"] if side else np.zeros((n, 0), np.float32)
        gallery = TaskSet(
            np.array([prefix + i for i in items.ids]), vectors[old, "gallery"], vectors[new, "gallery"], side_vectors
        )
        query = TaskSet(
            np.array([f"q-{prefix}{i}" for i in items.query_ids]),
            vectors[old, "query"],
            vectors[new, "query"],
            np.zeros((nq, 0), np.float32),
        )
        return TaskSplit(query, gallery, Positives.from_lists([[position[i]] for i in items.query_ids], n))

    return RetrievalTask(
        name, "instance", "recall@1", split(train, vectors_train, "train-"), split(evaluation, vectors_eval, "")
    )


def save_vectors(path: Path, vectors: Mapping[str, Mapping[tuple[str, str], np.ndarray]]) -> None:
    np.savez(
        path,
        **{f"{split}.{model}.{part}": array for split, by in vectors.items() for (model, part), array in by.items()},
    )


def load_vectors(path: Path) -> dict[str, dict[tuple[str, str], np.ndarray]]:
    vectors: dict[str, dict[tuple[str, str], np.ndarray]] = {}
    with np.load(path) as data:
        for key in data.files:
            split, model, part = key.split(".")
            vectors.setdefault(split, {})[model, part] = data[key]
    return vectors


def build(args: argparse.Namespace) -> dict[str, Any]:
    """Embed (or reuse the vectors of) the seed's split with every model; write one task file per ψ."""
    from instance_tasks import save_built_task
    from photo_side_info import train_simclr_side_info

    started = time.perf_counter()
    stem = args.out / f"photo-near-duplicates-seed{args.seed}"
    train, evaluation = photo_split(args.seed, args.eval_items, args.eval_queries, args.train_items)
    vectors_file = stem.with_name(stem.name + "-vectors.npz")
    if vectors_file.is_file():
        vectors = load_vectors(vectors_file)
    else:
        models = dict(load_exported(args.out / "models", (OLD, NEW, "lite1")))
        models["simclr"] = train_simclr_side_info(
            train.files, args.out / "models", seed=args.seed, epochs=args.simclr_epochs
        )
        vectors = {
            "train": embed_items(models, train, args.threads),
            "eval": embed_items(models, evaluation, args.threads),
        }
        save_vectors(vectors_file, vectors)
    facts = {
        "seed": args.seed,
        "photos": "Debian wallpapers (benchmarks/photo_data.py)",
        "old": OLD,
        "new": NEW,
        "eval gallery": len(evaluation.ids),
        "eval queries": len(evaluation.query_ids),
        "train pairs": len(train.ids),
    }
    for side in SIDE_CANDIDATES:
        task = photo_task(train, evaluation, vectors["train"], vectors["eval"], side=side)
        save_built_task(stem.with_name(f"{stem.name}-side-{side}.npz"), task, dict(facts, side=side), started)
    return facts


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument(
        "--seed", type=int, default=0, help="which photos evaluate, which tiles, which edits (default %(default)s)"
    )
    parser.add_argument("--eval-items", type=int, default=2000, help="evaluation gallery tiles (default %(default)s)")
    parser.add_argument("--eval-queries", type=int, default=500, help="evaluation queries (default %(default)s)")
    parser.add_argument(
        "--train-items", type=int, default=1500, help="training tiles, each with a query (default %(default)s)"
    )
    parser.add_argument("--simclr-epochs", type=int, default=10, help="SimCLR ψ training epochs (default %(default)s)")
    parser.add_argument("--threads", type=int, default=0, help="ONNX Runtime threads (0: its default)")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    try:
        facts = build(args)
    except BenchmarkSetupError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(json.dumps(facts))
    return 0


if __name__ == "__main__":
    sys.exit(main())

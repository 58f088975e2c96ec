"""Does the device's label-free upgrade health signal separate a good adapter from broken ones?

    python benchmarks/upgrade_health_signal.py                 # 5 seeds, samples of 32 and 64
    python benchmarks/upgrade_health_signal.py --seeds 3 --metric cosine

Sampled fidelity (:mod:`fctkit.upgrade_health`) on the embedded digits data, per
seed: a stratified split (60 % train, 40 % held-out evaluation gallery), an old backbone
(small CNN, 32-d, classes 0-4 only, the FCT protocol), a new backbone (wide CNN, 64-d, all
classes), and six adapters old → new, all trained on the train split and applied to the
old model's embeddings of the held-out gallery:

* good: FCT (branches 64, mixer 256, 40 epochs, no side-information);
* shuffled pairs: the same FCT trained on old/new features of different images;
* random orthogonal: a random 32→64 isometry (keeps every old inner product);
* other old (seed) / other old (arch): FCT trained for another old backbone (another seed of
  the small CNN / a wide CNN), applied to this old model's embeddings;
* truncated: the same FCT stopped after one epoch (8 optimiser steps of 128 rows).

Each adapted gallery gets the signal for samples of 32 and 64 rows drawn by ``sample_rows``
(``--draws`` sample seeds per model seed, the same rows for every adapter), the sampled rows
re-embedded by the new backbone. Printed: per adapter and sample size the mean / min / max of
the mean cosine, the 10th-percentile cosine and self-retrieval R@1 over the runs (and the mean
MRR); for mean cosine, R@1 and MRR the gap and ratio between the worst good run and the best
broken run; a threshold between them (what a
``--halt-below`` guard could use); and, beside it, the labelled figures the gate would see
(leave-one-out top-1 of new-model queries against the adapted gallery) and the old-space vs
adapted-space 10-NN overlap, which scores the random orthogonal map perfect.
"""

from __future__ import annotations

import argparse
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from fctkit.trainer.adapters import FCTAdapter
from fctkit.trainer.backbones import BackboneConfig, extract_features, train_backbone
from fctkit.trainer.datasets import ImageDataset, load_dataset, make_splits, old_class_subset
from fctkit.trainer.evaluation import evaluate_retrieval
from fctkit.trainer.ranking import pairwise_distances
from fctkit.upgrade_health import UpgradeHealth, sample_rows, upgrade_health

GOOD = "good FCT"
SIGNALS = ("mean_cosine", "p10_cosine", "recall_at_1")
NEIGHBOURS = 10


@dataclass(frozen=True)
class Embeddings:
    """One seed's models applied to its split: old (the device's model), two other old models,
    new; ``*_train`` rows train the adapters, ``*_eval`` rows are the device's gallery."""

    old_train: np.ndarray
    old_eval: np.ndarray
    other_seed_train: np.ndarray
    other_arch_train: np.ndarray
    new_train: np.ndarray
    new_eval: np.ndarray
    eval_labels: np.ndarray
    eval_ids: list[str]


@dataclass(frozen=True)
class Run:
    adapter: str
    seed: int
    sample_size: int
    health: UpgradeHealth


def embed(data: ImageDataset, seed: int) -> Embeddings:
    splits = make_splits(data.labels, seed=seed, query_fraction=0.0)
    train, held_out = data.subset(splits.train), data.subset(splits.gallery)
    old_train = train.subset(old_class_subset(train.labels))

    def backbone(images: ImageDataset, architecture: str, dim: int, model_seed: int):
        return train_backbone(
            images.images, images.labels, BackboneConfig(architecture, dim, progress=False), model_seed, "cpu"
        )

    old, other_seed = backbone(old_train, "small", 32, seed), backbone(old_train, "small", 32, seed + 1000)
    other_arch, new = backbone(old_train, "wide", 32, seed), backbone(train, "wide", 64, seed)
    return Embeddings(
        old_train=extract_features(old, train.images),
        old_eval=extract_features(old, held_out.images),
        other_seed_train=extract_features(other_seed, train.images),
        other_arch_train=extract_features(other_arch, train.images),
        new_train=extract_features(new, train.images),
        new_eval=extract_features(new, held_out.images),
        eval_labels=held_out.labels,
        eval_ids=[f"digit-{i}" for i in splits.gallery],
    )


def fct(old: np.ndarray, new: np.ndarray, seed: int, epochs: int = 40) -> FCTAdapter:
    train = {
        "epochs": epochs,
        "batch_size": 128,
        "lr": 2e-3,
        "warmup_epochs": min(5, epochs - 1),
        "seed": seed,
        "device": "cpu",
        "progress": False,
    }
    adapter, _ = FCTAdapter.fit(
        old, new, config={"side_info": False, "branch_width": 64, "mixer_width": 256, "train": train}
    )
    return adapter


def random_isometry(d_in: int, d_out: int, seed: int) -> np.ndarray:
    """A d_in×d_out matrix with orthonormal rows: x ↦ xQ keeps every inner product."""
    q, _ = np.linalg.qr(np.random.default_rng(seed).standard_normal((d_out, d_in)))
    return q.T.astype(np.float32)


def adapted_galleries(e: Embeddings, seed: int) -> dict[str, np.ndarray]:
    """Each adapter's h(old) of the held-out gallery."""
    shuffled = np.random.default_rng(seed).permutation(len(e.new_train))
    makers: dict[str, Callable[[], np.ndarray]] = {
        GOOD: lambda: fct(e.old_train, e.new_train, seed).transform(e.old_eval),
        "shuffled pairs": lambda: fct(e.old_train, e.new_train[shuffled], seed).transform(e.old_eval),
        "random orthogonal": lambda: e.old_eval @ random_isometry(e.old_eval.shape[1], e.new_eval.shape[1], seed),
        "other old (seed)": lambda: fct(e.other_seed_train, e.new_train, seed).transform(e.old_eval),
        "other old (arch)": lambda: fct(e.other_arch_train, e.new_train, seed).transform(e.old_eval),
        "truncated": lambda: fct(e.old_train, e.new_train, seed, epochs=1).transform(e.old_eval),
    }
    return {name: make() for name, make in makers.items()}


def neighbourhood_overlap(before: np.ndarray, after: np.ndarray, metric: str) -> float:
    """Mean share of each row's 10 nearest (itself excluded) kept between the two spaces."""

    def nearest(x: np.ndarray) -> np.ndarray:
        d = pairwise_distances(x, x, metric)
        np.fill_diagonal(d, np.inf)
        return np.argsort(d, axis=1, kind="stable")[:, :NEIGHBOURS]

    a, b = nearest(before), nearest(after)
    return float(np.mean([len(np.intersect1d(x, y)) / NEIGHBOURS for x, y in zip(a, b)]))


def gate_top1(e: Embeddings, adapted: np.ndarray, metric: str) -> float:
    """What the server's gate sees with labels: new-model queries against the adapted gallery."""
    return evaluate_retrieval(
        e.new_eval, e.eval_labels, adapted, e.eval_labels, distance=metric, leave_one_out=True, topk=(1,)
    ).top1


def spread(values: list[float]) -> str:
    return f"{np.mean(values):6.3f} [{min(values):6.3f}, {max(values):6.3f}]"


def print_table(runs: list[Run], sizes: list[int]) -> None:
    adapters = list(dict.fromkeys(r.adapter for r in runs))
    print(
        f"\n{'adapter':20s} {'k':>3s} {'runs':>4s}   {'mean cosine: mean [min, max]':30s} "
        f"{'p10 cosine':30s} {'R@1':30s} {'MRR':>6s}"
    )
    for adapter in adapters:
        for size in sizes:
            chosen = [r.health for r in runs if r.adapter == adapter and r.sample_size == size]
            cells = "".join(f"{spread([getattr(h, s) for h in chosen]):30s} " for s in SIGNALS)
            print(
                f"{adapter:20s} {size:3d} {len(chosen):4d}   {cells}{np.mean([h.mean_reciprocal_rank for h in chosen]):6.3f}"
            )


def print_gaps(runs: list[Run], sizes: list[int]) -> None:
    print(
        "\nseparation: worst good run vs best broken run (gap = worst good − best broken; "
        "ratio = worst good / best broken)"
    )
    for signal in ("mean_cosine", "recall_at_1", "mean_reciprocal_rank"):
        for size in sizes:
            good = [getattr(r.health, signal) for r in runs if r.adapter == GOOD and r.sample_size == size]
            broken = [r for r in runs if r.adapter != GOOD and r.sample_size == size]
            best = max(broken, key=lambda r: getattr(r.health, signal))
            worst, top = min(good), getattr(best.health, signal)
            verdict = (
                f"separated; a --halt-below threshold in ({top:.3f}, {worst:.3f}), e.g. {(top + worst) / 2:.3f}"
                if worst > top
                else "NOT separated"
            )
            ratio = f"{worst / top:.2f}" if top > 0 else "inf"
            print(
                f"  {signal:20s} k={size:2d}: worst good {worst:.3f}, best broken {top:.3f} ({best.adapter}), "
                f"gap {worst - top:+.3f}, ratio {ratio}: {verdict}"
            )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--seeds", type=int, default=5, help="model seeds (splits, backbones, adapters); a measurement wants >= 3"
    )
    parser.add_argument("--draws", type=int, default=5, help="sample seeds per model seed and sample size")
    parser.add_argument("--sizes", type=int, nargs="+", default=[32, 64], help="sample sizes (rows re-embedded)")
    parser.add_argument(
        "--metric", default="l2", choices=["l2", "cosine"], help="the bundle's distance (digits runs: l2)"
    )
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = parser.parse_args(argv)
    if min(args.seeds, args.draws, *args.sizes) < 1:
        parser.error("--seeds, --draws and --sizes must be >= 1")
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    data = load_dataset("digits")
    runs: list[Run] = []
    gate: dict[str, list[float]] = {}
    overlap: dict[str, list[float]] = {}
    for seed in range(args.seeds):
        e = embed(data, seed)
        for name, adapted in adapted_galleries(e, seed).items():
            gate.setdefault(name, []).append(gate_top1(e, adapted, args.metric))
            overlap.setdefault(name, []).append(neighbourhood_overlap(e.old_eval, adapted, args.metric))
            for size in args.sizes:
                for draw in range(args.draws):
                    sample = sample_rows(e.eval_ids, size, seed=1000 * seed + draw)
                    health = upgrade_health(adapted, sample, e.new_eval[sample], args.metric)
                    runs.append(Run(name, seed, size, health))
    gallery_rows = len(e.eval_ids)
    print(
        f"digits, {args.seeds} seeds x {args.draws} sample draws, held-out gallery of {gallery_rows} rows, "
        f"metric {args.metric}, old 32-d (classes 0-4) -> new 64-d"
    )
    print_table(runs, args.sizes)
    print_gaps(runs, args.sizes)
    print(
        f"\nwith labels, per adapter over the seeds: gate top-1 (new queries vs adapted gallery, leave-one-out) and "
        f"old vs adapted {NEIGHBOURS}-NN overlap (label-free, old space only)"
    )
    for name in gate:
        print(f"  {name:20s} top-1 {spread(gate[name])}   overlap {spread(overlap[name])}")
    print(f"\n{time.perf_counter() - start:.0f} s, {args.threads} torch threads")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Does the default rollout guard halt harmful releases, and only those, at instance and class level?

    python benchmarks/upgrade_health_guard.py                                   # the embedded synthetic task
    python benchmarks/upgrade_health_guard.py --task runs/quality/tasks/photos-1k.npz --seeds 0 1
    python benchmarks/upgrade_health_guard.py --level class       # digits: FCT adapters, pixel-noise fleets

For an instance-level task (``fctkit-task/1``), per seed, releases old → new are trained on the
task's training pairs (gallery items' old → new embeddings, with ψ when the task has one):

* good: the residual InfoNCE adapter (``fctkit train``'s instance-level adapter, fixed settings);
* 5% pairs / 10% pairs: the same on a random 5% / 10% of the pairs;
* 2 epochs: the same stopped after 2 epochs;
* least squares: the ridge map old → new;
* 30% shuffled: the good adapter's recipe on pairs whose targets are shuffled for 30% of them;
* wrong ψ (a task with ψ): the good adapter fed another item's ψ on the devices.

Each release gets what ``fctkit export`` records in its manifest: the gate's cases on the evaluation
split (old/old, new/h(old) R@1) and the health expectation (``expected_health``: samples of 32, by
gallery size; its break-even by gallery size: not upgrading's figure over the release's on cuts of
the evaluation split of that size). Then two fleets of ``--devices`` simulated devices,
one owner each, upgrade to it: each holds ``--rows`` items of the evaluation gallery and measures
its health exactly as a device does (32 rows, ``sample_rows``, ``upgrade_health``); the second
fleets' devices are "noisy" (Gaussian noise on every embedding of their items, old and new alike,
each ``--noise`` level × the embeddings' mean norm ÷ √d per coordinate): devices whose data the
evaluation split does not represent.

True quality on a fleet: the mean over its devices of R@1 of the new model's queries for the
device's items against its upgraded gallery; not upgrading: old queries against the old gallery.
A release is harmful on a fleet when its true quality is below not upgrading, useful otherwise.
The guard (the server's default, ``DEFAULT_GUARD_MARGIN`` and ``DEFAULT_GUARD_OWNERS``) halts when the
median device's vote falls under 1: its measure ÷ the expectation at its gallery size, over its
bound there (1 − margin, or the break-even at that size when above 1: the release did worse than
not upgrading on the evaluation split at that size); "(margin alone)" shows the verdict without the
break-even.

Printed per release and fleet: true R@1 vs not upgrading, the fleet's median R@1, mean cosine and
median rank, the expectation, the median ratio, the verdict; the last line
``guard: harmful halted H/H, useful halted U/N``.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from fctkit.protos.health_expectation import HealthExpectation
from fctkit.server.rollout.changes import DEFAULT_GUARD_MARGIN, DEFAULT_GUARD_OWNERS
from fctkit.trainer.backbones import BackboneConfig, extract_features, train_backbone
from fctkit.trainer.closed_form import least_squares_map
from fctkit.trainer.datasets import load_dataset, make_splits, old_class_subset
from fctkit.trainer.residual import ResidualAdapter
from fctkit.trainer.tasks import RetrievalTask, load_task
from fctkit.upgrade_health import DEFAULT_SAMPLE_SIZE, UpgradeHealth, expected_health, sample_rows, upgrade_health

sys.path.insert(0, str(Path(__file__).resolve().parent))
from upgrade_health_signal import fct, random_isometry

SYNTHETIC = "examples/tasks/synthetic-instance.npz"


@dataclass(frozen=True)
class Release:
    name: str
    forward: object  # (old, side) -> adapted
    wrong_side: bool = False


@dataclass(frozen=True)
class Fleet:
    """What a fleet's devices hold: per device, its gallery rows (eval gallery indices) and its
    queries (eval query indices whose positive is among them); noise on every embedding."""

    name: str
    galleries: list[np.ndarray]
    queries: list[np.ndarray]
    noise: dict[str, np.ndarray]


def unit(x: np.ndarray) -> np.ndarray:
    return x / np.maximum(np.linalg.norm(x, axis=1, keepdims=True), 1e-12)


def r_at_1(queries: np.ndarray, gallery: np.ndarray, truth: np.ndarray) -> float:
    return float(np.mean(np.argmax(unit(queries) @ unit(gallery).T, axis=1) == truth))


def residual(task: RetrievalTask, rows: np.ndarray, targets: np.ndarray, epochs: int, seed: int):
    """The residual InfoNCE adapter trained on the training gallery's ``rows`` towards ``targets``."""
    g = task.train.gallery
    side = g.side[rows] if g.side.shape[1] else None
    train = {"epochs": epochs, "batch_size": min(256, len(rows)), "lr": 3e-3, "weight_decay": 1e-4,
             "warmup_epochs": min(2, epochs - 1), "patience": 8, "seed": seed, "progress": False}  # fmt: skip
    model, _ = ResidualAdapter.fit(g.old[rows], targets, side, {"train": train, "side_info": side is not None})
    return lambda old, s: model.transform(old, s if side is not None else None)


def releases(task: RetrievalTask, seed: int, epochs: int) -> list[Release]:
    g = task.train.gallery
    n = len(g)
    rng = np.random.default_rng(seed)
    everything = np.arange(n)
    shuffled = g.new.copy()
    moved = rng.choice(n, int(0.3 * n), replace=False)
    shuffled[moved] = g.new[rng.permutation(moved)]
    inputs = np.hstack([g.old, g.side]) if g.side.shape[1] else g.old
    ls = least_squares_map(inputs, g.new, ridge=1e-3 * float(np.mean(np.sum(inputs**2, axis=1))))
    good = residual(task, everything, g.new, epochs, seed)
    made = [
        Release("good", good),
        Release(
            "5% pairs",
            residual(task, part := np.sort(rng.choice(n, max(8, n // 20), False)), g.new[part], epochs, seed),
        ),
        Release(
            "10% pairs",
            residual(task, part := np.sort(rng.choice(n, max(8, n // 10), False)), g.new[part], epochs, seed),
        ),
        Release("2 epochs", residual(task, everything, g.new, 2, seed)),
        Release("least squares", lambda old, s: (np.hstack([old, s]) if s is not None and s.shape[1] else old) @ ls),
        Release("30% shuffled", residual(task, everything, shuffled, epochs, seed)),
    ]
    if g.side.shape[1]:
        made.append(Release("wrong ψ", good, wrong_side=True))
    return made


def fleets(task: RetrievalTask, devices: int, rows: int, noise: list[float], seed: int) -> list[Fleet]:
    e = task.evaluation
    positive_of = {int(e.positives.of(q)[0][0]): q for q in range(e.positives.n_queries)}
    rng = np.random.default_rng(seed + 1000)
    galleries, queries = [], []
    for _ in range(devices):
        items = np.sort(rng.choice(len(e.gallery), min(rows, len(e.gallery)), replace=False))
        galleries.append(items)
        queries.append(np.array([positive_of.get(int(i), -1) for i in items]))

    def scale(x: np.ndarray) -> float:
        return float(np.mean(np.linalg.norm(x, axis=1))) / np.sqrt(x.shape[1])

    noisy = {
        f"{split}.{kind}": rng.normal(0, scale(getattr(getattr(e, split), kind)), getattr(getattr(e, split), kind).shape)
        for split in ("query", "gallery") for kind in ("old", "new")
    }  # fmt: skip
    clean = {k: np.zeros_like(v) for k, v in noisy.items()}
    return [Fleet("clean", galleries, queries, clean)] + [
        Fleet(f"noisy {level:g}", galleries, queries, {k: v * level for k, v in noisy.items()}) for level in noise
    ]


def instance_measured(task: RetrievalTask, release: Release, fleet: Fleet, seed: int) -> Measured:
    """The release's gate and expectation on the evaluation split, and the fleet's health and quality."""
    e = task.evaluation
    side = e.gallery.side if e.gallery.side.shape[1] else None
    adapted_eval = release.forward(e.gallery.old, side)
    truth = np.array([int(e.positives.of(q)[0][0]) for q in range(e.positives.n_queries)])
    cases = {
        "old/old": {"recall@1": r_at_1(e.query.old, e.gallery.old, truth)},
        "new/h(old)": {"recall@1": r_at_1(e.query.new, adapted_eval, truth)},
        "new/new": {"recall@1": r_at_1(e.query.new, e.gallery.new, truth)},
    }
    sizes, measures = expected_health(adapted_eval, e.gallery.new, "cosine", sample_size=DEFAULT_SAMPLE_SIZE)

    def cut_ratio(rows: np.ndarray) -> tuple[float, float]:
        where = {int(g): k for k, g in enumerate(rows)}
        asked = np.array([q for q in range(len(truth)) if int(truth[q]) in where], dtype=np.int64)
        local = np.array([where[int(truth[q])] for q in asked])
        return r_at_1(e.query.old[asked], e.gallery.old[rows], local), r_at_1(
            e.query.new[asked], adapted_eval[rows], local
        )

    sized = sized_break_even(len(adapted_eval), sizes, cut_ratio)
    expectation = HealthExpectation.measured(cases, sizes, measures, DEFAULT_SAMPLE_SIZE, 16, sized)
    device_side = side
    if release.wrong_side and side is not None:
        device_side = side[np.random.default_rng(seed + 7).permutation(len(side))]
    n = fleet.noise
    adapted = release.forward(e.gallery.old + n["gallery.old"], device_side)
    new_gallery = e.gallery.new + n["gallery.new"]
    healths, true, stay = [], [], []
    for d, (items, queries) in enumerate(zip(fleet.galleries, fleet.queries)):
        sample = sample_rows([f"row-{i}" for i in items], min(DEFAULT_SAMPLE_SIZE, len(items)), seed * 1000 + d)
        healths.append(upgrade_health(adapted[items], sample, new_gallery[items[sample]], "cosine"))
        asked = queries >= 0
        local = np.flatnonzero(asked)
        q = queries[asked]
        true.append(r_at_1(e.query.new[q] + n["query.new"][q], adapted[items], local))
        stay.append(r_at_1(e.query.old[q] + n["query.old"][q], e.gallery.old[items] + n["gallery.old"][items], local))
    return Measured(healths, true, stay, expectation, cases["new/h(old)"]["recall@1"])


def sized_break_even(
    n: int, sizes: tuple[int, ...], cut: Callable[[np.ndarray], tuple[float, float]], draws: int = 16
) -> tuple[float, ...]:
    """As ``fctkit export`` records it: per gallery size, not upgrading's figure over the release's,
    each the mean over ``draws`` galleries of that size cut from the ``n`` evaluation items
    (``cut(rows)``: the two figures on one cut)."""
    rng = np.random.default_rng(0)
    ratios = []
    for size in sizes:
        figures = np.array([cut(np.sort(rng.choice(n, size, replace=False))) for _ in range(draws)])
        ratios.append(float(figures[:, 0].mean()) / max(float(figures[:, 1].mean()), 1e-3))
    return tuple(ratios)


@dataclass(frozen=True)
class Measured:
    """One release on one fleet: each device's health, true quality and quality without upgrading,
    and what the release's manifest would record (its expectation, the gate's figure)."""

    healths: list[UpgradeHealth]
    true: list[float]
    stay: list[float]
    expectation: HealthExpectation
    gate: float


def verdict(m: Measured) -> dict:
    """What the server's default guard does with the fleet's reports (one owner per device)."""
    level = m.expectation.level
    measure = m.expectation.guard_measure
    margin = DEFAULT_GUARD_MARGIN[level]
    ratios = [m.expectation.ratio(measure, getattr(h, measure), h.gallery_rows) for h in m.healths]
    votes = [m.expectation.vote(measure, getattr(h, measure), h.gallery_rows, margin) for h in m.healths]
    reported = len(ratios) >= DEFAULT_GUARD_OWNERS
    return {
        "true": float(np.mean(m.true)),
        "stay": float(np.mean(m.stay)),
        "r1": statistics.median(h.recall_at_1 for h in m.healths),
        "cos": statistics.median(h.mean_cosine for h in m.healths),
        "rank": statistics.median(h.median_rank for h in m.healths),
        "expected": m.expectation.expected(measure, m.healths[0].gallery_rows)[0],
        "ratio": statistics.median(ratios),
        "threshold": m.expectation.bound(margin, m.healths[0].gallery_rows),
        "halted": reported and statistics.median(votes) < 1.0,
        "relative_only": reported and statistics.median(ratios) < 1.0 - DEFAULT_GUARD_MARGIN[level],
        "gate": m.gate,
    }


def instance_runs(args: argparse.Namespace) -> Iterator[tuple[int, str, str, Measured]]:
    task = load_task(args.task)
    if task.level != "instance" or task.evaluation.positives is None:
        raise SystemExit(f"{args.task} is a {task.level}-level task; --level instance needs an instance-level one")
    print(f"task {task.name}: {len(task.train.gallery)} training pairs, {len(task.evaluation.gallery)} eval items")
    for seed in args.seeds:
        made = releases(task, seed, args.epochs)
        for fleet in fleets(task, args.devices, args.rows, args.noise, seed):
            for release in made:
                yield seed, release.name, fleet.name, instance_measured(task, release, fleet, seed)


@dataclass(frozen=True)
class DigitsViews:
    """One seed's digits embeddings: the training split's old and new features, and the held-out
    gallery's labels and old/new features as each fleet's cameras see it (fleet name -> (old, new))."""

    old_train: np.ndarray
    new_train: np.ndarray
    labels: np.ndarray
    views: dict[str, tuple[np.ndarray, np.ndarray]]


def digits_views(seed: int, noise: list[float]) -> DigitsViews:
    """The FCT protocol on digits (old: small CNN, 32-d, classes 0-4; new: wide CNN, 64-d, all
    classes), the held-out gallery embedded clean and with Gaussian pixel noise of each level."""
    data = load_dataset("digits")
    splits = make_splits(data.labels, seed=seed, query_fraction=0.0)
    train, held_out = data.subset(splits.train), data.subset(splits.gallery)
    old_train = train.subset(old_class_subset(train.labels))

    def backbone(images, architecture: str, dim: int):
        return train_backbone(
            images.images, images.labels, BackboneConfig(architecture, dim, progress=False), seed, "cpu"
        )

    old, new = backbone(old_train, "small", 32), backbone(train, "wide", 64)
    rng = np.random.default_rng(seed + 2000)
    views = {}
    for level in (0.0, *noise):
        images = np.clip(held_out.images + rng.normal(0, level, held_out.images.shape), 0, 1).astype(np.float32)
        views["clean" if level == 0 else f"noisy {level:g}"] = (
            extract_features(old, images),
            extract_features(new, images),
        )
    return DigitsViews(extract_features(old, train.images), extract_features(new, train.images), held_out.labels, views)


def class_releases(d: DigitsViews, seed: int) -> dict[str, Callable[[np.ndarray], np.ndarray]]:
    """Old -> new maps: a good FCT adapter and worse ones, subtly (10% of the pairs, 5 epochs, 30% of
    the pairs shuffled) and grossly (all pairs shuffled, a random rotation, one epoch)."""
    rng = np.random.default_rng(seed)
    n = len(d.old_train)
    tenth = np.sort(rng.choice(n, n // 10, replace=False))
    shuffled = np.arange(n)
    moved = rng.choice(n, int(0.3 * n), replace=False)
    shuffled[moved] = rng.permutation(moved)
    rotation = random_isometry(d.old_train.shape[1], d.new_train.shape[1], seed)
    adapters = {
        "good FCT": fct(d.old_train, d.new_train, seed),
        "10% pairs": fct(d.old_train[tenth], d.new_train[tenth], seed),
        "5 epochs": fct(d.old_train, d.new_train, seed, epochs=5),
        "30% shuffled": fct(d.old_train, d.new_train[shuffled], seed),
        "all shuffled": fct(d.old_train, d.new_train[rng.permutation(n)], seed),
        "1 epoch": fct(d.old_train, d.new_train, seed, epochs=1),
    }
    maps: dict[str, Callable[[np.ndarray], np.ndarray]] = {name: a.transform for name, a in adapters.items()}
    maps["random rotation"] = lambda old: old @ rotation
    return maps


def top1_within(queries: np.ndarray, gallery: np.ndarray, labels: np.ndarray) -> float:
    """Leave-one-out top-1 of each query against the others of a device's gallery (L2, as digits runs)."""
    d = ((queries[:, None, :] - gallery[None, :, :]) ** 2).sum(-1)
    np.fill_diagonal(d, np.inf)
    return float(np.mean(labels[np.argmin(d, axis=1)] == labels))


def class_measured(d: DigitsViews, forward, fleet: str, galleries: list[np.ndarray], seed: int) -> Measured:
    old_clean, new_clean = d.views["clean"]
    adapted_clean = forward(old_clean)
    cases = {
        "old/old": {"top1": top1_within(old_clean, old_clean, d.labels)},
        "new/h(old)": {"top1": top1_within(new_clean, adapted_clean, d.labels)},
    }
    sizes, measures = expected_health(adapted_clean, new_clean, "l2", sample_size=DEFAULT_SAMPLE_SIZE)

    def cut_ratio(rows: np.ndarray) -> tuple[float, float]:
        labels = d.labels[rows]
        return top1_within(old_clean[rows], old_clean[rows], labels), top1_within(
            new_clean[rows], adapted_clean[rows], labels
        )

    sized = sized_break_even(len(adapted_clean), sizes, cut_ratio)
    expectation = HealthExpectation.measured(cases, sizes, measures, DEFAULT_SAMPLE_SIZE, 16, sized)
    old, new = d.views[fleet]
    adapted = forward(old)
    healths, true, stay = [], [], []
    for k, items in enumerate(galleries):
        sample = sample_rows([f"row-{i}" for i in items], DEFAULT_SAMPLE_SIZE, seed * 1000 + k)
        healths.append(upgrade_health(adapted[items], sample, new[items[sample]], "l2"))
        true.append(top1_within(new[items], adapted[items], d.labels[items]))
        stay.append(top1_within(old[items], old[items], d.labels[items]))
    return Measured(healths, true, stay, expectation, cases["new/h(old)"]["top1"])


def class_runs(args: argparse.Namespace) -> Iterator[tuple[int, str, str, Measured]]:
    print("digits: old small CNN 32-d (classes 0-4) -> new wide CNN 64-d, FCT adapters, L2; noisy fleets: pixel noise")
    for seed in args.seeds:
        d = digits_views(seed, args.noise)
        rng = np.random.default_rng(seed + 1000)
        galleries = [np.sort(rng.choice(len(d.labels), args.rows, replace=False)) for _ in range(args.devices)]
        for name, forward in class_releases(d, seed).items():
            for fleet in d.views:
                yield seed, name, fleet, class_measured(d, forward, fleet, galleries, seed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--level", choices=["instance", "class"], default="instance")
    parser.add_argument("--task", default=SYNTHETIC, help="--level instance: an instance-level fctkit-task/1 file")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--devices", type=int, default=30)
    parser.add_argument("--rows", type=int, default=64, help="items per device")
    parser.add_argument(
        "--noise",
        type=float,
        nargs="+",
        default=None,
        help="the noisy fleets' noise: × the embeddings' scale (instance; default 0.25 0.5), or the pixel noise's "
        "standard deviation on images in [0, 1] (class; default 0.15 0.3)",
    )
    parser.add_argument("--epochs", type=int, default=40)
    parser.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = parser.parse_args()
    args.noise = args.noise or ([0.25, 0.5] if args.level == "instance" else [0.15, 0.3])
    torch.set_num_threads(args.threads)
    started = time.perf_counter()
    counts = {"harmful": [0, 0, 0], "useful": [0, 0, 0]}
    level = args.level
    print(f"{level} level: {args.devices} devices of {args.rows} items, samples of {DEFAULT_SAMPLE_SIZE}; guard margin "
          f"{DEFAULT_GUARD_MARGIN[level]}, {DEFAULT_GUARD_OWNERS} owners")  # fmt: skip
    quality = "R@1" if level == "instance" else "top-1"
    print(f"seed  release            fleet      true {quality}  stay   kind     gate   expected  fleet R@1  cos    "
          "rank  ratio  threshold  verdict  (margin alone)")  # fmt: skip
    runs = instance_runs(args) if level == "instance" else class_runs(args)
    for seed, release, fleet, measured in runs:
        j = verdict(measured)
        kind = "harmful" if j["true"] < j["stay"] else "useful"
        counts[kind][0] += j["halted"]
        counts[kind][1] += 1
        counts[kind][2] += j["relative_only"]
        print(
            f"{seed:<5} {release:<18} {fleet:<10} {j['true']:.3f}      {j['stay']:.3f}  {kind:<8} "
            f"{j['gate']:.3f}  {j['expected']:.3f}     {j['r1']:.3f}      {j['cos']:.3f}  {j['rank']:<4g}  "
            f"{j['ratio']:.3f}  {j['threshold']:.3f}      {'HALTED ' if j['halted'] else 'goes on'}  "
            f"({'halted' if j['relative_only'] else 'goes on'})"
        )
    print(f"time: {time.perf_counter() - started:.0f} s")
    (h, nh, hr), (u, nu, ur) = counts["harmful"], counts["useful"]
    print(f"the margin alone, without the gate's break-even: harmful halted {hr}/{nh}, useful halted {ur}/{nu}")
    print(f"guard: harmful halted {h}/{nh}, useful halted {u}/{nu}")


if __name__ == "__main__":
    main()

"""Does the default rollout guard halt harmful instance-level releases, and only those?

    python benchmarks/upgrade_health_guard.py                                   # the embedded synthetic task
    python benchmarks/upgrade_health_guard.py --task runs/quality/tasks/photos-1k.npz --seeds 0 1

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
gallery size; its break-even from the gate). Then two fleets of ``--devices`` simulated devices,
one owner each, upgrade to it: each holds ``--rows`` items of the evaluation gallery and measures
its health exactly as a device does (32 rows, ``sample_rows``, ``upgrade_health``); the second
fleets' devices are "noisy" (Gaussian noise on every embedding of their items, old and new alike,
each ``--noise`` level × the embeddings' mean norm ÷ √d per coordinate): devices whose data the
evaluation split does not represent.

True quality on a fleet: the mean over its devices of R@1 of the new model's queries for the
device's items against its upgraded gallery; not upgrading: old queries against the old gallery.
A release is harmful on a fleet when its true quality is below not upgrading, useful otherwise.
The guard (the server's default, ``DEFAULT_GUARD_MARGIN`` and ``DEFAULT_GUARD_OWNERS``) halts when the
median device's R@1 ÷ the expectation at its gallery size falls under max(1 − margin, break-even);
"(margin alone)" shows the verdict without the break-even (the gate's own old/old ÷ release figure,
above 1 when the gate already found the release worse than not upgrading, i.e. one exported with
its gate overridden).

Printed per release and fleet: true R@1 vs not upgrading, the fleet's median R@1, mean cosine and
median rank, the expectation, the median ratio, the verdict; the last line
``guard: harmful halted H/H, useful halted U/N``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from dataclasses import dataclass

import numpy as np

from fctkit.protos.health_expectation import HealthExpectation
from fctkit.server.guard_votes import expected_threshold
from fctkit.server.rollout.changes import DEFAULT_GUARD_MARGIN, DEFAULT_GUARD_OWNERS
from fctkit.trainer.closed_form import least_squares_map
from fctkit.trainer.residual import ResidualAdapter
from fctkit.trainer.tasks import RetrievalTask, load_task
from fctkit.upgrade_health import DEFAULT_SAMPLE_SIZE, expected_health, sample_rows, upgrade_health

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


def judged(task: RetrievalTask, release: Release, fleet: Fleet, seed: int) -> dict:
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
    expectation = HealthExpectation.measured(cases, sizes, measures, DEFAULT_SAMPLE_SIZE, 16)
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
    ratios = [expectation.ratio("recall_at_1", h.recall_at_1, h.gallery_rows) for h in healths]
    threshold = expected_threshold(DEFAULT_GUARD_MARGIN["instance"], expectation)
    reported = len(ratios) >= DEFAULT_GUARD_OWNERS
    halted = reported and statistics.median(ratios) < threshold
    relative_only = reported and statistics.median(ratios) < 1.0 - DEFAULT_GUARD_MARGIN["instance"]
    return {
        "true": float(np.mean(true)),
        "stay": float(np.mean(stay)),
        "r1": statistics.median(h.recall_at_1 for h in healths),
        "cos": statistics.median(h.mean_cosine for h in healths),
        "rank": statistics.median(h.median_rank for h in healths),
        "expected": expectation.expected("recall_at_1", healths[0].gallery_rows)[0],
        "break_even": expectation.break_even,
        "ratio": statistics.median(ratios),
        "threshold": threshold,
        "halted": halted,
        "relative_only": relative_only,
        "gate": cases["new/h(old)"]["recall@1"],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--task", default=SYNTHETIC, help="an instance-level fctkit-task/1 file")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    parser.add_argument("--devices", type=int, default=30)
    parser.add_argument("--rows", type=int, default=64, help="items per device")
    parser.add_argument(
        "--noise", type=float, nargs="+", default=[0.25, 0.5], help="the noisy fleets' noise, × the embeddings' scale"
    )
    parser.add_argument("--epochs", type=int, default=40)
    args = parser.parse_args()
    task = load_task(args.task)
    if task.level != "instance" or task.evaluation.positives is None:
        raise SystemExit(f"{args.task} is a {task.level}-level task; this benchmark needs an instance-level one")
    started = time.perf_counter()
    counts = {"harmful": [0, 0, 0], "useful": [0, 0, 0]}
    print(f"task {task.name}: {len(task.train.gallery)} training pairs, {len(task.evaluation.gallery)} eval items; "
          f"{args.devices} devices of {args.rows} items, samples of {DEFAULT_SAMPLE_SIZE}; guard margin "
          f"{DEFAULT_GUARD_MARGIN['instance']}, {DEFAULT_GUARD_OWNERS} owners")  # fmt: skip
    header = "seed  release        fleet      true R@1  stay   kind     gate   expected  fleet R@1  cos    rank  ratio  threshold  verdict  (margin alone)"
    print(header)
    for seed in args.seeds:
        made = releases(task, seed, args.epochs)
        for fleet in fleets(task, args.devices, args.rows, args.noise, seed):
            for release in made:
                j = judged(task, release, fleet, seed)
                kind = "harmful" if j["true"] < j["stay"] else "useful"
                counts[kind][0] += j["halted"]
                counts[kind][1] += 1
                counts[kind][2] += j["relative_only"]
                print(
                    f"{seed:<5} {release.name:<14} {fleet.name:<10} {j['true']:.3f}     {j['stay']:.3f}  {kind:<8} "
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

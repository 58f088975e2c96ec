"""The quality suite: `fctkit train` with its pure defaults on instance-level tasks of different
sizes and modalities, over 3 seeds, against the figures stored in ``benchmarks/quality_figures.json``.

    python benchmarks/quality_suite.py run --tier full --out runs/quality              # every task, 3 seeds
    python benchmarks/quality_suite.py run --tier full --out runs/quality --defaults before-2026-11-29
    python benchmarks/quality_suite.py table --out runs/quality                        # markdown, every defaults set
    python benchmarks/quality_suite.py save --out runs/quality                         # store the current defaults' figures
    python benchmarks/quality_suite.py check --tier small --out runs/quality-check     # what `make test` runs

A default tuned on one benchmark is tuned to it: the suite holds tasks the kit's defaults were
never chosen on, and judges a change of a default on all of them. Each run is a user's run:
``data.name = "task"``, the task file, ``evaluation.distance = "cosine"`` and the seed, nothing else
(``--defaults`` names an older set of defaults, re-created with overrides, to compare with).

Per run the suite reads the run's gate: the variant it recommends for the gallery side (chosen on
held-out *training* data) and for the transition, their R@1 on the evaluation split as a share of
new/new, ECC, the wall time, and what each searched setting gained on held-out training data.
Per task: mean and sd over the seeds.

**The guard.** Every run records a fingerprint of every default of `fctkit train`
(:func:`defaults_fingerprint`), and ``save`` merges each task's summary into the stored figures;
``tests/trainer/test_quality_suite.py`` fails when any task's stored figures for the current
defaults were measured with other defaults (a default changed without the suite re-run and
saved), and runs the small tier, failing when a task's gallery-side share drops below its stored
mean by more than its seed spread (:func:`regressions`).

Tiers: ``small`` — a synthetic instance-level task built in code (minutes; `make test`); ``full`` —
the real tasks below, built by their benchmark scripts (hours on 2 cores; `make quality`).
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[1]
FIGURES = REPO / "benchmarks" / "quality_figures.json"
SEEDS = (0, 1, 2)
GALLERY_SIDE, TRANSITION = "gallery side", "during the transition"
MIN_SPREAD = 0.005  # a drop smaller than this is noise whatever the seeds' sd (R@1 on ≥ 400 queries)


@dataclasses.dataclass(frozen=True)
class SuiteTask:
    """One task of the suite: how to get its file and, optionally, how many training pairs to keep."""

    name: str
    tier: str  # "small" or "full"
    modality: str
    make: Callable[[Path], Path]  # folder for built files -> the task file
    describe: str
    train_pairs: int | None = None  # keep the first N training gallery items (and their queries)


def _built(relative: str, command: str) -> Callable[[Path], Path]:
    """A task file that a benchmark script builds (``command``, run from the repository when the
    file is missing: real models and data, minutes to an hour on 2 cores; cached afterwards)."""

    def make(_: Path) -> Path:
        path = REPO / relative
        if not path.is_file():
            print(f"building {relative}: {command}", flush=True)
            _, script, *args = command.split()
            subprocess.run([sys.executable, script, *args], cwd=REPO, check=True)
        return path

    return make


def _synthetic(n_train: int, n_eval: int, **shape: Any) -> Callable[[Path], Path]:
    def make(folder: Path) -> Path:
        from fctkit.trainer import save_task, synthetic_instance_task

        path = folder / f"synthetic-{n_train}-{n_eval}-{'-'.join(f'{k}{v}' for k, v in shape.items())}.npz"
        if not path.is_file():
            save_task(path, synthetic_instance_task(n_train=n_train, n_eval=n_eval, seed=0, **shape))
        return path

    return make


LEMMA = "python benchmarks/wordnet_lemma_task.py --out runs/bench/wordnet-lemma"
DEBIAN = "python benchmarks/debian_package_task.py --out runs/bench/debian-packages"
PHOTOS = (
    "python benchmarks/photo_near_duplicates.py --out runs/bench/photos2k --train-items 2000 --eval-queries 400 "
    "--simclr-epochs 1"
)
FASHION = (
    "python benchmarks/fashion_mnist_near_duplicates.py --out runs/bench/fmnist-neardup-2k "
    "--train-items 2000 --eval-queries 2000 --epochs-scale 0.3"
)
DEBIAN_FILE = "runs/bench/debian-packages/debian-synopsis-description-seed0.npz"
DEBIAN_20K_FILE = "runs/bench/debian-packages/debian-synopsis-description-seed0-train20000.npz"
PHOTO_FILE = "runs/bench/photos2k/photo-near-duplicates-seed0-side-lite1.npz"

TASKS = (
    SuiteTask("synthetic-1k", "small", "synthetic", _synthetic(1000, 600), "asymmetric synthetic, 1,000 pairs"),
    SuiteTask("lemma-gloss-6k", "full", "text", _built("runs/bench/wordnet-lemma/wordnet-lemma-gloss-seed0.npz", LEMMA),
              "WordNet lemma names → gloss, MiniLM → mpnet, ψ e5-small; 3,000 × 3,000"),
    SuiteTask("debian-1k", "full", "text", _built(DEBIAN_FILE, DEBIAN),
              "Debian package synopsis → description (asymmetric), 1,000 pairs; 3,000 × 3,000", 1000),
    SuiteTask("debian-6k", "full", "text", _built(DEBIAN_FILE, DEBIAN), "the same, 6,000 pairs"),
    SuiteTask("debian-20k", "full", "text", _built(DEBIAN_20K_FILE, DEBIAN + " --train-queries 20000"),
              "the same, 20,000 pairs"),
    SuiteTask("photos-1k", "full", "photos", _built(PHOTO_FILE, PHOTOS),
              "Debian photos, edited copy → tile, Lite0 → Lite2, ψ Lite1, 1,000 pairs; 400 × 2,000", 1000),
    SuiteTask("photos-2k", "full", "photos", _built(PHOTO_FILE, PHOTOS), "the same, 2,000 pairs"),
    SuiteTask("fashion-2k", "full", "images", _built(
        "runs/bench/fmnist-neardup-2k/fashion-mnist-near-duplicates-seed0.npz", FASHION),
        "Fashion-MNIST near duplicates, demo CNNs, 2,000 pairs; 2,000 × 10,000"),
)  # fmt: skip

# Older sets of defaults, re-created with overrides, to show what a change of defaults did.
DEFAULTS: dict[str, dict[str, Any]] = {
    "current": {},
    # batch 1,024 for the residual adapter and query positives, 8 mined hard negatives, never searched
    "before-2026-11-29": {
        "residual.train.batch_size": 1024,
        "query_positives.train.batch_size": 1024,
        "query_positives.hard_negatives": 8,
        "selection.batch_sizes": [1024],
        "selection.hard_negatives": [8],
    },
    # two releases earlier: batches of 256, no hard negatives
    "before-2026-11-28": {
        "residual.train.batch_size": 256,
        "query_positives.train.batch_size": 256,
        "query_positives.hard_negatives": 0,
        "selection.batch_sizes": [256],
        "selection.hard_negatives": [0],
    },
}


# --- the defaults' fingerprint ---------------------------------------------------------------


def current_defaults() -> dict[str, Any]:
    """Every default of `fctkit train`, flattened to dotted keys (what a user gets by not setting it)."""
    from fctkit.config import to_mapping
    from fctkit.trainer.pipeline_config import PipelineConfig

    def flatten(mapping: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
        flat: dict[str, Any] = {}
        for key, value in mapping.items():
            if isinstance(value, Mapping):
                flat |= flatten(value, f"{prefix}{key}.")
            else:
                flat[f"{prefix}{key}"] = value
        return flat

    return flatten(to_mapping(PipelineConfig()))


def defaults_fingerprint(defaults: Mapping[str, Any] | None = None) -> str:
    defaults = current_defaults() if defaults is None else defaults
    return hashlib.sha256(json.dumps(defaults, sort_keys=True).encode()).hexdigest()


def changed_defaults(stored: Mapping[str, Any], current: Mapping[str, Any]) -> list[str]:
    """``key: stored -> current`` for every default that differs (added and removed keys too)."""
    missing = object()
    return [
        f"{key}: {stored.get(key, missing)!r} -> {current.get(key, missing)!r}".replace(repr(missing), "(none)")
        for key in sorted(set(stored) | set(current))
        if stored.get(key, missing) != current.get(key, missing)
    ]


# --- running -----------------------------------------------------------------------------------


def task_file(task: SuiteTask, folder: Path) -> Path:
    """The task's file, cut to its training pairs when it keeps fewer than the built file has."""
    path = task.make(folder)
    if task.train_pairs is None:
        return path
    from fctkit.trainer.tasks import load_task, save_task

    cut = folder / f"{task.name}.npz"
    if cut.is_file() and cut.stat().st_mtime >= path.stat().st_mtime:
        return cut
    full = load_task(path)
    gallery = np.arange(min(task.train_pairs, len(full.train.gallery)))
    positives = full.train.positives
    assert positives is not None  # the suite's tasks are instance-level
    owners = np.repeat(np.arange(len(full.train.query)), np.diff(positives.indptr))
    inside = np.isin(positives.indices, gallery)
    queries = np.setdiff1d(np.unique(owners), np.unique(owners[~inside]))  # every positive kept
    train = full.train.subset(queries, gallery)
    return save_task(cut, dataclasses.replace(full, train=train))


def run_one(task: SuiteTask, defaults: str, seed: int, out: Path) -> dict[str, Any]:
    """One seed of one task with one set of defaults; cached in ``<out>/<defaults>/<task>/seed<k>.json``."""
    record_path = out / defaults / task.name / f"seed{seed}.json"
    if record_path.is_file():
        return json.loads(record_path.read_text())
    from fctkit.trainer.pipeline import run_pipeline
    from fctkit.trainer.pipeline_config import load_pipeline_config

    path = task_file(task, out / "tasks")
    overrides = {
        "seed": seed,
        "data.name": "task",
        "data.task": str(path),
        "evaluation.distance": "cosine",
        "progress": False,
        "backfill.orderings": [],  # curves are not what the suite judges
        **DEFAULTS[defaults],
    }
    started = time.perf_counter()
    run_dir = record_path.with_suffix("")
    result = run_pipeline(load_pipeline_config(None, overrides), run_dir, log=lambda _: None)
    record = run_record(result.gate, time.perf_counter() - started, result.report.facts)
    record["defaults_sha256"] = defaults_fingerprint()  # the code's defaults this run was made with
    record["train_pairs"] = len(result.train.old)
    record_path.write_text(json.dumps(record, indent=1) + "\n")
    return record


def run_record(gate: Mapping[str, Any], seconds: float, facts: Mapping[str, Any]) -> dict[str, Any]:
    """What the suite keeps of a run: each recommended variant's primary metric as a share of new/new."""
    metric, cases = gate["metric"], gate["cases"]
    new, old = cases["new/new"][metric], cases["old/old"][metric]
    chosen = {role: gate["recommended"][role] for role in (GALLERY_SIDE, TRANSITION)}
    return {
        "metric": metric,
        "new/new": new,
        "old/old": old,
        "variants": chosen,
        "share": {role: cases[variant][metric] / new for role, variant in chosen.items()},
        "ecc": {role: bool(gate["ecc"][variant]) for role, variant in chosen.items()},
        "seconds": round(seconds, 1),
        "stages": {k[len("time: ") :]: v for k, v in facts.items() if k.startswith("time: ")},
        "gains": {variant: search["gains"] for variant, search in gate.get("selection", {}).items()},
        "advice": gate.get("advice"),
    }


def summarise(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Mean and sd over seeds per role, ECC counts, old/old and new/new, time and the largest gains."""

    def spread(values: list[float]) -> dict[str, float]:
        return {
            "mean": round(statistics.fmean(values), 4),
            "sd": round(statistics.pstdev(values), 4),
            "range": round(max(values) - min(values), 4),
        }

    gains: dict[str, list[float]] = {}
    for record in records:
        for variant, by_setting in record["gains"].items():
            for setting, gain in by_setting.items():
                gains.setdefault(f"{variant}: {setting}", []).append(gain)
    fingerprints = {r.get("defaults_sha256") for r in records}
    return {
        "seeds": len(records),
        "train_pairs": records[0].get("train_pairs"),
        "defaults_sha256": fingerprints.pop() if len(fingerprints) == 1 else "mixed",
        "old/old ÷ new/new": round(statistics.fmean(r["old/old"] / r["new/new"] for r in records), 4),
        **{role: spread([r["share"][role] for r in records]) for role in (GALLERY_SIDE, TRANSITION)},
        "ecc": {role: sum(r["ecc"][role] for r in records) for role in (GALLERY_SIDE, TRANSITION)},
        "seconds": spread([r["seconds"] for r in records]),
        "gains": {name: round(max(values), 4) for name, values in sorted(gains.items())},
    }


def run_tier(tier: str, defaults: str, seeds: Sequence[int], out: Path, names: Sequence[str] = ()) -> dict[str, Any]:
    summaries = {}
    for task in TASKS:
        if task.tier != tier or (names and task.name not in names):
            continue
        records = []
        for seed in seeds:
            print(f"[{defaults}] {task.name} seed {seed} ...", flush=True)
            records.append(run_one(task, defaults, seed, out))
            print(f"  gallery side {records[-1]['share'][GALLERY_SIDE]:.3f} of new/new, {records[-1]['seconds']} s")
        summaries[task.name] = summarise(records)
    return summaries


# --- judging -----------------------------------------------------------------------------------


def regressions(stored: Mapping[str, Any], measured: Mapping[str, Any]) -> list[str]:
    """Each task whose gallery-side share fell below the stored mean by more than its seed spread
    (the larger of the stored and the measured range over seeds, at least :data:`MIN_SPREAD`): a
    change of threads or machine moves a run about as much as a change of seed does."""
    found = []
    for name, now in measured.items():
        before = stored.get(name)
        if before is None:
            continue
        old, new = before[GALLERY_SIDE], now[GALLERY_SIDE]
        allowed = max(old["range"], new["range"], MIN_SPREAD)
        if new["mean"] < old["mean"] - allowed:
            found.append(
                f"{name}: gallery side {new['mean']:.4f} of new/new (seeds' range {new['range']:.4f}), stored "
                f"{old['mean']:.4f} (range {old['range']:.4f}): a drop of {old['mean'] - new['mean']:.4f} > {allowed:.4f}"
            )
    return found


def load_figures(path: Path = FIGURES) -> dict[str, Any]:
    return json.loads(path.read_text())


def markdown(figures: Mapping[str, Any]) -> str:
    """One row per task and set of defaults: gallery side and transition as shares of new/new."""
    lines = [
        "| task | pairs | defaults | gallery side ÷ new/new | ECC | during the transition | old/old ÷ new/new | "
        "time a run (s) |",
        "|---|---:|---|---:|---:|---:|---:|---:|",
    ]
    for tier in ("small", "full"):
        for task in (t for t in TASKS if t.tier == tier):
            for defaults, tasks in figures["by_defaults"].items():
                row = tasks.get(task.name)
                if row is None:
                    continue
                side, fused = row[GALLERY_SIDE], row[TRANSITION]
                lines.append(
                    f"| {task.name} | {row['train_pairs'] or ''} | {defaults} | {side['mean']:.3f} ± {side['sd']:.3f} | "
                    f"{row['ecc'][GALLERY_SIDE]}/{row['seeds']} | {fused['mean']:.3f} ± {fused['sd']:.3f} | "
                    f"{row['old/old ÷ new/new']:.3f} | {row['seconds']['mean']:.0f} |"
                )
    return "\n".join(lines)


def gains_markdown(figures: Mapping[str, Any], defaults: str = "current") -> str:
    """What each searched setting gained on held-out training data (the largest gain over the
    seeds), one column per task: a setting that gains nothing anywhere does not earn its fits."""
    tasks = figures["by_defaults"].get(defaults, {})
    settings = sorted({name for row in tasks.values() for name in row["gains"]})
    lines = ["| setting | " + " | ".join(tasks) + " |", "|---|" + "---:|" * len(tasks)]
    for setting in settings:
        cells = [f"{row['gains'][setting]:+.3f}" if setting in row["gains"] else "" for row in tasks.values()]
        lines.append(f"| {setting} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def collect(out: Path) -> dict[str, Any]:
    """Every finished task summary under ``out``, by set of defaults (a task needs all of SEEDS)."""
    by_defaults: dict[str, Any] = {}
    for defaults in DEFAULTS:
        for task in TASKS:
            records = [out / defaults / task.name / f"seed{s}.json" for s in SEEDS]
            if all(p.is_file() for p in records):
                by_defaults.setdefault(defaults, {})[task.name] = summarise(
                    [json.loads(p.read_text()) for p in records]
                )
    return by_defaults


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("action", choices=("run", "table", "save", "check"))
    parser.add_argument("--tier", choices=("small", "full"), default="small")
    parser.add_argument("--defaults", choices=tuple(DEFAULTS), default="current")
    parser.add_argument("--tasks", nargs="*", default=(), help="only these tasks (default: the whole tier)")
    parser.add_argument("--seeds", type=int, nargs="+", default=list(SEEDS))
    parser.add_argument("--out", type=Path, default=Path("runs/quality"))
    args = parser.parse_args(argv)
    if args.action == "run":
        print(json.dumps(run_tier(args.tier, args.defaults, args.seeds, args.out, args.tasks), indent=1))
    elif args.action == "table":
        figures = {"by_defaults": collect(args.out)}
        print(markdown(figures) + "\n\n" + gains_markdown(figures))
    elif args.action == "save":  # merged into the stored figures: each task keeps its latest summary
        figures = load_figures() if FIGURES.is_file() else {"by_defaults": {}}
        for defaults, tasks in collect(args.out).items():
            figures["by_defaults"].setdefault(defaults, {}).update(tasks)
        figures |= {"defaults": current_defaults(), "defaults_sha256": defaults_fingerprint()}
        FIGURES.write_text(json.dumps(figures, indent=1, ensure_ascii=False) + "\n")
        print(f"wrote {FIGURES}")
    else:
        measured = run_tier(args.tier, "current", args.seeds, args.out, args.tasks)
        found = regressions(load_figures()["by_defaults"]["current"], measured)
        for line in found:
            print(f"regression: {line}")
        return 1 if found else 0
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Instance-level benchmarks: `fctkit train` on a retrieval task file, over seeds, summarised
against new/new and old/old.

    python benchmarks/wordnet_lemma_task.py --out runs/bench/wordnet-lemma         # builds the task once
    python benchmarks/instance_tasks.py runs/bench/wordnet-lemma/wordnet-lemma-gloss-seed0.npz \\
        --out runs/bench/wordnet-lemma/runs --seeds 0 1 2

Each seed is one full run (adapters fitted on the task's training split, every trainable
method's settings chosen on held-out training data by the task's primary metric, the report on
the evaluation split) with a different training seed and held-out cut; the task's split is the
same. The summary gives, per case, mean ± sd over the seeds of R@1, R@10 and MRR, R@1 as a
share of new/new, in how many seeds ECC held on R@1 and on R@10, and — where the run judged it
there — the variant's primary metric on held-out *training* data (what to choose variants by:
the evaluation split only reports); it is written to ``<out>/summary.{md,json}``.
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

from fctkit.trainer.pipeline import run_pipeline
from fctkit.trainer.pipeline_config import load_pipeline_config

DEFAULT_METHODS = ("residual", "least-squares", "procrustes")


def task_baselines(task) -> dict:
    """old/old and new/new on a task's evaluation split (cosine; R@1, R@5, R@10, MRR; class level: top-1, top-5, mAP)."""
    from fctkit.trainer.evaluation import evaluate_retrieval

    split = task.evaluation
    result = {}
    for case, field in (("old/old", "old"), ("new/new", "new")):
        r = evaluate_retrieval(
            getattr(split.query, field),
            split.query.labels,
            getattr(split.gallery, field),
            split.gallery.labels,
            positives=split.positives,
            distance="cosine",
            topk=(1, 5, 10),
        )
        result[case] = (
            {"R@1": r.recall[1], "R@5": r.recall[5], "R@10": r.recall[10], "MRR": r.mrr}
            if split.positives is not None
            else {"top1": r.cmc[1], "top5": r.cmc[5], "mAP": r.mean_ap}
        )
    return result


def build_and_save(build: Callable[[], tuple], path: Path) -> int:
    """A task builder's main step: run ``build()`` (task, facts) and :func:`save_built_task` its
    result; a kit error prints one line and gives exit status 2."""
    from fctkit.errors import FctkitError

    started = time.perf_counter()
    try:
        task, facts = build()
        save_built_task(path, task, facts, started)
    except FctkitError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    return 0


def save_built_task(path: Path, task, facts: dict, started: float) -> Path:
    """Save a task a builder made, with its baselines, and write ``<path>.summary.json``
    (``facts`` + baselines + wall time); print its sizes, dims and baselines."""
    from fctkit.trainer.tasks import save_task

    for name, split in (("eval", task.evaluation), ("train", task.train)):
        print(
            f"{name}: {len(split.query)} queries / {len(split.gallery)} gallery items",
            end="; " if name == "eval" else "\n",
        )
    gallery = task.evaluation.gallery
    print(f"dims old {gallery.old.shape[1]}, new {gallery.new.shape[1]}, side {gallery.side.shape[1]} (gallery only)")
    path = save_task(path, task)
    facts["baselines (eval)"] = task_baselines(task)
    facts["wall time (s)"] = round(time.perf_counter() - started, 1)
    path.with_suffix(".summary.json").write_text(json.dumps(facts, indent=2) + "\n")
    print(f"\nwrote {path}")
    for case, metrics in facts["baselines (eval)"].items():
        print(f"{case}: " + ", ".join(f"{k} {v:.4f}" for k, v in metrics.items()))
    print(f"wall time {facts['wall time (s)']} s")
    return path


def run_seed(task: Path, out: Path, seed: int, methods: list[str], query_map: bool, extra: dict) -> dict:
    overrides = {
        "seed": seed,
        "data.name": "task",
        "data.task": str(task),
        "methods": methods,
        "progress": False,
        "evaluation.distance": "cosine",
        "evaluation.topk": [1, 5, 10],
        "query_map.enabled": query_map,
        "backfill.orderings": ["random"],
        **extra,
    }
    start = time.perf_counter()
    run_pipeline(
        load_pipeline_config(None, overrides), out / f"seed{seed}", log=lambda m: print(f"  [{seed}] {m}", flush=True)
    )
    return read_run(out / f"seed{seed}") | {"seconds": time.perf_counter() - start}


METRICS = {"instance": ("recall@1", "recall@10", "mrr"), "class": ("top1", "top10", "mAP")}
HEADERS = {"instance": ("R@1", "R@10", "MRR"), "class": ("top-1", "top-10", "mAP")}


def read_run(folder: Path) -> dict:
    """A finished run's facts and, per case, R@1, R@10 and MRR (class level: top-1, top-10 and
    mAP) from its report.json; ``level`` says which."""
    report = json.loads((folder / "report.json").read_text())
    held_out = held_out_scores(report["facts"])
    cases, level = {}, "instance"
    for case in report["cases"]:
        name = re.sub(r", (w|β) [0-9.]+ \[", " [", case["name"])  # reports before the weight moved to a column
        result = case["result"]
        if result.get("relevance", "explicit") == "explicit":
            cases[name] = {"recall@1": result["recall"]["1"], "recall@10": result["recall"]["10"], "mrr": result["mrr"]}
            label = name.rpartition(" [")[2].rstrip("]")
            if label in held_out and not name.startswith("Q(new)/new"):
                cases[name]["held-out"] = held_out[label]
        else:
            level = "class"
            cases[name] = {"top1": result["cmc"]["1"], "top10": result["cmc"]["10"], "mAP": result["mean_ap"]}
    return {"facts": report["facts"], "cases": cases, "level": level}


HELD_OUT_FACT = re.compile(r"^(?:w|β) = [0-9.]+ \(\S+ ([0-9.]+) on held-out training data; (?:w|β) = 0: ([0-9.]+)\)")


def held_out_scores(facts: dict) -> dict[str, float]:
    """The primary metric each variant scored on held-out *training* data, by its report label,
    read from the run's transition-weight and hubness-β facts (the chosen setting's score, and
    the score without it: the variant it builds on)."""
    scores = {}
    for name, value in facts.items():
        for fact, part in (("transition weight [", " + transition scoring"), ("hubness β [", " + hubness offset")):
            found = HELD_OUT_FACT.match(str(value))
            if name.startswith(fact) and found:
                label = name[len(fact) : -1]
                scores[label + part], scores[label] = float(found[1]), float(found[2])
    return scores


def summarise(runs: dict[int, dict]) -> dict:
    """Per case: mean ± sd of the level's three metrics, the first as a share of new/new, and the
    seeds where ECC held on the first two (keys ``share_of_new_new_r1``, ``ecc_r1``, ``ecc_r10``
    at either level)."""
    first = next(iter(runs.values()))
    at1, at10, _ = metrics = METRICS[first.get("level", "instance")]
    summary = {}
    for name in first["cases"]:
        rows = [run["cases"][name] for run in runs.values()]
        shares = [row[at1] / run["cases"]["new/new"][at1] for row, run in zip(rows, runs.values())]
        summary[name] = {metric: _mean_sd([row[metric] for row in rows]) for metric in metrics}
        summary[name]["share_of_new_new_r1"] = _mean_sd(shares)
        summary[name]["ecc_r1"] = sum(row[at1] > run["cases"]["old/old"][at1] for row, run in zip(rows, runs.values()))
        summary[name]["ecc_r10"] = sum(
            row[at10] > run["cases"]["old/old"][at10] for row, run in zip(rows, runs.values())
        )
        if all("held-out" in row for row in rows):
            summary[name]["held-out"] = _mean_sd([row["held-out"] for row in rows])
    return summary


def _mean_sd(values: list[float]) -> tuple[float, float]:
    return statistics.fmean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def markdown(summary: dict, n_seeds: int, level: str = "instance") -> str:
    at1, at10, third = HEADERS[level]
    lines = [
        f"| case | {at1} | {at10} | {third} | {at1} ÷ new/new | ECC {at1} | ECC {at10} | held-out {at1} |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for name, row in summary.items():
        cells = [f"{m:.3f} ± {s:.3f}" for m, s in (*(row[k] for k in METRICS[level]), row["share_of_new_new_r1"])]
        judged = name not in ("old/old", "new/new", "new/old")
        ecc = [f"{row['ecc_r1']}/{n_seeds}", f"{row['ecc_r10']}/{n_seeds}"] if judged else ["", ""]
        held = [f"{row['held-out'][0]:.3f}"] if "held-out" in row else [""]
        lines.append(f"| {name} | " + " | ".join(cells + ecc + held) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("task", type=Path, help="a task file (fctkit-task/1)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--methods", nargs="+", default=list(DEFAULT_METHODS))
    parser.add_argument("--no-query-map", action="store_true", help="skip the jointly trained query map")
    parser.add_argument(
        "--summarise-only", action="store_true", help="read <out>/seed*/report.json of finished runs; train nothing"
    )
    parser.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=JSON",
        help="extra pipeline override, e.g. --set 'selection.widths=[512]'",
    )
    args = parser.parse_args(argv)
    extra = {key: json.loads(value) for key, _, value in (item.partition("=") for item in args.overrides)}
    runs = {}
    for seed in args.seeds:
        if args.summarise_only:
            runs[seed] = read_run(args.out / f"seed{seed}")
            continue
        print(f"seed {seed}", flush=True)
        runs[seed] = run_seed(args.task, args.out, seed, args.methods, not args.no_query_map, extra)
        print(f"  {runs[seed]['seconds']:.0f} s", flush=True)
    summary = summarise(runs)
    table = markdown(summary, len(runs), next(iter(runs.values())).get("level", "instance"))
    print(table)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "summary.md").write_text(table + "\n")
    (args.out / "summary.json").write_text(
        json.dumps(
            {"task": str(args.task), "seeds": args.seeds, "summary": summary, "runs": runs}, indent=2, default=str
        )
        + "\n"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

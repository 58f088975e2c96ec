"""Instance-level quality versus gallery size: one trained run, its evaluation queries searched
in galleries of growing size, each variant's R@1, R@10 and MRR as a share of new/new.

    python benchmarks/wordnet_lemma_task.py --out runs/bench/wordnet-lemma --distractors 200000   # task + distractors
    fctkit train --config configs/synthetic-instance.toml --set data.task=runs/bench/wordnet-lemma/wordnet-lemma-gloss-seed0.npz \\
        --out runs/bench/wordnet-lemma/run-seed0
    python benchmarks/instance_scaling.py runs/bench/wordnet-lemma/wordnet-lemma-gloss-seed0.npz \\
        --run runs/bench/wordnet-lemma/run-seed0 --distractors runs/bench/wordnet-lemma/wordnet-lemma-gloss-seed0.distractors.npz \\
        --sizes 3000 20000 100000 --out runs/bench/wordnet-lemma/scaling

The adapter is the one the run trained (nothing is fitted here); only the gallery changes. With
several runs (``--run A B C``, e.g. three training seeds) each figure is their mean, and the
R@1 share's standard deviation over the runs is shown beside it. A
size above the evaluation gallery's adds the first rows of ``--distractors`` (gallery items of
no query, embedded like the gallery: ``ids``, ``old``, ``new`` and ``side`` when the task has
side-info); a size below it keeps the queries whose positives fit (in a seeded order), their
positives and a seeded sample of the other rows. Each variant is searched exactly as a device runs it
(:func:`fctkit.trainer.searches.scored_retrieval`): the hubness offsets are computed for the
grown gallery's rows from the run's reference queries, transition scoring fuses the rows' old
vectors. A size larger than the task and its distractors is reported as not measured.

Writes ``<out>/scaling.{json,md,png}``: per size and variant R@1, R@10, MRR and their shares of
new/new at that size (each run's own figures too), old/old beside them.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

DEFAULT_VARIANTS = (
    "least-squares",
    "residual+query-positives",
    "residual+query-positives+hubness",
    "residual+query-positives+transition",
    "residual+query-positives+hubness+transition",
    "residual+query-map",
    "residual+query-map+hubness",
)
METRICS = (("R@1", "recall@1"), ("R@10", "recall@10"), ("MRR", "mrr"))


def gallery_of_size(split, distractors: dict[str, np.ndarray] | None, size: int, seed: int):
    """``split`` (queries, gallery, positives) with a gallery of ``size`` rows (see the module docstring)."""
    from fctkit.trainer.relevance import Positives
    from fctkit.trainer.tasks import TaskSet, TaskSplit

    n = len(split.gallery)
    if size <= n:
        rng = np.random.default_rng(seed)
        queries, positive_rows = [], set()
        for q in rng.permutation(len(split.query)):  # the queries whose positives fit, in a seeded order
            rows = set(split.positives.of(int(q))[0].tolist())
            if len(positive_rows | rows) <= size:
                queries.append(int(q))
                positive_rows |= rows
        if not queries:
            raise ValueError(f"{size} rows cannot hold the positives of any evaluation query")
        kept = np.array(sorted(positive_rows), dtype=np.int64)
        extra = rng.choice(np.setdiff1d(np.arange(n), kept), size - len(kept), replace=False)
        return split.subset(np.sort(np.array(queries)), np.sort(np.concatenate([kept, extra])))
    grow = size - n
    gallery = split.gallery
    pool = {name: distractors[name][:grow] for name in ("ids", "old", "new")}
    side = distractors["side"][:grow] if gallery.side.shape[1] else np.zeros((grow, 0), np.float32)
    grown = TaskSet(
        np.concatenate([gallery.ids.astype(str), pool["ids"].astype(str)]),
        np.vstack([gallery.old, pool["old"]]),
        np.vstack([gallery.new, pool["new"]]),
        np.vstack([gallery.side, side]),
    )
    p = split.positives
    return TaskSplit(split.query, grown, Positives(p.indptr, p.indices, p.grades, size))


def measure(split, runs: list[dict[str, object]]) -> list[dict[str, dict[str, float]]]:
    """Per run (its variants, loaded: name → what :meth:`TrainedRun.variant` gives), R@1, R@10 and
    MRR of old/old, new/new (searched once: they do not depend on the run) and each variant on
    ``split``, searched as a device would."""
    from fctkit.trainer.retrieval_result import metric_value
    from fctkit.trainer.searches import EvalSet, EvaluationConfig, Evaluator, scored_retrieval

    data = EvalSet.of_task(split)
    evaluate = Evaluator(EvaluationConfig(distance="cosine", topk=(1, 10)), data)

    def scores(name: str, query: np.ndarray, rows: np.ndarray, distance: str | None = None) -> dict[str, float]:
        started = time.perf_counter()
        result = evaluate(query, rows, distance)
        print(f"  {name}: R@1 {metric_value(result, 'recall@1'):.4f}", flush=True)
        return {label: float(metric_value(result, key)) for label, key in METRICS} | {
            "seconds": round(time.perf_counter() - started, 1)
        }

    baselines = {
        "old/old": scores("old/old", data.queries.old, data.gallery.old),
        "new/new": scores("new/new", data.queries.new, data.gallery.new),
    }
    return [
        baselines | {name: scores(name, *scored_retrieval(variant, data)) for name, variant in variants.items()}
        for variants in runs
    ]


def shares(results: dict[str, dict[str, float]]) -> dict[str, dict[str, float]]:
    ceiling = results["new/new"]
    return {name: {label: r[label] / max(ceiling[label], 1e-12) for label, _ in METRICS} for name, r in results.items()}


def over_runs(per_run: list[dict[str, dict[str, float]]], statistic) -> dict[str, dict[str, float]]:
    """``statistic`` (mean, sd) over the runs of each case's metrics."""
    return {
        name: {label: float(statistic([r[name][label] for r in per_run])) for label in per_run[0][name]}
        for name in per_run[0]
    }


def size_entry(per_run_results: list[dict[str, dict[str, float]]], queries: int) -> dict:
    """One size of the summary: the mean over runs of the results and of their shares of
    new/new, the shares' sd over runs, and each run's own figures."""
    per_run_shares = [shares(r) for r in per_run_results]
    return {
        "results": over_runs(per_run_results, np.mean),
        "share": over_runs(per_run_shares, np.mean),
        "share_sd": over_runs(per_run_shares, np.std),
        "per_run": per_run_results,
        "queries": queries,
    }


def markdown(table: dict, sizes: list[int], variants: list[str]) -> str:
    head = "| variant | " + " | ".join(f"{s:,} R@1 / R@10 / MRR" for s in sizes) + " |"
    lines = [head, "|" + "---|" * (len(sizes) + 1)]
    for name in ["old/old", *variants]:
        cells = []
        for size in sizes:
            entry = table.get(str(size))
            spread = f" (± {entry['share_sd'][name]['R@1']:.3f})" if entry and len(entry["per_run"]) > 1 else ""
            cells.append(
                "not measured"
                if entry is None
                else " / ".join(f"{entry['share'][name][label]:.3f}" for label, _ in METRICS) + spread
            )
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    absolute = [
        f"{s:,}: new/new R@1 {table[str(s)]['results']['new/new']['R@1']:.4f}" for s in sizes if str(s) in table
    ]
    return (
        "\n".join(lines) + "\n\nShares of new/new at the same size (mean over the runs; ± the R@1 share's sd over "
        "runs); " + "; ".join(absolute) + ".\n"
    )


def plot(table: dict, variants: list[str], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted(int(s) for s in table)
    figure, axes = plt.subplots(1, len(METRICS), figsize=(5 * len(METRICS), 4), sharey=True)
    for axis, (label, _) in zip(axes, METRICS, strict=True):
        for name in ["old/old", *variants]:
            axis.plot(sizes, [table[str(s)]["share"][name][label] for s in sizes], marker="o", label=name)
        axis.axhline(1.0, color="grey", linewidth=0.8)
        axis.set(xscale="log", xlabel="gallery items", title=f"{label} ÷ new/new")
    axes[0].legend(fontsize=7)
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "task", type=Path, help="the task file the run was trained on (its evaluation split is searched)"
    )
    parser.add_argument(
        "--run",
        type=Path,
        nargs="+",
        required=True,
        help="`fctkit train` output folder(s) on the task (e.g. one per training seed): figures are their mean",
    )
    parser.add_argument("--distractors", type=Path, help=".npz of gallery items of no query (ids, old, new[, side])")
    parser.add_argument("--sizes", type=int, nargs="+", required=True, help="gallery sizes to search")
    parser.add_argument(
        "--variants", nargs="+", help=f"gate keys of the run (default: those of {', '.join(DEFAULT_VARIANTS)} it has)"
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="seed of the sample kept for sizes below the evaluation gallery"
    )
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args(argv)

    from fctkit.export.trained_run import TrainedRun
    from fctkit.trainer.tasks import load_task

    runs = [TrainedRun.open(folder) for folder in args.run]
    split = load_task(args.task).evaluation
    trained = set.intersection(*(set(run.gate["ecc"]) for run in runs))
    variants = args.variants or [v for v in DEFAULT_VARIANTS if v in trained]
    missing = [v for v in variants if v not in trained]
    if missing:
        parser.error(f"not every run has the variant(s) {', '.join(missing)}; all have {', '.join(sorted(trained))}")
    loaded = [{name: run.variant(name) for name in variants} for run in runs]  # once: every size searches them
    distractors = dict(np.load(args.distractors, allow_pickle=False)) if args.distractors else None
    available = len(split.gallery) + (len(distractors["ids"]) if distractors else 0)
    table: dict[str, dict] = {}
    for size in sorted(args.sizes):
        if size > available:
            print(
                f"gallery of {size:,}: not measured (the task and its distractors hold {available:,} items)", flush=True
            )
            continue
        searched = gallery_of_size(split, distractors, size, args.seed)
        print(f"gallery of {size:,} items, {len(searched.query):,} queries", flush=True)
        table[str(size)] = size_entry(measure(searched, loaded), len(searched.query))
    args.out.mkdir(parents=True, exist_ok=True)
    summary = {
        "task": str(args.task),
        "runs": [str(r) for r in args.run],
        "distractors": str(args.distractors),
        "variants": variants,
        "sizes": table,
    }
    (args.out / "scaling.json").write_text(json.dumps(summary, indent=2) + "\n")
    (args.out / "scaling.md").write_text(markdown(table, sorted(args.sizes), variants))
    if table:
        plot(table, variants, args.out / "scaling.png")
    print((args.out / "scaling.md").read_text())
    return 0


if __name__ == "__main__":
    sys.exit(main())

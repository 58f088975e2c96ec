"""CoReS variants on the one-upgrade protocol of `fctkit train-compatible` (issue 9's gap).

    OMP_NUM_THREADS=1 python benchmarks/cores_variants.py                 # digits, 3 seeds, ~8 min
    OMP_NUM_THREADS=1 python benchmarks/cores_variants.py --config configs/fashion-mnist-compatible.toml --seeds 0
    OMP_NUM_THREADS=1 python benchmarks/cores_variants.py --evaluation-classes held-out --upgrade 3 6   # CoReS's protocol
    OMP_NUM_THREADS=1 python benchmarks/cores_variants.py --upgrade 10 10 --first-version-items 0.2   # data growth

Each variant is ``configs/digits-compatible.toml`` (or ``--config``) with CoReS overrides, run
through :func:`run_compatible` with one method (``cores`` or ``cores-hoc``) and no adapters;
``--evaluation-classes held-out --upgrade 3 6`` evaluates on the classes neither version trains
on (the open-set protocol of the CoReS authors' code) instead of all of the last version's. Printed per variant
and seed: old/old, new/old, new/new (top-1, all evaluation classes), the ratio new/old ÷ old/old
(ECC holds when it is > 1; the baseline is the variant's own old model, measured in the same run),
ECC on the old model's classes, and new/old split by the query's class (the old model's classes
vs the classes it never saw; gallery = every old embedding), which shows where ECC is lost.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch

from fctkit.trainer.backbones import extract_features
from fctkit.trainer.compatible_comparison import run_compatible
from fctkit.trainer.compatible_config import load_compatible_config
from fctkit.trainer.compatible_models import load_compatible_model
from fctkit.trainer.compatible_sequence import evaluation_items
from fctkit.trainer.evaluation import evaluate_retrieval
from fctkit.trainer.run_data import load_image_splits

VARIANTS: dict[str, tuple[str, dict[str, object]]] = {
    "fine-tune at the config's cores.finetune_lr (the default)": ("cores", {}),
    "fine-tune at the backbone's lr": ("cores", {"cores.finetune_lr": 0.0}),
    "from scratch (v2 = wide CNN, own seed)": ("cores", {"cores.warm_start": False}),
    "from scratch, last epoch (no ECC selection)": ("cores", {"cores.warm_start": False, "cores.ecc_selection": False}),
    "K = 10 (no spare vertices), fine-tune": ("cores", {"cores.reserved_classes": 10}),
    "K = 10, from scratch": ("cores", {"cores.reserved_classes": 10, "cores.warm_start": False}),
    "fine-tune, last epoch (no ECC selection)": ("cores", {"cores.ecc_selection": False}),
    "CoReS + HOC, fine-tune (the default selection)": ("cores-hoc", {}),
    "CoReS + HOC, fine-tune, last epoch": ("cores-hoc", {"cores.ecc_selection": False}),
    "CoReS + HOC, K = 10 (no spare vertices), fine-tune": ("cores-hoc", {"cores.reserved_classes": 10}),
    "CoReS + HOC, K = 10, fine-tune, last epoch": (
        "cores-hoc",
        {"cores.reserved_classes": 10, "cores.ecc_selection": False},
    ),
    "BCT (reference)": ("bct", {}),
    "independent training (reference)": ("independent", {}),
}


def top1(
    query: np.ndarray, query_labels: np.ndarray, gallery: np.ndarray, gallery_labels: np.ndarray, leave_one_out: bool
) -> float:
    return evaluate_retrieval(
        query, query_labels, gallery, gallery_labels, distance="cosine", topk=(1,), leave_one_out=leave_one_out
    ).cmc[1]


def measure(config_path: str, method: str, overrides: dict[str, object], seed: int, out: Path) -> dict[str, object]:
    config = load_compatible_config(
        config_path,
        {
            "seed": seed,
            "sequence": [],
            "methods": [method],
            "adapters": [],
            "progress": False,
            "device": "cpu",
            **overrides,
        },
    )
    run_compatible(config, out, log=lambda _: None)
    gate = json.loads((out / "gate.json").read_text())
    results = json.loads((out / "results.json").read_text())["upgrade"]
    splits = load_image_splits(config)
    old_classes = np.unique(splits.labels[splits.train])[: config.upgrade[0]]
    evaluation = evaluation_items(
        splits.labels, splits.train, splits.evaluation, config.upgrade[-1], config.evaluation_classes
    )
    images, labels = splits.images[evaluation], splits.labels[evaluation]
    old, new = (
        extract_features(load_compatible_model(out / "models" / "upgrade" / method / f"v{k}.pt"), images)
        for k in (1, 2)
    )
    seen = np.isin(labels, old_classes)
    cases = gate["cases"][method]
    row = {name: cases[name]["top1"] for name in ("old/old", "new/old", "new/new")}
    known = results["cases_on_gallery_classes"].get(method)
    row["old classes: old/old"], row["old classes: new/old"] = (
        (known["v1/v1"]["cmc"]["1"], known["v2/v1"]["cmc"]["1"]) if known else (None, None)
    )
    # queries of one group against the whole old gallery; a query is left out of the gallery by position
    for group, mask in (("seen", seen), ("unseen", ~seen)):
        for case, query in (("old/old", old), ("new/old", new)):
            row[f"{case} {group} queries"] = _group_top1(query, old, labels, mask)
    row["checkpoints"] = results["facts"].get(f"{method}_checkpoints")
    return row


def _group_top1(query: np.ndarray, gallery: np.ndarray, labels: np.ndarray, mask: np.ndarray) -> float | None:
    if not mask.any():
        return None
    dims = min(query.shape[1], gallery.shape[1])  # different dims: compared on the shorter prefix, as the run does
    query, gallery = query[:, :dims], gallery[:, :dims]
    q = query / np.linalg.norm(query, axis=1, keepdims=True)
    g = gallery / np.linalg.norm(gallery, axis=1, keepdims=True)
    rows = np.flatnonzero(mask)
    similarity = q[rows] @ g.T
    similarity[np.arange(len(rows)), rows] = -np.inf  # leave-one-out
    return float(np.mean(labels[similarity.argmax(axis=1)] == labels[rows]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default="configs/digits-compatible.toml")
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--variants", nargs="+", default=None, help="indices into the variant list (default: all)")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    parser.add_argument(
        "--evaluation-classes",
        choices=["trained", "held-out"],
        default=None,
        help="evaluate on the last version's classes (the config's default) or on the classes no version trains on",
    )
    parser.add_argument(
        "--upgrade", type=int, nargs=2, default=None, help="classes of v1 and v2 (default: the config's)"
    )
    parser.add_argument(
        "--first-version-items",
        type=float,
        default=None,
        help="fraction of its classes' training items v1 trains on (with --upgrade 10 10: a data-growth upgrade)",
    )
    args = parser.parse_args()
    torch.set_num_threads(1)
    chosen = [list(VARIANTS)[int(i)] for i in args.variants] if args.variants else list(VARIANTS)
    protocol = {
        key: value
        for key, value in (
            ("evaluation_classes", args.evaluation_classes),
            ("upgrade", args.upgrade),
            ("first_version_items", args.first_version_items),
        )
        if value
    }
    figures: dict[str, dict[int, dict[str, object]]] = {}
    print(
        "| variant | seed | old/old | new/old | ratio | new/new | ECC | old classes: old/old → new/old | "
        "seen-class queries: old/old → new/old | unseen-class queries: old/old → new/old |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in chosen:
        figures[name] = {}
        for seed in args.seeds:
            with tempfile.TemporaryDirectory() as tmp:
                method, overrides = VARIANTS[name]
                row = measure(args.config, method, {**overrides, **protocol}, seed, Path(tmp))
            figures[name][seed] = row
            print(
                f"| {name} | {seed} | {row['old/old']:.4f} | {row['new/old']:.4f} | {row['new/old'] / row['old/old']:.3f} | "
                f"{row['new/new']:.4f} | {'yes' if row['new/old'] > row['old/old'] else 'no'} | "
                f"{_pair(row, 'old classes: old/old', 'old classes: new/old', 4)} | "
                f"{_pair(row, 'old/old seen queries', 'new/old seen queries', 3)} | "
                f"{_pair(row, 'old/old unseen queries', 'new/old unseen queries', 3)} |",
                flush=True,
            )
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2, default=str) + "\n")


def _pair(row: dict[str, object], before: str, after: str, digits: int) -> str:
    if row[before] is None:
        return "—"
    return f"{row[before]:.{digits}f} → {row[after]:.{digits}f}"


if __name__ == "__main__":
    main()

"""CoReS variants on the one-upgrade protocol of `fctkit train-compatible` (issue 9's gap).

    OMP_NUM_THREADS=1 python benchmarks/cores_variants.py                 # digits, 3 seeds, ~8 min
    OMP_NUM_THREADS=1 python benchmarks/cores_variants.py --config configs/fashion-mnist-compatible.toml --seeds 0

Each variant is ``configs/digits-compatible.toml`` (or ``--config``) with CoReS overrides, run
through :func:`run_compatible` with ``methods = ["cores"]`` and no adapters. Printed per variant
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
from fctkit.trainer.compatible import load_compatible_config, load_compatible_model, run_compatible
from fctkit.trainer.evaluation import evaluate_retrieval
from fctkit.trainer.pipeline import load_image_splits

VARIANTS: dict[str, dict[str, object]] = {
    "fine-tune at the config's cores.finetune_lr (the default)": {},
    "fine-tune at the backbone's lr": {"cores.finetune_lr": 0.0},
    "from scratch (v2 = wide CNN, own seed)": {"cores.warm_start": False},
    "from scratch, last epoch (no ECC selection)": {"cores.warm_start": False, "cores.ecc_selection": False},
    "K = 10 (no spare vertices), fine-tune": {"cores.reserved_classes": 10},
    "K = 10, from scratch": {"cores.reserved_classes": 10, "cores.warm_start": False},
}


def top1(query: np.ndarray, query_labels: np.ndarray, gallery: np.ndarray, gallery_labels: np.ndarray,
         leave_one_out: bool) -> float:
    return evaluate_retrieval(query, query_labels, gallery, gallery_labels, distance="cosine", topk=(1,),
                              leave_one_out=leave_one_out).cmc[1]


def measure(config_path: str, overrides: dict[str, object], seed: int, out: Path) -> dict[str, object]:
    config = load_compatible_config(config_path, {"seed": seed, "sequence": [], "methods": ["cores"], "adapters": [],
                                                  "progress": False, "device": "cpu", **overrides})
    run_compatible(config, out, log=lambda _: None)
    gate = json.loads((out / "gate.json").read_text())
    facts = json.loads((out / "results.json").read_text())["upgrade"]["facts"]
    splits = load_image_splits(config)
    old_classes = np.unique(splits.labels[splits.train])[: config.upgrade[0]]
    images, labels = splits.images[splits.evaluation], splits.labels[splits.evaluation]
    old, new = (extract_features(load_compatible_model(out / "models" / "upgrade" / "cores" / f"v{k}.pt"), images) for k in (1, 2))
    seen = np.isin(labels, old_classes)
    cases = gate["cases"]["cores"]
    row = {name: cases[name]["top1"] for name in ("old/old", "new/old", "new/new")}
    known = json.loads((out / "results.json").read_text())["upgrade"]["cases_on_gallery_classes"]["cores"]
    row["old classes: old/old"], row["old classes: new/old"] = known["v1/v1"]["cmc"]["1"], known["v2/v1"]["cmc"]["1"]
    # queries of one group against the whole old gallery; a query is left out of the gallery by position
    for group, mask in (("seen", seen), ("unseen", ~seen)):
        for case, query in (("old/old", old), ("new/old", new)):
            row[f"{case} {group} queries"] = _group_top1(query, old, labels, mask)
    row["checkpoints"] = facts.get("cores_checkpoints")
    return row


def _group_top1(query: np.ndarray, gallery: np.ndarray, labels: np.ndarray, mask: np.ndarray) -> float:
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
    args = parser.parse_args()
    torch.set_num_threads(1)
    chosen = [list(VARIANTS)[int(i)] for i in args.variants] if args.variants else list(VARIANTS)
    figures: dict[str, dict[int, dict[str, object]]] = {}
    print("| variant | seed | old/old | new/old | ratio | new/new | ECC | old classes: old/old → new/old | "
          "seen-class queries: old/old → new/old | unseen-class queries: old/old → new/old |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for name in chosen:
        figures[name] = {}
        for seed in args.seeds:
            with tempfile.TemporaryDirectory() as tmp:
                row = measure(args.config, VARIANTS[name], seed, Path(tmp))
            figures[name][seed] = row
            print(f"| {name} | {seed} | {row['old/old']:.4f} | {row['new/old']:.4f} | {row['new/old'] / row['old/old']:.3f} | "
                  f"{row['new/new']:.4f} | {'yes' if row['new/old'] > row['old/old'] else 'no'} | "
                  f"{row['old classes: old/old']:.4f} → {row['old classes: new/old']:.4f} | "
                  f"{row['old/old seen queries']:.3f} → {row['new/old seen queries']:.3f} | "
                  f"{row['old/old unseen queries']:.3f} → {row['new/old unseen queries']:.3f} |", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2, default=str) + "\n")


if __name__ == "__main__":
    main()

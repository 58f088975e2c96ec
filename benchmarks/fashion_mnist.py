"""Fashion-MNIST accuracy benchmark: every adapter method, the chain and the backfill orderings.

    python benchmarks/fashion_mnist.py                  # 10k stratified images (default), ~20-40 min on 2 cores
    python benchmarks/fashion_mnist.py --max-items 0    # all 70,000 images (hours on 2 cores)

Data: the idx files of the Debian package ``dataset-fashion-mnist`` (installed with apt-get
when missing and we are root). The run is ``fctkit train --config configs/fashion-mnist.toml``
with the chain switched on: old = small CNN on classes 0-4, new = wider CNN on all 10,
side-info = SimCLR on the old data; FCT with and without side-info, FastFill, λ-orth (B⊥ and
B_λ), least-squares and Procrustes; the chain v1 → v2 → v3 over 4 / 7 / 10 classes, hop by
hop and direct; backfill curves with M̃ per ordering. CMC top-1/top-5 and mAP for every case
are in ``<out>/report.md``; the summary printed at the end (and ``<out>/summary.md``) gives
each method's top-1 as a fraction of new/new and its ECC verdict.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from debian_data import ensure_debian_package

from fctkit.errors import FctkitError

REPO = Path(__file__).resolve().parents[1]
PACKAGE = "dataset-fashion-mnist"


def fashion_mnist_present() -> bool:
    from fctkit.trainer.datasets import find_fashion_mnist

    try:
        find_fashion_mnist()
    except FctkitError:
        return False
    return True


def summary_markdown(gate: dict, max_items: int) -> str:
    """Each method's adapted top-1 (new/h(old), or B(new)/F(old) for λ-orth) against new/new, and ECC."""
    cases = gate["cases"]
    new_new, old_old = cases["new/new"]["top1"], cases["old/old"]["top1"]
    lines = [
        f"Fashion-MNIST, {max_items or 70000} images; old/old top-1 {old_old:.4f}, new/new top-1 {new_new:.4f}",
        "",
        "| method | adapted top-1 | fraction of new/new | ECC |",
        "|---|---|---|---|",
    ]
    ranked = sorted(gate["ecc"], key=lambda m: -cases[m]["top1"])
    for method in ranked:
        top1 = cases[method]["top1"]
        lines.append(f"| {method} | {top1:.4f} | {top1 / new_new:.3f} | {'PASS' if gate['ecc'][method] else 'FAIL'} |")
    best = ranked[0]
    lines += [
        "",
        f"best: {best}, {cases[best]['top1'] / new_new:.3f} × new/new, ECC {'holds' if gate['ecc'][best] else 'fails'}",
    ]
    if gate.get("backfill_area"):
        lines.append("backfill M̃: " + ", ".join(f"{k} {v:.4f}" for k, v in gate["backfill_area"].items()))
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("runs/bench-fashion-mnist"))
    parser.add_argument("--config", type=Path, default=REPO / "configs" / "fashion-mnist.toml")
    parser.add_argument(
        "--max-items", type=int, default=None, help="stratified subsample (default: the config's); 0 = all"
    )
    parser.add_argument("--seed", type=int, default=None, help="run seed (default: the config's)")
    parser.add_argument(
        "--no-chain", action="store_true", help="skip the v1 → v2 → v3 chain (it trains three more backbones)"
    )
    args = parser.parse_args(argv)
    try:
        ensure_debian_package(PACKAGE, fashion_mnist_present, "fashion-mnist idx files")
        from fctkit.trainer.pipeline import run_pipeline
        from fctkit.trainer.pipeline_config import load_pipeline_config

        overrides: dict[str, object] = {"chain.enabled": not args.no_chain, "chain.classes": [4, 7, 10]}
        if args.max_items is not None:
            overrides["data.max_items"] = args.max_items
        if args.seed is not None:
            overrides["seed"] = args.seed
        config = load_pipeline_config(args.config, overrides)
        result = run_pipeline(config, args.out)
    except FctkitError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    print(result.report.to_markdown())
    summary = summary_markdown(result.gate, config.data.max_items)
    (args.out / "summary.md").write_text(summary)
    (args.out / "summary.json").write_text(
        json.dumps({"seconds": round(result.seconds, 1), "gate": result.gate}, indent=2, default=float) + "\n"
    )
    print(summary)
    print(f"{result.seconds:.0f} s; full report: {args.out / 'report.md'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

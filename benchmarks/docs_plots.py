"""The figures of the documentation's Benchmarks pages (docs/benchmarks/img/*.png).

    .venv/bin/python benchmarks/docs_plots.py            # writes docs/benchmarks/img/*.png

Nothing is measured here. The runs behind these figures keep their results under ``runs/``,
which is not committed, so the numbers are copied below from the tables of the pages that
show each figure (each constant names its page, table and the command that measured it).
When a benchmark is re-run, update the constant and the page's table together.

matplotlib only (Agg backend); each PNG stays well under 150 KB.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt

OUT = Path(__file__).resolve().parents[1] / "docs" / "benchmarks" / "img"

# docs/benchmarks/class-level.md and text.md: top-1 of each method's adapted case (new/h(old), or
# B(new)/F(old) for λ-orth), with old/old and new/new of the same run.
#   digits:        fctkit train --config configs/digits.toml --out runs/digits --set chain.enabled=false
#   Fashion-MNIST: python benchmarks/fashion_mnist.py
#   WordNet:       python benchmarks/text_wordnet.py --threads 1   (split 0)
CLASS_LEVEL = {
    "digits": {
        "old/old": 0.8289,
        "new/new": 0.9917,
        "FCT + ψ": 0.9791,
        "FCT, no ψ": 0.9736,
        "FastFill": 0.9861,
        "least squares": 0.9805,
        "Procrustes": 0.8275,
        "λ-orth B⊥": 0.9875,
        "λ-orth B_λ": 0.9889,
    },
    "Fashion-MNIST": {
        "old/old": 0.7123,
        "new/new": 0.8772,
        "FCT + ψ": 0.8357,
        "FCT, no ψ": 0.8197,
        "FastFill": 0.8323,
        "least squares": 0.8067,
        "Procrustes": 0.6740,
        "λ-orth B⊥": 0.8115,
        "λ-orth B_λ": 0.7890,
    },
    "WordNet supersenses\n(MiniLM → mpnet)": {
        "old/old": 0.4517,
        "new/new": 0.5161,
        "FCT + ψ": 0.5127,
        "FCT, no ψ": 0.5005,
        "FastFill": 0.3835,
        "least squares": 0.5136,
        "Procrustes": 0.4855,
        "λ-orth B⊥": 0.5158,
        "λ-orth B_λ": 0.5152,
    },
}

# docs/benchmarks/compatible-training.md, "One upgrade": top-1 old/old and new/old of each method
# (new/old is new/h(old) for FCT, B⊥(new)/old for λ-orth; CoReS has its own v1).
#   OMP_NUM_THREADS=1 fctkit train-compatible --config configs/fashion-mnist-compatible.toml --out ...
#   OMP_NUM_THREADS=1 fctkit train-compatible --config configs/digits-compatible.toml --out ...
COMPATIBLE = {
    "Fashion-MNIST (classes 0–4 → 0–9)": {
        "independent": (0.7238, 0.0896),
        "BCT": (0.7238, 0.4763),
        "BT²": (0.7238, 0.7137),
        "CoReS": (0.6813, 0.3929),
        "CoReS + HOC": (0.6813, 0.5212),
        "FCT h(old, ψ)": (0.7238, 0.7879),
        "λ-orth B⊥": (0.7238, 0.6104),
    },
    "digits (classes 0–4 → 0–9, seed 0)": {
        "independent": (0.8414, 0.0779),
        "BCT": (0.8414, 0.8637),
        "BT²": (0.8414, 0.8707),
        "CoReS": (0.8623, 0.8512),
        "CoReS + HOC": (0.8623, 0.8178),
        "FCT h(old, ψ)": (0.8414, 0.9889),
        "λ-orth B⊥": (0.8414, 0.9221),
    },
}

# docs/benchmarks/photos.md, (a) and (b): R@1 ÷ new/new, mean and sd over 3 adapter seeds
# (ridge 0.3); old/old ÷ new/new is the ECC line.
#   python benchmarks/instance_tasks.py ... --seeds 0 1 2 --methods residual ... --set residual.ridge=0.3
PHOTOS = {
    "Debian photos, near-duplicates": {
        "old/old": 1.149,
        "residual": (0.360, 0.018),
        "+ query pos.": (0.486, 0.011),
        "+ query pos.\n+ hubness": (0.650, 0.014),
        "+ query pos.\n+ transition": (1.121, 0.058),
        "residual\n+ transition": (1.127, 0.031),
    },
    "Fashion-MNIST, near-duplicates": {
        "old/old": 1.543,
        "residual": (0.667, 0.035),
        "+ query pos.": (1.808, 0.049),
        "+ query pos.\n+ hubness": (2.453, 0.049),
        "+ query pos.\n+ transition": (2.272, 0.019),
        "residual\n+ transition": (1.525, 0.025),
    },
}

# docs/benchmarks/device.md, "Upgrades through blocks": 1,000,000 rows, batch 1,024, one run.
#   python benchmarks/edge_upgrade.py --rows 1000000 --adapters fct,fct-int8,linear --skip-reembed
# rows/s: bare ONNX Runtime on decrypted rows; the bulk floor (AES-GCM open + seal in 1 MiB
# records, one write, one fsync); the device's upgrade end to end.
UPGRADE = {
    "FCT mixer fp32": {"bare": 16_240, "bulk floor": 1_723_868, "device": 13_061},
    "FCT mixer int8": {"bare": 84_051, "bulk floor": 1_289_443, "device": 32_826},
    "linear 128×128": {"bare": 4_797_955, "bulk floor": 1_596_517, "device": 53_395},
}


def _finish(figure, name: str) -> Path:
    OUT.mkdir(parents=True, exist_ok=True)
    path = OUT / name
    figure.tight_layout()
    figure.savefig(path, dpi=100)
    plt.close(figure)
    return path


def class_level() -> Path:
    methods = [m for m in next(iter(CLASS_LEVEL.values())) if m not in ("old/old", "new/new")]
    figure, axis = plt.subplots(figsize=(9, 5))
    width = 0.8 / len(methods)
    colours = plt.get_cmap("tab10").colors
    for g, (_name, row) in enumerate(CLASS_LEVEL.items()):
        bound = row["new/new"]
        for i, method in enumerate(methods):
            x = g + (i - (len(methods) - 1) / 2) * width
            axis.bar(x, row[method] / bound, width * 0.95, color=colours[i], label=method if g == 0 else None)
        floor = row["old/old"] / bound
        axis.hlines(
            floor,
            g - 0.42,
            g + 0.42,
            colors="black",
            linestyles="--",
            label="old/old (ECC: beat this)" if g == 0 else None,
        )
    axis.axhline(1.0, color="grey", linewidth=0.8)
    axis.set_xticks(range(len(CLASS_LEVEL)), list(CLASS_LEVEL))
    axis.set_ylim(0.6, 1.05)
    axis.set_ylabel("top-1 ÷ new/new")
    axis.set_title("Class-level retrieval: the adapted gallery's top-1 as a share of re-embedding")
    axis.legend(ncol=4, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.14))
    return _finish(figure, "class-level-methods.png")


def compatible() -> Path:
    methods = list(next(iter(COMPATIBLE.values())))
    figure, axis = plt.subplots(figsize=(9, 4.8))
    width = 0.8 / len(methods)
    colours = plt.get_cmap("tab10").colors
    for g, (_name, row) in enumerate(COMPATIBLE.items()):
        for i, method in enumerate(methods):
            old_old, new_old = row[method]
            x = g + (i - (len(methods) - 1) / 2) * width
            axis.bar(x, new_old / old_old, width * 0.95, color=colours[i], label=method if g == 0 else None)
    axis.axhline(1.0, color="black", linestyle="--", label="new/old = old/old (ECC above)")
    axis.set_xticks(range(len(COMPATIBLE)), list(COMPATIBLE))
    axis.set_ylim(0, 1.25)
    axis.set_ylabel("new/old ÷ old/old (top-1)")
    axis.set_title("New model against the untouched old gallery: compatible backbones vs adapters")
    axis.legend(ncol=4, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1))
    return _finish(figure, "compatible-backbones.png")


def photos() -> Path:
    figure, axes = plt.subplots(1, 2, figsize=(10, 4.3), sharey=False)
    colours = plt.get_cmap("tab10").colors
    for axis, (name, row) in zip(axes, PHOTOS.items()):
        variants = [v for v in row if v != "old/old"]
        means = [row[v][0] for v in variants]
        sds = [row[v][1] for v in variants]
        axis.bar(
            range(len(variants)), means, 0.7, yerr=sds, capsize=3, color=[colours[i] for i in range(len(variants))]
        )
        axis.axhline(row["old/old"], color="black", linestyle="--", label="old/old (Lite0; ECC line)")
        axis.axhline(1.0, color="grey", linewidth=0.8, label="new/new (Lite2 re-embedded)")
        axis.set_xticks(range(len(variants)), variants, fontsize=8)
        axis.set_title(name, fontsize=10)
        axis.set_ylabel("R@1 ÷ new/new (3 seeds, ± sd)")
        axis.legend(fontsize=7, loc="upper left")
    figure.suptitle("EfficientNet-Lite0 → Lite2: what each variant keeps of re-embedding", fontsize=11)
    return _finish(figure, "photos-variants.png")


def upgrade() -> Path:
    adapters = list(UPGRADE)
    series = [
        ("bare ONNX Runtime (no storage)", lambda r: r["bare"]),
        ("ceiling: bare + bulk encrypted floor", lambda r: 1 / (1 / r["bare"] + 1 / r["bulk floor"])),
        ("device upgrade, end to end", lambda r: r["device"]),
    ]
    figure, axis = plt.subplots(figsize=(8, 4))
    width = 0.26
    colours = ["#9e9e9e", "#64b5f6", "#1565c0"]
    for s, (label, value) in enumerate(series):
        xs = [a + (s - 1) * width for a in range(len(adapters))]
        ys = [value(UPGRADE[name]) for name in adapters]
        axis.bar(xs, ys, width * 0.95, color=colours[s], label=label)
        for x, y in zip(xs, ys):
            axis.text(x, y * 1.15, f"{y / 1000:,.0f}k", ha="center", fontsize=7)
    axis.set_yscale("log")
    axis.set_ylim(5_000, 2e7)
    axis.set_xticks(range(len(adapters)), adapters)
    axis.set_ylabel("rows per second (log scale)")
    axis.set_title("Upgrading 1,000,000 sealed rows in place vs the transform alone and the ceiling")
    axis.legend(fontsize=8, loc="upper left")
    return _finish(figure, "device-upgrade-ceiling.png")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.parse_args()
    for make in (class_level, compatible, photos, upgrade):
        path = make()
        print(f"{path.relative_to(OUT.parents[2])}: {path.stat().st_size / 1024:.0f} KiB")


if __name__ == "__main__":
    main()

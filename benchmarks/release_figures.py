"""Retrieval through a release's ONNX graphs, as a device computes it, against the run's own
(torch) figures measured by `fctkit train`.

Every embedding starts from the evaluation images: φ and ψ come from each bundle's ``embed``
and ``side_info`` graphs, adapted rows from its ``forward``/``side_forward``/``backward``
graphs; top-1 / mAP are leave-one-out on the evaluation split, as the trainer measures them.
The ratio column is bundle / run (1.000 = the bundles reproduce the run).

    fctkit train --config configs/digits.toml --out RUN
    fctkit keys generate --out KEYS
    fctkit export RUN --key KEYS/publisher.key --out REL            # or --method lambda-orth, or --chain
    python benchmarks/release_figures.py RUN REL --public-key KEYS/publisher.pub
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np

from fctkit.export.onnx_export import run_onnx
from fctkit.export.trained_run import TrainedRun
from fctkit.protos.bundle import VerifiedBundle, verify_bundle
from fctkit.trainer.evaluation import evaluate_retrieval


def graph(bundle: VerifiedBundle, name: str, *inputs: np.ndarray) -> np.ndarray:
    return run_onnx(bundle.artifact_path(name), [np.asarray(a, np.float32) for a in inputs])[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("release_dir", type=Path, help="the --out folder of `fctkit export` (v<N>/ bundles)")
    parser.add_argument("--public-key", type=Path, required=True)
    args = parser.parse_args()

    run = TrainedRun.open(args.run_dir)
    folders = sorted(args.release_dir.glob("v[0-9]*/"), key=lambda p: int(p.name[1:]))
    bundles = [verify_bundle(folder, args.public_key) for folder in folders]
    labels, images = run.eval_features["labels"], run.eval_images
    distance = run.distance

    def measure(query: np.ndarray, gallery: np.ndarray) -> dict[str, float]:
        n = min(query.shape[1], gallery.shape[1])
        result = evaluate_retrieval(query[:, :n], labels, gallery[:, :n], labels, distance=distance, leave_one_out=True)
        return {"top1": result.top1, "mAP": result.mean_ap}

    phi = {b.manifest.version: graph(b, "embed", images) for b in bundles}
    psi = {b.manifest.version: graph(b, "side_info", images) for b in bundles if b.manifest.side_info_dim}
    rows: list[tuple[str, dict, dict]] = []
    first = bundles[0].manifest.version
    for bundle in bundles:
        m, v = bundle.manifest, bundle.manifest.version
        cases = m.gate["cases"]
        if not m.parents:
            own = next(k for k in cases if "/" in k)  # "old/old" or "v1/v1"
            rows.append((f"v{v} {own}", measure(phi[v], phi[v]), cases[own]))
            continue
        for a in m.artifacts:
            if a.role == "forward" and m.mode == "forward":
                side = [psi[a.source_version]] if len(a.inputs) > 1 else []
                adapted = graph(bundle, a.name, phi[a.source_version], *side)
                case = _case_for(cases, a.source_version, v, first)
                rows.append((f"v{v} {case} via {a.name}", measure(phi[v], adapted), cases[case]))
            if a.role == "backward":
                forward = m.artifact("forward", source_version=a.target_version)
                unified_new = graph(bundle, a.name, phi[v])
                unified_old = graph(bundle, forward.name, phi[a.target_version])
                rows.append((f"v{v} B(new)/F(old)", measure(unified_new, unified_old), cases["B(new)/F(old)"]))
        own = "new/new" if "new/new" in cases else f"v{v - first + 1}/v{v - first + 1}"
        rows.append((f"v{v} {own}", measure(phi[v], phi[v]), cases[own]))
    hop_by_hop = _hop_by_hop(bundles, phi, psi)
    if hop_by_hop is not None:
        last = bundles[-1].manifest
        rows.append(
            (
                f"v{last.version} v3/h3(h2(v1)) hop by hop",
                measure(phi[last.version], hop_by_hop),
                last.gate["cases"]["v3/h3(h2(v1))"],
            )
        )

    print("| case (through the bundles' ONNX graphs) | top-1 bundle | top-1 run | ratio | mAP bundle | mAP run |")
    print("|---|---:|---:|---:|---:|---:|")
    for name, got, want in rows:
        print(
            f"| {name} | {got['top1']:.4f} | {want['top1']:.4f} | {got['top1'] / want['top1']:.3f} | "
            f"{got['mAP']:.4f} | {want['mAP']:.4f} |"
        )


def _case_for(cases: dict, source: int, target: int, first: int) -> str:
    """The gate case that a forward artifact source→target reproduces."""
    if "new/h(old)" in cases:
        return "new/h(old)"
    s, t = source - first + 1, target - first + 1
    return f"v{t}/h{t}(v{s})" if f"v{t}/h{t}(v{s})" in cases else f"v{t}/h{s}{t}(v{s})"


def _hop_by_hop(bundles: list[VerifiedBundle], phi: dict, psi: dict) -> np.ndarray | None:
    """v1 rows moved to v3 through v2 (h3(h2(φ1, ψ1), g2(φ1, ψ1))) for a three-version chain release."""
    if len(bundles) != 3 or not any(a.role == "side_forward" for a in bundles[1].manifest.artifacts):
        return None
    v1, v2, v3 = (b.manifest.version for b in bundles)
    embedding = graph(bundles[1], f"forward_{v1}_to_{v2}", phi[v1], psi[v1])
    side = graph(bundles[1], f"side_forward_{v1}_to_{v2}", phi[v1], psi[v1])
    return graph(bundles[2], f"forward_{v2}_to_{v3}", embedding, side)


if __name__ == "__main__":
    main()

"""Side-information ψ for photos, and choosing it on held-out *training* data.

- :func:`train_simclr_side_info`: the FCT paper's ψ — an encoder trained with SimCLR (no labels)
  on the photos of the v1 era, here the training photos' tiles at 64 px (the kit's
  :func:`fctkit.trainer.side_info.train_side_info`), exported to ONNX with its declaration
  (RGB, 64 px, pixels ÷ 255) so a device computes it from the JPEG as it adds a photo.
- :func:`choose_side_info`: one task file per ψ candidate (the same task, another gallery ψ);
  each candidate's *training* split is cut by source photo into a part to fit on and a held-out
  part, the adapter method is fitted on the first and judged on the second, and the candidate
  with the best held-out primary metric is chosen. The evaluation split is never read.

    python benchmarks/photo_side_info.py runs/bench/photos/photo-near-duplicates-seed0-side-lite1.npz \\
        runs/bench/photos/photo-near-duplicates-seed0-side-simclr.npz --out runs/bench/photos/side-choice
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
from example_steps import train_task
from image_onnx_models import ExportedImageModel, export_graph

SIMCLR_SIDE = 64
CHOSEN_BY = "residual+query-positives+hubness"


def simclr_declaration() -> dict[str, Any]:
    return {
        "kind": "image",
        "input": "image",
        "mode": "RGB",
        "resize": SIMCLR_SIDE,
        "crop": [SIMCLR_SIDE, SIMCLR_SIDE],
        "resample": "bilinear",
        "scale": 1 / 255,
        "mean": [0.0] * 3,
        "std": [1.0] * 3,
        "layout": "NCHW",
    }


def small_images(files: Sequence[bytes], side: int = SIMCLR_SIDE) -> np.ndarray:
    """JPEG/PNG files as (N, 3, side, side) float32 in [0, 1] (shorter side resized, centre crop)."""
    from fctkit.protos.preprocessing import decode_image
    from fctkit.protos.preprocessing_spec import parse_declaration

    declaration = parse_declaration(simclr_declaration(), "simclr declaration", strict=False)
    return np.stack([decode_image(data, declaration) for data in files])


def train_simclr_side_info(
    files: Sequence[bytes], out: Path, seed: int = 0, epochs: int = 15, dim: int = 64
) -> ExportedImageModel:
    """SimCLR ψ trained on ``files`` (the v1-era photos), exported to ``<out>/simclr/model.onnx``."""
    from fctkit.trainer.side_info import SideInfoConfig, train_side_info

    config = SideInfoConfig(
        kind="simclr",
        dim=dim,
        architecture="small",
        width=32,
        pool_grid=2,
        projection_dim=128,
        epochs=epochs,
        batch_size=256,
        patience=epochs,
        progress=False,
    )
    start = time.perf_counter()
    model = train_side_info(small_images(files), None, config, seed=seed, device="cpu")
    graph = export_graph(model, SIMCLR_SIDE, out / "simclr" / "model.onnx")
    (out / "simclr" / "training.json").write_text(
        json.dumps(
            {
                "images": len(files),
                "epochs": epochs,
                "dim": dim,
                "seed": seed,
                "seconds": round(time.perf_counter() - start, 1),
            }
        )
    )
    return ExportedImageModel("simclr", graph, simclr_declaration())


def held_out_task(task: Any, held_out_fraction: float, seed: int) -> Any:
    """The task's *training* split as a task of its own: gallery items grouped by source
    (the id up to its first '/'), a seeded ``held_out_fraction`` of the groups evaluates."""
    from fctkit.trainer.tasks import RetrievalTask

    split = task.train
    groups = np.array([str(i).split("/", 1)[0] for i in split.gallery.ids])
    names = np.unique(groups)
    held = set(
        np.random.default_rng(seed).choice(names, size=max(1, round(len(names) * held_out_fraction)), replace=False)
    )
    held_gallery = np.array([g in held for g in groups])
    first_positive = np.array([split.positives.of(q)[0][0] for q in range(len(split.query))])
    held_query = held_gallery[first_positive]
    fit = split.subset(np.flatnonzero(~held_query), np.flatnonzero(~held_gallery))
    judged = split.subset(np.flatnonzero(held_query), np.flatnonzero(held_gallery))
    return RetrievalTask(f"{task.name}-held-out", task.level, task.primary_metric, fit, judged, task.source)


def ridge_on_held_out(task: Any, ridges: Sequence[float]) -> dict[float, float]:
    """Recall@1 of the residual adapter's least-squares start ``[φ_old, ψ] → φ_new``
    (:func:`~fctkit.trainer.closed_form.relative_ridge_map`, ``residual.ridge``'s meaning) fitted on a
    held-out task's training part and judged on its held-out part, for each ridge. With fewer
    training pairs than input dims a small ridge overfits, and the adapter's training starts from that fit."""
    from fctkit.trainer.closed_form import relative_ridge_map
    from fctkit.trainer.evaluation import evaluate_retrieval

    def inputs(items: Any) -> np.ndarray:
        return np.hstack([items.old, items.side]) if items.side.shape[1] else items.old

    fit, judged = task.train.gallery, task.evaluation
    scores = {}
    for ridge in ridges:
        matrix, bias = relative_ridge_map(inputs(fit), fit.new, ridge)
        adapted = inputs(judged.gallery).astype(np.float64) @ matrix + bias
        result = evaluate_retrieval(
            judged.query.new,
            None,
            adapted.astype(np.float32),
            None,
            positives=judged.positives,
            distance="cosine",
            topk=(1,),
        )
        scores[ridge] = float(result.recall[1])
    return scores


def choose_ridge(held_out: Path, ridges: Sequence[float]) -> tuple[float, dict[float, float]]:
    """The ridge with the best :func:`ridge_on_held_out` on the held-out task file, and every score."""
    from fctkit.trainer.tasks import load_task

    scores = ridge_on_held_out(load_task(held_out), ridges)
    return max(scores, key=lambda r: scores[r]), scores


def choose_side_info(
    candidates: Mapping[str, Path],
    out: Path,
    seed: int = 0,
    overrides: Mapping[str, Any] | None = None,
    held_out_fraction: float = 0.25,
    method: str = CHOSEN_BY,
) -> dict[str, Any]:
    """Fit the recommended instance-level method (:func:`example_steps.train_task`: settings fixed
    unless ``overrides`` say ``selection.enabled``) on each candidate's held-out task; the candidate
    with the best held-out primary metric of ``method`` is ``chosen``. Writes ``<out>/side-info-choice.json``."""
    from fctkit.trainer.tasks import load_task, save_task

    out.mkdir(parents=True, exist_ok=True)
    held_out: dict[str, Any] = {}
    for name, path in candidates.items():
        task = held_out_task(load_task(path), held_out_fraction, seed)
        task_path = save_task(out / f"{name}-held-out.npz", task)
        gate = train_task(task_path, out / name, seed, {"backfill.orderings": ["random"], **(overrides or {})})
        held_out[name] = {
            "metric": gate["metric"],
            method: gate["cases"][method][gate["metric"]],
            "new/new": gate["cases"]["new/new"][gate["metric"]],
            "old/old": gate["cases"]["old/old"][gate["metric"]],
            "queries": len(task.evaluation.query),
            "gallery": len(task.evaluation.gallery),
        }
    chosen = max(held_out, key=lambda n: held_out[n][method])
    result = {
        "chosen": chosen,
        "method": method,
        "held_out_fraction": held_out_fraction,
        "seed": seed,
        "held_out": held_out,
    }
    (out / "side-info-choice.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "tasks", type=Path, nargs="+", help="task files that differ only in ψ; the name is after '-side-'"
    )
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--ridges",
        type=float,
        nargs="*",
        default=[1e-3, 1e-2, 1e-1, 0.3, 1.0, 3.0, 10.0],
        help="also judge the least-squares start's ridge on the chosen ψ's held-out task (default %(default)s)",
    )
    parser.add_argument(
        "--reuse", action="store_true", help="read <out>/side-info-choice.json of an earlier run; fit nothing"
    )
    parser.add_argument(
        "--no-selection",
        action="store_true",
        help="fit every candidate with the method's default settings (no nested search; faster)",
    )
    args = parser.parse_args(argv)
    candidates = {path.stem.rsplit("-side-", 1)[-1]: path for path in args.tasks}
    done = args.out / "side-info-choice.json"
    if args.reuse and done.is_file():
        result = json.loads(done.read_text())
    else:
        result = choose_side_info(
            candidates, args.out, args.seed, None if args.no_selection else {"selection.enabled": True}
        )
    for name, row in result["held_out"].items():
        print(
            f"{name}: held-out {row['metric']} {row[CHOSEN_BY]:.4f} (new/new {row['new/new']:.4f}, old/old {row['old/old']:.4f})"
        )
    print(f"chosen: {result['chosen']}")
    if args.ridges:
        best, scores = choose_ridge(args.out / f"{result['chosen']}-held-out.npz", args.ridges)
        result |= {"ridge_on_held_out": {str(r): v for r, v in scores.items()}, "ridge": best}
        (args.out / "side-info-choice.json").write_text(json.dumps(result, indent=2) + "\n")
        print(
            "least squares on held-out training data, R@1 by ridge: "
            + ", ".join(f"{r:g} {v:.3f}" for r, v in scores.items())
            + f"; chosen residual.ridge = {best:g}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())

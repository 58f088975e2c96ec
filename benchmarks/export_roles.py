"""Export every bundle role from models trained on digits: ONNX opset, file size, export time,
parity (fp32 and fp16), retrieval top-1 through the graphs, and ONNX Runtime throughput.

    python benchmarks/export_roles.py                  # FCT paper widths (256 / 2048), a few minutes on 2 cores
    python benchmarks/export_roles.py --epochs 2 --mixer-width 512 --markdown BENCHMARKS-export.md

Baselines measured in the same run, so the printed ratios do not depend on the machine's load:
throughput is ONNX Runtime rows/s over torch rows/s (same module, same batches); file size and
retrieval are fp16 over fp32 / ONNX over torch.
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
from pathlib import Path

import numpy as np
import onnxruntime as ort
import torch

from fctkit.export.onnx_export import run_onnx, run_torch
from fctkit.export.roles import RoleExport, export_role, role_module
from fctkit.trainer import evaluate_retrieval, load_dataset, make_splits, old_class_subset
from fctkit.trainer.adapters import FastFillAdapter, FastFillConfig, FCTAdapter, FCTConfig
from fctkit.trainer.backbones import BackboneConfig, extract_features, train_backbone
from fctkit.trainer.closed_form import ClosedFormAdapter
from fctkit.trainer.fitting import TrainConfig
from fctkit.trainer.lambda_orth import LambdaOrthAdapter, LambdaOrthConfig
from fctkit.trainer.side_info import SideInfoConfig, train_side_info


def rows_per_second(run, arrays: list[np.ndarray], batch: int, repeats: int) -> float:
    """Best-of-``repeats`` throughput of ``run`` over the arrays in batches of ``batch``."""
    best = float("inf")
    n = len(arrays[0])
    for _ in range(repeats):
        start = time.perf_counter()
        for i in range(0, n, batch):
            run([a[i : i + batch] for a in arrays])
        best = min(best, time.perf_counter() - start)
    return n / best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--epochs", type=int, default=5, help="training epochs of every model (export facts hardly depend on it)"
    )
    parser.add_argument("--branch-width", type=int, default=256)
    parser.add_argument("--mixer-width", type=int, default=2048)
    parser.add_argument("--batch", type=int, default=256, help="batch size of the throughput comparison")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=1, help="intra-op threads of torch and ONNX Runtime alike")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--markdown", type=Path, help="also write the tables to this markdown file")
    parser.add_argument("--json", type=Path, help="also write every figure to this JSON file")
    args = parser.parse_args()
    logging.getLogger("torch").setLevel(logging.ERROR)
    torch.set_num_threads(args.threads)

    data = load_dataset("digits")
    splits = make_splits(data.labels, seed=args.seed)
    train, query, gallery = (data.subset(s) for s in (splits.train, splits.query, splits.gallery))
    old_rows = old_class_subset(train.labels)
    backbone = {"epochs": args.epochs, "progress": False}
    old = train_backbone(
        train.images[old_rows],
        train.labels[old_rows],
        BackboneConfig("small", embedding_dim=32, **backbone),
        seed=args.seed,
        device="cpu",
    )
    new = train_backbone(
        train.images,
        train.labels,
        BackboneConfig("wide", embedding_dim=64, **backbone),
        seed=args.seed + 1,
        device="cpu",
    )
    side = train_side_info(
        train.images[old_rows],
        config=SideInfoConfig(dim=32, epochs=args.epochs, progress=False),
        seed=args.seed + 2,
        device="cpu",
    )
    f_old, f_new, f_side = (extract_features(m, train.images) for m in (old, new, side))
    adapter_train = TrainConfig(
        epochs=args.epochs * 4, warmup_epochs=1, lr=1e-3, progress=False, device="cpu", seed=args.seed
    )
    widths = {"branch_width": args.branch_width, "mixer_width": args.mixer_width, "train": adapter_train}
    models = {
        "embed v1 (small CNN)": ("embed", old, None),
        "embed v2 (wide CNN)": ("embed", new, None),
        "side_info (SimCLR)": ("side_info", side, None),
        "forward h (FCT)": ("forward", FCTAdapter.fit(f_old, f_new, f_side, FCTConfig(**widths))[0], (1, 2)),
        "side_forward g (FCT)": ("side_forward", FCTAdapter.fit(f_old, f_side, f_side, FCTConfig(**widths))[0], (1, 2)),
        "forward h (FastFill)": (
            "forward",
            FastFillAdapter.fit(f_old, f_new, f_side, FastFillConfig(**widths))[0],
            (1, 2),
        ),
        "uncertainty σ (FastFill)": ("uncertainty", None, (1, 2)),
        "forward F (λ-orth, affine)": (
            "forward",
            LambdaOrthAdapter.fit(f_old, f_new, train.labels, LambdaOrthConfig(train=adapter_train))[0],
            (1, 2),
        ),
        "backward B⊥ (λ-orth)": ("backward", None, (2, 1)),
        "forward (least squares)": ("forward", ClosedFormAdapter.fit(f_old, f_new)[0], (1, 2)),
    }
    models["uncertainty σ (FastFill)"] = ("uncertainty", models["forward h (FastFill)"][1], (1, 2))
    models["backward B⊥ (λ-orth)"] = ("backward", models["forward F (λ-orth, affine)"][1], (2, 1))

    q_old, q_new, q_side = (extract_features(m, query.images) for m in (old, new, side))
    real_for = {"image": query.images, "old": q_old, "side": q_side, "new": q_new}
    rows, exports = [], {}
    with tempfile.TemporaryDirectory(prefix="fctkit-export-bench-") as folder:
        for label, (role, trained, hop) in models.items():
            module, names = role_module(role, trained)
            real = [real_for[n] for n in names]
            versions = {"source_version": hop[0], "target_version": hop[1]} if hop else {}
            fp32 = export_role(role, trained, Path(folder) / f"{len(rows)}.onnx", real, **versions)
            fp16 = export_role(role, trained, Path(folder) / f"{len(rows)}.fp16.onnx", real, fp16=True, **versions)
            bench = [np.concatenate([a] * max(1, 2048 // len(a))) for a in real]
            session = _session(fp32.export.path, args.threads)
            input_names = [i.name for i in session.get_inputs()]
            # the lambdas bind this pass's session and module (rows_per_second calls them at once)
            ort_rate = rows_per_second(
                lambda b, session=session, input_names=input_names: session.run(None, dict(zip(input_names, b))),
                bench,
                args.batch,
                args.repeats,
            )
            torch_rate = rows_per_second(lambda b, module=module: run_torch(module, b), bench, args.batch, args.repeats)
            exports[label] = (fp32, fp16)
            rows.append(_row(label, fp32, fp16, ort_rate, torch_rate))
            print(f"{label}: {rows[-1]}", flush=True)
        retrieval = _retrieval(models, exports, query, gallery, old, new, side)

    text = _markdown(rows, retrieval, args)
    print("\n" + text)
    if args.markdown:
        args.markdown.write_text(text)
    if args.json:
        args.json.write_text(
            json.dumps(
                {"roles": rows, "retrieval": retrieval, "args": {k: str(v) for k, v in vars(args).items()}}, indent=2
            )
        )


def _session(path: Path, threads: int) -> ort.InferenceSession:
    options = ort.SessionOptions()
    options.intra_op_num_threads = options.inter_op_num_threads = threads
    return ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])


def _row(label: str, fp32: RoleExport, fp16: RoleExport, ort_rate: float, torch_rate: float) -> dict:
    return {
        "artifact": label,
        "opset": fp32.export.opset,
        "inputs": {s.name: list(s.shape) for s in fp32.export.inputs},
        "fp32_bytes": fp32.export.size_bytes,
        "fp16_bytes": fp16.export.size_bytes,
        "export_seconds": round(fp32.export.export_seconds, 2),
        "fp32_max_abs_error": fp32.parity.max_abs_error,
        "fp16_max_abs_error": fp16.parity.max_abs_error,
        "fp16_relative_error": fp16.parity.max_abs_error / max(1.0, fp16.parity.max_abs_reference),
        "fp16_tolerance": fp16.parity.tolerance,
        "ort_rows_per_s": round(ort_rate),
        "torch_rows_per_s": round(torch_rate),
    }


def _retrieval(models, exports, query, gallery, old, new, side) -> dict:
    """top-1 of new/h(old) and B(new)/F(old) computed with torch, fp32 ONNX and fp16 ONNX."""
    h = models["forward h (FCT)"][1]
    lam = models["forward F (λ-orth, affine)"][1]
    keys = [
        "embed v1 (small CNN)",
        "embed v2 (wide CNN)",
        "side_info (SimCLR)",
        "forward h (FCT)",
        "forward F (λ-orth, affine)",
        "backward B⊥ (λ-orth)",
    ]

    def cases(embed_old, embed_new, side_info, run_h, run_f, run_b):
        q_new, g_old, g_side = embed_new(query.images), embed_old(gallery.images), side_info(gallery.images)
        top1 = lambda q, g: evaluate_retrieval(q, query.labels, g, gallery.labels, distance="cosine").top1  # noqa: E731
        return {
            "old/old": top1(embed_old(query.images), g_old),
            "new/new": top1(q_new, embed_new(gallery.images)),
            "new/h(old)": top1(q_new, run_h(g_old, g_side)),
            "B(new)/F(old)": top1(run_b(q_new), run_f(g_old)),
        }

    result = {
        "torch": cases(
            lambda x: extract_features(old, x),
            lambda x: extract_features(new, x),
            lambda x: extract_features(side, x),
            h.transform,
            lam.transform,
            lam.transform_new,
        )
    }
    for index, precision in enumerate(("onnx fp32", "onnx fp16")):
        path = {k: exports[k][index].export.path for k in keys}
        one = lambda key, path=path: lambda *arrays: run_onnx(path[key], list(arrays))[0]  # noqa: E731
        result[precision] = cases(one(keys[0]), one(keys[1]), one(keys[2]), one(keys[3]), one(keys[4]), one(keys[5]))
    return result


def _markdown(rows: list[dict], retrieval: dict, args) -> str:
    lines = [
        f"Digits, FCT widths {args.branch_width}/{args.mixer_width}, {args.epochs} backbone epochs; "
        f"throughput at batch {args.batch}, best of {args.repeats}, {args.threads} thread(s) for torch and ONNX Runtime alike.",
        "",
        "| artifact | opset | fp32 KiB | fp16 KiB | export s | fp32 max err | fp16 rel err | ORT rows/s | ORT / torch |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        lines.append(
            f"| {r['artifact']} | {r['opset']} | {r['fp32_bytes'] / 1024:.1f} | {r['fp16_bytes'] / 1024:.1f} | "
            f"{r['export_seconds']:.2f} | {r['fp32_max_abs_error']:.1e} | {r['fp16_relative_error']:.1e} | "
            f"{r['ort_rows_per_s']:,} | {r['ort_rows_per_s'] / r['torch_rows_per_s']:.2f}× |"
        )
    cases = list(retrieval["torch"])
    lines += ["", "| top-1 | " + " | ".join(cases) + " |", "|---|" + "---:|" * len(cases)]
    for source, values in retrieval.items():
        lines.append(f"| {source} | " + " | ".join(f"{values[c]:.4f}" for c in cases) + " |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()

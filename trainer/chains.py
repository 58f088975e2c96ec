"""Chains of versions v1 → v2 → v3 (FCT paper, Table 5).

Each version's backbone sees the first ``classes[v]`` classes and its own SimCLR side-info
model is trained on that version's data. Hop by hop, a v1 row becomes
``h3(h2(φ1, ψ1), g2(φ1, ψ1))``: h2 moves the embedding, g2 the side-info, h3 the result.
A device that skipped v2 can instead use the direct adapter ``h13(φ1, ψ1)``.

Writes ``models/chain_v{1,2,3}_{backbone,side_info}.pt``, ``adapters/chain_{h2,g2,h3,h13}.pt``
and the evaluation split's per-version features ``features/chain_eval.npz`` (``v{v}_embedding``,
``v{v}_side``, ``labels``); the returned gate section holds each hop's ECC under ``ecc``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from .adapters import FCTAdapter
from .backbones import extract_features, save_backbone, train_backbone
from .compatibility import ecc
from .datasets import class_subset
from .methods import run_seeded
from .pipeline_config import PipelineConfig
from .report import Report
from .run_data import load_image_splits
from .searches import Evaluator, gate_metrics
from .side_info import extract_side_info, save_side_info, train_side_info


@dataclasses.dataclass
class VersionFeatures:
    embedding: np.ndarray  # φ_v
    side: np.ndarray  # ψ_v


def run_chain(config: PipelineConfig, out: Path, report: Report, log: Callable[[str], None]) -> dict[str, Any]:
    data = load_image_splits(config)
    train_labels = data.labels[data.train]
    versions_train: list[VersionFeatures] = []
    versions_eval: list[VersionFeatures] = []
    for v, n_classes in enumerate(config.chain.classes, start=1):
        seen = class_subset(train_labels, n_classes)
        backbone_config = config.old_backbone if v == 1 else config.new_backbone
        log(f"chain v{v}: backbone and side-info on {n_classes} classes ({len(seen)} images)")
        images = data.images[data.train][seen]
        backbone = train_backbone(images, train_labels[seen], backbone_config, config.seed + 10 * v, config.device)
        side_model = train_side_info(
            images, train_labels[seen], config.side_info, config.seed + 10 * v + 1, config.device
        )
        save_backbone(backbone, out / "models" / f"chain_v{v}_backbone.pt")
        save_side_info(side_model, out / "models" / f"chain_v{v}_side_info.pt")
        for split, target in ((data.train, versions_train), (data.evaluation, versions_eval)):
            x = data.images[split]
            target.append(VersionFeatures(extract_features(backbone, x), extract_side_info(side_model, x)))

    v1, v2, v3 = versions_train
    fct = dataclasses.replace(run_seeded(config, config.fct), side_info=True)
    log("chain adapters h2, g2, h3 and direct h13")
    h2, _ = FCTAdapter.fit(v1.embedding, v2.embedding, v1.side, fct)
    g2, _ = FCTAdapter.fit(v1.embedding, v2.side, v1.side, fct)
    h3, _ = FCTAdapter.fit(v2.embedding, v3.embedding, v2.side, fct)
    h13, _ = FCTAdapter.fit(v1.embedding, v3.embedding, v1.side, fct)
    for name, adapter in (("chain_h2", h2), ("chain_g2", g2), ("chain_h3", h3), ("chain_h13", h13)):
        adapter.save(out / "adapters" / f"{name}.pt")

    e1, e2, e3 = versions_eval
    np.savez(
        out / "features" / "chain_eval.npz",
        labels=data.labels[data.evaluation],
        **{
            f"v{v}_{kind}": getattr(f, kind)
            for v, f in enumerate(versions_eval, start=1)
            for kind in ("embedding", "side")
        },
    )
    hop_by_hop = h3.transform(h2.transform(e1.embedding, e1.side), g2.transform(e1.embedding, e1.side))
    direct = h13.transform(e1.embedding, e1.side)
    evaluate = Evaluator.labelled(data.labels[data.evaluation], config.evaluation)
    cases = {
        "v1/v1 [chain]": evaluate(e1.embedding, e1.embedding),
        "v2/v2 [chain]": evaluate(e2.embedding, e2.embedding),
        "v3/v3 [chain]": evaluate(e3.embedding, e3.embedding),
        "v2/h2(v1) [chain]": evaluate(e2.embedding, h2.transform(e1.embedding, e1.side)),
        "v3/h3(v2) [chain]": evaluate(e3.embedding, h3.transform(e2.embedding, e2.side)),
        "v3/v1 [chain]": evaluate(e3.embedding, e1.embedding),
        "v3/h3(h2(v1)) [chain, hop by hop]": evaluate(e3.embedding, hop_by_hop),
        "v3/h13(v1) [chain, direct]": evaluate(e3.embedding, direct),
    }
    for name, result in cases.items():
        report.add_case(name, result)
    hop, one = cases["v3/h3(h2(v1)) [chain, hop by hop]"], cases["v3/h13(v1) [chain, direct]"]
    report.add_verdict(
        "ECC [chain, hop by hop]",
        hop.top1 > cases["v1/v1 [chain]"].top1,
        f"top-1 {hop.top1:.4f} vs v1/v1 {cases['v1/v1 [chain]'].top1:.4f}",
    )
    report.add_verdict(
        "ECC [chain, direct]",
        one.top1 > cases["v1/v1 [chain]"].top1,
        f"top-1 {one.top1:.4f} vs v1/v1 {cases['v1/v1 [chain]'].top1:.4f}",
    )
    # Per-hop ECC, keyed by adapter name: each hop's adapted gallery against its source version's own retrieval.
    hop_ecc = {
        "chain_h2": ecc(cases["v2/h2(v1) [chain]"], cases["v1/v1 [chain]"]),
        "chain_h3": ecc(cases["v3/h3(v2) [chain]"], cases["v2/v2 [chain]"]),
        "chain_h13": ecc(one, cases["v1/v1 [chain]"]),
    }
    return {
        "hop_by_hop": gate_metrics(hop),
        "direct": gate_metrics(one),
        "v1/v1": gate_metrics(cases["v1/v1 [chain]"]),
        "v2/v2": gate_metrics(cases["v2/v2 [chain]"]),
        "v3/v3": gate_metrics(cases["v3/v3 [chain]"]),
        "v2/h2(v1)": gate_metrics(cases["v2/h2(v1) [chain]"]),
        "v3/h3(v2)": gate_metrics(cases["v3/h3(v2) [chain]"]),
        "ecc": hop_ecc,
    }

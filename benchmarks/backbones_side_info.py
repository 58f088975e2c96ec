"""Demo backbones and side-information models: retrieval quality, CKA and training time.

    python benchmarks/backbones_side_info.py                      # digits, seconds
    python benchmarks/backbones_side_info.py --dataset fashion-mnist --max-train 12000

FCT protocol: the old backbone (small CNN) and ψ see only the first half of the classes of the
training split; the new backbone (wide CNN) sees all classes. Retrieval top-1 on held-out
query/gallery splits; the baseline measured in the same run is retrieval on raw pixels
(quality) and the old backbone's training time (time), so the printed ratios do not depend
on the machine's load.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from fctkit.trainer.backbones import BackboneConfig, extract_features, train_backbone
from fctkit.trainer.cka import linear_cka
from fctkit.trainer.datasets import ImageDataset, load_dataset, make_splits, old_class_subset
from fctkit.trainer.evaluation import evaluate_retrieval
from fctkit.trainer.side_info import SideInfoConfig, SideInfoModel, extract_side_info, train_side_info


def top1(query: np.ndarray, query_labels: np.ndarray, gallery: np.ndarray, gallery_labels: np.ndarray) -> float:
    return evaluate_retrieval(query, query_labels, gallery, gallery_labels, topk=(1,)).cmc[1]


def capped(dataset: ImageDataset, limit: int | None, seed: int) -> ImageDataset:
    if limit is None or limit >= len(dataset):
        return dataset
    keep = np.sort(np.random.default_rng(seed).permutation(len(dataset))[:limit])
    return dataset.subset(keep)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dataset", default="digits", choices=["digits", "fashion-mnist"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default="cpu", choices=["auto", "cpu", "cuda"])
    parser.add_argument("--max-train", type=int, default=None, help="subsample the training split (seeded)")
    parser.add_argument("--max-eval", type=int, default=None, help="subsample query and gallery each (seeded)")
    parser.add_argument("--epochs", type=int, default=None, help="override every model's epoch budget")
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's choice)")
    parser.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)

    data = load_dataset(args.dataset)
    splits = make_splits(data.labels, seed=args.seed)
    train = capped(data.subset(splits.train), args.max_train, args.seed)
    query = capped(data.subset(splits.query), args.max_eval, args.seed + 1)
    gallery = capped(data.subset(splits.gallery), args.max_eval, args.seed + 2)
    old_train = train.subset(old_class_subset(train.labels))
    old_query, old_gallery = (s.subset(old_class_subset(s.labels)) for s in (query, gallery))
    epochs = {} if args.epochs is None else {"epochs": args.epochs}

    timings: dict[str, float] = {}

    def timed(name: str, fn):
        start = time.perf_counter()
        result = fn()
        timings[name] = time.perf_counter() - start
        return result

    old = timed(
        "old backbone",
        lambda: train_backbone(
            old_train.images, old_train.labels, BackboneConfig("small", 32, **epochs), args.seed, args.device
        ),
    )
    new = timed(
        "new backbone",
        lambda: train_backbone(
            train.images, train.labels, BackboneConfig("wide", 64, **epochs), args.seed, args.device
        ),
    )
    simclr = timed(
        "simclr side-info",
        lambda: train_side_info(old_train.images, None, SideInfoConfig("simclr", 32, **epochs), args.seed, args.device),
    )
    alternate = timed(
        "alternate side-info",
        lambda: train_side_info(
            old_train.images, old_train.labels, SideInfoConfig("alternate", 32, **epochs), args.seed + 1, args.device
        ),
    )
    torch.manual_seed(args.seed)
    untrained = SideInfoModel(SideInfoConfig("simclr", 32))

    def pixels(s: ImageDataset) -> np.ndarray:
        return s.images.reshape(len(s), -1)

    def retrieval(embed, q: ImageDataset, g: ImageDataset) -> float:
        return top1(embed(q), q.labels, embed(g), g.labels)

    def model(m):
        return lambda s: extract_features(m, s.images)

    figures = {
        "dataset": args.dataset,
        "train": len(train),
        "old_train": len(old_train),
        "query": len(query),
        "gallery": len(gallery),
        "top1_all_classes": {
            "pixels (baseline)": retrieval(pixels, query, gallery),
            "old backbone": retrieval(model(old), query, gallery),
            "new backbone": retrieval(model(new), query, gallery),
        },
        "top1_old_classes": {
            "pixels (baseline)": retrieval(pixels, old_query, old_gallery),
            "old backbone": retrieval(model(old), old_query, old_gallery),
            "simclr psi (no labels)": retrieval(model(simclr), old_query, old_gallery),
            "untrained encoder": retrieval(model(untrained), old_query, old_gallery),
            "alternate psi": retrieval(model(alternate), old_query, old_gallery),
        },
        "epochs_run": {
            "old backbone": len(old.history.train_loss),
            "new backbone": len(new.history.train_loss),
            "simclr side-info": len(simclr.history.train_loss),
            "alternate side-info": len(alternate.history.train_loss),
        },
        "simclr_loss_first_last": [simclr.history.train_loss[0], simclr.history.train_loss[-1]],
        "seconds": timings,
    }
    phi_old = extract_features(old, query.images)
    figures["cka_phi_old"] = {
        "simclr psi": linear_cka(phi_old, extract_side_info(simclr, query.images)),
        "alternate psi": linear_cka(phi_old, extract_side_info(alternate, query.images)),
        "new backbone": linear_cka(phi_old, extract_features(new, query.images)),
    }

    print(
        f"{args.dataset}: train {len(train)} (old classes {len(old_train)}), query {len(query)}, gallery {len(gallery)}"
    )
    for section in ("top1_all_classes", "top1_old_classes"):
        base = figures[section]["pixels (baseline)"]
        print(f"\n{section.replace('_', ' ')}  (ratio = top-1 / raw-pixel top-1 measured in this run)")
        for name, value in figures[section].items():
            print(f"  {name:26s} {value:.3f}   ratio {value / base:.3f}")
    print("\nlinear CKA with phi_old (query split)")
    for name, value in figures["cka_phi_old"].items():
        print(f"  {name:26s} {value:.3f}")
    print("\ntraining wall time  (ratio = seconds / old-backbone seconds in this run)")
    for name, seconds in timings.items():
        print(
            f"  {name:26s} {seconds:7.2f} s   ratio {seconds / timings['old backbone']:.2f}   "
            f"epochs {figures['epochs_run'][name]}"
        )
    print(f"  {'total':26s} {sum(timings.values()):7.2f} s")
    if args.json:
        with open(args.json, "w") as fh:
            json.dump(figures, fh, indent=2)


if __name__ == "__main__":
    main()

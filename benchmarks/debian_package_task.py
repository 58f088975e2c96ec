"""Instance-level, asymmetric text task from Debian's package index: a package's one-line
synopsis → its long description (a title against a passage).

    python benchmarks/debian_package_task.py --out runs/bench/debian-packages                  # 3,000 / 6,000
    python benchmarks/debian_package_task.py --out runs/bench/debian-packages --train-queries 20000

writes ``<out>/debian-synopsis-description-seed<seed>[-train<N>].npz`` (a task in the kit's format)
and prints its old/old and new/new baselines.

Data: the English descriptions of Debian 12's ``main`` packages (``Translation-en``, which
``apt-get update -o Acquire::Languages=en`` fetches; this script runs that when the file is
missing and we are root). Query: the synopsis ("fast, scalable, distributed revision control
system"); gallery item: the long description, paragraphs joined, cut after
``--passage-chars`` characters at a word boundary. One positive per query, gallery row i. Dropped:
descriptions shorter than 80 characters, and — keeping the first in package-name order — repeated
synopses and repeated descriptions (compared lower-case with digits removed, so ``libfoo1`` and
``libfoo2`` sharing one text count once), so every query and every item is unique. Packages are
shuffled with ``numpy.random.default_rng(seed)``: the first ``--eval-queries`` make the evaluation
split, the next ``--train-queries`` the training split; a larger training split keeps the smaller
one's packages first (and reuses their cached embeddings).

The kit's defaults were never tuned on this task: it is one of the quality suite's held-out cases.
Models as in :mod:`wordnet_lemma_task` (MiniLM-L6 old, mpnet-base new, e5-small ψ on items only).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
from debian_data import BenchmarkSetupError
from instance_tasks import build_and_save
from text_wordnet import new_model_dir, old_model_dir
from wordnet_lemma_task import e5_passage_encoder, embed_cached, sentence_transformer_encoder

TASK_NAME = "debian-synopsis-description"
LISTS = Path("/var/lib/apt/lists")
MIN_DESCRIPTION_CHARS = 80


def translation_files() -> list[Path]:
    """Debian main's ``Translation-en`` lists, fetched once with apt-get when missing."""
    found = sorted(LISTS.glob("*_debian_dists_*_main_i18n_Translation-en*"))
    if found:
        return found
    if os.geteuid() != 0:
        raise BenchmarkSetupError(
            "no Translation-en under /var/lib/apt/lists: run `apt-get update -o Acquire::Languages=en`"
        )
    print("fetching Debian's English package descriptions (apt-get update -o Acquire::Languages=en) ...", flush=True)
    subprocess.run(["apt-get", "update", "-q", "-o", "Acquire::Languages=en"], check=True, stdout=subprocess.DEVNULL)
    found = sorted(LISTS.glob("*_debian_dists_*_main_i18n_Translation-en*"))
    if not found:
        raise BenchmarkSetupError("apt-get update fetched no Translation-en list")
    return found


def read_descriptions(files: list[Path]) -> dict[str, tuple[str, list[str]]]:
    """Package → (synopsis, long-description lines), read through apt's own decompressor."""
    packages: dict[str, tuple[str, list[str]]] = {}
    for path in files:
        text = subprocess.run(
            ["/usr/lib/apt/apt-helper", "cat-file", str(path)], check=True, capture_output=True, text=True
        ).stdout
        for record in text.split("\n\n"):
            name, synopsis, body = None, None, []
            for line in record.splitlines():
                if line.startswith("Package: "):
                    name = line[9:].strip()
                elif line.startswith("Description-en: "):
                    synopsis = line[16:].strip()
                elif line.startswith(" ") and synopsis is not None:
                    body.append(line[1:])
            if name and synopsis:
                packages.setdefault(name, (synopsis, body))
    return packages


def passage(lines: list[str], limit: int) -> str:
    """The long description as one passage: '.' lines are paragraph breaks, bullets kept as text."""
    text = re.sub(r"\s+", " ", " ".join("" if line.strip() == "." else line.strip() for line in lines)).strip()
    if len(text) <= limit:
        return text
    return text[:limit].rsplit(" ", 1)[0]


def usable_pairs(packages: dict[str, tuple[str, list[str]]], limit: int) -> list[tuple[str, str, str]]:
    """(package, synopsis, passage) with unique synopses and descriptions (see the docstring)."""
    seen_query, seen_item, pairs = set(), set(), []
    for name in sorted(packages):
        synopsis, body = packages[name]
        item = passage(body, limit)
        query_key = synopsis.lower()
        item_key = re.sub(r"\d+", "", item.lower())
        if len(item) < MIN_DESCRIPTION_CHARS or query_key in seen_query or item_key in seen_item:
            continue
        seen_query.add(query_key)
        seen_item.add(item_key)
        pairs.append((name, synopsis, item))
    return pairs


def build_task(args: argparse.Namespace) -> tuple[object, dict]:
    from fctkit.trainer.relevance import Positives
    from fctkit.trainer.tasks import RetrievalTask, TaskSet, TaskSplit

    packages = read_descriptions(translation_files())
    pairs = usable_pairs(packages, args.passage_chars)
    wanted = args.eval_queries + args.train_queries
    if wanted > len(pairs):
        raise BenchmarkSetupError(f"{wanted} packages asked for but only {len(pairs)} are usable")
    order = np.random.default_rng(args.seed).permutation(len(pairs))
    rows = {"eval": order[: args.eval_queries], "train": order[args.eval_queries : wanted]}
    print(f"{len(packages)} packages, {len(pairs)} usable; eval {args.eval_queries}, train {args.train_queries}")
    texts = {(split, "query"): [pairs[i][1] for i in index] for split, index in rows.items()}
    texts |= {(split, "gallery"): [pairs[i][2] for i in index] for split, index in rows.items()}
    models = {
        "old": ("all-MiniLM-L6-v2", sentence_transformer_encoder(old_model_dir(), args.batch_size)),
        "new": ("all-mpnet-base-v2", sentence_transformer_encoder(new_model_dir(args.out), args.batch_size)),
        "side": ("multilingual-e5-small-q4", e5_passage_encoder()),
    }
    vectors, timings = {}, {}
    for role, (model, encode) in models.items():
        started = time.perf_counter()
        for (split, part), items in texts.items():
            if role != "side" or part == "gallery":
                vectors[role, split, part] = embed_cached(encode, model, f"{split}-{part}", items, args.out)
        timings[f"embed {model} (s)"] = round(time.perf_counter() - started, 1)
    splits = {}
    for split, index in rows.items():
        ids = np.array([pairs[i][0] for i in index])
        none = np.zeros((len(ids), 0), np.float32)
        query = TaskSet(ids, vectors["old", split, "query"], vectors["new", split, "query"], none)
        gallery = TaskSet(
            ids, vectors["old", split, "gallery"], vectors["new", split, "gallery"], vectors["side", split, "gallery"]
        )
        splits[split] = TaskSplit(query, gallery, Positives.from_lists([[i] for i in range(len(ids))], len(ids)))
    task = RetrievalTask(
        name=TASK_NAME, level="instance", primary_metric="recall@1", train=splits["train"], evaluation=splits["eval"]
    )
    facts = {"packages": len(packages), "usable": len(pairs), "eval": args.eval_queries, "train": args.train_queries}
    return task, facts | timings


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("runs/bench/debian-packages"))
    parser.add_argument("--seed", type=int, default=0, help="seed of the package shuffle that makes the split")
    parser.add_argument("--eval-queries", type=int, default=3000, help="evaluation packages (queries = items)")
    parser.add_argument("--train-queries", type=int, default=6000, help="training packages, disjoint from evaluation")
    parser.add_argument("--passage-chars", type=int, default=400, help="cut each description after this many chars")
    parser.add_argument("--batch-size", type=int, default=64, help="embedding batch size (MiniLM, mpnet)")
    args = parser.parse_args(argv)
    if min(args.eval_queries, args.train_queries, args.batch_size) < 1 or args.passage_chars < MIN_DESCRIPTION_CHARS:
        parser.error(f"sizes must be at least 1 and --passage-chars at least {MIN_DESCRIPTION_CHARS}")
    size = "" if args.train_queries == 6000 else f"-train{args.train_queries}"
    return build_and_save(lambda: build_task(args), args.out / f"{TASK_NAME}-seed{args.seed}{size}.npz")


if __name__ == "__main__":
    sys.exit(main())

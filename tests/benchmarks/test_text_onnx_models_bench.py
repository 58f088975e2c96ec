"""The text example's model export (benchmarks/text_onnx_models.py) on tiny models the test
makes: a 1-layer BERT (takes token_type_ids) and a 1-layer MPNet (does not; pad id 1), each a
sentence-transformers folder (mean pooling, Normalize) with a WordLevel tokenizer.json. Each
is exported with torch.onnx and its graph + the kit's Preprocessor must match
``SentenceTransformer.encode``, a text over the limit included. No download."""

from __future__ import annotations

import json
import warnings
from pathlib import Path

import numpy as np
import pytest

from tests.support.benchmark_scripts import benchmark_script

pytest.importorskip("sentence_transformers")
pytest.importorskip("onnxruntime")

WORDS = [f"w{i}" for i in range(30)]


@pytest.fixture(scope="module")
def bench():
    with benchmark_script("text_onnx_models.py") as module:
        yield module


def tiny_sentence_model(folder: Path, kind: str, pooling: str = "mean") -> Path:
    """A random 1-layer ``kind`` ('bert' or 'mpnet') saved as a sentence-transformers folder."""
    from tokenizers import Tokenizer, models, pre_tokenizers, processors
    from transformers import (
        BertConfig,
        BertModel,
        MPNetConfig,
        MPNetModel,
        PreTrainedTokenizerFast,
    )

    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)
        from sentence_transformers import SentenceTransformer
        from sentence_transformers import models as st

    special = ["[UNK]", "[PAD]", "[CLS]", "[SEP]"] if kind == "mpnet" else ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
    vocab = {w: i for i, w in enumerate(special + WORDS)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, pad_token="[PAD]", unk_token="[UNK]", cls_token="[CLS]", sep_token="[SEP]"
    )
    sizes = {
        "vocab_size": len(vocab),
        "hidden_size": 16,
        "num_hidden_layers": 1,
        "num_attention_heads": 2,
        "intermediate_size": 32,
        "max_position_embeddings": 40,
    }
    model = BertModel(BertConfig(**sizes)) if kind == "bert" else MPNetModel(MPNetConfig(**sizes, pad_token_id=1))
    model.save_pretrained(folder / "hf")
    fast.save_pretrained(folder / "hf")
    modules = [st.Transformer(str(folder / "hf"), max_seq_length=10), st.Pooling(16, pooling), st.Normalize()]
    SentenceTransformer(modules=modules, device="cpu").save(str(folder / "st"))
    return folder / "st"


@pytest.mark.parametrize(
    "kind, inputs, pad_id",
    [("bert", ["input_ids", "attention_mask", "token_type_ids"], 0), ("mpnet", ["input_ids", "attention_mask"], 1)],
)
def test_an_exported_graph_with_the_kits_preprocessing_matches_sentence_transformers(
    bench, tmp_path, kind, inputs, pad_id
):
    source = tiny_sentence_model(tmp_path / "source", kind)
    exported = bench.export_model("old", source, tmp_path / "out")
    assert list(exported.inputs) == inputs
    assert {p.name for p in (tmp_path / "out" / "old").iterdir()} == {
        "model.onnx",
        "tokenizer.json",
        "preprocessing.json",
    }
    declared = json.loads((tmp_path / "out" / "old" / "preprocessing.json").read_text())
    assert (declared["max_length"], declared["pad_id"], declared["pooling"], declared["normalize"]) == (
        10,
        pad_id,
        "mean",
        True,
    )
    assert declared["token_type_ids"] == ("token_type_ids" if kind == "bert" else None)
    rng = np.random.default_rng(0)
    texts = [" ".join(rng.choice(WORDS, size=rng.integers(1, 7))) for _ in range(20)] + [" ".join(WORDS[:15])]
    parity = bench.check_parity(exported, texts, batch_size=8)
    assert parity["texts"] == 21 and parity["truncated_texts"] == 1 and parity["dim"] == 16
    assert parity["max_abs_error"] < 1e-5, parity


def test_a_model_that_does_not_mean_pool_is_refused(bench, tmp_path):
    source = tiny_sentence_model(tmp_path / "source", "bert", pooling="cls")
    with pytest.raises(bench.BenchmarkSetupError, match=r"the model pools with .cls."):
        bench.export_model("old", source, tmp_path / "out")
    assert not (tmp_path / "out").exists()

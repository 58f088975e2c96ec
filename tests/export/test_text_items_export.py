"""A team's own text models, end to end: two tiny text graphs the test builds (int64
input_ids / attention_mask, v2 also token_type_ids; dynamic token axes), each with its own
WordLevel tokenizer.json built with `tokenizers`; a features-mode run on the features their
"pipeline" (numpy, here) computed; `fctkit export --preprocessing --tokenizer` with a JSONL
parity sample; and a device (torch blocked) that adds a JSONL of texts with v1, upgrades to
v2 and answers text queries exactly as the numpy / ONNX reference does. Bad texts (empty,
over the limit) are refused or skipped by id and nothing stored is touched."""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
from click.testing import CliRunner

from fctkit.cli import cli
from fctkit.edge_runtime import Device
from fctkit.errors import ExportError
from fctkit.export.keys import generate_keys, load_private_key
from tests.server.conftest import admin_token_file  # noqa: F401 (a fixture)
from tests.support.raw_items import device_cli, device_ok, features_run, onnx_forward, unit

WORDS = [f"w{i}" for i in range(40)]
SPECIAL = ["[PAD]", "[UNK]", "[CLS]", "[SEP]"]
V1_VOCAB = {w: i for i, w in enumerate(SPECIAL + WORDS)}
V2_VOCAB = {w: i for i, w in enumerate([*SPECIAL, "query", "passage", ":", *WORDS[::-1]])}
DECLARATION = """
[old]
kind = "text"
output = "last_hidden_state"
max_length = 10
overflow = "refuse"
pooling = "mean"

[new]
kind = "text"
output = "hidden"
max_length = 12
token_type_ids = "token_type_ids"
pooling = "cls"
query_prefix = "query: "
passage_prefix = "passage: "
"""


def word_tokenizer(vocab: dict[str, int], path, *, truncate_in_file: bool = False):
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    if truncate_in_file:  # what the file says is overridden by the declaration
        tokenizer.enable_truncation(4)
    tokenizer.save(str(path))
    return path


def text_graph(path, weights: dict[str, np.ndarray], *, v2: bool):
    """v1: tanh(E[ids] W) masked, 12-d tokens. v2: tokens mixed with their masked mean context,
    type embeddings added, 20-d, and a first output 'extra' the declaration does not use."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    nodes = [
        helper.make_node("Gather", ["E", "input_ids"], ["emb0"]),
        helper.make_node("Cast", ["attention_mask"], ["maskf"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["maskf", "axis2"], ["m3"]),
    ]
    inputs = [
        helper.make_tensor_value_info(n, TensorProto.INT64, ["batch", "tokens"])
        for n in ("input_ids", "attention_mask")
    ]
    if v2:
        inputs.append(helper.make_tensor_value_info("token_type_ids", TensorProto.INT64, ["batch", "tokens"]))
        nodes += [
            helper.make_node("Gather", ["T", "token_type_ids"], ["typ"]),
            helper.make_node("Add", ["emb0", "typ"], ["emb"]),
            helper.make_node("Mul", ["emb", "m3"], ["masked"]),
            helper.make_node("ReduceSum", ["masked", "axis1"], ["total"], keepdims=1),
            helper.make_node("ReduceSum", ["m3", "axis1"], ["count"], keepdims=1),
            helper.make_node("Div", ["total", "count"], ["context"]),
            helper.make_node("Add", ["emb", "context"], ["mixed"]),
        ]
        source, output, dim = "mixed", "hidden", 20
    else:
        source, output, dim = "emb0", "last_hidden_state", 12
    nodes += [
        helper.make_node("MatMul", [source, "W"], ["h"]),
        helper.make_node("Tanh", ["h"], ["t"]),
        helper.make_node("Mul", ["t", "m3"], [output]),
    ]
    outputs = [helper.make_tensor_value_info(output, TensorProto.FLOAT, ["batch", "tokens", dim])]
    if v2:
        nodes.append(helper.make_node("MatMul", [output, "X"], ["extra"]))
        outputs.insert(0, helper.make_tensor_value_info("extra", TensorProto.FLOAT, ["batch", "tokens", 3]))
    constants = {**weights, "axis2": np.array([2], np.int64), **({"axis1": np.array([1], np.int64)} if v2 else {})}
    graph = helper.make_graph(
        nodes, "text", inputs, outputs, initializer=[numpy_helper.from_array(v, k) for k, v in constants.items()]
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


def tokens(text: str, vocab: dict[str, int], limit: int) -> list[int]:
    """The reference tokenisation: the Whitespace pre-tokeniser's split, [CLS] … [SEP], first ``limit`` tokens."""
    words = [vocab.get(w, vocab["[UNK]"]) for w in re.findall(r"\w+|[^\w\s]+", text)]
    return [vocab["[CLS]"], *words[: limit - 2], vocab["[SEP]"]]


def reference_v1(texts, w) -> np.ndarray:
    return unit(np.stack([np.tanh(w["E"][tokens(t, V1_VOCAB, 10)] @ w["W"]).mean(axis=0) for t in texts]))


def reference_v2(texts, w, prefix: str) -> np.ndarray:
    rows = []
    for text in texts:
        emb = w["E"][tokens(prefix + text, V2_VOCAB, 12)] + w["T"][0]
        rows.append(np.tanh((emb + emb.mean(axis=0)) @ w["W"])[0])  # the [CLS] token
    return unit(np.stack(rows))


@pytest.fixture(scope="module")
def text_release(tmp_path_factory):
    root = tmp_path_factory.mktemp("text-release")
    rng = np.random.default_rng(3)
    w1 = {
        "E": rng.normal(size=(len(V1_VOCAB), 16)).astype(np.float32),
        "W": rng.normal(size=(16, 12)).astype(np.float32) * 0.4,
    }
    w2 = {
        "E": rng.normal(size=(len(V2_VOCAB), 16)).astype(np.float32),
        "T": rng.normal(size=(2, 16)).astype(np.float32),
        "W": rng.normal(size=(16, 20)).astype(np.float32) * 0.4,
        "X": rng.normal(size=(20, 3)).astype(np.float32),
    }
    labels = np.repeat(np.arange(6), 40)
    topics = [WORDS[6 * c : 6 * c + 6] for c in range(6)]
    texts = [" ".join(rng.choice(topics[c], size=rng.integers(3, 8))) for c in labels]
    run = features_run(root / "train", reference_v1(texts, w1), reference_v2(texts, w2, "passage: "), labels)
    queries = [" ".join(rng.choice(topics[c], size=4)) for c in range(6)]
    lines = [
        {"text": t, "old": reference_v1([t], w1)[0].tolist(), "new": reference_v2([t], w2, "passage: ")[0].tolist()}
        for t in texts[:24]
    ]
    lines += [
        {
            "text": q,
            "purpose": "query",
            "old": reference_v1([q], w1)[0].tolist(),
            "new": reference_v2([q], w2, "query: ")[0].tolist(),
        }
        for q in queries
    ]
    (root / "sample.jsonl").write_text("\n".join(json.dumps(line) for line in lines) + "\n")
    (root / "preprocessing.toml").write_text(DECLARATION)
    private, public = generate_keys(root / "keys", None)
    files = {
        "old": text_graph(root / "old.onnx", w1, v2=False),
        "new": text_graph(root / "new.onnx", w2, v2=True),
        "tok1": word_tokenizer(V1_VOCAB, root / "tok1.json"),
        "tok2": word_tokenizer(V2_VOCAB, root / "tok2.json", truncate_in_file=True),
    }
    args = [
        "export",
        str(run),
        "--key",
        str(private),
        "--method",
        "least-squares",
        "--old-graph",
        str(files["old"]),
        "--new-graph",
        str(files["new"]),
        "--sample",
        str(root / "sample.jsonl"),
        "--preprocessing",
        str(root / "preprocessing.toml"),
        "--tokenizer",
        f"old={files['tok1']}",
        "--tokenizer",
        f"new={files['tok2']}",
        "--force",
        "--reason",
        "test: random text models",
        "--no-progress",
    ]
    done = CliRunner().invoke(cli, [*args, "--out", str(root / "out")])
    assert done.exit_code == 0, done.output
    return {
        "root": root,
        "w1": w1,
        "w2": w2,
        "texts": texts,
        "queries": queries,
        "out": root / "out",
        "public": public,
        "files": files,
        "args": args,
        "key": load_private_key(private, None),
    }


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_the_bundles_carry_each_models_tokenizer_and_declaration(text_release):
    from fctkit.protos.bundle import file_sha256, load_public_key, verify_bundle

    public = load_public_key(text_release["public"])
    v1, v2 = (verify_bundle(text_release["out"] / f"v{v}", public).manifest for v in (1, 2))
    for manifest, tokenizer in ((v1, "tok1"), (v2, "tok2")):
        assert manifest.artifact("tokenizer").sha256 == file_sha256(text_release["files"][tokenizer])[0]
        assert "raw items" in manifest.parity["embed"]["against"] and manifest.parity["embed"]["max_abs_error"] < 1e-5
    assert v1.preprocessing.of("embed").overflow == "refuse" and v1.embedding_dim == 12
    declared = v2.preprocessing.of("embed")
    assert (declared.output, declared.pooling, declared.token_type_ids, declared.query_prefix) == (
        "hidden",
        "cls",
        "token_type_ids",
        "query: ",
    )
    assert v2.embedding_dim == 20 and [s.shape for s in v2.artifact("embed").inputs] == [(None, None)] * 3


def test_a_device_adds_texts_upgrades_and_answers_text_queries_as_the_reference(text_release, tmp_path):
    texts, w1, w2 = text_release["texts"], text_release["w1"], text_release["w2"]
    folder = str(tmp_path / "device")
    gallery = write_jsonl(tmp_path / "gallery.jsonl", [{"id": f"t{i}", "text": t} for i, t in enumerate(texts)])
    device_ok("init", "--dir", folder, "--publisher-key", str(text_release["public"]))
    device_ok("upgrade", "--dir", folder, "--bundle", str(text_release["out"] / "v1.tar"), "--quiet")
    added = json.loads(device_ok("add", "--dir", folder, gallery, "--no-upload", "--quiet"))
    assert added["added"] == len(texts) and added["skipped"] == []
    device_ok("upgrade", "--dir", folder, "--bundle", str(text_release["out"] / "v2"), "--quiet")
    queries = write_jsonl(
        tmp_path / "queries.jsonl", [{"id": f"q{i}", "text": q} for i, q in enumerate(text_release["queries"])]
    )
    answers = [json.loads(line) for line in device_ok("query", "--dir", folder, queries, "-k", "3").splitlines()]

    rows = onnx_forward(text_release["out"] / "v2", reference_v1(texts, w1))
    wanted = reference_v2(text_release["queries"], w2, "query: ")
    with Device.open(folder) as device:
        stored = device.gallery.load()
        order = np.argsort([int(i[1:]) for i in stored.item_ids])
        np.testing.assert_allclose(np.stack(stored.embeddings)[order], rows, atol=1e-5)
        np.testing.assert_allclose(device.query_vectors(text_release["queries"]), wanted, atol=1e-5)
        assert device.engine().provider == "CPUExecutionProvider"  # no GPU here: the ONNX graphs on the CPU
    similarity = wanted @ unit(rows).T
    assert [a["id"] for a in answers] == [f"q{i}" for i in range(6)]
    for q, answer in enumerate(answers):  # the reference's nearest (texts of the same words tie)
        top = [int(m["item_id"][1:]) for m in answer["matches"]]
        np.testing.assert_allclose(similarity[q, top], np.sort(similarity[q])[::-1][:3], atol=1e-5)
        np.testing.assert_allclose([1 - m["distance"] for m in answer["matches"]], similarity[q, top], atol=1e-5)


def test_bad_texts_are_refused_or_skipped_by_id_and_nothing_stored_is_touched(text_release, tmp_path):
    folder = str(tmp_path / "device")
    device_ok("init", "--dir", folder, "--publisher-key", str(text_release["public"]))
    device_ok("upgrade", "--dir", folder, "--bundle", str(text_release["out"] / "v1"), "--quiet")
    device_ok(
        "add", "--dir", folder, write_jsonl(tmp_path / "first.jsonl", [{"id": "a", "text": "w1 w2"}]), "--no-upload"
    )
    long_text = " ".join(["w3"] * 9)  # 11 tokens with [CLS] and [SEP]: v1 refuses over 10
    batch = write_jsonl(
        tmp_path / "batch.jsonl",
        [{"id": "b", "text": "w4 w5", "label": "x"}, {"id": "empty", "text": "  "}, {"id": "long", "text": long_text}],
    )
    refused = device_cli("add", "--dir", folder, batch, "--no-upload")
    assert refused.returncode == 2
    assert (
        "'empty' is an empty text" in refused.stderr
        and "'long' has 11 tokens, more than the max_length 10" in refused.stderr
    )
    with Device.open(folder) as device:
        assert device.gallery.load().item_ids == ["a"] and device.gallery.replica_log.outbox_size() == 1
    skipped = json.loads(device_ok("add", "--dir", folder, batch, "--no-upload", "--on-bad-item", "skip"))
    assert skipped["added"] == 1 and [s["id"] for s in skipped["skipped"]] == ["empty", "long"] and skipped["rows"] == 2
    queries = write_jsonl(tmp_path / "q.jsonl", [{"id": "ok", "text": "w1"}, {"id": "blank", "text": ""}])
    assert "'blank' is an empty text" in device_cli("query", "--dir", folder, queries).stderr
    answered = device_cli("query", "--dir", folder, queries, "--on-bad-item", "skip")
    assert answered.returncode == 0 and "skipped query 'blank': is an empty text" in answered.stderr
    assert [json.loads(line)["id"] for line in answered.stdout.splitlines()] == ["ok"]
    arrays = tmp_path / "arrays.npy"
    np.save(arrays, np.zeros((2, 4), np.float32))
    assert "takes raw items" in device_cli("add", "--dir", folder, str(arrays)).stderr


def test_a_graph_its_declaration_does_not_feed_is_refused_before_signing(text_release, tmp_path):
    root, args = text_release["root"], list(text_release["args"])
    (tmp_path / "no_types.toml").write_text(DECLARATION.replace('token_type_ids = "token_type_ids"\n', ""))
    args[args.index(str(root / "preprocessing.toml"))] = str(tmp_path / "no_types.toml")
    done = CliRunner().invoke(cli, [*args, "--out", str(tmp_path / "out")])
    assert isinstance(done.exception, ExportError) and "feeds ['attention_mask', 'input_ids']" in str(done.exception)
    assert not (tmp_path / "out").exists()
    (tmp_path / "other.toml").write_text(DECLARATION.replace('output = "hidden"', 'output = "extra"'))
    args[args.index(str(tmp_path / "no_types.toml"))] = str(tmp_path / "other.toml")
    done = CliRunner().invoke(cli, [*args, "--out", str(tmp_path / "out")])
    assert isinstance(
        done.exception, ExportError
    ) and "outputs 'extra' of shape (None, None, 3), but the run's features are 20-d" in str(done.exception)
    (tmp_path / "typo.toml").write_text(DECLARATION.replace('pooling = "cls"', 'pooling = "cls"\npoolling = "mean"'))
    args[args.index(str(tmp_path / "other.toml"))] = str(tmp_path / "typo.toml")
    done = CliRunner().invoke(cli, [*args, "--out", str(tmp_path / "out")])
    assert "unknown key(s) poolling" in str(done.exception) and not (tmp_path / "out").exists()


def test_through_a_server_texts_are_sealed_as_they_came_and_backfilled_with_the_new_tokenizer(
    text_release,
    tmp_path,
    admin_token_file,  # noqa: F811 (a pytest fixture, imported from tests/server/conftest.py)
):
    """v1 and v2 (with their tokenizer artifacts) published on a real loopback server; a device
    adds texts at v1 (originals in the vault), syncs to v2 (whose health check re-embeds a sample
    of the texts) and backfills every other row: the rows are then v2's own passage embeddings of
    the texts, as the numpy reference computes them."""
    from tests.edge.conftest import ServerProcess, enrolment_code, publish

    server = ServerProcess(tmp_path / "data", text_release["public"], admin_token_file).start()
    (tmp_path / "archives").mkdir()
    try:
        publish(server, text_release["out"] / "v1", tmp_path / "archives")
        device = Device.init(tmp_path / "device")
        device.progress = False
        device.enrol(server.target, enrolment_code(server, "texts"), device_name="texts", trust_on_first_use=True)
        assert device.sync().installed_after == 1
        texts = text_release["texts"][:40]
        device.add(texts, item_ids=[f"t{i}" for i in range(40)])
        publish(server, text_release["out"] / "v2", tmp_path / "archives")
        assert device.sync().installed_after == 2
        sampled = device.status()["upgrade_health"]["sample_size"]  # the health check re-embedded these from the vault
        assert sampled == device.settings.health_sample == 32
        assert device.backfill(budget=40, order="random").backfilled == 40 - sampled  # every row now v2's own
        rows = device.gallery.load()
        order = np.argsort([int(i[1:]) for i in rows.item_ids])
        np.testing.assert_allclose(
            np.stack(rows.embeddings)[order], reference_v2(texts, text_release["w2"], "passage: "), atol=1e-5
        )
        device.close()
    finally:
        server.stop()


SIDE_DECLARATION = (
    DECLARATION
    + """
[side_info]
kind = "text"
output = "last_hidden_state"
max_length = 10
pooling = "mean"
"""
)


def text_task(texts: list[str], old, new, side, n_train: int):
    """An instance-level task on the texts: item i's query is its first three words; ``side`` (ψ) on every set."""
    from fctkit.trainer.relevance import Positives
    from fctkit.trainer.tasks import RetrievalTask, TaskSet, TaskSplit

    def split(rows: slice) -> TaskSplit:
        ids, n = np.array([f"t{i}" for i in range(len(texts))])[rows], len(texts[rows])
        return TaskSplit(
            TaskSet(ids, *(v["query"][rows] for v in (old, new, side))),
            TaskSet(ids, *(v["gallery"][rows] for v in (old, new, side))),
            Positives.from_lists([[i] for i in range(n)], n),
        )

    return RetrievalTask("texts", "instance", "recall@1", split(slice(0, n_train)), split(slice(n_train, None)))


@pytest.fixture(scope="module")
def side_release(text_release, tmp_path_factory):
    """v2 with a side-info text graph (v1's structure, other weights) and transition scoring:
    ``residual+transition`` on a task built from the reference features, forced through its gate."""
    from fctkit.trainer import save_task
    from fctkit.trainer.pipeline import run_pipeline
    from fctkit.trainer.pipeline_config import load_pipeline_config
    from tests.support.seeds import seed

    root, texts = tmp_path_factory.mktemp("side-release"), text_release["texts"]
    w1, w2 = text_release["w1"], text_release["w2"]
    rng = np.random.default_rng(5)
    w3 = {
        "E": rng.normal(size=(len(V1_VOCAB), 16)).astype(np.float32),
        "W": rng.normal(size=(16, 12)).astype(np.float32) * 0.4,
    }
    queries = [" ".join(t.split()[:3]) for t in texts]
    old = {"query": reference_v1(queries, w1), "gallery": reference_v1(texts, w1)}
    new = {"query": reference_v2(queries, w2, "query: "), "gallery": reference_v2(texts, w2, "passage: ")}
    side = {"query": reference_v1(queries, w3), "gallery": reference_v1(texts, w3)}
    task = save_task(root / "task.npz", text_task(texts, old, new, side, n_train=160))
    config = load_pipeline_config(
        None,
        {
            "seed": seed(),
            "data.name": "task",
            "data.task": str(task),
            "methods": ["residual"],
            "transition.enabled": True,
            "selection.enabled": False,
            "progress": False,
            "device": "cpu",
            "evaluation.distance": "cosine",
        },
    )
    run_pipeline(config, root / "run", log=lambda _: None)
    lines = [
        {
            "text": t,
            "old": old["gallery"][i].tolist(),
            "new": new["gallery"][i].tolist(),
            "side": side["gallery"][i].tolist(),
        }
        for i, t in enumerate(texts[:16])
    ]
    (root / "sample.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    (root / "preprocessing.toml").write_text(SIDE_DECLARATION)
    files = text_release["files"]
    done = CliRunner().invoke(
        cli,
        [
            "export",
            str(root / "run"),
            "--key",
            str(text_release["root"] / "keys" / "publisher.key"),
            "--out",
            str(root / "out"),
            "--method",
            "residual+transition",
            "--old-graph",
            str(files["old"]),
            "--new-graph",
            str(files["new"]),
            "--side-info-graph",
            str(text_graph(root / "side.onnx", w3, v2=False)),
            "--sample",
            str(root / "sample.jsonl"),
            "--preprocessing",
            str(root / "preprocessing.toml"),
            "--tokenizer",
            f"old={files['tok1']}",
            "--tokenizer",
            f"side_info={files['tok1']}",
            "--tokenizer",
            f"new={files['tok2']}",
            "--force",
            "--reason",
            "test: random text models",
            "--no-progress",
        ],
    )
    assert done.exit_code == 0, done.output
    return {"out": root / "out", "texts": texts, "old": old["gallery"], "side": side["gallery"], "w2": w2}


def test_side_info_and_transition_scoring_work_on_raw_texts(side_release, text_release, tmp_path):
    """The device computes ψ of each text with the side-info graph and feeds it to v2's adapter;
    texts added during the transition also keep v1's embedding for transition scoring."""
    import onnxruntime as ort

    texts, out = side_release["texts"], side_release["out"]
    device = Device.init(tmp_path / "device", publisher_key=text_release["public"])
    device.progress = False
    device.upgrade(out / "v1")
    device.add(texts[:200], item_ids=[f"t{i}" for i in range(200)], upload=False)
    np.testing.assert_allclose(device.gallery.load().side_infos, side_release["side"][:200], atol=1e-5)
    device.upgrade(out / "v2")
    assert device.status()["scoring"].startswith("transition")
    device.add(texts[200:], item_ids=[f"t{i}" for i in range(200, len(texts))], upload=False)

    (graph,) = out.glob("v2/forward_*.onnx")
    forward = ort.InferenceSession(str(graph), providers=["CPUExecutionProvider"])
    names = [i.name for i in forward.get_inputs()]
    upgraded = forward.run(
        None, dict(zip(names, (side_release["old"][:200], side_release["side"][:200]), strict=True))
    )[0]
    rows = device.gallery.load()
    np.testing.assert_allclose(rows.embeddings[:200], upgraded, atol=1e-5)
    np.testing.assert_allclose(
        rows.embeddings[200:], reference_v2(texts[200:], side_release["w2"], "passage: "), atol=1e-5
    )
    np.testing.assert_allclose(rows.side_infos, side_release["side"], atol=1e-5)
    previous = device.gallery.extras.load("previous_embedding")
    assert previous.item_ids == rows.item_ids  # the upgraded rows' v1 embeddings and the new texts' v1 embedding
    np.testing.assert_allclose(previous.embeddings, side_release["old"], atol=1e-5)
    device.close()

"""`fctkit export` of a features-mode run (a retrieval task): the team's own ONNX embed graphs,
checked against a sample of their features; the run's variant (adapter, query map, transition
or hubness) gated by ECC on the task's primary metric; and a real device that runs the
bundles and reproduces, query by query, the R@1 the gate judged.

The task is the synthetic instance-level one (trainer/synthetic.py), on which least squares
fails ECC on R@1 and the residual InfoNCE adapter holds it. Its "items" are the rows
``[old | new]``; the graphs select their model's columns (real ONNX MatMuls), so the task's
features are exactly what the graphs compute.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
from click.testing import CliRunner

from fctkit.cli import cli
from fctkit.edge_runtime import Device
from fctkit.errors import ExportError, GateError, InputError
from fctkit.export import build_release
from fctkit.export.features_release import UserGraphs
from fctkit.export.keys import generate_keys, load_private_key
from fctkit.trainer import load_task
from fctkit.trainer.synthetic import D_NEW, D_OLD
from tests.support.task_runs import synthetic_task_run

SEARCH = {
    "selection.temperatures": [0.05, 0.1],
    "selection.learning_rates": [3e-3],
    "selection.widths": [256],
    "selection.weight_decays": [1e-4],
}


def selection_graph(
    path, columns: slice, *, scale: float = 1.0, nan: bool = False, width: int | None = None, int_input: bool = False
):
    """A real ONNX graph from an item row [old | new] to one model's columns (times ``scale``)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    picked = np.eye(D_OLD + D_NEW, dtype=np.float32)[:, columns] * scale
    if width is not None:
        picked = np.hstack([picked, np.zeros((D_OLD + D_NEW, width - picked.shape[1]), np.float32)])
    nodes = [helper.make_node("MatMul", ["item" if not int_input else "item_f", "W"], ["product"])]
    if int_input:
        nodes.insert(0, helper.make_node("Cast", ["item"], ["item_f"], to=TensorProto.FLOAT))
    nodes.append(
        helper.make_node("Div", ["product", "zero"], ["embedding"])
        if nan
        else helper.make_node("Identity", ["product"], ["embedding"])
    )
    graph = helper.make_graph(
        nodes,
        "select",
        [
            helper.make_tensor_value_info(
                "item", TensorProto.INT64 if int_input else TensorProto.FLOAT, ["batch", D_OLD + D_NEW]
            )
        ],
        [helper.make_tensor_value_info("embedding", TensorProto.FLOAT, ["batch", picked.shape[1]])],
        initializer=[numpy_helper.from_array(picked, "W"), numpy_helper.from_array(np.zeros(1, np.float32), "zero")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    onnx.save(model, str(path))
    return path


OLD, NEW = slice(0, D_OLD), slice(D_OLD, D_OLD + D_NEW)


@pytest.fixture(scope="module")
def task_release(tmp_path_factory):
    root = tmp_path_factory.mktemp("features-release")
    run = synthetic_task_run(
        root, n_train=1200, n_eval=500, **{"query_map.enabled": True, "query_positives.enabled": True}, **SEARCH
    )
    task = root / "task.npz"
    gallery = load_task(task).evaluation.gallery
    items = np.hstack([gallery.old, gallery.new])
    np.savez(root / "sample.npz", input=items[:64], old=gallery.old[:64], new=gallery.new[:64])
    private, public = generate_keys(root / "keys", None)
    graphs = UserGraphs(
        selection_graph(root / "old.onnx", OLD), selection_graph(root / "new.onnx", NEW), root / "sample.npz"
    )
    return {
        "root": root,
        "run": run,
        "task": load_task(task),
        "graphs": graphs,
        "key": load_private_key(private, None),
        "public": public,
        "private_path": private,
    }


def released(task_release, variant, out, **options):
    return build_release(
        task_release["run"].files["gate"].parent,
        out,
        private_key=task_release["key"],
        method=variant,
        graphs=task_release["graphs"],
        **options,
    )


def device_top1(task_release, bundles, tmp_path) -> tuple[np.ndarray, str]:
    """Install v1 on a new device, add the evaluation gallery, upgrade to v2, ask every query:
    the gallery row each query's first match is, and the scoring the device used."""
    evaluation = task_release["task"].evaluation
    device = Device.init(tmp_path / "device", publisher_key=task_release["public"])
    device.progress = False
    device.upgrade(bundles[0])
    items = np.hstack([evaluation.gallery.old, evaluation.gallery.new])
    device.add(items, item_ids=[str(i) for i in evaluation.gallery.ids], upload=False)
    device.upgrade(bundles[1])
    queries = np.hstack([evaluation.query.old, evaluation.query.new])
    row_of = {str(item): row for row, item in enumerate(evaluation.gallery.ids)}
    top = np.array([row_of[matches[0].item_id] for matches in device.query(queries, k=1)])
    scoring = device.status()["scoring"]
    device.close()
    return top, scoring


def recall_at_1(task_release, top: np.ndarray) -> float:
    positives = task_release["task"].evaluation.positives
    return float(
        np.mean([top[q] in positives.indices[positives.indptr[q] : positives.indptr[q + 1]] for q in range(len(top))])
    )


def gate_top1(task_release, variant) -> tuple[np.ndarray, np.ndarray]:
    """Each query's first row as the trainer ranked it for ``variant``, and the margin to its
    second (where the margin is ~0 a device may break the tie the other way)."""
    from fctkit.trainer.searches import EvalSet, scored_retrieval

    query, rows, distance = scored_retrieval(
        task_release["run"].adapters[variant], EvalSet.of_task(task_release["task"].evaluation)
    )
    if distance == "l2":
        scores = 2 * query @ rows.T - (rows**2).sum(axis=1)  # −‖q − g‖² up to a per-query constant
    else:
        scores = (query / np.linalg.norm(query, axis=1, keepdims=True)) @ (
            rows / np.linalg.norm(rows, axis=1, keepdims=True)
        ).T
    best = np.sort(scores, axis=1)[:, -2:]
    return scores.argmax(axis=1), best[:, 1] - best[:, 0]


VARIANTS = [
    ("residual+query-map+transition", "transition"),
    ("residual+hubness", "hubness"),
    ("residual", "plain"),
    ("residual+query-positives+hubness", "hubness"),
    ("residual+query-positives", "plain"),
    ("residual+query-map", "plain"),
    ("residual+query-positives+transition", "transition"),
    ("residual+query-positives+hubness+transition", "transition+hubness"),
    ("residual+query-map+hubness+transition", "transition+hubness"),
]


@pytest.mark.parametrize("variant, scoring", VARIANTS)
def test_a_device_runs_what_the_gate_judged(task_release, variant, scoring, tmp_path):
    """Query by query: the device's first match is the trainer's, except where the trainer's
    first two scores tie (within float32 noise), and its R@1 is the signed gate's."""
    gate = task_release["run"].gate
    weight, beta = gate["transition_weight"].get(variant, 0.5), gate["hubness_beta"].get(variant, 1.0)
    if not (0 < weight < 1 and beta > 0):
        pytest.skip(f"the run chose w = {weight}, β = {beta} for {variant}: export refuses it (tested below)")
    bundles = released(task_release, variant, tmp_path / "out")
    v1, v2 = (b.bundle.manifest for b in bundles)
    assert v2.gate["ecc"] == {"forward_1_to_2": True} and not v2.gate["forced"]
    case = next(name for name in v2.gate["cases"] if name not in ("old/old", "new/new"))
    assert v2.gate["cases"][case] == gate["cases"][variant]  # every task metric, signed
    assert {"recall@1", "recall@10", "mrr", "ndcg@10"} <= set(v2.gate["cases"][case])
    assert v1.parity["embed"] == {"max_abs_error": 0.0, "tolerance": 1e-3, "against": "the sample's features"}
    assert v2.health_expectation.level == "instance" and min(v2.health_expectation.break_even) > 0
    assert v2.parity["forward_1_to_2"]["against"] == "torch"
    assert ("query_map" in {a.role for a in v2.artifacts}) == ("query-map" in variant)
    assert (v2.transition is not None, v2.hubness is not None) == ("transition" in variant, "hubness" in variant)
    if v2.transition is not None:
        assert v2.transition.weight == gate["transition_weight"][variant] and v2.transition.max_days == 30.0
    if v2.hubness is not None:
        assert v2.hubness.beta == gate["hubness_beta"][variant] and v2.parity["hubness"]["max_abs_error"] < 1e-5
    top, used = device_top1(task_release, [b.bundle.root for b in bundles], tmp_path)
    assert used == scoring
    expected, margin = gate_top1(task_release, variant)
    differs = np.flatnonzero(top != expected)
    assert (margin[differs] < 1e-4).all(), (
        f"queries {differs[margin[differs] >= 1e-4][:5]} differ from the gate's ranking"
    )
    assert recall_at_1(task_release, expected) == pytest.approx(gate["cases"][variant]["recall@1"], abs=1e-9)
    assert recall_at_1(task_release, top) == pytest.approx(
        v2.gate["cases"][case]["recall@1"], abs=len(differs) / len(top) + 1e-9
    )


@pytest.mark.parametrize(
    "variant, scoring",
    [("residual+query-positives+hubness", "hubness"), ("residual+query-map+transition", "transition")],
)
def test_a_device_runs_what_the_int8_gate_judged(task_release, variant, scoring, tmp_path):
    """With --quantize int8 the gate is the quantised forward adapter's, searched with the
    variant's query map and scoring; a device running the bundle reproduces it."""
    bundles = released(task_release, variant, tmp_path / "out", quantize="int8")
    v2 = bundles[1].bundle.manifest
    record, fp32 = v2.gate["quantization"], task_release["run"].gate["cases"][variant]
    assert v2.artifact("forward", source_version=1, target_version=2).precision == "int8"
    assert (record["metric"], record["fp32"]) == ("recall@1", fp32["recall@1"])
    case = next(name for name in v2.gate["cases"] if name not in ("old/old", "new/new") and not name.endswith("[fp32]"))
    assert v2.gate["cases"][f"{case} [fp32]"] == fp32 and v2.gate["cases"][case]["recall@1"] == record["quantized"]
    assert v2.gate["ecc"] == {"forward_1_to_2": record["quantized"] > v2.gate["cases"]["old/old"]["recall@1"]}
    top, used = device_top1(task_release, [b.bundle.root for b in bundles], tmp_path)
    assert used == scoring
    assert recall_at_1(task_release, top) == pytest.approx(record["quantized"], abs=2 / 500)


def test_the_gate_refuses_an_adapter_that_fails_on_the_primary_metric(task_release, tmp_path):
    gate = task_release["run"].gate
    assert gate["metric"] == "recall@1" and gate["ecc"]["least-squares"] is False
    with pytest.raises(GateError, match="does not hold for v2 forward_1_to_2"):
        released(task_release, "least-squares", tmp_path / "out")
    assert not (tmp_path / "out").exists()
    # what the device would run with transition scoring holds ECC, so that variant may be published
    bundles = released(task_release, "least-squares+transition", tmp_path / "fused")
    assert bundles[1].bundle.manifest.gate["ecc"] == {"forward_1_to_2": True}
    forced = released(
        task_release, "least-squares", tmp_path / "forced", force=True, force_reason="test: on the record"
    )
    assert forced[1].bundle.manifest.gate == forced[1].bundle.manifest.gate | {
        "forced": True,
        "ecc": {"forward_1_to_2": False},
    }


def test_wrong_graphs_and_samples_are_refused_before_anything_is_signed(task_release, tmp_path):
    graphs = task_release["graphs"]
    cases = [
        (
            graphs.__class__(graphs.old, selection_graph(tmp_path / "wide.onnx", NEW, width=D_NEW + 2), graphs.sample),
            ExportError,
            "outputs 'embedding' of shape \\(None, 50\\), but the run's features are 48-d",
        ),
        (
            graphs.__class__(selection_graph(tmp_path / "nan.onnx", OLD, nan=True), graphs.new, graphs.sample),
            ExportError,
            "NaN or inf",
        ),
        (
            graphs.__class__(selection_graph(tmp_path / "other.onnx", OLD, scale=1.5), graphs.new, graphs.sample),
            ExportError,
            "differs from the sample's features by up to",
        ),
        (
            graphs.__class__(selection_graph(tmp_path / "ids.onnx", OLD, int_input=True), graphs.new, graphs.sample),
            ExportError,
            "token ids need a preprocessing declaration",
        ),
        (graphs.__class__(graphs.new, graphs.old, graphs.sample), ExportError, "but the run's features are 32-d"),
        (graphs.__class__(graphs.old, graphs.new, graphs.sample, side_info=graphs.old), InputError, "no side-info"),
    ]
    for i, (bad, error, message) in enumerate(cases):
        with pytest.raises(error, match=message):
            released_with(task_release, tmp_path / f"out{i}", bad)
        assert not (tmp_path / f"out{i}").exists()
    with np.load(graphs.sample) as sample:
        np.savez(tmp_path / "typo.npz", inputs=sample["input"], old=sample["old"], new=sample["new"])
    with pytest.raises(InputError, match="unknown key\\(s\\) \\['inputs'\\]; no input rows"):
        released_with(task_release, tmp_path / "typo", graphs.__class__(graphs.old, graphs.new, tmp_path / "typo.npz"))
    with pytest.raises(InputError, match="has no variant 'residual\\+typo'"):
        released(task_release, "residual+typo", tmp_path / "out")
    with pytest.raises(InputError, match="name the embed graphs"):
        build_release(
            task_release["run"].files["gate"].parent, tmp_path / "x", private_key=task_release["key"], method="residual"
        )


def released_with(task_release, out, graphs):
    """A plain residual release with these ``graphs``."""
    return build_release(
        task_release["run"].files["gate"].parent, out, private_key=task_release["key"], method="residual", graphs=graphs
    )


def test_the_export_cli_takes_the_graphs_and_says_what_devices_will_run(task_release, tmp_path):
    graphs = task_release["graphs"]
    result = CliRunner().invoke(
        cli,
        [
            "export",
            str(task_release["run"].files["gate"].parent),
            "--key",
            str(task_release["private_path"]),
            "--out",
            str(tmp_path / "out"),
            "--method",
            "residual+query-map+transition",
            "--old-graph",
            str(graphs.old),
            "--new-graph",
            str(graphs.new),
            "--sample",
            str(graphs.sample),
            "--transition-days",
            "7",
            "--no-progress",
        ],
    )
    assert result.exit_code == 0, result.output
    assert "transition scoring from v1: weight" in result.output and "at most 7 days" in result.output
    manifest = json.loads((tmp_path / "out" / "v2" / "manifest.json").read_text())
    assert manifest["transition"]["max_days"] == 7.0
    missing = CliRunner().invoke(
        cli,
        [
            "export",
            str(task_release["run"].files["gate"].parent),
            "--key",
            str(task_release["private_path"]),
            "--out",
            str(tmp_path / "o2"),
            "--method",
            "residual",
            "--old-graph",
            str(graphs.old),
        ],
    )
    assert missing.exit_code != 0 and "needs --new-graph, --sample as well" in missing.output

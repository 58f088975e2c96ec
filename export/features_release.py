"""A release from a features-mode run (``data.name`` "features" or "task"): the team's own
ONNX embed graphs carry the versions, the run's adapters carry the upgrade.

==========  ==================================================================================
version     artifacts
==========  ==================================================================================
v1          ``embed`` = the old model's graph, ``side_info`` = the side-info graph (when the run's
            features have side-info)
v2          ``embed`` = the new model's graph, the same ``side_info`` graph, ``forward`` 1→2 = the
            variant's adapter (``+query-positives``: the adapter trained on the task's query
            positives); ``+query-map``: the ``query_map`` role; ``+transition``: the
            transition declaration (weight from the run); ``+hubness``: the ``hubness`` graph
            (the run's reference queries) and its β; ``+hubness+transition``: both
==========  ==================================================================================

The variant is a key of the run's gate (``residual``, ``residual+query-map+transition``, …),
so the ECC verdict that gates v2 is the one judged, on the task's primary metric, for exactly
what a device will run; the manifest records every metric of old/old, new/new and the variant.

Each graph of the team is checked before anything is exported or signed (:class:`UserGraphs`):
a (batch, d) output (after pooling, for text) whose d is the run's feature dim, finite outputs,
and parity: on the ``sample`` the team supplies, the graph reproduces the features their own
pipeline computed, within ``tolerance``. The result is recorded in the manifest. A graph fed
arrays takes one float input; graphs fed raw items (image files, texts) take any inputs their
preprocessing declaration feeds (:mod:`.user_preprocessing`), which the bundle then carries.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import numpy as np

from fctkit.errors import ExportError, InputError, require
from fctkit.protos.bundle import Role
from fctkit.protos.search_policy import HubnessPolicy, TransitionPolicy

from .hubness_graph import hubness_onnx
from .onnx_export import ExportResult, ParityReport
from .onnx_graph import graph_io_specs, load_onnx_model
from .roles import RoleExport
from .user_preprocessing import GraphPreprocessing, check_preprocessed_graph, checked_against_sample, read_item_sample
from .variants import Variant

#: the graphs a team names, the run's feature each must reproduce, and its bundle role
GRAPH_FEATURES: dict[str, tuple[str, Role]] = {
    "old": ("old", "embed"),
    "new": ("new", "embed"),
    "side_info": ("side", "side_info"),
}


@dataclass(frozen=True)
class UserGraphs:
    """The team's ONNX graphs for a features-mode release and the sample that checks them.

    ``sample`` is an ``.npz`` holding, for the same items, the graphs' input rows (``input``,
    or one per graph: ``old_input`` / ``new_input`` / ``side_input``) and the features the
    team's pipeline computed for them (``old``, ``new``, and ``side`` with a side-info graph).
    With ``preprocessing`` (graphs fed raw items) it is JSON Lines of raw items and their
    features (:func:`~.user_preprocessing.read_item_sample`)."""

    old: Path
    new: Path
    sample: Path
    side_info: Path | None = None
    tolerance: float = 1e-3
    preprocessing: GraphPreprocessing | None = None


def declarations(variant: Variant, gate: dict, previous_version: int, transition_days: float) -> dict[str, Any]:
    """The variant's transition and hubness declarations for the new version's manifest."""
    declared: dict[str, Any] = {}
    if variant.transition:
        weight = gate["transition_weight"][variant.key]
        if not 0.0 < weight < 1.0:
            raise InputError(
                f"the run chose transition weight {weight} for {variant.key!r} on held-out training data "
                "(fusing with the old space did not help): export the variant without +transition"
            )
        declared["transition"] = TransitionPolicy(previous_version, float(weight), float(transition_days))
    if variant.hubness:
        beta = gate["hubness_beta"][variant.key]
        if beta <= 0:
            raise InputError(
                f"the run chose hubness β = {beta} for {variant.key!r} on held-out training data (no offset "
                "helped): export the variant without +hubness"
            )
        declared["hubness"] = HubnessPolicy(float(beta))
    return declared


def check_user_graphs(graphs: UserGraphs, features: dict[str, np.ndarray]) -> dict[str, RoleExport]:
    """Each graph checked against the run's feature dims and the sample (see the module
    docstring); keyed ``graph:old``, ``graph:new``, ``graph:side_info``."""
    if graphs.preprocessing is not None:
        return _check_preprocessed_graphs(graphs, graphs.preprocessing, features)
    sample = _read_sample(graphs)
    checked = {}
    for name, path in (("old", graphs.old), ("new", graphs.new), ("side_info", graphs.side_info)):
        if path is None:
            continue
        feature, role = GRAPH_FEATURES[name]
        rows = cast(np.ndarray, sample.get(f"{feature}_input", sample.get("input")))  # load_sample checked one is there
        checked[f"graph:{name}"] = check_user_graph(
            Path(path), role, rows, sample[feature], features[feature].shape[1], graphs.tolerance, f"the {name} graph"
        )
    return checked


def _check_preprocessed_graphs(
    graphs: UserGraphs, preprocessing: GraphPreprocessing, features: dict[str, np.ndarray]
) -> dict[str, RoleExport]:
    named = {
        name: path for name, path in (("old", graphs.old), ("new", graphs.new), ("side_info", graphs.side_info)) if path
    }
    sample = read_item_sample(graphs.sample, preprocessing.kind, [GRAPH_FEATURES[name][0] for name in named])
    checked = {}
    for name, path in named.items():
        feature, role = GRAPH_FEATURES[name]
        checked[f"graph:{name}"] = check_preprocessed_graph(
            Path(path),
            role,
            preprocessing.declarations[name],
            preprocessing.tokenizers.get(name),
            sample,
            sample.features[feature],
            features[feature].shape[1],
            graphs.tolerance,
            f"the {name} graph",
        )
    return checked


def check_user_graph(
    path: Path, role: Role, rows: np.ndarray, expected: np.ndarray, feature_dim: int, tolerance: float, what: str
) -> RoleExport:
    ort = require("onnxruntime", "cpu")
    model = load_onnx_model(path)
    inputs, outputs = graph_io_specs(model)
    if len(inputs) != 1 or not inputs[0].dtype.startswith("float") or inputs[0].dynamic:
        raise ExportError(
            f"{what} ({path}) takes {[(s.name, s.dtype, s.shape) for s in inputs]}: without preprocessing a "
            "device feeds one float array of fixed shape per item; graphs that take token ids need a "
            "preprocessing declaration, as do graphs fed image files: give one with --preprocessing (and "
            "--tokenizer)"
        )
    output = outputs[0]
    if len(output.shape) != 2 or output.feature_dim != feature_dim:
        raise ExportError(
            f"{what} ({path}) outputs {output.name!r} of shape {output.shape}, but the run's features are "
            f"{feature_dim}-d: name the graph of the model the features came from"
        )
    per_item = tuple(inputs[0].shape[1:])
    if rows.shape[1:] != per_item:
        raise ExportError(
            f"{what} ({path}) takes input {inputs[0].name!r} rows of shape {per_item}; the sample's rows are "
            f"{rows.shape[1:]}"
        )
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    start = time.perf_counter()
    produced = session.run([output.name], {inputs[0].name: rows.astype(np.float32)})[0]
    result, parity = checked_against_sample(
        f"{what} ({path})",
        path,
        model,
        produced,
        expected,
        tolerance,
        time.perf_counter() - start,
        "the sample's features",
    )
    return RoleExport(role, result, parity)


def hubness_role(reference: np.ndarray, k: int, rows: np.ndarray) -> Callable[[Path], RoleExport]:
    """The hubness graph, built into the release's scratch folder and checked against numpy on ``rows``."""
    from fctkit.trainer.hubness import hubness_offsets

    def build(folder: Path) -> RoleExport:
        start = time.perf_counter()
        path = hubness_onnx(reference, k, folder / "hubness.onnx")
        seconds = time.perf_counter() - start
        ort = require("onnxruntime", "cpu")
        produced = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"embedding": rows})[
            0
        ][:, 0]
        expected = hubness_offsets(rows, reference, k)
        error = float(np.abs(produced - expected).max())
        parity = ParityReport(
            path, "fp32", 1e-4, error, float(np.abs(expected).max()), against="numpy (trainer.hubness)"
        )
        if not parity.passed:
            raise ExportError(f"the hubness graph differs from the trainer's offsets by {error:.3g}")
        inputs, outputs = graph_io_specs(load_onnx_model(path))
        return RoleExport(
            "hubness", ExportResult(path, 17, "fp32", inputs, outputs, path.stat().st_size, seconds), parity
        )

    return build


def _read_sample(graphs: UserGraphs) -> dict[str, np.ndarray]:
    path = Path(graphs.sample)
    try:
        with np.load(path, allow_pickle=False) as data:
            sample = {k: np.asarray(data[k]) for k in data.files}
    except (OSError, ValueError) as exc:
        raise InputError(f"cannot read the parity sample {path}: {exc}") from exc
    features = ["old", "new"] + (["side"] if graphs.side_info is not None else [])
    allowed = {*features, "input", *(f"{f}_input" for f in features)}
    unknown, missing = sorted(set(sample) - allowed), [f for f in features if f not in sample]
    no_input = [f for f in features if f"{f}_input" not in sample and "input" not in sample]
    if unknown or missing or no_input:
        raise InputError(
            f"parity sample {path}: "
            + "; ".join(
                filter(
                    None,
                    (
                        f"unknown key(s) {unknown}" if unknown else "",
                        f"missing feature(s) {missing}" if missing else "",
                        f"no input rows for {no_input} (give 'input' or '<feature>_input')" if no_input else "",
                    ),
                )
            )
            + f"; it holds {', '.join(sorted(allowed))}"
        )
    counts = {k: len(v) for k, v in sample.items()}
    if len(set(counts.values())) != 1 or not next(iter(counts.values())):
        raise InputError(f"parity sample {path}: every array needs the same, non-zero number of rows, got {counts}")
    for key, value in sample.items():
        if not np.issubdtype(value.dtype, np.number) or not np.isfinite(value).all():
            raise InputError(f"parity sample {path}: {key!r} must be finite numbers")
    return sample

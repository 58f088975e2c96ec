"""A team's graphs that take raw items: their preprocessing declarations, their parity sample,
and the bundle section and tokenizer artifacts they become.

- The declaration file (``fctkit export --preprocessing FILE``, JSON or TOML) holds one
  declaration for every graph (a table with ``kind``), or one table per graph: ``old``, ``new``,
  ``side_info``. Keys are :mod:`fctkit.protos.preprocessing_spec`'s; unknown keys are errors;
  ``tokenizer`` is not one of them (``--tokenizer PATH``, or ``--tokenizer GRAPH=PATH``).
- The sample (``--sample``) is JSON Lines, one item a line: ``{"text": ...}`` or ``{"image":
  path}`` (relative to the sample file), optionally ``"purpose": "query"`` (default
  ``passage``), and the features the team's pipeline computed for it: ``old``, ``new``
  (``side``). Each graph runs on the raw items through :mod:`fctkit.protos.preprocessing`,
  the code devices run, and must reproduce its features.
"""

from __future__ import annotations

import json
import time
import tomllib
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np

from fctkit.errors import BundleFormatError, ConfigError, ExportError, InputError, require
from fctkit.protos.bundle import Artifact, Role, file_sha256
from fctkit.protos.preprocessing import Preprocessor
from fctkit.protos.preprocessing_spec import (
    Declaration,
    Preprocessing,
    TextPreprocessing,
    check_declared_graph,
    parse_declaration,
    vector_output,
)

from .bundle_builder import ArtifactSource
from .onnx_export import ExportResult, ParityReport
from .onnx_graph import graph_io_specs, graph_precision, load_onnx_model
from .roles import RoleExport

GRAPH_NAMES = ("old", "new", "side_info")


@dataclass(frozen=True)
class GraphPreprocessing:
    """The declaration of each named graph and the tokenizer.json of each text graph."""

    declarations: dict[str, Declaration]
    tokenizers: dict[str, Path] = field(default_factory=dict)

    @property
    def kind(self) -> str:
        return next(iter(self.declarations.values())).kind


def load_graph_preprocessing(path: Path, tokenizer_options: Sequence[str], graphs: Sequence[str]) -> GraphPreprocessing:
    """Read the declaration file for ``graphs`` and match ``--tokenizer`` options to its text graphs."""
    data = _read_table(path)
    tables = dict.fromkeys(graphs, data) if "kind" in data else data
    unknown, missing = sorted(set(tables) - set(GRAPH_NAMES)), [g for g in graphs if g not in tables]
    if unknown or missing:
        raise ConfigError(
            f"{path}: give one declaration (a table with 'kind') or one table per graph among "
            f"{', '.join(graphs)}; "
            + "; ".join(
                filter(
                    None, (f"unknown table(s) {unknown}" if unknown else "", f"missing {missing}" if missing else "")
                )
            )
        )
    declarations = {}
    for graph in graphs:
        table = tables[graph]
        if isinstance(table, dict) and "tokenizer" in table:
            raise ConfigError(f"{path} [{graph}]: name the tokenizer.json with --tokenizer, not in the declaration")
        try:
            declarations[graph] = parse_declaration(table, f"{path} [{graph}]", strict=False)
        except BundleFormatError as exc:
            raise ConfigError(str(exc)) from exc
    if len({d.kind for d in declarations.values()}) != 1:
        raise ConfigError(f"{path}: every graph must take the same kind of item (a device adds one kind)")
    return GraphPreprocessing(declarations, _tokenizers(tokenizer_options, declarations))


def _read_table(path: Path) -> dict:
    try:
        text = Path(path).read_text(encoding="utf-8")
        data = tomllib.loads(text) if Path(path).suffix == ".toml" else json.loads(text)
    except (OSError, UnicodeDecodeError, ValueError) as exc:  # tomllib.TOMLDecodeError is a ValueError
        raise ConfigError(
            f"cannot read the preprocessing declaration {path} (JSON, or TOML named *.toml): {exc}"
        ) from exc
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: expected a table of declarations, got {type(data).__name__}")
    return data


def _tokenizers(options: Sequence[str], declarations: dict[str, Declaration]) -> dict[str, Path]:
    """``PATH`` (every text graph) or ``GRAPH=PATH`` (one graph) -> the tokenizer.json of each text graph."""
    text_graphs = [g for g, d in declarations.items() if isinstance(d, TextPreprocessing)]
    given: dict[str | None, Path] = {}
    for option in options:
        head, sep, tail = option.partition("=")
        graph, path = (head, tail) if sep and head in GRAPH_NAMES else ("", option)
        if graph and graph not in text_graphs:
            raise ConfigError(f"--tokenizer {option}: graph {graph!r} is not declared as taking text")
        if not Path(path).is_file():
            raise ConfigError(f"--tokenizer {option}: {path} is not a file")
        given[graph or None] = Path(path)
    if given and not text_graphs:
        raise ConfigError("--tokenizer is for graphs that take text; the declarations take images")
    missing = [g for g in text_graphs if g not in given and None not in given]
    if missing:
        raise ConfigError(f"the text graph(s) {missing} need their tokenizer.json: --tokenizer PATH (or GRAPH=PATH)")
    return {g: given[g] if g in given else given[None] for g in text_graphs}  # one of them: checked above


@dataclass(frozen=True)
class ItemSample:
    """Raw items, what each is embedded as (passage or query), and the team's features of them."""

    items: list[Any]
    purposes: list[str]
    features: dict[str, np.ndarray]


def read_item_sample(path: Path, kind: str, features: Sequence[str]) -> ItemSample:
    """The JSON Lines parity sample (see the module docstring)."""
    items: list[Any] = []
    purposes: list[str] = []
    rows: dict[str, list[Any]] = {f: [] for f in features}
    allowed = {kind, "purpose", "id", *features}
    try:
        lines = [
            (n, line) for n, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1) if line.strip()
        ]
    except (OSError, UnicodeDecodeError) as exc:
        raise InputError(f"cannot read the parity sample {path}: {exc}") from exc
    for number, line in lines:
        where = f"parity sample {path} line {number}"
        try:
            record = json.loads(line)
        except ValueError as exc:
            raise InputError(f"{where}: not JSON ({exc})") from exc
        if not isinstance(record, dict) or kind not in record or set(record) - allowed or set(features) - set(record):
            raise InputError(
                f"{where}: expected {{{kind!r}: ..., {', '.join(repr(f) for f in features)}: [numbers], "
                f"optional 'purpose', 'id'}}, got keys {sorted(record) if isinstance(record, dict) else record!r}"
            )
        items.append(_sample_item(record[kind], kind, Path(path).parent, where))
        purposes.append(record.get("purpose", "passage"))
        if purposes[-1] not in ("passage", "query"):
            raise InputError(f"{where}: purpose must be 'passage' or 'query', got {purposes[-1]!r}")
        for feature in features:
            rows[feature].append(record[feature])
    if not items:
        raise InputError(f"parity sample {path} holds no items")
    return ItemSample(items, purposes, {f: _matrix(v, f"parity sample {path}: {f!r}") for f, v in rows.items()})


def _sample_item(value: Any, kind: str, folder: Path, where: str) -> Any:
    if kind == "text":
        return value
    if not isinstance(value, str) or not (folder / value).is_file():
        raise InputError(f"{where}: image {value!r} is not a file (paths are relative to the sample's folder)")
    return (folder / value).read_bytes()


def _matrix(rows: list, where: str) -> np.ndarray:
    try:
        matrix = np.asarray(rows, dtype=np.float32)
    except (TypeError, ValueError) as exc:
        raise InputError(f"{where}: every item needs a list of numbers of the same length ({exc})") from exc
    if matrix.ndim != 2 or not np.isfinite(matrix).all():
        raise InputError(f"{where}: expected one list of finite numbers per item, all of one length")
    return matrix


def check_preprocessed_graph(
    path: Path,
    role: Role,
    declaration: Declaration,
    tokenizer: Path | None,
    sample: ItemSample,
    expected: np.ndarray,
    feature_dim: int,
    tolerance: float,
    what: str,
) -> RoleExport:
    """The team's graph checked as devices will run it: against its declaration, then on the
    sample's raw items through the devices' preprocessing, against the team's features."""
    model = load_onnx_model(path)
    inputs, outputs = graph_io_specs(model)
    artifact = Artifact(role, role, f"{role}.onnx", *file_sha256(path), inputs, outputs, None, None)
    files = (
        (artifact, Artifact("tokenizer", "tokenizer", "tokenizer.json", *file_sha256(tokenizer), (), (), None, None))
        if tokenizer is not None
        else (artifact,)
    )
    try:
        check_declared_graph(declaration, artifact, files)
        preprocessor = Preprocessor(declaration, artifact, tokenizer.read_bytes() if tokenizer is not None else None)
        output, dim = vector_output(declaration, artifact)
    except BundleFormatError as exc:
        raise ExportError(f"{what} ({path}) does not fit its preprocessing declaration: {exc}") from exc
    if dim != feature_dim:
        raise ExportError(
            f"{what} ({path}) outputs {output.name!r} of shape {output.shape}, but the run's features are "
            f"{feature_dim}-d: name the graph of the model the features came from"
        )
    start = time.perf_counter()
    produced = _embedded(preprocessor, model, sample, dim, f"{what} ({path})")
    result, parity = checked_against_sample(
        f"{what} ({path})",
        path,
        model,
        produced,
        expected,
        tolerance,
        time.perf_counter() - start,
        "the sample's features, from its raw items through the declared preprocessing",
    )
    return RoleExport(role, result, parity, declaration=declaration, tokenizer=tokenizer)


def checked_against_sample(
    what: str,
    path: Path,
    model: Any,
    produced: np.ndarray,
    expected: np.ndarray,
    tolerance: float,
    seconds: float,
    against: str,
) -> tuple[ExportResult, ParityReport]:
    """A team's graph's outputs on the sample, checked against the features their pipeline
    computed: finite and within ``tolerance``; the export result and parity the manifest records."""
    if not np.isfinite(produced).all():
        raise ExportError(f"{what} produces NaN or inf on the sample: the graph is broken or needs other inputs")
    error = float(np.abs(produced - expected).max())
    if error > tolerance:
        raise ExportError(
            f"{what} differs from the sample's features by up to {error:.3g} (tolerance "
            f"{tolerance:g}): it is not the model those features came from, or its preprocessing differs"
        )
    precision = graph_precision(model)
    inputs, outputs = graph_io_specs(model)
    result = ExportResult(
        path, int(model.opset_import[0].version), precision, inputs, outputs, path.stat().st_size, seconds
    )
    return result, ParityReport(path, precision, tolerance, error, float(np.abs(expected).max()), against=against)


def _embedded(preprocessor: Preprocessor, model: Any, sample: ItemSample, dim: int, what: str) -> np.ndarray:
    ort = require("onnxruntime", "cpu")
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    produced = np.zeros((len(sample.items), dim), np.float32)
    for purpose in ("passage", "query"):
        index = [i for i, p in enumerate(sample.purposes) if p == purpose]
        if not index:
            continue
        done = preprocessor.embed([sample.items[i] for i in index], session.run, purpose=purpose, keep_going=False)
        if done.bad:
            reasons = "; ".join(f"item {index[i] + 1} {reason}" for i, reason in done.bad[:5])
            raise InputError(f"the parity sample has items {what} cannot take: {reasons}")
        produced[index] = done.vectors
    return produced


def bundle_preprocessing(exports: Sequence[RoleExport]) -> tuple[Preprocessing | None, list[ArtifactSource]]:
    """A bundle's preprocessing section and tokenizer artifacts, from its roles' exports; graphs
    sharing a tokenizer.json share one artifact."""
    roles: list[tuple[str, Any]] = []
    tokenizers: dict[str, ArtifactSource] = {}
    for export in exports:
        declaration = export.declaration
        if declaration is None:
            continue
        if isinstance(declaration, TextPreprocessing):
            name = "tokenizer" if export.role == "embed" else f"{export.role}_tokenizer"
            assert export.tokenizer is not None  # a text declaration's export carries its tokenizer
            source = tokenizers.setdefault(
                file_sha256(export.tokenizer)[0], ArtifactSource(export.tokenizer, "tokenizer", name=name)
            )
            declaration = replace(declaration, tokenizer=source.artifact_name)
        roles.append((export.role, declaration))
    return (Preprocessing(tuple(roles)) if roles else None), list(tokenizers.values())

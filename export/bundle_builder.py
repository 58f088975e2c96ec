"""Building, signing and checking model bundles (the format is :mod:`fctkit.protos.bundle`).

:func:`build_bundle` is the publishing gate: it refuses a bundle unless the empirical
compatibility criterion (ECC) holds for every forward/backward artifact, or an explicit
override with a reason is given, which the signed manifest then records.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, Literal

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from fctkit import __version__
from fctkit.errors import BundleFormatError, ConfigError, GateError, require
from fctkit.protos.bundle import (
    FILE_ROLES,
    FORMAT_VERSION,
    MANIFEST_FILE,
    SIGNATURE_FILE,
    Artifact,
    Distance,
    Manifest,
    Mode,
    Role,
    VerifiedBundle,
    artifact_name,
    file_sha256,
    gate_failures,
    gated_artifacts,
    public_key_id,
    staged_directory,
    verify_bundle,
)
from fctkit.protos.health_expectation import HealthExpectation
from fctkit.protos.preprocessing_spec import Preprocessing, vector_output
from fctkit.protos.search_policy import HubnessPolicy, TransitionPolicy

from .onnx_graph import graph_io_specs, graph_precision, load_onnx_model


@dataclass(frozen=True)
class ArtifactSource:
    """An ONNX file (or, role ``tokenizer``, a ``tokenizer.json``) to put into a bundle, and what it is.

    ``name`` defaults to :func:`~fctkit.protos.bundle.artifact_name` (``embed``,
    ``forward_1_to_2``, …), the key under which the gate records ECC."""

    file: Path
    role: Role
    source_version: int | None = None
    target_version: int | None = None
    name: str | None = None

    @property
    def artifact_name(self) -> str:
        return self.name or artifact_name(self.role, self.source_version, self.target_version)


def build_bundle(
    out_dir: str | os.PathLike[str],
    *,
    version: int,
    parents: Sequence[int],
    mode: Mode,
    distance: Distance,
    normalize: bool,
    artifacts: Sequence[ArtifactSource],
    gate: Mapping[str, Any],
    private_key: Ed25519PrivateKey,
    force: bool = False,
    force_reason: str | None = None,
    compatible_prefix_dim: int | None = None,
    transition: TransitionPolicy | None = None,
    hubness: HubnessPolicy | None = None,
    parity: Mapping[str, Mapping[str, Any]] | None = None,
    preprocessing: Preprocessing | None = None,
    rollback_window_days: int | None = None,
    health_expectation: HealthExpectation | None = None,
) -> VerifiedBundle:
    """Copy the ONNX files into a new bundle directory ``out_dir``, describe them in a
    manifest, sign it, and return the bundle verified as a device would verify it.

    ``gate`` is ``{"cases": {case: {metric: value}}, "ecc": {artifact name: bool}}`` from the
    trainer's report. Unless ECC is true for every gated artifact (forward/backward adapters;
    a compatible bundle's embed graph when it has parents) this raises
    :class:`GateError`; ``force=True`` with a ``force_reason`` publishes anyway and records
    ``"forced": true`` and the reason in the signed manifest. ``out_dir`` appears only when
    everything succeeded (written to a temporary directory, fsynced, renamed).

    ``compatible_prefix_dim`` (mode ``compatible`` only) records how many leading dims of the
    embedding the parent versions' rows are compared on (BT²'s old-compatible block).

    ``transition`` / ``hubness`` declare how devices score queries during and after the
    upgrade (:mod:`fctkit.protos.search_policy`); a hubness declaration needs the bundle's
    ``hubness`` graph (:func:`fctkit.export.hubness_onnx`). ``parity``: per artifact name,
    the export's parity check (max_abs_error, tolerance, against), recorded in the manifest.
    ``preprocessing``: how devices feed raw items to the embed/side_info graphs
    (:mod:`fctkit.protos.preprocessing_spec`); its tokenizers are ``tokenizer`` artifacts.
    ``rollback_window_days``: how long devices keep the rows' previous vectors after upgrading
    to it, so that a withdrawal reverts them exactly (0: none; None: not written, the default).
    ``health_expectation``: what devices should report after upgrading (:mod:`.expected_health`)."""
    cases, ecc, quantization = _gate_tables(gate)
    if force and not (force_reason and force_reason.strip()):
        raise GateError("--force needs a reason (--reason '...'): the override is recorded in the signed manifest")
    with staged_directory(out_dir) as staging:
        described = tuple(_copy_and_describe(source, staging) for source in artifacts)
        failures = gate_failures(gated_artifacts(described, mode, parents), ecc)
        if failures and not force:
            raise GateError(
                f"publishing refused: ECC (M(new, h(old)) > M(old, old)) is not recorded as holding for "
                f"{', '.join(failures)}; fix the adapters, or pass --force --reason '...' to override on the record"
            )
        manifest = Manifest(
            format_version=FORMAT_VERSION,
            version=version,
            parents=tuple(parents),
            mode=mode,
            distance=distance,
            normalize=normalize,
            embedding_dim=_output_dim(described, "embed", preprocessing),
            side_info_dim=_output_dim(described, "side_info", preprocessing),
            artifacts=described,
            gate={
                "cases": cases,
                "ecc": ecc,
                "forced": bool(failures),
                "force_reason": force_reason if failures else None,
                **quantization,
            },
            created_at=datetime.now(UTC).isoformat(timespec="seconds"),
            kit_version=__version__,
            publisher_key_id=public_key_id(private_key.public_key()),
            compatible_prefix_dim=compatible_prefix_dim,
            transition=transition,
            hubness=hubness,
            parity=None if parity is None else json.loads(json.dumps({k: dict(v) for k, v in parity.items()})),
            preprocessing=preprocessing,
            rollback_window_days=rollback_window_days,
            health_expectation=health_expectation,
        )
        manifest_bytes = manifest.canonical_bytes()
        (staging / MANIFEST_FILE).write_bytes(manifest_bytes)
        (staging / SIGNATURE_FILE).write_bytes(private_key.sign(manifest_bytes))
    return verify_bundle(out_dir, private_key.public_key())


def _gate_tables(gate: Mapping[str, Any]) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The gate's cases, ECC verdicts and (a quantised release) its ``quantization`` record, as
    plain JSON values exactly as they will be signed."""
    if not isinstance(gate, Mapping):
        raise GateError(f"the gate must be a table with 'cases' and 'ecc', got {type(gate).__name__}")
    unknown = sorted(set(gate) - {"cases", "ecc", "quantization"})
    if unknown:
        raise GateError(
            f"the gate has unknown key(s) {', '.join(unknown)}; it holds only 'cases' and 'ecc' (and 'quantization', "
            "written by `fctkit export --quantize`); the override is recorded from --force/--reason, not from the gate file"
        )
    cases, ecc = gate.get("cases", {}), gate.get("ecc", {})
    if not isinstance(cases, Mapping) or not isinstance(ecc, Mapping):
        raise GateError("gate 'cases' and 'ecc' must be tables")
    extra = {"quantization": gate["quantization"]} if "quantization" in gate else {}
    return json.loads(json.dumps(dict(cases))), json.loads(json.dumps(dict(ecc))), json.loads(json.dumps(extra))


def _copy_and_describe(source: ArtifactSource, staging: Path) -> Artifact:
    name = source.artifact_name
    src = Path(source.file)
    if not src.is_file():
        raise BundleFormatError(f"artifact {name!r}: file {src} does not exist")
    file_name = f"{name}.json" if source.role in FILE_ROLES else f"{name}.onnx"
    copy = staging / file_name
    if copy.exists():
        raise BundleFormatError(f"two artifacts are both named {name!r}: give one a distinct name")
    shutil.copyfile(src, copy)
    if source.role in FILE_ROLES:
        sha256, size = file_sha256(copy)
        return Artifact(
            name, source.role, file_name, sha256, size, (), (), source.source_version, source.target_version
        )
    # Describe the copy, not the source, so the manifest matches exactly the bytes bundled.
    model = load_onnx_model(copy)
    inputs, outputs = graph_io_specs(model)
    sha256, size = file_sha256(copy)
    return Artifact(
        name=name,
        role=source.role,
        file=file_name,
        sha256=sha256,
        size=size,
        inputs=inputs,
        outputs=outputs,
        source_version=source.source_version,
        target_version=source.target_version,
        precision=graph_precision(model),
    )


def _output_dim(artifacts: Sequence[Artifact], role: str, preprocessing: Preprocessing | None) -> int:
    matches = [a for a in artifacts if a.role == role]
    declaration = preprocessing.of(role) if preprocessing is not None else None
    return vector_output(declaration, matches[0])[1] if matches else 0


# --------------------------------------------------------------------------- ONNX Runtime check

_ORT_TYPES = {
    "tensor(float)": "float32",
    "tensor(float16)": "float16",
    "tensor(double)": "float64",
    "tensor(int64)": "int64",
    "tensor(int32)": "int32",
    "tensor(int8)": "int8",
    "tensor(uint8)": "uint8",
    "tensor(bool)": "bool",
}


def check_graphs_load(bundle: VerifiedBundle) -> dict[str, list[str]]:
    """Load every graph artifact of a verified bundle in an ONNX Runtime session (from the
    re-verified bytes) and check its input/output names, dims and dtypes against the
    manifest. Returns the execution providers each session uses."""
    ort = require("onnxruntime", "cpu")
    providers: dict[str, list[str]] = {}
    for artifact in (a for a in bundle.manifest.artifacts if not a.is_file):
        try:
            session = ort.InferenceSession(bundle.read_artifact(artifact), providers=["CPUExecutionProvider"])
        except Exception as exc:  # onnxruntime raises its own non-exported exception types
            raise BundleFormatError(f"artifact {artifact.name!r} does not load in ONNX Runtime: {exc}") from exc
        for kind, declared, actual in (
            ("inputs", artifact.inputs, session.get_inputs()),
            ("outputs", artifact.outputs, session.get_outputs()),
        ):
            found = tuple(_ort_spec(node) for node in actual)
            expected = tuple((s.name, s.shape, s.dtype) for s in declared)
            if found != expected:
                raise BundleFormatError(
                    f"artifact {artifact.name!r}: graph {kind} {_describe(found)} differ from the manifest's "
                    f"{_describe(expected)}; rebuild the bundle"
                )
        providers[artifact.name] = session.get_providers()
    return providers


def _ort_spec(node: Any) -> tuple[str, tuple[Any, ...], str]:
    shape = tuple(d if isinstance(d, int) else None for d in node.shape)
    return node.name, shape, _ORT_TYPES.get(node.type, node.type)


def _describe(specs: Sequence[tuple[str, tuple[Any, ...], str]]) -> str:
    return "[" + ", ".join(f"{name}{list(shape)}:{dtype}" for name, shape, dtype in specs) + "]"


# --------------------------------------------------------------------------- build spec (TOML)

TRAINER_REPORT_FORMAT = "fctkit-report/1"


@dataclass(frozen=True)
class ArtifactSpec:
    """One ``[[artifact]]`` table of a build spec. ``ecc`` names the trainer-report verdict
    (e.g. ``"ECC (top1)"``) that gates this forward/backward artifact when ``gate`` is a
    trainer ``report.json``."""

    file: Path
    role: Role
    source_version: int | None = None
    target_version: int | None = None
    name: str | None = None
    ecc: str | None = None

    def source(self, base: Path) -> ArtifactSource:
        return ArtifactSource(base / self.file, self.role, self.source_version, self.target_version, self.name)


@dataclass(frozen=True)
class BundleSpec:
    """The TOML spec of ``fctkit bundle build``; relative paths resolve against the spec's folder.

    ``gate`` is either a gate JSON (``{"cases": …, "ecc": {artifact name: bool}}``) or a
    trainer ``report.json``, whose cases are copied and whose verdicts named by each
    artifact's ``ecc`` give the ECC entries."""

    version: int
    mode: Mode
    distance: Literal["l2", "cosine"]
    normalize: bool
    artifact: tuple[ArtifactSpec, ...]
    parents: tuple[int, ...] = ()
    gate: Path | None = None


def load_bundle_spec(path: str | os.PathLike[str]) -> tuple[BundleSpec, list[ArtifactSource], dict[str, Any]]:
    """Read a build spec: the spec, its artifacts (paths resolved) and the gate tables."""
    from fctkit.config import from_mapping, load_toml

    path = Path(path)
    spec = from_mapping(BundleSpec, load_toml(path), where=path.name)
    if not spec.artifact:
        raise ConfigError(f"{path}: no [[artifact]] tables; a bundle needs at least its embed model")
    sources = [a.source(path.parent) for a in spec.artifact]
    if spec.gate is None:
        return spec, sources, {"cases": {}, "ecc": {}}
    gate_path = path.parent / spec.gate
    try:
        data = json.loads(gate_path.read_text())
    except FileNotFoundError as exc:
        raise ConfigError(f"{path}: gate file {gate_path} does not exist") from exc
    except ValueError as exc:
        raise ConfigError(f"{path}: gate file {gate_path} is not valid JSON: {exc}") from exc
    if isinstance(data, dict) and data.get("format") == TRAINER_REPORT_FORMAT:
        verdicts = {source.artifact_name: a.ecc for a, source in zip(spec.artifact, sources) if a.ecc is not None}
        return spec, sources, gate_from_report(data, verdicts)
    stray = [a.file for a in spec.artifact if a.ecc is not None]
    if stray:
        raise ConfigError(
            f"{path}: 'ecc' (for {', '.join(map(str, stray))}) names report verdicts, but {gate_path} is not a trainer report"
        )
    return spec, sources, data


def gate_from_report(report: Mapping[str, Any], ecc_verdicts: Mapping[str, str]) -> dict[str, Any]:
    """Gate tables from a trainer ``report.json``: every case's top-k and mAP, and for each
    artifact name in ``ecc_verdicts`` whether the named verdict passed."""
    try:
        cases = {
            case["name"]: {
                **{f"top{k}": float(v) for k, v in case["result"]["cmc"].items()},
                "mAP": float(case["result"]["mean_ap"]),
            }
            for case in report["cases"]
        }
        names = [v["name"] for v in report["verdicts"]]
        verdicts = {v["name"]: v["passed"] for v in report["verdicts"]}
    except (KeyError, TypeError, ValueError) as exc:
        raise GateError(f"the trainer report is malformed ({exc!r}); regenerate it with the trainer") from exc
    repeated = sorted({n for n in names if names.count(n) > 1} & set(ecc_verdicts.values()))
    if repeated:
        raise GateError(
            f"the trainer report has several verdicts named {', '.join(map(repr, repeated))}: give each a distinct name"
        )
    ecc = {}
    for artifact, verdict in ecc_verdicts.items():
        if verdict not in verdicts:
            raise GateError(
                f"artifact {artifact!r} is gated by verdict {verdict!r}, which the report does not have "
                f"(it has: {', '.join(verdicts) or 'none'})"
            )
        ecc[artifact] = verdicts[verdict] is True
    return {"cases": cases, "ecc": ecc}


__all__ = [
    "ArtifactSource",
    "ArtifactSpec",
    "BundleSpec",
    "build_bundle",
    "check_graphs_load",
    "gate_from_report",
    "load_bundle_spec",
]

"""The internal consistency rules a bundle manifest obeys, checked when one is constructed:
its header (format version, versions, mode, dims, publisher, time), its artifacts (roles,
source/target versions, dims), its search policies, its parity records and its publishing gate
(ECC of every gated artifact, or a recorded override).

The rules take the manifest being constructed as it is (duck-typed: this module sits below
:mod:`fctkit.protos.manifest`, which calls :func:`check_manifest`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from datetime import datetime
from typing import Any, Protocol, TypeVar

from fctkit.errors import BundleFormatError

from .artifact_spec import Artifact, TensorSpec
from .bundle_vocabulary import (
    DISTANCES,
    FORMAT_VERSION,
    GATED_ROLES,
    HEX64,
    MANIFEST_FILE,
    MODES,
    PRECISIONS,
    TRANSFORM_ROLES,
)
from .preprocessing_spec import Preprocessing, check_preprocessing, vector_output
from .search_policy import check_search_policies
from .strict_json import exact_keys, is_int, is_number, typed

_GATE_KEYS = ("cases", "ecc", "forced", "force_reason")
#: A quantised release's record of what quantisation cost (``fctkit export --quantize``).
_QUANTIZATION_KEYS = ("precision", "scheme", "artifacts", "metric", "fp32", "quantized")


#: the longest rollback window a bundle may ask of devices (they keep twice the vectors meanwhile)
MAX_ROLLBACK_WINDOW_DAYS = 365


def check_manifest(m: Any) -> None:
    """Raise :class:`BundleFormatError` for the first rule the manifest ``m`` breaks."""
    _check_header(m)
    _check_artifacts(m)
    check_search_policies(m)
    _check_parity(m)
    _check_gate(m.gate, gated_artifacts(m.artifacts, m.mode, m.parents))
    if "quantization" in m.gate:
        _check_quantization(m.gate["quantization"], m.artifacts)


def _check_header(m: Any) -> None:
    if not is_int(m.format_version) or m.format_version != FORMAT_VERSION:
        raise BundleFormatError(
            f"{MANIFEST_FILE}: format_version {m.format_version!r} is not supported (this fctkit reads "
            f"{FORMAT_VERSION}); upgrade fctkit on this device"
        )
    if not is_int(m.version) or m.version <= 0:
        raise BundleFormatError(f"{MANIFEST_FILE}: version must be a positive integer, got {m.version!r}")
    if not isinstance(m.parents, tuple) or not all(is_int(p) and 0 < p < m.version for p in m.parents):
        raise BundleFormatError(
            f"{MANIFEST_FILE}: parents must be positive integers lower than version {m.version}, got {m.parents!r}"
        )
    if len(set(m.parents)) != len(m.parents):
        raise BundleFormatError(f"{MANIFEST_FILE}: duplicate parent versions {m.parents!r}")
    if m.mode not in MODES:
        raise BundleFormatError(f"{MANIFEST_FILE}: mode {m.mode!r} is not one of {', '.join(MODES)}")
    if m.distance not in DISTANCES:
        raise BundleFormatError(f"{MANIFEST_FILE}: distance {m.distance!r} is not one of {', '.join(DISTANCES)}")
    if not isinstance(m.normalize, bool):
        raise BundleFormatError(f"{MANIFEST_FILE}: normalize must be true or false")
    window = m.rollback_window_days
    if window is not None and (not is_int(window) or not 0 <= window <= MAX_ROLLBACK_WINDOW_DAYS):
        raise BundleFormatError(
            f"{MANIFEST_FILE}: rollback_window_days must be an integer from 0 (none) to "
            f"{MAX_ROLLBACK_WINDOW_DAYS}, got {window!r}"
        )
    if not is_int(m.embedding_dim) or m.embedding_dim <= 0:
        raise BundleFormatError(f"{MANIFEST_FILE}: embedding_dim must be a positive integer")
    if not is_int(m.side_info_dim) or m.side_info_dim < 0:
        raise BundleFormatError(f"{MANIFEST_FILE}: side_info_dim must be a non-negative integer")
    if not isinstance(m.publisher_key_id, str) or not HEX64.fullmatch(m.publisher_key_id):
        raise BundleFormatError(f"{MANIFEST_FILE}: publisher_key_id must be 64 lowercase hex digits")
    if not isinstance(m.kit_version, str) or not m.kit_version:
        raise BundleFormatError(f"{MANIFEST_FILE}: kit_version must be a non-empty string")
    try:
        created = datetime.fromisoformat(m.created_at)
    except (TypeError, ValueError) as exc:
        raise BundleFormatError(f"{MANIFEST_FILE}: created_at {m.created_at!r} is not an ISO 8601 time") from exc
    if created.tzinfo is None:
        raise BundleFormatError(f"{MANIFEST_FILE}: created_at {m.created_at!r} has no time zone")
    prefix = m.compatible_prefix_dim
    if prefix is not None:
        if m.mode != "compatible":
            raise BundleFormatError(
                f"{MANIFEST_FILE}: compatible_prefix_dim is for mode 'compatible' only (mode is {m.mode!r})"
            )
        if not is_int(prefix) or not 0 < prefix <= m.embedding_dim:
            raise BundleFormatError(
                f"{MANIFEST_FILE}: compatible_prefix_dim must be an integer in 1..{m.embedding_dim} (the embedding_dim), got {prefix!r}"
            )


def _check_artifacts(m: Any) -> None:
    arts = m.artifacts
    if not isinstance(arts, tuple) or not all(isinstance(a, Artifact) for a in arts):
        raise BundleFormatError(f"{MANIFEST_FILE}: artifacts must be a tuple of Artifact")
    for attr in ("name", "file"):
        values = [getattr(a, attr) for a in arts]
        if len(set(values)) != len(values):
            raise BundleFormatError(f"{MANIFEST_FILE}: artifact {attr}s must be unique, got {values}")
    keys = [(a.role, a.source_version, a.target_version) for a in arts if not a.is_file]  # files go by name
    if len(set(keys)) != len(keys):
        raise BundleFormatError(f"{MANIFEST_FILE}: two artifacts share a role and source/target versions")
    embeds = [a for a in arts if a.role == "embed"]
    side_infos = [a for a in arts if a.role == "side_info"]
    query_maps = [a for a in arts if a.role == "query_map"]
    if len(embeds) != 1:
        raise BundleFormatError(
            f"bundle v{m.version}: needs exactly one embed artifact (the model devices embed with), has {len(embeds)}"
        )
    if len(side_infos) > 1 or len(query_maps) > 1:
        raise BundleFormatError(
            f"bundle v{m.version}: has {len(side_infos)} side_info and {len(query_maps)} query_map "
            f"artifacts, at most one of each is allowed"
        )
    for query_map in query_maps:  # the new model's query embedding -> the vector searched with
        if m.mode != "forward":
            raise BundleFormatError(
                f"bundle v{m.version}: a query_map artifact belongs to a forward-mode bundle, not {m.mode!r}"
            )
        _require_dim(
            query_map.inputs[0], m.embedding_dim, f"query_map artifact {query_map.name!r} input", "embedding_dim"
        )
        _require_dim(
            query_map.outputs[0], m.embedding_dim, f"query_map artifact {query_map.name!r} output", "embedding_dim"
        )
    if m.preprocessing is not None and not isinstance(m.preprocessing, Preprocessing):
        raise BundleFormatError(f"{MANIFEST_FILE}: preprocessing must be a Preprocessing section")
    check_preprocessing(m.preprocessing, arts)
    embed_output, embed_dim = vector_output(_declared(m, "embed"), embeds[0])
    if embed_dim != m.embedding_dim:
        raise BundleFormatError(
            f"embed artifact {embeds[0].name!r} output {embed_output.name!r} has shape "
            f"{embed_output.shape}, but the manifest's embedding_dim is {m.embedding_dim}"
        )
    expected_side = vector_output(_declared(m, "side_info"), side_infos[0])[1] if side_infos else 0
    if m.side_info_dim != expected_side:
        raise BundleFormatError(
            f"bundle v{m.version}: side_info_dim is {m.side_info_dim} but the side_info artifact gives {expected_side}"
            + ("" if side_infos else " (no side_info artifact: side_info_dim must be 0)")
        )
    forward_sources = {a.source_version for a in arts if a.role == "forward"}
    for a in arts:
        where = f"{a.role} artifact {a.name!r}"
        if a.role in TRANSFORM_ROLES and m.mode == "compatible":
            raise BundleFormatError(f"bundle v{m.version}: mode 'compatible' uses no transformations, but has {where}")
        if a.role in ("forward", "side_forward", "uncertainty") and (
            a.target_version != m.version or a.source_version >= m.version
        ):
            raise BundleFormatError(
                f"{where}: maps v{a.source_version} -> v{a.target_version}, but in bundle v{m.version} it must map an "
                f"older version to v{m.version}"
            )
        if a.role == "backward" and (a.source_version != m.version or a.target_version >= m.version):
            raise BundleFormatError(
                f"{where}: maps v{a.source_version} -> v{a.target_version}, but in bundle v{m.version} it must map "
                f"v{m.version} to an older version"
            )
        if a.role == "forward" and m.mode == "forward":
            _require_dim(a.outputs[0], m.embedding_dim, f"{where} output", "embedding_dim")
        if a.role == "side_forward":
            _require_dim(a.outputs[0], m.side_info_dim, f"{where} output", "side_info_dim")
        if a.role == "backward":
            _require_dim(a.inputs[0], m.embedding_dim, f"{where} input", "embedding_dim")
        if a.role == "uncertainty" and a.source_version not in forward_sources:
            raise BundleFormatError(f"{where}: there is no forward artifact from v{a.source_version} for it to qualify")


def _declared(m: Any, role: str) -> Any:
    return None if m.preprocessing is None else m.preprocessing.of(role)


def _check_parity(m: Any) -> None:
    if m.parity is None:
        return
    names = {a.name for a in m.artifacts}
    for name, entry in typed(m.parity, dict, "manifest parity").items():
        where = f"{MANIFEST_FILE}.parity[{name!r}]"
        if name not in names:
            raise BundleFormatError(f"{where}: names no artifact of this bundle")
        entry = exact_keys(entry, ("max_abs_error", "tolerance", "against"), where)
        if not (
            is_number(entry["max_abs_error"])
            and entry["max_abs_error"] >= 0
            and is_number(entry["tolerance"])
            and entry["tolerance"] > 0
            and isinstance(entry["against"], str)
            and entry["against"]
        ):
            raise BundleFormatError(
                f"{where}: expected max_abs_error >= 0, tolerance > 0 and a non-empty 'against', got {entry}"
            )


class _HasRoleAndName(Protocol):
    @property
    def role(self) -> str: ...
    @property
    def name(self) -> str: ...


_Named = TypeVar("_Named", bound=_HasRoleAndName)  # an artifact or a plan of one: has ``role`` and ``name``


def _require_dim(spec: TensorSpec, expected: int, where: str, field: str) -> None:
    if len(spec.shape) != 2 or spec.feature_dim != expected:
        raise BundleFormatError(
            f"{where} {spec.name!r} has shape {spec.shape}, but the manifest's {field} is {expected}"
        )


def gated_artifacts(artifacts: Sequence[_Named], mode: str, parents: Sequence[int]) -> list[_Named]:
    """The artifacts whose ECC verdict the gate records: every forward/backward adapter and, in
    a "compatible" bundle with parents, its embed graph (the new backbone, whose queries meet
    the parents' rows as they are). ``artifacts``: anything with ``role`` and ``name`` (a
    manifest's artifacts, or an export's plan of them before anything is exported)."""
    return [a for a in artifacts if a.role in GATED_ROLES or (mode == "compatible" and parents and a.role == "embed")]


def gate_failures(gated: Sequence[_Named], ecc: Mapping[str, Any]) -> list[str]:
    """Names of the ``gated`` artifacts (:func:`gated_artifacts`) for which ECC is not recorded as holding."""
    return [a.name for a in gated if ecc.get(a.name) is not True]


def _check_gate(gate: Any, gated_list: list[Artifact]) -> None:
    keys = (*_GATE_KEYS, "quantization") if isinstance(gate, dict) and "quantization" in gate else _GATE_KEYS
    gate = exact_keys(gate, keys, f"{MANIFEST_FILE}.gate")
    cases = typed(gate["cases"], dict, "gate.cases")
    for case, metrics in cases.items():
        for metric, value in typed(metrics, dict, f"gate.cases[{case!r}]").items():
            if not isinstance(metric, str) or not is_number(value):
                raise BundleFormatError(f"gate.cases[{case!r}][{metric!r}]: expected a finite number, got {value!r}")
    ecc = typed(gate["ecc"], dict, "gate.ecc")
    gated = {a.name for a in gated_list}
    for name, holds in ecc.items():
        if name not in gated:
            raise BundleFormatError(
                f"gate.ecc names {name!r}, which is not a gated artifact of this bundle (forward/backward adapters, "
                f"and a compatible bundle's embed graph; here: {', '.join(sorted(gated)) or 'none'})"
            )
        if not isinstance(holds, bool):
            raise BundleFormatError(f"gate.ecc[{name!r}]: expected true or false, got {holds!r}")
    forced = typed(gate["forced"], bool, "gate.forced")
    reason = gate["force_reason"]
    if forced != (isinstance(reason, str) and bool(reason.strip())):
        raise BundleFormatError("gate: force_reason must be a non-empty string exactly when forced is true")
    failures = gate_failures(gated_list, ecc)
    if failures and not forced:
        raise BundleFormatError(
            f"gate: ECC does not hold for {', '.join(failures)} and no override is recorded: such a bundle must not be published"
        )


def _check_quantization(record: Any, artifacts: Sequence[Artifact]) -> None:
    """The quantised artifacts named exist in that precision; the metric values are numbers."""
    where = f"{MANIFEST_FILE}.gate.quantization"
    record = exact_keys(record, _QUANTIZATION_KEYS, where)
    precision = typed(record["precision"], str, f"{where}.precision")
    if precision not in PRECISIONS[1:]:
        raise BundleFormatError(f"{where}.precision: expected one of {', '.join(PRECISIONS[1:])}, got {precision!r}")
    typed(record["scheme"], str, f"{where}.scheme")
    typed(record["metric"], str, f"{where}.metric")
    by_name = {a.name: a for a in artifacts}
    names = typed(record["artifacts"], list, f"{where}.artifacts")
    if not names or any(by_name.get(n) is None or by_name[n].precision != precision for n in names):
        raise BundleFormatError(f"{where}.artifacts: {names!r} must name this bundle's {precision} artifacts")
    for key in ("fp32", "quantized"):
        if not is_number(record[key]):
            raise BundleFormatError(f"{where}.{key}: expected a finite number, got {record[key]!r}")

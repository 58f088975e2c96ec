"""The signed model bundle: one directory (or tar archive) per model version.

A bundle holds ONNX files and two fixed files: ``manifest.json`` (the canonical manifest
bytes, exactly what is signed) and ``manifest.sig`` (a raw 64-byte Ed25519 signature over
them). Devices pin the publisher's public key and call :func:`verify_bundle`, which refuses
a bundle whose signature, any artifact hash or size, internal consistency (roles, dims,
gate) or version monotonicity fails, each with its own error class and a message that
names the file and what to do.

Artifact graphs take the embedding (or image) as their first input and, when they use it,
the side-info as their second; every tensor's first axis is the dynamic batch. ``fctkit.export``
names them ``image``/``old``/``new`` and ``side``, outputs ``embedding``/``side_info``/``sigma``;
the manifest records the exact names and dims, which ``fctkit bundle verify`` checks
against the graphs.

This module is the format only: stdlib + cryptography, no torch, no onnxruntime.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import re
import shutil
import stat
import tarfile
import tempfile
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any, Literal, TypeVar, get_args

from cryptography.exceptions import InvalidSignature, UnsupportedAlgorithm
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from fctkit.errors import (
    BundleError,
    BundleFormatError,
    HashMismatchError,
    PublisherKeyError,
    RollbackError,
    SignatureError,
)

from .search_policy import HubnessPolicy, TransitionPolicy, check_search_policies
from .strict_json import canonical_json, exact_keys, is_int, is_number, optional_int, reject_constant, typed

MANIFEST_FILE = "manifest.json"
SIGNATURE_FILE = "manifest.sig"
FORMAT_VERSION = 1
SIGNATURE_SIZE = 64

Role = Literal["embed", "side_info", "forward", "side_forward", "backward", "uncertainty", "query_map", "hubness"]
Mode = Literal["forward", "unified", "compatible"]
Distance = Literal["l2", "cosine"]
ROLES: tuple[str, ...] = get_args(Role)
MODES: tuple[str, ...] = get_args(Mode)
DISTANCES: tuple[str, ...] = get_args(Distance)
#: Roles that map one version's space to another's; they carry source/target versions.
TRANSFORM_ROLES = ("forward", "side_forward", "backward", "uncertainty")
#: Roles whose empirical compatibility criterion (ECC) gates publishing (and, in a "compatible"
#: bundle with parents, its embed graph: see gated_artifacts).
GATED_ROLES = ("forward", "backward")
DTYPES = ("float32", "float16", "float64", "int64", "int32", "int8", "uint8", "bool")
PRECISIONS = ("fp32", "fp16")

MAX_MANIFEST_BYTES = 1 << 20
DEFAULT_MAX_MEMBERS = 256
DEFAULT_MAX_FILE_BYTES = 2 << 30
DEFAULT_MAX_TOTAL_BYTES = 4 << 30

_SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
_HEX64 = re.compile(r"[0-9a-f]{64}")
_RESERVED_FILES = (MANIFEST_FILE, SIGNATURE_FILE)


def artifact_name(role: str, source_version: int | None = None, target_version: int | None = None) -> str:
    """The default artifact name, e.g. ``embed`` or ``forward_1_to_3``; gate ECC entries use it."""
    if source_version is None and target_version is None:
        return role
    return f"{role}_{source_version}_to_{target_version}"


# --------------------------------------------------------------------------- data model


@dataclass(frozen=True)
class TensorSpec:
    """One graph input or output; ``None`` in ``shape`` marks the dynamic batch axis."""

    name: str
    shape: tuple[int | None, ...]
    dtype: str

    def __post_init__(self) -> None:
        where = f"tensor {self.name!r}"
        if not isinstance(self.name, str) or not self.name:
            raise BundleFormatError(f"{where}: the name must be a non-empty string")
        if not isinstance(self.shape, tuple) or not self.shape:
            raise BundleFormatError(f"{where}: the shape must be a non-empty tuple, got {self.shape!r}")
        if self.shape[0] is not None:
            raise BundleFormatError(f"{where}: the first axis must be the dynamic batch axis (None), got {self.shape!r}")
        if not all(is_int(d) and d > 0 for d in self.shape[1:]):
            raise BundleFormatError(f"{where}: every axis after the batch must be a positive integer, got {self.shape!r}")
        if self.dtype not in DTYPES:
            raise BundleFormatError(f"{where}: dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")

    @property
    def feature_dim(self) -> int:
        """The size of the last axis (the embedding / side-info dimension for 2-D tensors)."""
        return int(self.shape[-1]) if len(self.shape) > 1 else 1

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}

    @classmethod
    def from_json(cls, data: Any, where: str) -> TensorSpec:
        data = exact_keys(data, ("name", "shape", "dtype"), where)
        shape = typed(data["shape"], list, f"{where}.shape")
        for i, dim in enumerate(shape):
            if dim is not None and not is_int(dim):
                raise BundleFormatError(f"{where}.shape[{i}]: expected an integer or null, got {dim!r}")
        return cls(
            name=typed(data["name"], str, f"{where}.name"),
            shape=tuple(shape),
            dtype=typed(data["dtype"], str, f"{where}.dtype"),
        )


@dataclass(frozen=True)
class Artifact:
    """One ONNX file of a bundle and what it computes."""

    name: str
    role: Role
    file: str
    sha256: str
    size: int
    inputs: tuple[TensorSpec, ...]
    outputs: tuple[TensorSpec, ...]
    source_version: int | None
    target_version: int | None
    precision: str = "fp32"

    def __post_init__(self) -> None:
        where = f"artifact {self.name!r}"
        if not isinstance(self.name, str) or not _SAFE_NAME.fullmatch(self.name):
            raise BundleFormatError(f"{where}: names use letters, digits, '.', '_' and '-' (at most 100)")
        if self.role not in ROLES:
            raise BundleFormatError(f"{where}: role {self.role!r} is not one of {', '.join(ROLES)}")
        if not isinstance(self.file, str) or not _SAFE_NAME.fullmatch(self.file) or self.file in _RESERVED_FILES:
            raise BundleFormatError(
                f"{where}: file {self.file!r} must be a plain file name inside the bundle "
                f"(no folders, no '..', not {' or '.join(_RESERVED_FILES)})"
            )
        if not isinstance(self.sha256, str) or not _HEX64.fullmatch(self.sha256):
            raise BundleFormatError(f"{where}: sha256 must be 64 lowercase hex digits")
        if not is_int(self.size) or self.size <= 0:
            raise BundleFormatError(f"{where}: size must be a positive integer, got {self.size!r}")
        for kind, specs in (("inputs", self.inputs), ("outputs", self.outputs)):
            if not isinstance(specs, tuple) or not specs or not all(isinstance(s, TensorSpec) for s in specs):
                raise BundleFormatError(f"{where}: {kind} must be a non-empty tuple of TensorSpec")
            names = [s.name for s in specs]
            if len(set(names)) != len(names):
                raise BundleFormatError(f"{where}: duplicate {kind} names {names}")
        if self.precision not in PRECISIONS:
            raise BundleFormatError(f"{where}: precision {self.precision!r} is not one of {', '.join(PRECISIONS)}")
        for field in ("source_version", "target_version"):
            value = getattr(self, field)
            if self.role in TRANSFORM_ROLES:
                if not is_int(value) or value <= 0:
                    raise BundleFormatError(f"{where}: a {self.role} artifact needs a positive integer {field}")
            elif value is not None:
                raise BundleFormatError(f"{where}: a {self.role} artifact has no {field} (got {value!r})")
        if self.role in TRANSFORM_ROLES and self.source_version == self.target_version:
            raise BundleFormatError(f"{where}: source_version and target_version are both {self.source_version}")

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "role": self.role,
            "file": self.file,
            "sha256": self.sha256,
            "size": self.size,
            "inputs": [s.to_json() for s in self.inputs],
            "outputs": [s.to_json() for s in self.outputs],
            "source_version": self.source_version,
            "target_version": self.target_version,
            "precision": self.precision,
        }

    @classmethod
    def from_json(cls, data: Any, where: str) -> Artifact:
        keys = ("name", "role", "file", "sha256", "size", "inputs", "outputs", "source_version", "target_version", "precision")
        data = exact_keys(data, keys, where)
        return cls(
            name=typed(data["name"], str, f"{where}.name"),
            role=typed(data["role"], str, f"{where}.role"),  # type: ignore[arg-type]
            file=typed(data["file"], str, f"{where}.file"),
            sha256=typed(data["sha256"], str, f"{where}.sha256"),
            size=typed(data["size"], int, f"{where}.size"),
            inputs=tuple(TensorSpec.from_json(s, f"{where}.inputs[{i}]") for i, s in enumerate(typed(data["inputs"], list, f"{where}.inputs"))),
            outputs=tuple(TensorSpec.from_json(s, f"{where}.outputs[{i}]") for i, s in enumerate(typed(data["outputs"], list, f"{where}.outputs"))),
            source_version=optional_int(data["source_version"], f"{where}.source_version"),
            target_version=optional_int(data["target_version"], f"{where}.target_version"),
            precision=typed(data["precision"], str, f"{where}.precision"),
        )


_MANIFEST_KEYS = (
    "format_version", "version", "parents", "mode", "distance", "normalize", "embedding_dim",
    "side_info_dim", "artifacts", "gate", "created_at", "kit_version", "publisher_key_id",
)
#: Keys a manifest may omit; absent keys are not written, so older manifests keep their bytes.
_OPTIONAL_MANIFEST_KEYS = ("compatible_prefix_dim", "transition", "hubness", "parity")
_GATE_KEYS = ("cases", "ecc", "forced", "force_reason")


@dataclass(frozen=True)
class Manifest:
    """What a bundle contains; constructing one validates its internal consistency."""

    format_version: int
    version: int
    parents: tuple[int, ...]
    mode: Mode
    distance: Distance
    normalize: bool
    embedding_dim: int
    side_info_dim: int
    artifacts: tuple[Artifact, ...]
    gate: dict
    created_at: str
    kit_version: str
    publisher_key_id: str
    #: mode "compatible" only: how many leading dims of this version's embedding are comparable
    #: with the parent versions' rows (BT²'s old-compatible block); None = all of them.
    compatible_prefix_dim: int | None = None
    #: how a device scores queries beyond plain nearest neighbours (see fctkit.protos.search_policy)
    transition: TransitionPolicy | None = None
    hubness: HubnessPolicy | None = None
    #: artifact name -> {"max_abs_error", "tolerance", "against"}: how closely each graph reproduced
    #: its reference at export (torch, the team's own features, numpy)
    parity: dict | None = None

    def __post_init__(self) -> None:
        _check_header(self)
        _check_artifacts(self)
        check_search_policies(self)
        _check_parity(self)
        _check_gate(self.gate, gated_artifacts(self.artifacts, self.mode, self.parents))

    def canonical_bytes(self) -> bytes:
        """The exact bytes that are signed and stored as ``manifest.json``."""
        return canonical_json(self.to_json())

    def to_json(self) -> dict[str, Any]:
        return {
            "format_version": self.format_version,
            "version": self.version,
            "parents": list(self.parents),
            "mode": self.mode,
            "distance": self.distance,
            "normalize": self.normalize,
            "embedding_dim": self.embedding_dim,
            "side_info_dim": self.side_info_dim,
            "artifacts": [a.to_json() for a in self.artifacts],
            "gate": self.gate,
            "created_at": self.created_at,
            "kit_version": self.kit_version,
            "publisher_key_id": self.publisher_key_id,
        } | {key: value for key, value in (("compatible_prefix_dim", self.compatible_prefix_dim),
                                          ("transition", self.transition and self.transition.to_json()),
                                          ("hubness", self.hubness and self.hubness.to_json()),
                                          ("parity", self.parity)) if value is not None}

    @property
    def compatible_dims(self) -> int:
        """The leading dims of this version's embedding that parent versions' rows are compared on."""
        return self.embedding_dim if self.compatible_prefix_dim is None else self.compatible_prefix_dim

    @classmethod
    def from_bytes(cls, data: bytes) -> Manifest:
        """Parse canonical manifest bytes; anything unknown, missing, mistyped or not in
        canonical form raises :class:`BundleFormatError`."""
        if len(data) > MAX_MANIFEST_BYTES:
            raise BundleFormatError(f"{MANIFEST_FILE} is {len(data)} bytes, more than the {MAX_MANIFEST_BYTES} allowed")
        try:
            raw = json.loads(data.decode("ascii"), parse_constant=reject_constant)
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise BundleFormatError(f"{MANIFEST_FILE} is not valid ASCII JSON: {exc}") from exc
        optional = {k: raw.pop(k) for k in _OPTIONAL_MANIFEST_KEYS if isinstance(raw, dict) and k in raw}
        raw = exact_keys(raw, _MANIFEST_KEYS, MANIFEST_FILE)
        where = MANIFEST_FILE
        manifest = cls(
            format_version=typed(raw["format_version"], int, f"{where}.format_version"),
            version=typed(raw["version"], int, f"{where}.version"),
            parents=tuple(typed(p, int, f"{where}.parents[{i}]") for i, p in enumerate(typed(raw["parents"], list, f"{where}.parents"))),
            mode=typed(raw["mode"], str, f"{where}.mode"),  # type: ignore[arg-type]
            distance=typed(raw["distance"], str, f"{where}.distance"),  # type: ignore[arg-type]
            normalize=typed(raw["normalize"], bool, f"{where}.normalize"),
            embedding_dim=typed(raw["embedding_dim"], int, f"{where}.embedding_dim"),
            side_info_dim=typed(raw["side_info_dim"], int, f"{where}.side_info_dim"),
            artifacts=tuple(Artifact.from_json(a, f"{where}.artifacts[{i}]") for i, a in enumerate(typed(raw["artifacts"], list, f"{where}.artifacts"))),
            gate=typed(raw["gate"], dict, f"{where}.gate"),
            created_at=typed(raw["created_at"], str, f"{where}.created_at"),
            kit_version=typed(raw["kit_version"], str, f"{where}.kit_version"),
            publisher_key_id=typed(raw["publisher_key_id"], str, f"{where}.publisher_key_id"),
            compatible_prefix_dim=(typed(optional["compatible_prefix_dim"], int, f"{where}.compatible_prefix_dim")
                                   if "compatible_prefix_dim" in optional else None),
            transition=TransitionPolicy.from_json(optional["transition"], f"{where}.transition") if "transition" in optional else None,
            hubness=HubnessPolicy.from_json(optional["hubness"], f"{where}.hubness") if "hubness" in optional else None,
            parity=typed(optional["parity"], dict, f"{where}.parity") if "parity" in optional else None,
        )
        if manifest.canonical_bytes() != data:
            raise BundleFormatError(
                f"{MANIFEST_FILE} is valid JSON but not in canonical form (sorted keys, no spaces, ASCII): "
                "it was not written by fctkit; rebuild the bundle"
            )
        return manifest

    def artifact(self, role: str, *, source_version: int | None = None, target_version: int | None = None) -> Artifact:
        """The one artifact with ``role`` (and the given source/target version, when several match)."""
        matches = [
            a for a in self.artifacts
            if a.role == role
            and (source_version is None or a.source_version == source_version)
            and (target_version is None or a.target_version == target_version)
        ]
        if len(matches) == 1:
            return matches[0]
        wanted = f"{role!r}" + (f" from v{source_version}" if source_version is not None else "") + (
            f" to v{target_version}" if target_version is not None else "")
        if not matches:
            have = ", ".join(a.name for a in self.artifacts)
            raise BundleFormatError(f"bundle v{self.version} has no {wanted} artifact (it has: {have})")
        raise BundleFormatError(
            f"bundle v{self.version} has several {wanted} artifacts ({', '.join(a.name for a in matches)}): "
            "pass source_version= or target_version= to choose one"
        )


@dataclass(frozen=True)
class VerifiedBundle:
    """A bundle directory whose signature, hashes and version have been checked."""

    root: Path
    manifest: Manifest
    manifest_bytes: bytes
    signature: bytes

    def artifact_path(self, artifact: Artifact | str) -> Path:
        """The path of an artifact (given as an :class:`Artifact` or its name)."""
        if isinstance(artifact, str):
            artifact = self._by_name(artifact)
        return self.root / artifact.file

    def read_artifact(self, artifact: Artifact | str) -> bytes:
        """The artifact's bytes, re-checked against the manifest as they are read, so a
        runtime loads exactly the verified bytes even if the file changed since."""
        if isinstance(artifact, str):
            artifact = self._by_name(artifact)
        data = _read_regular_file(self.root / artifact.file, artifact.size + 1)
        _check_artifact_bytes(artifact, len(data), hashlib.sha256(data).hexdigest())
        return data

    def _by_name(self, name: str) -> Artifact:
        for artifact in self.manifest.artifacts:
            if artifact.name == name:
                return artifact
        raise BundleFormatError(f"bundle v{self.manifest.version} has no artifact named {name!r}")


# --------------------------------------------------------------------------- consistency rules


def _check_header(m: Manifest) -> None:
    if not is_int(m.format_version) or m.format_version != FORMAT_VERSION:
        raise BundleFormatError(
            f"{MANIFEST_FILE}: format_version {m.format_version!r} is not supported (this fctkit reads "
            f"{FORMAT_VERSION}); upgrade fctkit on this device"
        )
    if not is_int(m.version) or m.version <= 0:
        raise BundleFormatError(f"{MANIFEST_FILE}: version must be a positive integer, got {m.version!r}")
    if not isinstance(m.parents, tuple) or not all(is_int(p) and 0 < p < m.version for p in m.parents):
        raise BundleFormatError(f"{MANIFEST_FILE}: parents must be positive integers lower than version {m.version}, got {m.parents!r}")
    if len(set(m.parents)) != len(m.parents):
        raise BundleFormatError(f"{MANIFEST_FILE}: duplicate parent versions {m.parents!r}")
    if m.mode not in MODES:
        raise BundleFormatError(f"{MANIFEST_FILE}: mode {m.mode!r} is not one of {', '.join(MODES)}")
    if m.distance not in DISTANCES:
        raise BundleFormatError(f"{MANIFEST_FILE}: distance {m.distance!r} is not one of {', '.join(DISTANCES)}")
    if not isinstance(m.normalize, bool):
        raise BundleFormatError(f"{MANIFEST_FILE}: normalize must be true or false")
    if not is_int(m.embedding_dim) or m.embedding_dim <= 0:
        raise BundleFormatError(f"{MANIFEST_FILE}: embedding_dim must be a positive integer")
    if not is_int(m.side_info_dim) or m.side_info_dim < 0:
        raise BundleFormatError(f"{MANIFEST_FILE}: side_info_dim must be a non-negative integer")
    if not isinstance(m.publisher_key_id, str) or not _HEX64.fullmatch(m.publisher_key_id):
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
            raise BundleFormatError(f"{MANIFEST_FILE}: compatible_prefix_dim is for mode 'compatible' only (mode is {m.mode!r})")
        if not is_int(prefix) or not 0 < prefix <= m.embedding_dim:
            raise BundleFormatError(f"{MANIFEST_FILE}: compatible_prefix_dim must be an integer in 1..{m.embedding_dim} (the embedding_dim), got {prefix!r}")


def _check_artifacts(m: Manifest) -> None:
    arts = m.artifacts
    if not isinstance(arts, tuple) or not all(isinstance(a, Artifact) for a in arts):
        raise BundleFormatError(f"{MANIFEST_FILE}: artifacts must be a tuple of Artifact")
    for attr in ("name", "file"):
        values = [getattr(a, attr) for a in arts]
        if len(set(values)) != len(values):
            raise BundleFormatError(f"{MANIFEST_FILE}: artifact {attr}s must be unique, got {values}")
    keys = [(a.role, a.source_version, a.target_version) for a in arts]
    if len(set(keys)) != len(keys):
        raise BundleFormatError(f"{MANIFEST_FILE}: two artifacts share a role and source/target versions")
    embeds = [a for a in arts if a.role == "embed"]
    side_infos = [a for a in arts if a.role == "side_info"]
    query_maps = [a for a in arts if a.role == "query_map"]
    if len(embeds) != 1:
        raise BundleFormatError(f"bundle v{m.version}: needs exactly one embed artifact (the model devices embed with), has {len(embeds)}")
    if len(side_infos) > 1 or len(query_maps) > 1:
        raise BundleFormatError(f"bundle v{m.version}: has {len(side_infos)} side_info and {len(query_maps)} query_map "
                                f"artifacts, at most one of each is allowed")
    for query_map in query_maps:  # the new model's query embedding -> the vector searched with
        if m.mode != "forward":
            raise BundleFormatError(f"bundle v{m.version}: a query_map artifact belongs to a forward-mode bundle, not {m.mode!r}")
        _require_dim(query_map.inputs[0], m.embedding_dim, f"query_map artifact {query_map.name!r} input", "embedding_dim")
        _require_dim(query_map.outputs[0], m.embedding_dim, f"query_map artifact {query_map.name!r} output", "embedding_dim")
    _require_dim(embeds[0].outputs[0], m.embedding_dim, f"embed artifact {embeds[0].name!r} output", "embedding_dim")
    expected_side = side_infos[0].outputs[0].feature_dim if side_infos else 0
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
        if a.role in ("forward", "side_forward", "uncertainty"):
            if a.target_version != m.version or a.source_version >= m.version:
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


def _check_parity(m: Manifest) -> None:
    if m.parity is None:
        return
    names = {a.name for a in m.artifacts}
    for name, entry in typed(m.parity, dict, "manifest parity").items():
        where = f"{MANIFEST_FILE}.parity[{name!r}]"
        if name not in names:
            raise BundleFormatError(f"{where}: names no artifact of this bundle")
        entry = exact_keys(entry, ("max_abs_error", "tolerance", "against"), where)
        if not (is_number(entry["max_abs_error"]) and entry["max_abs_error"] >= 0 and is_number(entry["tolerance"])
                and entry["tolerance"] > 0 and isinstance(entry["against"], str) and entry["against"]):
            raise BundleFormatError(f"{where}: expected max_abs_error >= 0, tolerance > 0 and a non-empty 'against', got {entry}")


_Named = TypeVar("_Named")  # an artifact or a plan of one: has ``role`` and ``name``


def _require_dim(spec: TensorSpec, expected: int, where: str, field: str) -> None:
    if len(spec.shape) != 2 or spec.feature_dim != expected:
        raise BundleFormatError(f"{where} {spec.name!r} has shape {spec.shape}, but the manifest's {field} is {expected}")


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
    gate = exact_keys(gate, _GATE_KEYS, f"{MANIFEST_FILE}.gate")
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


# --------------------------------------------------------------------------- keys and signatures


def load_public_key(path_or_bytes: str | os.PathLike | bytes | Ed25519PublicKey) -> Ed25519PublicKey:
    """The publisher's Ed25519 public key from a PEM file, PEM bytes, or the raw 32 bytes."""
    if isinstance(path_or_bytes, Ed25519PublicKey):
        return path_or_bytes
    if isinstance(path_or_bytes, (bytes, bytearray)):
        data, where = bytes(path_or_bytes), "the given public key bytes"
    else:
        path = Path(path_or_bytes)
        where = str(path)
        try:
            data = path.read_bytes()
        except OSError as exc:
            raise PublisherKeyError(f"cannot read the publisher public key {path}: {exc.strerror}") from exc
    if len(data) == 32:
        return Ed25519PublicKey.from_public_bytes(data)
    try:
        key = serialization.load_pem_public_key(data)
    except (ValueError, TypeError, UnsupportedAlgorithm) as exc:  # a damaged PEM may name another algorithm
        raise PublisherKeyError(
            f"{where} is not an Ed25519 public key (PEM or raw 32 bytes); use the publisher.pub written by "
            "`fctkit keys generate`"
        ) from exc
    if not isinstance(key, Ed25519PublicKey):
        raise PublisherKeyError(f"{where} holds a {type(key).__name__}, not an Ed25519 public key")
    return key


def public_key_id(public_key: Ed25519PublicKey) -> str:
    """SHA-256 hex of the raw 32-byte public key: what manifests name as their publisher."""
    raw = public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
    return hashlib.sha256(raw).hexdigest()


def verify_manifest(manifest_bytes: bytes, signature: bytes, public_key: Any) -> Manifest:
    """Check the Ed25519 signature over the manifest bytes, then parse and validate them."""
    key = load_public_key(public_key)
    if len(signature) != SIGNATURE_SIZE:
        raise SignatureError(
            f"{SIGNATURE_FILE} is {len(signature)} bytes, an Ed25519 signature is {SIGNATURE_SIZE}: "
            "the signature is truncated or corrupt; fetch the bundle again"
        )
    pinned = public_key_id(key)
    try:
        key.verify(signature, manifest_bytes)
    except InvalidSignature:
        claimed = _claimed_key_id(manifest_bytes)
        # a claimed id one byte off the pinned one is a damaged manifest, not another publisher
        foreign = claimed is not None and sum(a != b for a, b in zip(claimed, pinned)) + abs(len(claimed) - len(pinned)) > 2
        if foreign:
            raise SignatureError(
                f"the bundle is signed by publisher key {claimed}, but this device pins {pinned}: "
                "it comes from another publisher (or the pinned key is wrong); refuse it"
            ) from None
        raise SignatureError(
            f"{SIGNATURE_FILE} does not verify {MANIFEST_FILE} under the pinned publisher key: the manifest or "
            "the signature was modified; fetch the bundle again from the registry"
        ) from None
    manifest = Manifest.from_bytes(manifest_bytes)
    if manifest.publisher_key_id != pinned:
        raise SignatureError(
            f"{MANIFEST_FILE} names publisher key {manifest.publisher_key_id[:16]}… but was signed by {pinned[:16]}…: "
            "rebuild the bundle with the publisher's own key"
        )
    return manifest


def _claimed_key_id(manifest_bytes: bytes) -> str | None:
    try:
        claimed = json.loads(manifest_bytes).get("publisher_key_id")
    except (ValueError, AttributeError, UnicodeDecodeError, RecursionError):
        return None
    return claimed if isinstance(claimed, str) else None


# --------------------------------------------------------------------------- bundle directories


def verify_bundle(root: str | os.PathLike, public_key: Any, *, installed_version: int | None = None) -> VerifiedBundle:
    """Verify a bundle directory: signature, version monotonicity, no stray files, and every
    artifact's size and SHA-256. Returns the :class:`VerifiedBundle` or raises a
    :class:`~fctkit.errors.BundleError` subclass naming what failed."""
    root = Path(root)
    if not root.is_dir():
        raise BundleFormatError(f"{root} is not a bundle directory (a .tar archive: `fctkit device upgrade --bundle` takes "
                                f"it as it is; `fctkit bundle verify` too)")
    manifest_path, signature_path = root / MANIFEST_FILE, root / SIGNATURE_FILE
    if not manifest_path.exists():
        raise BundleFormatError(f"{root} has no {MANIFEST_FILE}: not a bundle, or an incomplete copy")
    if not signature_path.exists():
        raise SignatureError(f"{root} has no {SIGNATURE_FILE}: the bundle is unsigned; refuse it")
    manifest_bytes = _read_regular_file(manifest_path, MAX_MANIFEST_BYTES)
    signature = _read_regular_file(signature_path, SIGNATURE_SIZE + 1)
    manifest = verify_manifest(manifest_bytes, signature, public_key)
    check_version_is_newer(manifest.version, installed_version)
    expected = {MANIFEST_FILE, SIGNATURE_FILE} | {a.file for a in manifest.artifacts}
    present = {p.name for p in root.iterdir()}
    if present - expected:
        raise BundleFormatError(
            f"{root} holds files the manifest does not list: {', '.join(sorted(present - expected))}; "
            "a bundle directory must hold only its signed files"
        )
    for artifact in manifest.artifacts:
        path = root / artifact.file
        if artifact.file not in present:
            raise BundleFormatError(f"artifact {artifact.name!r}: file {artifact.file} is missing from {root}")
        _require_regular(path)
        size = path.stat().st_size
        _check_artifact_bytes(artifact, size, None)
        with path.open("rb") as fh:
            digest = hashlib.file_digest(fh, "sha256").hexdigest()
        _check_artifact_bytes(artifact, size, digest)
    return VerifiedBundle(root=root.resolve(), manifest=manifest, manifest_bytes=manifest_bytes, signature=signature)


def check_version_is_newer(version: int, installed_version: int | None) -> None:
    """Raise :class:`RollbackError` unless ``version`` is newer than ``installed_version``."""
    if installed_version is None or version > installed_version:
        return
    what = "a replay of the installed version" if version == installed_version else "a rollback"
    raise RollbackError(
        f"bundle v{version} is not newer than the installed v{installed_version} ({what}); devices only move forward"
    )


def _check_artifact_bytes(artifact: Artifact, size: int, digest: str | None) -> None:
    if size != artifact.size:
        raise HashMismatchError(
            f"artifact {artifact.name!r} ({artifact.file}) is {size} bytes but the manifest says {artifact.size}: "
            "the file is truncated or replaced; fetch the bundle again"
        )
    if digest is not None and digest != artifact.sha256:
        raise HashMismatchError(
            f"artifact {artifact.name!r} ({artifact.file}) has SHA-256 {digest[:16]}… but the manifest says "
            f"{artifact.sha256[:16]}…: its bytes were modified or it was swapped for another file; fetch the bundle again"
        )


def _require_regular(path: Path) -> None:
    mode = os.lstat(path).st_mode
    if not stat.S_ISREG(mode):
        raise BundleFormatError(f"{path} is not a regular file (links and special files are refused)")


def _read_regular_file(path: Path, limit: int) -> bytes:
    _require_regular(path)
    with path.open("rb") as fh:
        data = fh.read(limit + 1)
    if len(data) > limit:
        raise BundleFormatError(f"{path} is larger than the {limit} bytes allowed")
    return data


def file_sha256(path: str | os.PathLike) -> tuple[str, int]:
    """SHA-256 hex digest and size of a file, read in chunks."""
    with open(path, "rb") as fh:
        digest = hashlib.file_digest(fh, "sha256").hexdigest()
        return digest, fh.tell()


@contextlib.contextmanager
def staged_directory(dest: str | os.PathLike) -> Iterator[Path]:
    """Yield an empty temporary directory next to ``dest``; on success fsync everything in
    it and rename it to ``dest`` in one step, so ``dest`` is either absent or complete."""
    dest = Path(dest)
    if dest.exists() or dest.is_symlink():
        raise BundleError(f"{dest} already exists: remove it or choose another destination")
    dest.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{dest.name}.", suffix=".partial", dir=dest.parent))
    try:
        yield staging
        for path in staging.iterdir():
            with path.open("rb") as fh:
                os.fsync(fh.fileno())
        fsync_dir(staging)
        os.rename(staging, dest)
        fsync_dir(dest.parent)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise


def fsync_dir(path: str | os.PathLike) -> None:
    """Make a rename or create inside ``path`` durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- archives


def pack_bundle(root: str | os.PathLike, archive: str | os.PathLike) -> Path:
    """Write the bundle directory as a deterministic tar (sorted, zero times and owners).

    Only the manifest, the signature and the artifacts the manifest lists are packed; a
    stray file is an error. The archive is written to a temporary name and renamed."""
    root, archive = Path(root), Path(archive)
    manifest_bytes = _read_regular_file(root / MANIFEST_FILE, MAX_MANIFEST_BYTES) if (root / MANIFEST_FILE).exists() else None
    if manifest_bytes is None:
        raise BundleFormatError(f"{root} has no {MANIFEST_FILE}: not a bundle")
    manifest = Manifest.from_bytes(manifest_bytes)
    names = sorted({MANIFEST_FILE, SIGNATURE_FILE} | {a.file for a in manifest.artifacts})
    present = {p.name for p in root.iterdir()}
    if set(names) - present or present - set(names):
        raise BundleFormatError(
            f"{root}: files missing {sorted(set(names) - present)} or not listed {sorted(present - set(names))}; "
            "pack a complete bundle directory"
        )
    archive.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=f".{archive.name}.", suffix=".partial", dir=archive.parent)
    try:
        with os.fdopen(fd, "wb") as raw, tarfile.open(fileobj=raw, mode="w", format=tarfile.USTAR_FORMAT) as tar:
            for name in names:
                path = root / name
                _require_regular(path)
                info = tarfile.TarInfo(name)
                info.size, info.mode, info.mtime = path.stat().st_size, 0o644, 0
                info.uid = info.gid = 0
                info.uname = info.gname = ""
                with path.open("rb") as fh:
                    tar.addfile(info, fh)
        with open(tmp_name, "rb") as fh:
            os.fsync(fh.fileno())
        os.replace(tmp_name, archive)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp_name)
        raise
    return archive


def unpack_bundle(
    archive: str | os.PathLike,
    dest: str | os.PathLike,
    *,
    max_members: int = DEFAULT_MAX_MEMBERS,
    max_file_bytes: int = DEFAULT_MAX_FILE_BYTES,
    max_total_bytes: int = DEFAULT_MAX_TOTAL_BYTES,
) -> Path:
    """Extract a bundle archive into the new directory ``dest`` (created atomically).

    Only plain files with plain names are accepted: absolute paths, ``..``, folders,
    links, devices, duplicates and oversized members are refused, and nothing is written
    outside ``dest``. This does not verify the signature: call :func:`verify_bundle` next."""
    archive, dest = Path(archive), Path(dest)
    try:
        tar = tarfile.open(archive, mode="r:")
    except FileNotFoundError as exc:
        raise BundleFormatError(f"bundle archive {archive} does not exist") from exc
    except (tarfile.TarError, OSError) as exc:
        raise BundleFormatError(f"{archive} is not a tar archive ({exc}); fetch it again") from exc
    with tar, staged_directory(dest) as staging:
        seen: set[str] = set()
        total = 0
        try:
            for member in tar:
                _check_member(member, seen, max_members, max_file_bytes, archive)
                total += member.size
                if total > max_total_bytes:
                    raise BundleFormatError(f"{archive}: members add up to more than {max_total_bytes} bytes; refused")
                source = tar.extractfile(member)
                assert source is not None  # regular files always have a payload
                with source, open(staging / member.name, "xb") as out:
                    shutil.copyfileobj(source, out)
                    if out.tell() != member.size:
                        raise BundleFormatError(f"{archive}: member {member.name} is truncated; fetch the archive again")
        except (tarfile.TarError, EOFError) as exc:
            raise BundleFormatError(f"{archive} is truncated or corrupt ({exc}); fetch it again") from exc
        for required in (MANIFEST_FILE, SIGNATURE_FILE):
            if required not in seen:
                raise BundleFormatError(f"{archive} has no {required}: not a complete bundle")
    return dest


def _check_member(member: tarfile.TarInfo, seen: set[str], max_members: int, max_file_bytes: int, archive: Path) -> None:
    if len(seen) >= max_members:
        raise BundleFormatError(f"{archive}: more than {max_members} members; refused")
    if not member.isreg():
        kind = "link" if (member.issym() or member.islnk()) else "folder" if member.isdir() else "special file"
        raise BundleFormatError(f"{archive}: member {member.name!r} is a {kind}; bundles hold only plain files")
    if not _SAFE_NAME.fullmatch(member.name):
        raise BundleFormatError(
            f"{archive}: member name {member.name!r} is not a plain file name (absolute paths, folders and '..' are refused)"
        )
    if member.name in seen:
        raise BundleFormatError(f"{archive}: member {member.name!r} appears twice; refused")
    limit = MAX_MANIFEST_BYTES if member.name == MANIFEST_FILE else max_file_bytes
    if member.size > limit:
        raise BundleFormatError(f"{archive}: member {member.name!r} is {member.size} bytes, more than the {limit} allowed")
    seen.add(member.name)


__all__ = [
    "MANIFEST_FILE", "SIGNATURE_FILE", "FORMAT_VERSION", "SIGNATURE_SIZE", "Role", "Mode", "Distance",
    "ROLES", "MODES", "DISTANCES", "TRANSFORM_ROLES", "GATED_ROLES", "TensorSpec", "Artifact", "Manifest",
    "VerifiedBundle", "artifact_name", "gate_failures", "gated_artifacts", "load_public_key", "public_key_id", "verify_manifest",
    "verify_bundle", "check_version_is_newer", "file_sha256", "fsync_dir", "staged_directory", "pack_bundle", "unpack_bundle",
]

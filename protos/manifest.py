"""The bundle manifest: what a bundle contains, as the canonical JSON bytes that are signed.

:class:`Manifest` validates itself on construction (see :mod:`fctkit.protos.manifest_rules`),
writes its canonical bytes and parses them back strictly (:meth:`Manifest.from_bytes`)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from fctkit.errors import BundleFormatError

from .artifact_spec import Artifact
from .bundle_vocabulary import MANIFEST_FILE, MAX_MANIFEST_BYTES, Distance, Mode
from .health_expectation import HealthExpectation
from .manifest_rules import check_manifest
from .preprocessing_spec import Preprocessing
from .search_policy import HubnessPolicy, TransitionPolicy
from .strict_json import canonical_json, exact_keys, reject_constant, typed

_MANIFEST_KEYS = (
    "format_version",
    "version",
    "parents",
    "mode",
    "distance",
    "normalize",
    "embedding_dim",
    "side_info_dim",
    "artifacts",
    "gate",
    "created_at",
    "kit_version",
    "publisher_key_id",
)
#: Keys a manifest may omit; absent keys are not written, so older manifests keep their bytes.
_OPTIONAL_MANIFEST_KEYS = (
    "compatible_prefix_dim",
    "transition",
    "hubness",
    "parity",
    "preprocessing",
    "rollback_window_days",
    "health_expectation",
)
#: how long a device keeps every row's previous vectors after upgrading to a bundle that does not say:
#: none, as before the field existed (a bundle already published never asked devices for the room);
#: `fctkit export` writes its own default (7 days) into new bundles
DEFAULT_ROLLBACK_WINDOW_DAYS = 0


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
    gate: dict[str, Any]
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
    parity: dict[str, Any] | None = None
    #: how raw items (image files, texts) become the embed/side_info graphs' inputs
    #: (fctkit.protos.preprocessing_spec); None: devices pass arrays as they are
    preprocessing: Preprocessing | None = None
    #: days a device keeps every row's vectors from before its upgrade to this version, so that a
    #: withdrawal reverts it exactly (0: none); None (absent): :data:`DEFAULT_ROLLBACK_WINDOW_DAYS`
    rollback_window_days: int | None = None
    #: what devices should report after upgrading to it (the exporter's measurement of the label-free
    #: health on the evaluation split, fctkit.protos.health_expectation); None: not measured (older bundles)
    health_expectation: HealthExpectation | None = None

    def __post_init__(self) -> None:
        check_manifest(self)

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
        } | {
            key: value
            for key, value in (
                ("compatible_prefix_dim", self.compatible_prefix_dim),
                ("transition", self.transition and self.transition.to_json()),
                ("hubness", self.hubness and self.hubness.to_json()),
                ("parity", self.parity),
                ("preprocessing", self.preprocessing and self.preprocessing.to_json()),
                ("rollback_window_days", self.rollback_window_days),
                ("health_expectation", self.health_expectation and self.health_expectation.to_json()),
            )
            if value is not None
        }

    @property
    def rollback_days(self) -> int:
        """The rollback window in days (the default when the manifest does not say)."""
        return DEFAULT_ROLLBACK_WINDOW_DAYS if self.rollback_window_days is None else self.rollback_window_days

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
            parents=tuple(
                typed(p, int, f"{where}.parents[{i}]")
                for i, p in enumerate(typed(raw["parents"], list, f"{where}.parents"))
            ),
            mode=typed(raw["mode"], str, f"{where}.mode"),
            distance=typed(raw["distance"], str, f"{where}.distance"),
            normalize=typed(raw["normalize"], bool, f"{where}.normalize"),
            embedding_dim=typed(raw["embedding_dim"], int, f"{where}.embedding_dim"),
            side_info_dim=typed(raw["side_info_dim"], int, f"{where}.side_info_dim"),
            artifacts=tuple(
                Artifact.from_json(a, f"{where}.artifacts[{i}]")
                for i, a in enumerate(typed(raw["artifacts"], list, f"{where}.artifacts"))
            ),
            gate=typed(raw["gate"], dict, f"{where}.gate"),
            created_at=typed(raw["created_at"], str, f"{where}.created_at"),
            kit_version=typed(raw["kit_version"], str, f"{where}.kit_version"),
            publisher_key_id=typed(raw["publisher_key_id"], str, f"{where}.publisher_key_id"),
            compatible_prefix_dim=(
                typed(optional["compatible_prefix_dim"], int, f"{where}.compatible_prefix_dim")
                if "compatible_prefix_dim" in optional
                else None
            ),
            transition=TransitionPolicy.from_json(optional["transition"], f"{where}.transition")
            if "transition" in optional
            else None,
            hubness=HubnessPolicy.from_json(optional["hubness"], f"{where}.hubness") if "hubness" in optional else None,
            parity=typed(optional["parity"], dict, f"{where}.parity") if "parity" in optional else None,
            preprocessing=(
                Preprocessing.from_json(optional["preprocessing"], f"{where}.preprocessing")
                if "preprocessing" in optional
                else None
            ),
            rollback_window_days=(
                typed(optional["rollback_window_days"], int, f"{where}.rollback_window_days")
                if "rollback_window_days" in optional
                else None
            ),
            health_expectation=(
                HealthExpectation.from_json(optional["health_expectation"], f"{where}.health_expectation")
                if "health_expectation" in optional
                else None
            ),
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
            a
            for a in self.artifacts
            if a.role == role
            and (source_version is None or a.source_version == source_version)
            and (target_version is None or a.target_version == target_version)
        ]
        if len(matches) == 1:
            return matches[0]
        wanted = (
            f"{role!r}"
            + (f" from v{source_version}" if source_version is not None else "")
            + (f" to v{target_version}" if target_version is not None else "")
        )
        if not matches:
            have = ", ".join(a.name for a in self.artifacts)
            raise BundleFormatError(f"bundle v{self.version} has no {wanted} artifact (it has: {have})")
        raise BundleFormatError(
            f"bundle v{self.version} has several {wanted} artifacts ({', '.join(a.name for a in matches)}): "
            "pass source_version= or target_version= to choose one"
        )

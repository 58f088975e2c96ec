"""The timestamp: a short-lived statement, signed by the online timestamp role, naming the
snapshot on offer: every release version with the SHA-256 and length of its manifest. A device
checks it on each sync (freeze, replay) and checks each manifest it downloads against it
(mix-and-match)."""

from __future__ import annotations

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, ClassVar

from fctkit.errors import BundleFormatError, TrustFormatError

from ..bundle_vocabulary import MAX_MANIFEST_BYTES
from ..strict_json import exact_keys, typed
from .trust_format import MAX_TIMESTAMP_BYTES, Signed, format_time, load_signed, parse_sha256_hex, parse_time

MAX_RELEASES = 1000
"""Releases one timestamp may name, and the most versions ListVersions may bring a client in one answer."""


@dataclass(frozen=True)
class ReleaseEntry:
    """One version on offer and the manifest it must have."""

    version: int
    manifest_sha256: str
    manifest_length: int

    def to_dict(self) -> dict[str, Any]:
        return {
            "version": self.version,
            "manifest_sha256": self.manifest_sha256,
            "manifest_length": self.manifest_length,
        }


@dataclass(frozen=True)
class Timestamp:
    """The ``signed`` part of ``timestamp.json``."""

    KIND: ClassVar[str] = "timestamp"
    MAX_BYTES: ClassVar[int] = MAX_TIMESTAMP_BYTES

    version: int
    expires: datetime
    releases: tuple[ReleaseEntry, ...]

    def __post_init__(self) -> None:
        if self.version < 1:
            raise TrustFormatError(f"timestamp version {self.version}: versions start at 1")
        versions = [entry.version for entry in self.releases]
        if versions != sorted(set(versions)):
            raise TrustFormatError("timestamp releases must be listed once each, by increasing version")
        if len(versions) > MAX_RELEASES:
            raise TrustFormatError(f"timestamp lists {len(versions)} releases, more than the {MAX_RELEASES} allowed")

    def entry(self, version: int) -> ReleaseEntry | None:
        return next((entry for entry in self.releases if entry.version == version), None)

    def signed_dict(self) -> dict[str, Any]:
        return {
            "_type": self.KIND,
            "version": self.version,
            "expires": format_time(self.expires),
            "releases": [entry.to_dict() for entry in self.releases],
        }

    @classmethod
    def from_signed(cls, data: dict[str, Any], where: str) -> Timestamp:
        data = exact_keys(data, ("_type", "version", "expires", "releases"), where)
        releases = typed(data["releases"], list, f"{where}.releases")
        if len(releases) > MAX_RELEASES:
            raise BundleFormatError(f"{where}.releases: more than the {MAX_RELEASES} allowed")
        return cls(
            typed(data["version"], int, f"{where}.version"),
            parse_time(data["expires"], f"{where}.expires"),
            tuple(_parse_entry(item, f"{where}.releases[{i}]") for i, item in enumerate(releases)),
        )


def make_timestamp(version: int, expires: datetime, manifests: Mapping[int, bytes]) -> Timestamp:
    """The timestamp naming these releases' manifests (release version → canonical manifest bytes)."""
    return Timestamp(version, expires, tuple(release_entry(v, data) for v, data in sorted(manifests.items())))


def release_entry(version: int, manifest: bytes) -> ReleaseEntry:
    """What a timestamp says of one release: its version, manifest SHA-256 and length."""
    return ReleaseEntry(version, hashlib.sha256(manifest).hexdigest(), len(manifest))


def parse_timestamp(data: bytes, what: str = "timestamp.json") -> Signed[Timestamp]:
    """A signed timestamp from a file's bytes, size-limited before parsing (signatures not yet checked)."""
    return load_signed(data, Timestamp, what)


def _parse_entry(value: Any, where: str) -> ReleaseEntry:
    item = exact_keys(value, ("version", "manifest_sha256", "manifest_length"), where)
    version = typed(item["version"], int, f"{where}.version")
    length = typed(item["manifest_length"], int, f"{where}.manifest_length")
    if version < 1 or not 0 < length <= MAX_MANIFEST_BYTES:
        raise BundleFormatError(f"{where}: version ≥ 1 and a manifest length of 1..{MAX_MANIFEST_BYTES} bytes expected")
    return ReleaseEntry(version, parse_sha256_hex(item["manifest_sha256"], f"{where}.manifest_sha256"), length)

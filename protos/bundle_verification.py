"""Verifying a bundle directory as a device must before it loads anything from it.

:func:`verify_bundle` checks the signature under the pinned publisher key, that the version is
newer than the installed one (no replay, no rollback), that the directory holds only the signed
files, and every artifact's size and SHA-256; each failure raises its own
:class:`~fctkit.errors.BundleError` subclass with a message that names the file and what to do.
It returns a :class:`VerifiedBundle`, which re-checks each artifact's bytes as it reads them."""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from fctkit.errors import BundleFormatError, HashMismatchError, RollbackError, SignatureError

from .artifact_spec import Artifact
from .bundle_vocabulary import MANIFEST_FILE, MAX_MANIFEST_BYTES, SIGNATURE_FILE, SIGNATURE_SIZE, SIGNATURES_FILE
from .durable_files import read_regular_file, require_regular_file
from .manifest import Manifest
from .trust import MAX_SIGNATURES_BYTES, verify_release_manifest


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
        data = read_regular_file(self.root / artifact.file, artifact.size + 1)
        _check_artifact_bytes(artifact, len(data), hashlib.sha256(data).hexdigest())
        return data

    def _by_name(self, name: str) -> Artifact:
        for artifact in self.manifest.artifacts:
            if artifact.name == name:
                return artifact
        raise BundleFormatError(f"bundle v{self.manifest.version} has no artifact named {name!r}")


def verify_bundle(root: str | os.PathLike[str], trust: Any, *, installed_version: int | None = None) -> VerifiedBundle:
    """Verify a bundle directory: signatures under ``trust`` (a pinned publisher key, or a root
    whose publisher threshold must have signed: :func:`~fctkit.protos.trust.verify_release_manifest`),
    version monotonicity, no stray files, and every artifact's size and SHA-256. Returns the
    :class:`VerifiedBundle` or raises a :class:`~fctkit.errors.BundleError` subclass naming what failed."""
    root = Path(root)
    if not root.is_dir():
        raise BundleFormatError(
            f"{root} is not a bundle directory (a .tar archive: `fctkit device upgrade --bundle` takes "
            f"it as it is; `fctkit bundle verify` too)"
        )
    manifest_path, signature_path = root / MANIFEST_FILE, root / SIGNATURE_FILE
    if not manifest_path.exists():
        raise BundleFormatError(f"{root} has no {MANIFEST_FILE}: not a bundle, or an incomplete copy")
    if not signature_path.exists():
        raise SignatureError(f"{root} has no {SIGNATURE_FILE}: the bundle is unsigned; refuse it")
    manifest_bytes = read_regular_file(manifest_path, MAX_MANIFEST_BYTES)
    signature = read_regular_file(signature_path, SIGNATURE_SIZE + 1)
    co_signatures_path = root / SIGNATURES_FILE
    co_signatures = read_regular_file(co_signatures_path, MAX_SIGNATURES_BYTES) if co_signatures_path.exists() else None
    manifest = verify_release_manifest(manifest_bytes, signature, co_signatures, trust)
    check_version_is_newer(manifest.version, installed_version)
    expected = {MANIFEST_FILE, SIGNATURE_FILE, SIGNATURES_FILE} | {a.file for a in manifest.artifacts}
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
        require_regular_file(path)
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

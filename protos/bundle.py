"""The signed model bundle: one directory (or tar archive) per model version — the public face.

A bundle holds ONNX files and two fixed files: ``manifest.json`` (the canonical manifest
bytes, exactly what is signed) and ``manifest.sig`` (a raw 64-byte Ed25519 signature over
them). Devices pin the publisher's public key and call :func:`verify_bundle`, which refuses
a bundle whose signature, any artifact hash or size, internal consistency (roles, dims,
gate) or version monotonicity fails, each with its own error class and a message that
names the file and what to do.

This module re-exports the format's public names, so callers import them from here. Each
piece lives in its own module (lower ones never import higher ones):

- :mod:`~fctkit.protos.bundle_vocabulary` — file names, format version, roles, modes,
  distances, dtypes, size limits, default artifact names;
- :mod:`~fctkit.protos.artifact_spec` — :class:`TensorSpec` and :class:`Artifact`;
- :mod:`~fctkit.protos.manifest_rules` — the manifest's consistency rules and publishing gate;
- :mod:`~fctkit.protos.preprocessing_spec` — the manifest's preprocessing declarations (raw
  images and texts to graph inputs); :mod:`~fctkit.protos.preprocessing` applies them;
- :mod:`~fctkit.protos.manifest` — :class:`Manifest`, its canonical bytes and strict parsing;
- :mod:`~fctkit.protos.manifest_signature` — publisher keys, key ids, the manifest signature;
- :mod:`~fctkit.protos.durable_files` — bounded reads of regular files, SHA-256, fsync,
  atomically staged directories;
- :mod:`~fctkit.protos.bundle_verification` — :func:`verify_bundle`, :class:`VerifiedBundle`,
  the replay/rollback check;
- :mod:`~fctkit.protos.bundle_archive` — :func:`pack_bundle` and the safe :func:`unpack_bundle`.

The format only: stdlib + cryptography, no torch, no onnxruntime (applying a preprocessing
declaration needs numpy, and Pillow or ``tokenizers`` when first used).
"""

from __future__ import annotations

from .artifact_spec import Artifact, TensorSpec
from .bundle_archive import (
    DEFAULT_MAX_FILE_BYTES,
    DEFAULT_MAX_MEMBERS,
    DEFAULT_MAX_TOTAL_BYTES,
    pack_bundle,
    unpack_bundle,
)
from .bundle_verification import VerifiedBundle, check_version_is_newer, verify_bundle
from .bundle_vocabulary import (
    DISTANCES,
    DTYPES,
    FILE_ROLES,
    FORMAT_VERSION,
    GATED_ROLES,
    MANIFEST_FILE,
    MAX_MANIFEST_BYTES,
    MODES,
    PRECISIONS,
    ROLES,
    SIGNATURE_FILE,
    SIGNATURE_SIZE,
    TRANSFORM_ROLES,
    Distance,
    Mode,
    Role,
    artifact_name,
)
from .durable_files import file_sha256, fsync_dir, staged_directory
from .manifest import Manifest
from .manifest_rules import gate_failures, gated_artifacts
from .manifest_signature import load_public_key, public_key_id, verify_manifest

__all__ = [
    "DEFAULT_MAX_FILE_BYTES",
    "DEFAULT_MAX_MEMBERS",
    "DEFAULT_MAX_TOTAL_BYTES",
    "DISTANCES",
    "DTYPES",
    "FILE_ROLES",
    "FORMAT_VERSION",
    "GATED_ROLES",
    "MANIFEST_FILE",
    "MAX_MANIFEST_BYTES",
    "MODES",
    "PRECISIONS",
    "ROLES",
    "SIGNATURE_FILE",
    "SIGNATURE_SIZE",
    "TRANSFORM_ROLES",
    "Artifact",
    "Distance",
    "Manifest",
    "Mode",
    "Role",
    "TensorSpec",
    "VerifiedBundle",
    "artifact_name",
    "check_version_is_newer",
    "file_sha256",
    "fsync_dir",
    "gate_failures",
    "gated_artifacts",
    "load_public_key",
    "pack_bundle",
    "public_key_id",
    "staged_directory",
    "unpack_bundle",
    "verify_bundle",
    "verify_manifest",
]

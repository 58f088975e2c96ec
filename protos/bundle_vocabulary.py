"""The bundle format's fixed vocabulary: its two signed file names, the format version, the
artifact roles (graphs and files), manifest modes and distances, tensor dtypes and precisions, the manifest's
size limit, the patterns of a plain file name and a SHA-256 hex digest, and default artifact
names. Every other bundle module builds on these."""

from __future__ import annotations

import re
from typing import Literal, get_args

MANIFEST_FILE = "manifest.json"
SIGNATURE_FILE = "manifest.sig"
#: Optional: more publishers' signatures over the same manifest bytes (fctkit.protos.trust).
SIGNATURES_FILE = "manifest.sigs.json"
FORMAT_VERSION = 1
SIGNATURE_SIZE = 64

Role = Literal[
    "embed", "side_info", "forward", "side_forward", "backward", "uncertainty", "query_map", "hubness", "tokenizer"
]
Mode = Literal["forward", "unified", "compatible"]
Distance = Literal["l2", "cosine"]
ROLES: tuple[str, ...] = get_args(Role)
MODES: tuple[str, ...] = get_args(Mode)
DISTANCES: tuple[str, ...] = get_args(Distance)
#: Roles that map one version's space to another's; they carry source/target versions.
TRANSFORM_ROLES = ("forward", "side_forward", "backward", "uncertainty")
#: Roles whose files are not ONNX graphs (no inputs, no outputs): a text model's ``tokenizer.json``,
#: hashed and signed like the graphs and named by the manifest's preprocessing section.
FILE_ROLES = ("tokenizer",)
#: Roles whose empirical compatibility criterion (ECC) gates publishing (and, in a "compatible"
#: bundle with parents, its embed graph: see gated_artifacts).
GATED_ROLES = ("forward", "backward")
DTYPES = ("float32", "float16", "float64", "int64", "int32", "int8", "uint8", "bool")
#: How a graph's weights are stored: float32, float16, or int8 (ONNX Runtime's dynamic quantisation).
PRECISIONS = ("fp32", "fp16", "int8")

MAX_MANIFEST_BYTES = 1 << 20

SAFE_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
HEX64 = re.compile(r"[0-9a-f]{64}")
RESERVED_FILES = (MANIFEST_FILE, SIGNATURE_FILE, SIGNATURES_FILE)


def artifact_name(role: str, source_version: int | None = None, target_version: int | None = None) -> str:
    """The default artifact name, e.g. ``embed`` or ``forward_1_to_3``; gate ECC entries use it."""
    if source_version is None and target_version is None:
        return role
    return f"{role}_{source_version}_to_{target_version}"

"""A release's signatures: the single ``manifest.sig`` every bundle has (by the publisher the
manifest names) plus ``manifest.sigs.json``, the co-signers' list ``{"signatures": [{keyid,
sig}]}`` over the same canonical manifest bytes. :func:`~.trust_rules.verify_release` counts them
against the root's publisher role."""

from __future__ import annotations

from pathlib import Path

from ..bundle_vocabulary import MANIFEST_FILE, MAX_MANIFEST_BYTES, SIGNATURE_FILE, SIGNATURE_SIZE, SIGNATURES_FILE
from ..durable_files import read_regular_file
from ..manifest import Manifest
from ..strict_json import canonical_json, exact_keys
from .trust_format import MAX_SIGNATURES_BYTES, Signature, parse_signatures, strict_parse, strictly


def parse_release_signatures(data: bytes, what: str = SIGNATURES_FILE) -> tuple[Signature, ...]:
    """The co-signers' list from ``manifest.sigs.json`` bytes, size-limited before parsing."""
    raw = strict_parse(data, MAX_SIGNATURES_BYTES, what)
    return strictly(
        what, lambda: parse_signatures(exact_keys(raw, ("signatures",), what)["signatures"], f"{what}.signatures")
    )


def release_signatures_bytes(signatures: tuple[Signature, ...]) -> bytes:
    return canonical_json({"signatures": [s.to_dict() for s in signatures]})


def read_release_signatures(bundle_root: Path) -> tuple[bytes, tuple[Signature, ...]]:
    """A bundle folder's manifest bytes and every signature it carries: ``manifest.sig``
    attributed to the manifest's publisher key id, then those of ``manifest.sigs.json``."""
    manifest_bytes = read_regular_file(bundle_root / MANIFEST_FILE, MAX_MANIFEST_BYTES)
    publisher = Manifest.from_bytes(manifest_bytes).publisher_key_id
    signatures: tuple[Signature, ...] = ()
    if (bundle_root / SIGNATURE_FILE).exists():
        sig = read_regular_file(bundle_root / SIGNATURE_FILE, SIGNATURE_SIZE + 1)
        signatures = (Signature(publisher, sig),)
    if (bundle_root / SIGNATURES_FILE).exists():
        path = bundle_root / SIGNATURES_FILE
        extra = strictly(str(path), lambda: read_regular_file(path, MAX_SIGNATURES_BYTES))
        signatures += parse_release_signatures(extra, str(path))
    return manifest_bytes, signatures

"""What a release must be signed by on a device or server: either one pinned publisher key (a
device or server without a root, as before roots existed) or a root, whose publisher role needs a
threshold of distinct keys over the manifest bytes (``manifest.sig`` and ``manifest.sigs.json``)."""

from __future__ import annotations

from typing import TypeAlias

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from fctkit.errors import SignatureError

from ..bundle_vocabulary import SIGNATURE_FILE, SIGNATURE_SIZE
from ..manifest import Manifest
from ..manifest_signature import verify_manifest
from .release_signatures import parse_release_signatures
from .root_metadata import Root
from .trust_format import Signature, Signed
from .trust_rules import verify_release

ReleaseTrust: TypeAlias = Ed25519PublicKey | Signed[Root]
"""A pinned publisher key (legacy) or a root of trust."""


def verify_release_manifest(
    manifest_bytes: bytes, signature: bytes, co_signatures: bytes | None, trust: ReleaseTrust
) -> Manifest:
    """The manifest, once its signatures satisfy ``trust``: under a root, ``manifest.sig`` plus the
    co-signatures must come from a threshold of its publisher keys (a key the root no longer
    lists counts for nothing); under a single key, ``manifest.sig`` must verify under it."""
    if not isinstance(trust, Signed):
        return verify_manifest(manifest_bytes, signature, trust)
    if len(signature) != SIGNATURE_SIZE:
        raise SignatureError(
            f"{SIGNATURE_FILE} is {len(signature)} bytes, an Ed25519 signature is {SIGNATURE_SIZE}: "
            "the signature is truncated or corrupt; fetch the bundle again"
        )
    signatures = _attributed(trust.body, manifest_bytes, signature)
    if co_signatures:
        signatures += parse_release_signatures(co_signatures)
    verify_release(trust, manifest_bytes, signatures)
    return Manifest.from_bytes(manifest_bytes)


def _attributed(root: Root, manifest_bytes: bytes, signature: bytes) -> tuple[Signature, ...]:
    """``manifest.sig`` under the publisher key it verifies with (none: it counts for nothing)."""
    for keyid in root.role("publisher").keyids:
        try:
            root.keys[keyid].verify(signature, manifest_bytes)
        except InvalidSignature:
            continue
        return (Signature(keyid, signature),)
    return ()

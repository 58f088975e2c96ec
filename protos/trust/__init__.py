"""Trust metadata for fctkit: a root of trust with threshold-signed
roles, its rotation through a chain of roots, a short-lived timestamp against freeze and
mix-and-match, and releases co-signed by k of n publishers.

Decision: the rules are written here, after the TUF specification simplified for one
repository, rather than taken from ``python-tuf``. python-tuf (6.0) would bring securesystemslib
and urllib3 to every device; its ``tuf.api.metadata`` models many repositories (targets,
delegations, a separate snapshot role, hashed bins) that fctkit does not need; and its client
(``ngclient``) owns the download loop, which here is fctkit's own gRPC client. The device install must stay numpy +
onnxruntime + grpcio + cryptography; these modules need only the standard library and
``cryptography`` (Ed25519), and reuse the bundle format's strict JSON. What is kept from TUF:
signed roles with thresholds (distinct keys, a key outside the role counts for nothing), a
chain of roots each exactly one version higher and signed by a threshold of the old AND the new
root keys (5.3.4), expiry checked only on the last root reached (5.3.10), the timestamp never
older than the last accepted (5.4.3), its version forgotten when the timestamp keys rotate
(fast-forward recovery, 5.3.11), and a size limit on every file checked before it is parsed.
Simplified: the snapshot is folded into the timestamp (it lists each release version with the
SHA-256 and length of its manifest), and a release's "targets" are the bundle's signed manifest.

Files: ``root.<N>.json`` and ``timestamp.json`` are ``{"signed": {...}, "signatures": [{"keyid",
"sig"}]}`` (canonical JSON; a key id is the SHA-256 of the raw Ed25519 public key, hex; each
signature covers the canonical bytes of ``signed``); a bundle's co-signatures are
``manifest.sigs.json``, ``{"signatures": [...]}`` over the manifest bytes ``manifest.sig`` signs.

What the next layer calls:

- the device: at ``device init --root`` / ``enrol``, :func:`pin_root` (the root file and the
  ``--root-fingerprint``); on each sync :func:`walk_root_chain` over the roots after its own,
  then :func:`timestamp_version_floor` on its remembered timestamp version, :func:`parse_timestamp`
  and :func:`verify_timestamp`, :func:`verify_snapshot_manifest` for each manifest it downloads,
  and :func:`verify_release` (with :func:`read_release_signatures` for a bundle folder) before it
  installs; :func:`freshness` for ``device status`` and the fleet report ("stale: possible freeze").
  Migration of a device pinning ``publisher.pub``: :func:`verify_migration` on root v1 (signed by
  that key as well as by its own root keys), then the walk. Bundles are checked with
  :func:`verify_release_manifest` under a :data:`ReleaseTrust` (the root, or the legacy key).
- the server: :func:`parse_root` to check the chain it serves, :func:`make_timestamp` over the
  manifests on offer and ``Signed(timestamp).signed_by(online_key)`` to sign it.
- the offline tools (``fctkit keys …``, :mod:`fctkit.export.keys`): :class:`Root`,
  :meth:`Signed.signed_by`, :func:`root_fingerprint`, :func:`verify_root_update`.
"""

from __future__ import annotations

from .release_signatures import parse_release_signatures, read_release_signatures, release_signatures_bytes
from .release_trust import ReleaseTrust, verify_release_manifest
from .root_metadata import DEFAULT_FRESHNESS_LIMIT_S, ROLE_NAMES, RoleKeys, Root, parse_root, root_fingerprint
from .timestamp_metadata import MAX_RELEASES, ReleaseEntry, Timestamp, make_timestamp, parse_timestamp, release_entry
from .trust_format import (
    MAX_ROOT_BYTES,
    MAX_SIGNATURES_BYTES,
    MAX_TIMESTAMP_BYTES,
    Signature,
    Signed,
    format_time,
    sign_bytes,
)
from .trust_rules import (
    DEFAULT_CLOCK_TOLERANCE_S,
    MAX_ROOT_CHAIN,
    Freshness,
    RootWalk,
    check_not_expired,
    freshness,
    pin_root,
    timestamp_keys_changed,
    timestamp_version_floor,
    verify_migration,
    verify_release,
    verify_root_update,
    verify_self_signed,
    verify_snapshot_manifest,
    verify_timestamp,
    walk_root_chain,
)
from .withdrawal import MAX_WITHDRAWAL_BYTES, Withdrawal, parse_withdrawal, verify_withdrawal

__all__ = [
    "DEFAULT_CLOCK_TOLERANCE_S",
    "DEFAULT_FRESHNESS_LIMIT_S",
    "MAX_RELEASES",
    "MAX_ROOT_BYTES",
    "MAX_ROOT_CHAIN",
    "MAX_SIGNATURES_BYTES",
    "MAX_TIMESTAMP_BYTES",
    "MAX_WITHDRAWAL_BYTES",
    "ROLE_NAMES",
    "Freshness",
    "ReleaseEntry",
    "ReleaseTrust",
    "RoleKeys",
    "Root",
    "RootWalk",
    "Signature",
    "Signed",
    "Timestamp",
    "Withdrawal",
    "check_not_expired",
    "format_time",
    "freshness",
    "make_timestamp",
    "parse_release_signatures",
    "parse_root",
    "parse_timestamp",
    "parse_withdrawal",
    "pin_root",
    "read_release_signatures",
    "release_entry",
    "release_signatures_bytes",
    "root_fingerprint",
    "sign_bytes",
    "timestamp_keys_changed",
    "timestamp_version_floor",
    "verify_migration",
    "verify_release",
    "verify_release_manifest",
    "verify_root_update",
    "verify_self_signed",
    "verify_snapshot_manifest",
    "verify_timestamp",
    "verify_withdrawal",
    "walk_root_chain",
]

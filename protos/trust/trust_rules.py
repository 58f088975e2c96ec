"""The rules, after the TUF specification simplified for one repository: pure functions over
parsed metadata, each raising its own :class:`~fctkit.errors.TrustError` subclass."""

from __future__ import annotations

import hashlib
from collections.abc import Iterable
from dataclasses import dataclass
from datetime import datetime, timedelta

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from fctkit.errors import (
    ExpiredMetadataError,
    MetadataRollbackError,
    ReleaseSignatureError,
    RootChainError,
    SnapshotMismatchError,
)

from ..manifest_signature import public_key_id
from .root_metadata import Root, parse_root, root_fingerprint
from .timestamp_metadata import Timestamp
from .trust_format import Signature, Signed, format_time, require_threshold, require_utc

DEFAULT_CLOCK_TOLERANCE_S = 300
"""How far past its expiry a root or timestamp is still accepted, for device clocks a little off."""
MAX_ROOT_CHAIN = 1000
"""Roots one walk accepts at once, and the most GetTrust may bring a client in one answer (endless data)."""


@dataclass(frozen=True)
class RootWalk:
    """Where a chain walk ended, and whether the timestamp keys changed on the way (then the
    device forgets its remembered timestamp version: TUF 5.3.11, fast-forward recovery)."""

    root: Signed[Root]
    timestamp_keys_rotated: bool


@dataclass(frozen=True)
class Freshness:
    """How long since the device last accepted a fresh timestamp, against the root's limit."""

    age_s: float
    limit_s: int

    @property
    def stale(self) -> bool:
        return self.age_s > self.limit_s

    def describe(self) -> str:
        if self.stale:
            return (
                f"stale: possible freeze (no fresh timestamp for {self.age_s / 3600:.1f} h, the root allows "
                f"{self.limit_s / 3600:.1f} h); sync with the server, or check that it is reachable and honest"
            )
        return f"fresh (timestamp accepted {self.age_s / 3600:.1f} h ago, limit {self.limit_s / 3600:.1f} h)"


def verify_self_signed(root: Signed[Root], what: str = "the root") -> Signed[Root]:
    """A threshold of the root's own root keys signed it."""
    role = root.body.role("root")
    require_threshold(
        root.signed_bytes,
        root.signatures,
        root.body.keys,
        role.keyids,
        role.threshold,
        f"{what} v{root.body.version} (its own root keys)",
    )
    return root


def pin_root(data: bytes, fingerprint: str | None, *, trust_on_first_use: bool = False) -> Signed[Root]:
    """The root a device starts from: it must match the fingerprint it was given (unless trust on
    first use was chosen explicitly) and be signed by a threshold of its own root keys."""
    root = parse_root(data)
    if fingerprint is None and not trust_on_first_use:
        raise RootChainError(
            "no root fingerprint given: pass --root-fingerprint (printed by `fctkit keys init-root`), "
            "or --trust-on-first-use to accept whatever root is offered"
        )
    if fingerprint is not None and root_fingerprint(root) != fingerprint.lower():
        raise RootChainError(
            f"the root offered has fingerprint {root_fingerprint(root)[:16]}…, not the "
            f"{fingerprint[:16]}… this device was given: refused (a wrong or forged root)"
        )
    return verify_self_signed(root)


def verify_migration(publisher_key: Ed25519PublicKey, first: Signed[Root]) -> Signed[Root]:
    """The first root a device that pinned one publisher key (``publisher.pub``) moves to: root
    v1, self-signed, listing that key in its publisher role, and signed by that key too (the
    key stands for the implicit root before v1, so only its holder can move the device)."""
    keyid = public_key_id(publisher_key)
    version = first.body.version
    if version != 1:
        raise RootChainError(f"a device pinning one publisher key moves to root v1 first, not v{version}")
    if keyid not in first.body.role("publisher").keyids:
        raise RootChainError(
            f"root v1 does not list this device's publisher key {keyid[:16]}… as a publisher: "
            "refused (a root of another publisher)"
        )
    require_threshold(
        first.signed_bytes,
        first.signatures,
        {keyid: publisher_key},
        (keyid,),
        1,
        f"root v1 (the publisher key {keyid[:16]}… this device pinned; the publisher signs it with "
        "`fctkit keys sign root.1.json --key publisher.key`)",
    )
    return verify_self_signed(first)


def verify_root_update(trusted: Signed[Root], new: Signed[Root]) -> Signed[Root]:
    """``new`` follows ``trusted``: exactly one version higher, signed by a threshold of the
    trusted root's root keys AND a threshold of its own. Expiry is not checked here."""
    old_version, version = trusted.body.version, new.body.version
    if version != old_version + 1:
        what = "skips a version" if version > old_version + 1 else "is not newer"
        raise RootChainError(
            f"root v{version} {what} after the trusted v{old_version}: roots are accepted one "
            f"version at a time; fetch root v{old_version + 1} first"
        )
    old_role = trusted.body.role("root")
    require_threshold(
        new.signed_bytes,
        new.signatures,
        trusted.body.keys,
        old_role.keyids,
        old_role.threshold,
        f"root v{version} (the root keys of the trusted v{old_version})",
    )
    return verify_self_signed(new, "root")


def walk_root_chain(
    trusted: Signed[Root], chain: Iterable[bytes], now: datetime, clock_tolerance_s: int = DEFAULT_CLOCK_TOLERANCE_S
) -> RootWalk:
    """Each root file after ``trusted``, in order, through :func:`verify_root_update`; only the
    last one reached must not have expired (as TUF does)."""
    current, rotated = trusted, False
    for count, data in enumerate(chain):
        if count >= MAX_ROOT_CHAIN:
            raise RootChainError(f"more than {MAX_ROOT_CHAIN} roots offered at once: refused (endless data)")
        new = verify_root_update(current, parse_root(data, f"root.{current.body.version + 1}.json"))
        rotated = rotated or timestamp_keys_changed(current.body, new.body)
        current = new
    check_not_expired(current.body.expires, now, clock_tolerance_s, f"root v{current.body.version}")
    return RootWalk(current, rotated)


def timestamp_keys_changed(old: Root, new: Root) -> bool:
    before, after = old.role("timestamp"), new.role("timestamp")
    return set(before.keyids) != set(after.keyids) or before.threshold != after.threshold


def timestamp_version_floor(walk: RootWalk, last_accepted_version: int) -> int:
    """The timestamp version a device must not go below after a walk: 0 once the timestamp keys
    rotated (the old key may have signed a huge version: fast-forward recovery), else its last."""
    return 0 if walk.timestamp_keys_rotated else last_accepted_version


def check_not_expired(expires: datetime, now: datetime, clock_tolerance_s: int, what: str) -> None:
    now = require_utc(now)
    if now > expires + timedelta(seconds=clock_tolerance_s):
        raise ExpiredMetadataError(
            f"{what} expired at {format_time(expires)}; this device's clock reads {format_time(now)} (tolerance "
            f"{clock_tolerance_s} s). If the clock is right, the server serves stale metadata (possible freeze): "
            "sync again later or report it; if the clock is wrong, set it"
        )


def verify_timestamp(
    root: Signed[Root],
    timestamp: Signed[Timestamp],
    last_accepted_version: int,
    now: datetime,
    clock_tolerance_s: int = DEFAULT_CLOCK_TOLERANCE_S,
) -> Signed[Timestamp]:
    """A threshold of the root's timestamp keys signed it, it is not older than the last one
    accepted (replay, rollback), and it has not expired."""
    role = root.body.role("timestamp")
    require_threshold(
        timestamp.signed_bytes,
        timestamp.signatures,
        root.body.keys,
        role.keyids,
        role.threshold,
        f"timestamp v{timestamp.body.version} (the timestamp keys of root v{root.body.version})",
    )
    if timestamp.body.version < last_accepted_version:
        raise MetadataRollbackError(
            f"timestamp v{timestamp.body.version} is older than the v{last_accepted_version} this device already "
            "accepted: a replayed or rolled-back timestamp; refused (the server or a mirror is not serving the latest)"
        )
    check_not_expired(timestamp.body.expires, now, clock_tolerance_s, f"timestamp v{timestamp.body.version}")
    return timestamp


def freshness(root: Root, last_fresh_at: datetime, now: datetime) -> Freshness:
    """How fresh the device is: stale once ``now - last_fresh_at`` exceeds the root's limit."""
    return Freshness((require_utc(now) - require_utc(last_fresh_at)).total_seconds(), root.freshness_limit_s)


def verify_snapshot_manifest(timestamp: Timestamp, version: int, manifest_bytes: bytes) -> None:
    """The manifest downloaded for ``version`` is the one the timestamp names (mix-and-match)."""
    entry = timestamp.entry(version)
    if entry is None:
        raise SnapshotMismatchError(
            f"v{version} is not in the snapshot timestamp v{timestamp.version} names: "
            "refused (a release the server does not currently offer)"
        )
    if (
        len(manifest_bytes) != entry.manifest_length
        or hashlib.sha256(manifest_bytes).hexdigest() != entry.manifest_sha256
    ):
        raise SnapshotMismatchError(
            f"the manifest of v{version} ({len(manifest_bytes)} bytes) is not the one timestamp v{timestamp.version} "
            f"names ({entry.manifest_length} bytes, SHA-256 {entry.manifest_sha256[:16]}…): metadata from different "
            "snapshots mixed together; refused, sync again"
        )


def verify_release(root: Signed[Root], manifest_bytes: bytes, signatures: Iterable[Signature]) -> frozenset[str]:
    """The distinct publisher keys of ``root`` whose signatures over the manifest verify, at
    least the publisher threshold of them; a key the root no longer lists does not count."""
    role = root.body.role("publisher")
    return require_threshold(
        manifest_bytes,
        signatures,
        root.body.keys,
        role.keyids,
        role.threshold,
        f"the release (publisher role of root v{root.body.version})",
        ReleaseSignatureError,
    )

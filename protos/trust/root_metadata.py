"""The root: the keys of each role (root, publisher, timestamp), a threshold per role, an expiry,
and how long a device may go without a fresh timestamp. A root file ``root.<N>.json`` is a
:class:`~.trust_format.Signed` root."""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, ClassVar

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

from fctkit.errors import BundleFormatError, TrustFormatError

from ..manifest_signature import public_key_id
from ..strict_json import exact_keys, typed
from .trust_format import MAX_ROOT_BYTES, Signed, format_time, load_signed, parse_sha256_hex, parse_time

ROLE_NAMES = ("root", "publisher", "timestamp")
DEFAULT_FRESHNESS_LIMIT_S = 7 * 24 * 3600
MIN_FRESHNESS_LIMIT_S = 60
MAX_KEYS = 64
_PUBLIC_HEX = re.compile(r"[0-9a-f]{64}")


@dataclass(frozen=True)
class RoleKeys:
    """The key ids allowed to sign for a role, and how many of them must."""

    keyids: tuple[str, ...]
    threshold: int

    def __post_init__(self) -> None:
        object.__setattr__(self, "keyids", tuple(sorted(self.keyids)))  # one order: equal roles compare equal

    def to_dict(self) -> dict[str, Any]:
        return {"keyids": list(self.keyids), "threshold": self.threshold}


@dataclass(frozen=True)
class Root:
    """One version of the root of trust (the ``signed`` part of ``root.<N>.json``)."""

    KIND: ClassVar[str] = "root"
    MAX_BYTES: ClassVar[int] = MAX_ROOT_BYTES

    version: int
    expires: datetime
    keys: dict[str, Ed25519PublicKey] = field(compare=False)
    roles: dict[str, RoleKeys]
    freshness_limit_s: int = DEFAULT_FRESHNESS_LIMIT_S

    def __post_init__(self) -> None:
        _check_root(self)

    def role(self, name: str) -> RoleKeys:
        return self.roles[name]

    def signed_dict(self) -> dict[str, Any]:
        return {
            "_type": self.KIND,
            "version": self.version,
            "expires": format_time(self.expires),
            "keys": {
                keyid: {"keytype": "ed25519", "public": _raw(key).hex()} for keyid, key in sorted(self.keys.items())
            },
            "roles": {name: self.roles[name].to_dict() for name in ROLE_NAMES},
            "freshness_limit_s": self.freshness_limit_s,
        }

    @classmethod
    def from_signed(cls, data: dict[str, Any], where: str) -> Root:
        data = exact_keys(data, ("_type", "version", "expires", "keys", "roles", "freshness_limit_s"), where)
        keys = typed(data["keys"], dict, f"{where}.keys")
        if len(keys) > MAX_KEYS:
            raise BundleFormatError(f"{where}.keys: {len(keys)} keys, more than the {MAX_KEYS} allowed")
        roles = exact_keys(data["roles"], ROLE_NAMES, f"{where}.roles")
        return cls(
            version=typed(data["version"], int, f"{where}.version"),
            expires=parse_time(data["expires"], f"{where}.expires"),
            keys={parse_sha256_hex(k, f"{where}.keys"): _parse_key(v, f"{where}.keys.{k}") for k, v in keys.items()},
            roles={name: _parse_role(roles[name], f"{where}.roles.{name}") for name in ROLE_NAMES},
            freshness_limit_s=typed(data["freshness_limit_s"], int, f"{where}.freshness_limit_s"),
        )


def root_fingerprint(root: Signed[Root] | Root) -> str:
    """SHA-256 (hex) of the root's canonical signed bytes: what devices are given with
    ``--root-fingerprint``; adding a signature does not change it."""
    body = root.body if isinstance(root, Signed) else root
    return hashlib.sha256(Signed(body).signed_bytes).hexdigest()


def parse_root(data: bytes, what: str = "root.json") -> Signed[Root]:
    """A signed root from a file's bytes, size-limited before parsing (signatures not yet checked)."""
    return load_signed(data, Root, what)


def _raw(key: Ed25519PublicKey) -> bytes:
    return key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def _parse_key(value: Any, where: str) -> Ed25519PublicKey:
    item = exact_keys(value, ("keytype", "public"), where)
    if item["keytype"] != "ed25519":
        raise BundleFormatError(f"{where}.keytype: only 'ed25519' keys are supported, got {item['keytype']!r:.30}")
    public = typed(item["public"], str, f"{where}.public")
    if not _PUBLIC_HEX.fullmatch(public):
        raise BundleFormatError(f"{where}.public: expected the raw 32-byte key as 64 lowercase hex digits")
    return Ed25519PublicKey.from_public_bytes(bytes.fromhex(public))


def _parse_role(value: Any, where: str) -> RoleKeys:
    item = exact_keys(value, ("keyids", "threshold"), where)
    keyids = typed(item["keyids"], list, f"{where}.keyids")
    return RoleKeys(
        tuple(parse_sha256_hex(k, f"{where}.keyids") for k in keyids),
        typed(item["threshold"], int, f"{where}.threshold"),
    )


def _check_root(root: Root) -> None:
    if root.version < 1:
        raise TrustFormatError(f"root version {root.version}: versions start at 1")
    if root.freshness_limit_s < MIN_FRESHNESS_LIMIT_S:
        raise TrustFormatError(f"freshness_limit_s {root.freshness_limit_s}: at least {MIN_FRESHNESS_LIMIT_S} s")
    for keyid, key in root.keys.items():
        if public_key_id(key) != keyid:
            raise TrustFormatError(f"key {keyid[:16]}… is listed under an id that is not the SHA-256 of its public key")
    if set(root.roles) != set(ROLE_NAMES):
        raise TrustFormatError(f"a root has exactly the roles {', '.join(ROLE_NAMES)}")
    for name, role in root.roles.items():
        _check_role(root, name, role)
    unused = set(root.keys) - {k for role in root.roles.values() for k in role.keyids}
    if unused:
        raise TrustFormatError(f"keys no role uses: {', '.join(k[:16] + '…' for k in sorted(unused))}; drop them")


def _check_role(root: Root, name: str, role: RoleKeys) -> None:
    if len(set(role.keyids)) != len(role.keyids):
        raise TrustFormatError(f"role {name} lists a key id twice")
    unknown = [k for k in role.keyids if k not in root.keys]
    if unknown:
        raise TrustFormatError(f"role {name} names key {unknown[0][:16]}…, which the root's keys do not hold")
    if role.threshold < 1:
        raise TrustFormatError(f"role {name}: threshold {role.threshold}, at least 1")
    if name == "root" and role.threshold > len(role.keyids):
        raise TrustFormatError(
            f"role root: threshold {role.threshold} with only {len(role.keyids)} key(s) can never be met"
        )

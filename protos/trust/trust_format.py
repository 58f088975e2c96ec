"""What every trust file shares: size limits checked before parsing, strict JSON (no duplicate
keys, no unknown keys), the ``{"signed": …, "signatures": […]}`` envelope whose canonical
``signed`` bytes are what each key signs, Ed25519 signatures by key id, threshold counting, and
UTC times."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import UTC, datetime
from typing import Any, ClassVar, Generic, Protocol, Self, TypeVar

from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from fctkit.errors import BundleFormatError, ThresholdError, TrustFormatError

from ..manifest_signature import public_key_id
from ..strict_json import canonical_json, exact_keys, typed

MAX_ROOT_BYTES = 64 << 10
MAX_TIMESTAMP_BYTES = 256 << 10
MAX_SIGNATURES_BYTES = 64 << 10
MAX_SIGNATURES = 32
"""Signatures in one file: far above any real threshold, so a list cannot grow without end."""

_HEX64 = re.compile(r"[0-9a-f]{64}")
_SIG_HEX = re.compile(r"[0-9a-f]{128}")
_TIME = re.compile(r"\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}Z")


@dataclass(frozen=True)
class Signature:
    """One Ed25519 signature and the id (SHA-256 of the raw public key, hex) of its key."""

    keyid: str
    sig: bytes

    def to_dict(self) -> dict[str, str]:
        return {"keyid": self.keyid, "sig": self.sig.hex()}


def sign_bytes(data: bytes, private_key: Ed25519PrivateKey) -> Signature:
    return Signature(public_key_id(private_key.public_key()), private_key.sign(data))


def strict_parse(data: bytes, limit: int, what: str) -> Any:
    """JSON from at most ``limit`` bytes (checked before parsing); duplicate keys refused."""
    if len(data) > limit:
        raise TrustFormatError(
            f"{what} is {len(data)} bytes, more than the {limit} allowed: refused unread "
            "(endless data); fetch it again from a trusted source"
        )
    try:
        return json.loads(data.decode("utf-8"), object_pairs_hook=_no_duplicates, parse_constant=_no_constant)
    except (UnicodeDecodeError, ValueError, RecursionError) as exc:
        raise TrustFormatError(f"{what} is not valid JSON: {exc}") from exc


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [key for key, _ in pairs]
    if len(set(keys)) != len(keys):
        raise ValueError(f"a key appears twice in one object: {sorted(k for k in keys if keys.count(k) > 1)[0]!r}")
    return dict(pairs)


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


_Parsed = TypeVar("_Parsed")


def strictly(what: str, parse: Callable[[], _Parsed]) -> _Parsed:
    """Run a parser built on :mod:`~fctkit.protos.strict_json`, its errors reported as this file's."""
    try:
        return parse()
    except (BundleFormatError, TrustFormatError) as exc:
        raise TrustFormatError(f"{what}: {exc}") from exc


def parse_signatures(value: Any, where: str) -> tuple[Signature, ...]:
    items = typed(value, list, where)
    if len(items) > MAX_SIGNATURES:
        raise BundleFormatError(f"{where}: {len(items)} signatures, more than the {MAX_SIGNATURES} allowed")
    return tuple(_parse_signature(item, f"{where}[{i}]") for i, item in enumerate(items))


def _parse_signature(value: Any, where: str) -> Signature:
    item = exact_keys(value, ("keyid", "sig"), where)
    keyid, sig = parse_sha256_hex(item["keyid"], f"{where}.keyid"), typed(item["sig"], str, f"{where}.sig")
    if not _SIG_HEX.fullmatch(sig):
        raise BundleFormatError(f"{where}.sig: expected an Ed25519 signature as 128 lowercase hex digits")
    return Signature(keyid, bytes.fromhex(sig))


def parse_sha256_hex(value: Any, where: str) -> str:
    """A SHA-256 as 64 lowercase hex digits: a key id, or a manifest's digest."""
    if not isinstance(value, str) or not _HEX64.fullmatch(value):
        raise BundleFormatError(f"{where}: expected a SHA-256 as 64 lowercase hex digits, got {value!r:.80}")
    return value


def parse_time(value: Any, where: str) -> datetime:
    text = typed(value, str, where)
    if not _TIME.fullmatch(text):
        raise BundleFormatError(f"{where}: expected a UTC time like 2027-01-31T12:00:00Z, got {text!r:.40}")
    try:
        return datetime.strptime(text, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=UTC)
    except ValueError as exc:
        raise BundleFormatError(f"{where}: {text} is not a real date and time ({exc})") from exc


def format_time(moment: datetime) -> str:
    return require_utc(moment).strftime("%Y-%m-%dT%H:%M:%SZ")


def require_utc(moment: datetime) -> datetime:
    if moment.tzinfo is None:
        raise TypeError("trust times must be timezone-aware (datetime.now(UTC)), not naive")
    return moment.astimezone(UTC).replace(microsecond=0)


def valid_signers(
    data: bytes, signatures: Iterable[Signature], keys: Mapping[str, Ed25519PublicKey], allowed: Iterable[str]
) -> frozenset[str]:
    """The distinct allowed key ids whose signature over ``data`` verifies; a key outside
    ``allowed`` or a second signature by one key adds nothing."""
    allowed_ids, signers = set(allowed), set()
    for signature in signatures:
        key = keys.get(signature.keyid)
        if signature.keyid in signers or signature.keyid not in allowed_ids or key is None:
            continue
        try:
            key.verify(signature.sig, data)
        except InvalidSignature:
            continue
        signers.add(signature.keyid)
    return frozenset(signers)


def require_threshold(
    data: bytes,
    signatures: Iterable[Signature],
    keys: Mapping[str, Ed25519PublicKey],
    role_keyids: tuple[str, ...],
    threshold: int,
    what: str,
    error: type[ThresholdError] = ThresholdError,
) -> frozenset[str]:
    """The signers, or ``error`` saying how many valid signatures there were and how many are needed."""
    signatures = tuple(signatures)
    signers = valid_signers(data, signatures, keys, role_keyids)
    if len(signers) >= threshold:
        return signers
    outside = sorted({s.keyid for s in signatures} - set(role_keyids))
    note = (
        f"; signatures by keys outside the role do not count ({', '.join(k[:12] + '…' for k in outside)})"
        if outside
        else ""
    )
    raise error(
        f"{what} has {len(signers)} valid signature(s) of the {threshold} needed from its "
        f"{len(role_keyids)} key(s){note}: have more key holders sign it (`fctkit keys sign`)"
    )


class Body(Protocol):
    """What a signed document holds: its kind and size limit, and its canonical ``signed`` part."""

    KIND: ClassVar[str]
    MAX_BYTES: ClassVar[int]

    def signed_dict(self) -> dict[str, Any]: ...

    @classmethod
    def from_signed(cls, data: dict[str, Any], where: str) -> Self: ...


B = TypeVar("B", bound=Body)


@dataclass(frozen=True)
class Signed(Generic[B]):
    """A document and the signatures over its canonical bytes (:attr:`signed_bytes`)."""

    body: B
    signatures: tuple[Signature, ...] = ()

    @property
    def signed_bytes(self) -> bytes:
        return canonical_json(self.body.signed_dict())

    def to_bytes(self) -> bytes:
        return canonical_json({"signed": self.body.signed_dict(), "signatures": [s.to_dict() for s in self.signatures]})

    def signed_by(self, private_key: Ed25519PrivateKey) -> Signed[B]:
        """A copy with this key's signature added (replacing an earlier one by the same key)."""
        signature = sign_bytes(self.signed_bytes, private_key)
        kept = tuple(s for s in self.signatures if s.keyid != signature.keyid)
        if len(kept) >= MAX_SIGNATURES:
            raise TrustFormatError(f"a {self.body.KIND} file holds at most {MAX_SIGNATURES} signatures")
        return replace(self, signatures=(*kept, signature))


def load_signed(data: bytes, body_type: type[B], what: str) -> Signed[B]:
    """Parse a signed document of ``body_type``: size first, then the envelope, the kind, the
    body's strict rules, and that the body serialises back to exactly what was signed."""
    raw = strict_parse(data, body_type.MAX_BYTES, what)

    def parse() -> Signed[B]:
        envelope = exact_keys(raw, ("signed", "signatures"), what)
        signed = typed(envelope["signed"], dict, f"{what}.signed")
        if signed.get("_type") != body_type.KIND:
            raise BundleFormatError(f"{what} is a {signed.get('_type')!r:.30} document, not a {body_type.KIND!r} one")
        body = body_type.from_signed(signed, f"{what}.signed")
        if canonical_json(body.signed_dict()) != canonical_json(signed):
            raise BundleFormatError(f"{what}.signed is not in its canonical form (key ids out of order?)")
        return Signed(body, parse_signatures(envelope["signatures"], f"{what}.signatures"))

    return strictly(what, parse)

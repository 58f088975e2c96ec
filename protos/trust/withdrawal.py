"""A withdrawal: the publishers' signed statement that a release must no longer be
used, and which version devices that installed it go back to. It is signed like a release —
by a threshold of the root's publisher keys (or by the one key of a device from before roots) —
so a server on its own cannot make devices go back: that would be a downgrade attack.
``withdrawal.<V>.json`` is a :class:`~.trust_format.Signed` withdrawal; :func:`write_withdrawal`
writes one signed by a first publisher key (`fctkit keys withdraw` and `fctkit admin withdraw`)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any, ClassVar

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

from fctkit.errors import TrustError, TrustFormatError

from ..durable_files import write_atomic
from ..manifest_signature import public_key_id
from ..strict_json import exact_keys, typed
from .root_metadata import Root
from .trust_format import Signed, format_time, load_signed, parse_time, require_threshold

MAX_WITHDRAWAL_BYTES = 16 << 10
MAX_REASON_CHARS = 1024


@dataclass(frozen=True)
class Withdrawal:
    """The ``signed`` part of ``withdrawal.<V>.json``: ``version`` is withdrawn; devices on it go
    back to ``revert_to`` (an earlier version, 0: none, e.g. a first release withdrawn)."""

    KIND: ClassVar[str] = "withdrawal"
    MAX_BYTES: ClassVar[int] = MAX_WITHDRAWAL_BYTES

    version: int
    revert_to: int
    reason: str
    withdrawn_at: datetime

    def __post_init__(self) -> None:
        if self.version < 1:
            raise TrustFormatError(f"withdrawal of version {self.version}: versions start at 1")
        if not 0 <= self.revert_to < self.version:
            raise TrustFormatError(
                f"a withdrawal of v{self.version} reverts to an earlier version, not v{self.revert_to}"
            )
        if not self.reason.strip() or len(self.reason) > MAX_REASON_CHARS:
            raise TrustFormatError(
                f"a withdrawal needs a reason of 1..{MAX_REASON_CHARS} characters (it is shown to "
                "operators and devices)"
            )

    def signed_dict(self) -> dict[str, Any]:
        return {
            "_type": self.KIND,
            "version": self.version,
            "revert_to": self.revert_to,
            "reason": self.reason,
            "withdrawn_at": format_time(self.withdrawn_at),
        }

    @classmethod
    def from_signed(cls, data: dict[str, Any], where: str) -> Withdrawal:
        data = exact_keys(data, ("_type", "version", "revert_to", "reason", "withdrawn_at"), where)
        return cls(
            typed(data["version"], int, f"{where}.version"),
            typed(data["revert_to"], int, f"{where}.revert_to"),
            typed(data["reason"], str, f"{where}.reason"),
            parse_time(data["withdrawn_at"], f"{where}.withdrawn_at"),
        )


def parse_withdrawal(data: bytes, what: str = "withdrawal.json") -> Signed[Withdrawal]:
    """A signed withdrawal from a file's bytes, size-limited before parsing (signatures not yet checked)."""
    return load_signed(data, Withdrawal, what)


def verify_withdrawal(trust: Signed[Root] | Ed25519PublicKey, withdrawal: Signed[Withdrawal]) -> Signed[Withdrawal]:
    """Signed by a threshold of the root's publisher keys, or by the one pinned publisher key."""
    what = f"the withdrawal of v{withdrawal.body.version}"
    if isinstance(trust, Signed):
        role = trust.body.role("publisher")
        require_threshold(
            withdrawal.signed_bytes,
            withdrawal.signatures,
            trust.body.keys,
            role.keyids,
            role.threshold,
            f"{what} (publisher role of root v{trust.body.version})",
        )
    else:
        keyid = public_key_id(trust)
        require_threshold(
            withdrawal.signed_bytes,
            withdrawal.signatures,
            {keyid: trust},
            (keyid,),
            1,
            f"{what} (the pinned publisher key)",
        )
    return withdrawal


def withdrawal_file_name(version: int) -> str:
    return f"withdrawal.{version}.json"


def write_withdrawal(
    path: str | os.PathLike[str],
    version: int,
    revert_to: int,
    reason: str,
    private_key: Ed25519PrivateKey,
    now: datetime | None = None,
) -> Signed[Withdrawal]:
    """Write ``withdrawal.<version>.json`` signed by this publisher key (others co-sign it with
    `fctkit keys sign`); an existing file is never replaced."""
    path = Path(path)
    if path.exists():
        raise TrustError(f"{path} already exists: co-sign it with `fctkit keys sign {path} --key KEY`")
    moment = (now or datetime.now(UTC)).replace(microsecond=0)
    signed = Signed(Withdrawal(version, revert_to, reason, moment)).signed_by(private_key)
    write_atomic(path, signed.to_bytes())
    return signed

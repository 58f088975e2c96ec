"""Field checks shared by the services: each failure is an INVALID_ARGUMENT naming the field
and the limit (see ``protos/proto-src/fctkit/v1/common.proto``)."""

from __future__ import annotations

import re
from collections.abc import Sequence
from datetime import UTC, datetime, timedelta

from fctkit.errors import RpcStatusError
from fctkit.protos import limits

_SHA256 = re.compile(r"[0-9a-f]{64}")


def invalid(message: str) -> RpcStatusError:
    return RpcStatusError("INVALID_ARGUMENT", message)


def sha256_field(value: str, field: str) -> str:
    if not _SHA256.fullmatch(value):
        raise invalid(f"{field} must be a SHA-256 digest: 64 lowercase hex characters")
    return value


QUOTED_CHARS = 64  # what an error message quotes of a request string at most: details travel in size-limited metadata


def quoted(value: str, max_chars: int = QUOTED_CHARS) -> str:
    """``value`` quoted for an error message, cut to ``max_chars`` characters (its length said)."""
    if len(value) <= max_chars:
        return repr(value)
    return f"{value[:max_chars]!r}... ({len(value)} characters)"


def text_field(value: str, field: str, max_chars: int = limits.MAX_NAME_CHARS) -> str:
    if len(value) > max_chars:
        raise invalid(f"{field} has {len(value)} characters; at most {max_chars}")
    if any(ord(c) < 32 and c not in "\t\n" for c in value):
        raise invalid(f"{field} contains control characters")
    return value


_CONTROL = re.compile("[\x00-\x08\x0b-\x1f]")


def text_fields(values: Sequence[str], field: str, max_chars: int = limits.MAX_NAME_CHARS) -> tuple[str, ...]:
    """:func:`text_field` of each of ``values`` (``field[k]`` named), checked in bulk."""
    if any(len(v) > max_chars for v in values) or _CONTROL.search("\t".join(values)):
        for k, value in enumerate(values):
            text_field(value, f"{field}[{k}]", max_chars)
    return tuple(values)


def version_field(value: int, field: str) -> int:
    if value <= 0:
        raise invalid(f"{field} must be a positive version number")
    return value


def counter_field(value: int, field: str) -> int:
    if value > limits.MAX_UINT63:
        raise invalid(f"{field} is larger than 2**63 - 1")
    return value


def page_size(requested: int, maximum: int) -> int:
    if requested > maximum:
        raise invalid(f"page_size is {requested}; at most {maximum} (0 for the default)")
    return requested or maximum


def chunk_size(requested: int) -> int:
    if requested > limits.MAX_CHUNK_BYTES:
        raise invalid(f"chunk_size is {requested}; at most {limits.MAX_CHUNK_BYTES} (0 for the default)")
    return requested or limits.MAX_CHUNK_BYTES


def utc_now() -> datetime:
    return datetime.now(UTC)


def timestamp(moment: datetime | None = None, *, after_s: float = 0.0) -> str:
    """RFC 3339 UTC with microseconds; equal-length strings, so they sort by time."""
    moment = (moment or utc_now()) + timedelta(seconds=after_s)
    return moment.strftime("%Y-%m-%dT%H:%M:%S.%fZ")

"""Strict JSON for signed formats: canonical bytes, exact keys, exact types (stdlib only).

A signed manifest must parse to exactly one value and serialise back to exactly the signed
bytes, so every reader refuses unknown or missing keys, booleans posing as integers, NaN and
non-canonical spacing, each with the JSON path of what failed."""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from typing import Any

from fctkit.errors import BundleFormatError

from .bundle_vocabulary import MANIFEST_FILE


def canonical_json(value: Any) -> bytes:
    try:
        return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False).encode(
            "ascii"
        )
    except (TypeError, ValueError) as exc:
        raise BundleFormatError(f"the manifest holds a value JSON cannot represent exactly: {exc}") from exc


def reject_constant(name: str) -> Any:
    raise BundleFormatError(f"{MANIFEST_FILE} holds {name}, which is not valid JSON")


def exact_keys(data: Any, keys: Sequence[str], where: str) -> dict:
    if not isinstance(data, dict):
        raise BundleFormatError(f"{where}: expected an object, got {type(data).__name__}")
    missing, unknown = sorted(set(keys) - set(data)), sorted(set(data) - set(keys))
    if missing or unknown:
        raise BundleFormatError(
            f"{where}: "
            + "; ".join(
                part
                for part in (
                    f"missing key(s) {', '.join(missing)}" if missing else "",
                    f"unknown key(s) {', '.join(unknown)}" if unknown else "",
                )
                if part
            )
        )
    return data


def typed(value: Any, kind: type, where: str) -> Any:
    ok = isinstance(value, kind) and not (kind is int and isinstance(value, bool))
    if not ok:
        raise BundleFormatError(f"{where}: expected {kind.__name__}, got {type(value).__name__} {value!r:.60}")
    return value


def optional_int(value: Any, where: str) -> int | None:
    return None if value is None else typed(value, int, where)


def is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: Any) -> bool:
    return (is_int(value) or isinstance(value, float)) and math.isfinite(value)


def number(value: Any, where: str) -> float:
    """``value`` as a float when it is a finite JSON number (not a bool); BundleFormatError otherwise."""
    if not is_number(value):
        raise BundleFormatError(f"{where}: expected a finite number, got {value!r:.60}")
    return float(value)

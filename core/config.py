"""Strict configs: dataclasses built from mappings (TOML files, CLI) where unknown keys are errors."""

from __future__ import annotations

import dataclasses
import tomllib
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

from fctkit.errors import ConfigError

T = TypeVar("T")


def from_mapping(cls: type[T], data: typing.Mapping[str, Any], where: str = "") -> T:
    """Build dataclass ``cls`` from ``data``; nested dataclasses are built recursively.

    Unknown keys raise :class:`ConfigError` naming the key and the allowed ones, so a typo
    never silently falls back to a default.
    """
    if not dataclasses.is_dataclass(cls):
        raise TypeError(f"{cls!r} is not a dataclass")
    if not isinstance(data, typing.Mapping):
        raise ConfigError(f"{where or cls.__name__}: expected a table, got {type(data).__name__}")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    unknown = sorted(set(data) - set(fields))
    if unknown:
        raise ConfigError(
            f"{where or cls.__name__}: unknown key(s) {', '.join(map(repr, unknown))}; "
            f"allowed: {', '.join(sorted(fields))}"
        )
    hints = typing.get_type_hints(cls)
    kwargs = {
        name: _coerce(hints[name], _over_default(fields[name], value), f"{where}.{name}" if where else name)
        for name, value in data.items()
    }
    try:
        return cls(**kwargs)
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"{where or cls.__name__}: {exc}") from exc


def _over_default(field: dataclasses.Field, value: Any) -> Any:
    """A partial table for a nested config applies on top of that field's *own* default (a
    method's tuned training settings, say), not on top of the nested class's bare defaults."""
    if field.default_factory is dataclasses.MISSING or not isinstance(value, typing.Mapping):
        return value
    default = field.default_factory()
    if not dataclasses.is_dataclass(default):
        return value
    return _merged({f.name: getattr(default, f.name) for f in dataclasses.fields(default) if f.init}, value)


def _merged(base: dict[str, Any], update: typing.Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in update.items():
        current = merged.get(key)
        if dataclasses.is_dataclass(current) and isinstance(value, typing.Mapping):
            value = _merged({f.name: getattr(current, f.name) for f in dataclasses.fields(current) if f.init}, value)
        merged[key] = value
    return merged


def _coerce(hint: Any, value: Any, where: str) -> Any:
    origin = typing.get_origin(hint)
    if isinstance(hint, type) and dataclasses.is_dataclass(hint):
        return value if isinstance(value, hint) else from_mapping(hint, value, where)
    if origin is typing.Literal:
        allowed = typing.get_args(hint)
        if value not in allowed:
            raise ConfigError(f"{where}: {value!r} is not one of {', '.join(map(repr, allowed))}")
        return value
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(hint) if a is not type(None)]
        if value is None:
            return None
        if len(args) == 1:
            return _coerce(args[0], value, where)
        return value
    if origin in (tuple, list) and isinstance(value, (list, tuple)):
        item_types = typing.get_args(hint)
        inner = item_types[0] if item_types else Any
        items = [_coerce(inner, v, f"{where}[{i}]") for i, v in enumerate(value)]
        return tuple(items) if origin is tuple else items
    if hint is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if hint in (int, float, str, bool) and not isinstance(value, hint):
        raise ConfigError(f"{where}: expected {hint.__name__}, got {value!r}")
    if isinstance(hint, type) and issubclass(hint, Path):
        return Path(value)
    return value


def read_setting_file(path: str | Path, what: str) -> bytes:
    """The bytes of a file a setting names (a key, a certificate); a :class:`ConfigError` naming
    ``what`` and the path when it cannot be read."""
    try:
        return Path(path).read_bytes()
    except OSError as exc:
        raise ConfigError(f"cannot read the {what} {path}: {exc.strerror}") from exc


def load_toml(path: str | Path) -> dict[str, Any]:
    path = Path(path)
    try:
        with path.open("rb") as fh:
            return tomllib.load(fh)
    except FileNotFoundError as exc:
        raise ConfigError(f"config file not found: {path}") from exc
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"{path}: not valid TOML: {exc}") from exc


def load_config(cls: type[T], path: str | Path | None = None, overrides: typing.Mapping[str, Any] | None = None) -> T:
    """A ``cls`` config from a TOML file (unknown keys are errors; no file: the defaults) with
    dotted-key overrides applied on top, e.g. ``{"data.max_items": 2000}``."""
    data = load_toml(path) if path is not None else {}
    for dotted, value in (overrides or {}).items():
        node = data
        *parents, leaf = dotted.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return from_mapping(cls, data)


def to_mapping(obj: Any) -> dict[str, Any]:
    """The inverse of :func:`from_mapping`, JSON/TOML friendly (paths become strings)."""

    def convert(value: Any) -> Any:
        if isinstance(value, Path):
            return str(value)
        if isinstance(value, (list, tuple)):
            return [convert(v) for v in value]
        if isinstance(value, dict):
            return {k: convert(v) for k, v in value.items()}
        return value

    return convert(dataclasses.asdict(obj))

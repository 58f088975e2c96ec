from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Literal

import pytest

from fctkit.config import from_mapping, load_config, load_toml, to_mapping
from fctkit.errors import ConfigError, FctkitError


@dataclasses.dataclass
class Inner:
    width: int = 8
    rate: float = 0.1


@dataclasses.dataclass
class Outer:
    name: str = "x"
    mode: Literal["forward", "unified"] = "forward"
    inner: Inner = dataclasses.field(default_factory=Inner)
    dims: tuple[int, ...] = (1, 2)
    out: Path | None = None


def test_builds_nested_and_coerces():
    cfg = from_mapping(Outer, {"inner": {"rate": 1}, "dims": [3, 4], "out": "a/b"})
    assert cfg.inner.rate == 1.0 and isinstance(cfg.inner.rate, float)
    assert cfg.dims == (3, 4)
    assert cfg.out == Path("a/b")
    assert from_mapping(Outer, to_mapping(cfg)) == cfg


def test_unknown_key_names_the_key_and_the_allowed_ones():
    with pytest.raises(ConfigError, match=r"inner: unknown key\(s\) 'widht'.*allowed: rate, width"):
        from_mapping(Outer, {"inner": {"widht": 3}})


@pytest.mark.parametrize(
    "data, message",
    [
        ({"mode": "sideways"}, "not one of"),
        ({"name": 3}, "expected str"),
        ({"inner": {"width": "wide"}}, "expected int"),
        ({"inner": 5}, "expected a table"),
    ],
)
def test_wrong_values_are_config_errors(data, message):
    with pytest.raises(ConfigError, match=message):
        from_mapping(Outer, data)


def test_config_error_is_a_kit_error(tmp_path):
    bad = tmp_path / "bad.toml"
    bad.write_text("a = [")
    with pytest.raises(FctkitError, match="not valid TOML"):
        load_toml(bad)
    with pytest.raises(ConfigError, match="not found"):
        load_toml(tmp_path / "missing.toml")


def test_load_config_applies_dotted_overrides_on_the_file(tmp_path):
    path = tmp_path / "run.toml"
    path.write_text('name = "file"\n[inner]\nwidth = 4\n')
    cfg = load_config(Outer, path, {"inner.rate": 0.5, "mode": "unified"})
    assert (cfg.name, cfg.mode, cfg.inner.width, cfg.inner.rate) == ("file", "unified", 4, 0.5)
    assert load_config(Outer) == Outer()
    with pytest.raises(ConfigError, match="unknown key"):
        load_config(Outer, path, {"inner.widht": 3})

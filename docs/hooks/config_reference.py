"""MkDocs hook: tables of keys generated from the kit's dataclasses at build time, so that the
configuration and format references cannot fall behind the code.

- ``<!-- config: fctkit.trainer.pipeline_config.PipelineConfig -->`` becomes a run config's keys:
  the top-level keys, then one table per section (``[data]``, ``[fct]``, ...) with nested sections
  flattened to dotted keys (``train.epochs``), each key with its type, its default *in that
  section* and its meaning. Sections of one type (``[old_backbone]``, ``[new_backbone]``) share a
  table with a default column each.
- ``<!-- fields: fctkit.protos.manifest.Manifest -->`` becomes one table of a format's keys (a
  JSON object's), with ``required`` where a key has no default.

A key's meaning is the comment beside or above its field in the code; ``field_meanings.toml``
(next to this file) gives it where the code has none or says it in the code's terms (and, rarely,
how to show a default). A field with
neither, or a meaning for a field that does not exist, is a warning, and ``mkdocs build --strict``
fails on it.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import importlib
import inspect
import io
import logging
import re
import textwrap
import tokenize
import tomllib
import types
import typing
from pathlib import Path
from typing import Any

log = logging.getLogger("mkdocs.plugins.fctkit_tables")

MARKER = re.compile(r"^<!-- (?P<kind>config|fields): (?P<path>fctkit(?:\.\w+)+) -->[ \t]*$", re.MULTILINE)
MEANINGS_FILE = Path(__file__).with_name("field_meanings.toml")
ROLE = re.compile(r":[a-z]+:`~?\.?([^`]+)`")


class Tables:
    """One build's state: the meanings, which of them were used, the classes seen, what was warned."""

    def __init__(self) -> None:
        self.meanings: dict[str, str] = tomllib.loads(MEANINGS_FILE.read_text())
        self.used: set[str] = set()
        self.classes: dict[str, type] = {}
        self.warned: set[str] = set()

    def warn(self, key: str, message: str, *args: Any) -> None:
        if key not in self.warned:
            self.warned.add(key)
            log.warning(message, *args)


_BUILD: Tables | None = None


def on_pre_build(config: Any) -> None:
    global _BUILD
    _BUILD = Tables()


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if _BUILD is None or ("<!-- config: " not in markdown and "<!-- fields: " not in markdown):
        return markdown

    def expand(match: re.Match[str]) -> str:
        cls = _load(match.group("path"))
        if match.group("kind") == "config":
            return config_markdown(cls, _BUILD, page.file.src_uri)
        return "\n".join(fields_table(cls, _BUILD, page.file.src_uri))

    return MARKER.sub(expand, markdown)


def on_post_build(config: Any) -> None:
    """Every meaning names a field of a class some page showed (after all pages: one page shows
    the configs, another the formats)."""
    if _BUILD is None:
        return
    for key in sorted(set(_BUILD.meanings) - _BUILD.used):
        cls_name, _, field = key.partition(".")
        cls = _BUILD.classes.get(cls_name)
        if cls is None or (field and field not in {f.name for f in dataclasses.fields(cls)}):
            log.warning(
                "%s gives a meaning for %r, which no table shows (no such class or field)", MEANINGS_FILE.name, key
            )


def _load(path: str) -> type:
    module, _, name = path.rpartition(".")
    return getattr(importlib.import_module(module), name)


# --- a field's meaning from the code -------------------------------------------------------------


@functools.cache
def code_comments(cls: type) -> dict[str, str]:
    """Field name -> the comment lines just above its definition (``#`` or ``#:``) and the
    comment beside it."""
    source = textwrap.dedent(inspect.getsource(cls))
    lines = source.splitlines()
    comments: dict[int, str] = {}
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            comments[token.start[0]] = token.string.lstrip("#:").strip()
    found = {}
    for node in ast.parse(source).body[0].body:  # the class body
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above, line = [], node.lineno - 1
        while line >= 1 and lines[line - 1].strip().startswith("#"):
            above.insert(0, comments[line])
            line -= 1
        beside = [comments[n] for n in range(node.lineno, (node.end_lineno or node.lineno) + 1) if n in comments]
        text = " ".join(above + beside).strip()
        if text:
            found[node.target.id] = text
    return found


def _entry(tables: Tables, key: str) -> dict[str, str] | None:
    """``field_meanings.toml``'s entry: a string (the meaning) or a table with ``meaning`` and,
    where the code's default reads badly (``0.00392…`` for 1/255), ``default``."""
    entry = tables.meanings.get(key)
    if entry is None:
        return None
    tables.used.add(key)
    return {"meaning": entry} if isinstance(entry, str) else entry


def shown_default(cls: type, name: str, value: Any, tables: Tables) -> str:
    for klass in cls.__mro__:
        entry = _entry(tables, f"{klass.__name__}.{name}")
        if entry is not None:
            return entry.get("default") or ("required" if value is dataclasses.MISSING else value_text(value))
    return "required" if value is dataclasses.MISSING else value_text(value)


def meaning(cls: type, name: str, tables: Tables, where: str) -> str:
    for klass in cls.__mro__:  # a subclass's field may be documented on its base
        entry = _entry(tables, f"{klass.__name__}.{name}")
        if entry is not None:
            text = entry["meaning"]
            break
        if dataclasses.is_dataclass(klass) and name in code_comments(klass):
            text = code_comments(klass)[name]
            break
    else:
        tables.warn(
            f"{cls.__name__}.{name}",
            "%s: %s.%s has no meaning: comment the field in the code or add %s.%s to %s",
            where,
            cls.__name__,
            name,
            cls.__name__,
            name,
            MEANINGS_FILE.name,
        )
        return ""
    return ROLE.sub(r"`\1`", text).replace("|", "\\|")


def intro(cls: type, tables: Tables) -> str:
    """What a table is: ``field_meanings.toml``'s ``Class`` entry, else the first paragraph of the
    class docstring (a dataclass without one has none)."""
    tables.classes[cls.__name__] = cls
    entry = _entry(tables, cls.__name__)
    if entry is not None:
        return entry["meaning"]
    doc = cls.__doc__ or ""
    if doc.startswith(f"{cls.__name__}("):  # the signature dataclasses write when there is no docstring
        return ""
    return ROLE.sub(r"`\1`", inspect.cleandoc(doc).split("\n\n")[0].replace("\n", " "))


# --- types and values as a TOML or JSON file writes them ------------------------------------------


def type_name(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is typing.Literal:
        return " \\| ".join(f'`"{a}"`' if isinstance(a, str) else f"`{a}`" for a in args)
    if origin in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        text = " or ".join(type_name(a) for a in rest)
        return f"{text} or null" if len(rest) < len(args) else text
    if origin in (tuple, list):
        if args and dataclasses.is_dataclass(args[0]):
            return "list of objects"
        return f"list of {type_name(args[0]) if args else 'values'}"
    if dataclasses.is_dataclass(hint):
        return "object"
    if origin is dict or hint is dict:
        return "object"
    names = {int: "integer", float: "number", str: "string", bool: "boolean"}
    return names.get(hint, getattr(hint, "__name__", str(hint)))


def value_text(value: Any) -> str:
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return "`true`" if value else "`false`"
    if isinstance(value, str):
        return f'`"{value}"`'
    if isinstance(value, (list, tuple)):
        return "`[" + ", ".join(value_text(v).strip("`") for v in value) + "]`"
    if isinstance(value, float) and len(repr(value)) > 10:
        return f"`{value:.6g}`"
    return f"`{value!r}`"


def _default(field: dataclasses.Field) -> Any:
    if field.default is not dataclasses.MISSING:
        return field.default
    if field.default_factory is not dataclasses.MISSING:
        return field.default_factory()
    return dataclasses.MISSING


# --- the tables ----------------------------------------------------------------------------------


def flattened(cls: type, default: Any, tables: Tables, prefix: str = "") -> list[tuple[str, type, str, Any]]:
    """(dotted key, owning class, field name, default) of every leaf field below ``cls``."""
    hints = typing.get_type_hints(cls)
    tables.classes[cls.__name__] = cls
    rows = []
    for field in dataclasses.fields(cls):
        if not field.init:
            continue
        value = getattr(default, field.name)
        if dataclasses.is_dataclass(hints[field.name]):
            rows += flattened(type(value), value, tables, f"{prefix}{field.name}.")
        else:
            rows.append((f"{prefix}{field.name}", cls, field.name, value))
    return rows


def section_table(sections: list[str], cls: type, defaults: list[Any], tables: Tables, where: str) -> list[str]:
    by_section = [
        {key: (owner, name, value) for key, owner, name, value in flattened(cls, d, tables)} for d in defaults
    ]
    keys = list(by_section[0])
    differ = len(sections) > 1 and any(len({repr(s[k][2]) for s in by_section}) > 1 for k in keys)
    heads = [f"default in `{s}`" for s in sections] if differ else ["default"]
    out = ["| key | type | " + " | ".join(heads) + " | meaning |", "|---|---|" + "---|" * len(heads) + "---|"]
    for key in keys:
        owner, name, _ = by_section[0][key]
        values = [shown_default(owner, name, s[key][2], tables) for s in by_section]
        out.append(
            f"| `{key}` | {type_name(typing.get_type_hints(owner)[name])} | "
            + " | ".join(values if differ else values[:1])
            + f" | {meaning(owner, name, tables, where)} |"
        )
    return out


def config_markdown(root: type, tables: Tables, where: str) -> str:
    """A run config: its top-level keys, then a table per section."""
    default = root()
    hints = typing.get_type_hints(root)
    tables.classes[root.__name__] = root
    out = ["| key | type | default | meaning |", "|---|---|---|---|"]
    groups: dict[type, list[str]] = {}
    for field in dataclasses.fields(root):
        if not field.init:
            continue
        if dataclasses.is_dataclass(hints[field.name]):
            groups.setdefault(type(getattr(default, field.name)), []).append(field.name)
        else:
            value = shown_default(root, field.name, getattr(default, field.name), tables)
            out.append(
                f"| `{field.name}` | {type_name(hints[field.name])} | {value} | "
                f"{meaning(root, field.name, tables, where)} |"
            )
    for cls, sections in groups.items():
        out += ["", "### " + ", ".join(f"`[{s}]`" for s in sections), ""]
        text = intro(cls, tables)
        out += [text, ""] if text else []
        out += section_table(sections, cls, [getattr(default, s) for s in sections], tables, where)
    return "\n".join(out)


def fields_table(cls: type, tables: Tables, where: str) -> list[str]:
    """One table of a format's keys, in the order the code declares them."""
    hints = typing.get_type_hints(cls)
    text = intro(cls, tables)
    out = [text, ""] if text else []
    out += ["| key | type | default | meaning |", "|---|---|---|---|"]
    for field in dataclasses.fields(cls):
        shown = shown_default(cls, field.name, _default(field), tables)
        out.append(
            f"| `{field.name}` | {type_name(hints[field.name])} | {shown} | {meaning(cls, field.name, tables, where)} |"
        )
    return out

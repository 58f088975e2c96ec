"""Where each name of the kit's public API is defined: the module of ``package.name``.

The strict type check (:mod:`tests.support.typecheck`) checks every module that defines an
exported name, and the docs' API reference (``docs/hooks/api_reference.py``) renders each name from
that module; both ask :func:`defining_module`. The answer follows the source's imports (not object
identity, which equal interned strings in two modules would confuse).
"""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

from tests.support.package_view import package_dirs


def module_file(module: str) -> Path:
    """The checkout's file of a module of the kit ("fctkit.edge_runtime.device" -> edge_runtime/device.py)."""
    dirs = package_dirs()
    if module in dirs:
        return dirs[module] / "__init__.py"
    package, _, name = module.rpartition(".")
    return dirs[package] / f"{name}.py"


def _top_level_sources(module: str) -> tuple[set[str], dict[str, str]]:
    """A module's own top-level names, and the module each name it imports comes from (an
    ``from X import name``, or a lazy table ``{"name": "submodule"}`` of a package's ``__getattr__``)."""
    tree = ast.parse(module_file(module).read_text())
    package = module if module in package_dirs() else module.rpartition(".")[0]
    defined: set[str] = set()
    imported: dict[str, str] = {}
    for node in tree.body:
        if isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            source = ".".join(part for part in (base, node.module or "") if part)
            for alias in node.names:
                imported[alias.asname or alias.name] = source
        elif isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            defined.add(node.name)
        elif isinstance(node, (ast.Assign, ast.AnnAssign)):
            targets = node.targets if isinstance(node, ast.Assign) else [node.target]
            defined.update(t.id for t in targets if isinstance(t, ast.Name))
            if isinstance(node.value, ast.Dict) and all(
                isinstance(x, ast.Constant) and isinstance(x.value, str) for x in [*node.value.keys, *node.value.values]
            ):
                for key, value in zip(node.value.keys, node.value.values):
                    imported[key.value] = f"{package}.{value.value}"  # type: ignore[union-attr]  # checked above
    return defined, imported


def _source_of(module: str, name: str) -> str:
    defined, imported = _top_level_sources(module)
    if name in imported and imported[name].startswith("fctkit"):
        return _source_of(imported[name], name)
    if name in defined or name.startswith("__"):
        return module
    value = getattr(importlib.import_module(module), name)  # offered by a module __getattr__ (classes and functions)
    return _source_of(value.__module__, name)


def defining_module(package: str, name: str) -> str:
    """The dotted path of the module of the kit whose top level defines ``name`` as ``package``
    offers it (an exported module: that module itself)."""
    value = getattr(importlib.import_module(package), name)
    return value.__name__ if inspect.ismodule(value) else _source_of(package, name)

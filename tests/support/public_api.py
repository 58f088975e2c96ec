"""Where each name of the kit's public API is defined: the module of ``package.name``.

The strict type check (:mod:`tests.support.typecheck`) checks every module that defines an
exported name, and the docs' API reference (``docs/hooks/api_reference.py``) renders each name from
that module; both ask :func:`defining_module`.
"""

from __future__ import annotations

import ast
import importlib
import inspect
import sys
from pathlib import Path


def _assigns(module: str, name: str) -> bool:
    """Whether ``module``'s own source assigns ``name`` at its top level."""
    path = getattr(sys.modules.get(module), "__file__", None)
    if not path or not path.endswith(".py"):
        return False
    for node in ast.parse(Path(path).read_text()).body:
        targets = (
            node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(node, ast.AnnAssign) else []
        )
        if isinstance(node, getattr(ast, "TypeAlias", ())):  # `type X = ...` (Python 3.12)
            targets = [node.name]
        if any(isinstance(t, ast.Name) and t.id == name for t in targets):
            return True
    return False


def defining_module(package: str, name: str) -> str:
    """The dotted path of the module that defines ``package.name`` (a module: itself)."""
    obj = getattr(importlib.import_module(package), name)
    if inspect.ismodule(obj):
        return obj.__name__
    module = getattr(obj, "__module__", "") or ""
    if (inspect.isclass(obj) or inspect.isroutine(obj)) and module.startswith("fctkit"):
        return module
    for candidate in [package, *sorted(m for m in list(sys.modules) if m.startswith("fctkit."))]:
        if vars(sys.modules[candidate]).get(name) is obj and _assigns(candidate, name):
            return candidate
    raise LookupError(f"{package}.{name}: cannot find the module that defines it")

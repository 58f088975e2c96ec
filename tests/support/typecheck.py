"""Type-check the kit with mypy: ``make lint`` runs it, or ``.venv/bin/python tests/support/typecheck.py``
(further arguments go to mypy).

pyproject's ``package-dir`` maps the kit's top-level folders onto one namespace (``fctkit`` is
``core/``, ``fctkit.trainer`` is ``trainer/``, ``fctkit.demo`` is ``core/demo/``, ...), and the
editable install finds them with an import hook that mypy cannot follow. So mypy checks a view of
the package made of symlinks, one per source file (and per generated ``.pyi`` stub), in the layout
Python sees, with the ``[tool.mypy]`` configuration of pyproject.toml; its messages name the
files of the checkout again. The cache stays in the checkout's ``.mypy_cache/``.
"""

from __future__ import annotations

import ast
import importlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the checkout's tests/ package
from tests.support.package_view import REPO, build_view, package_dirs, view_files

PACKAGE_FILES = ("*.py", "*.pyi", "py.typed")
# the parts whose public face (the package's __init__ and the modules defining what its __all__
# exports) mypy checks strictly; fctkit.demo is the demo command's, not an API
PUBLIC_PACKAGES = (
    "fctkit",
    "fctkit.trainer",
    "fctkit.export",
    "fctkit.edge_runtime",
    "fctkit.edge_runtime.gallery",
    "fctkit.protos",
    "fctkit.protos.trust",
    "fctkit.server",
    "fctkit.server.rollout",
)


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


def defining_module(module: str, name: str) -> str:
    """The module of the kit whose top level defines ``name`` as ``module`` offers it."""
    defined, imported = _top_level_sources(module)
    if name in imported and imported[name].startswith("fctkit"):
        return defining_module(imported[name], name)
    if name in defined or name.startswith("__"):
        return module
    value = getattr(importlib.import_module(module), name)  # offered by a module __getattr__ (classes and functions)
    return defining_module(value.__module__, name)


def public_api_modules() -> list[str]:
    """The public packages and every module defining a name their ``__all__`` exports."""
    modules = set(PUBLIC_PACKAGES)
    for package in PUBLIC_PACKAGES:
        for name in importlib.import_module(package).__all__:
            modules.add(defining_module(package, name))
    return sorted(modules)


def main(arguments: list[str]) -> int:
    if arguments == ["--public-api"]:
        print("\n".join(public_api_modules()))
        return 0
    with tempfile.TemporaryDirectory(prefix="fctkit-typecheck-") as folder:
        view = Path(folder)
        build_view(view, PACKAGE_FILES)
        files = view_files(PACKAGE_FILES)
        command = [
            *(sys.executable, "-m", "mypy"),
            *("--config-file", str(REPO / "pyproject.toml")),
            *("--cache-dir", str(REPO / ".mypy_cache")),
            *("--package", "fctkit"),
            *arguments,
        ]
        done = subprocess.run(
            command, cwd=view, env={**os.environ, "MYPYPATH": str(view)}, capture_output=True, text=True
        )
    in_view = re.compile(r"^(" + "|".join(re.escape(name) for name in sorted(files, key=len, reverse=True)) + r")\b")

    def checkout_path(match: re.Match[str]) -> str:
        return str(files[match.group(1)].relative_to(REPO))

    for stream, text in ((sys.stdout, done.stdout), (sys.stderr, done.stderr)):
        for line in text.splitlines():
            print(in_view.sub(checkout_path, line), file=stream)
    return done.returncode


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

"""The kit laid out as Python sees it, made of symlinks.

pyproject's ``package-dir`` maps the kit's top-level folders onto one namespace (``fctkit`` is
``core/``, ``fctkit.trainer`` is ``trainer/``, ``fctkit.demo`` is ``core/demo/``, ...). Tools that
walk a package on disk cannot follow that mapping: grimp (the architecture checks), mypy
(:mod:`tests.support.typecheck`) and griffe (the docs' API reference, ``docs/hooks/api_reference.py``).
Each is given this view instead: one symlink per source file, at ``fctkit/<part>/<module>.py``.
"""

from __future__ import annotations

import tomllib
from collections.abc import Sequence
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def package_dirs(repo: Path = REPO) -> dict[str, Path]:
    """Package name ("fctkit.edge_runtime") -> its folder in the checkout."""
    mapping = tomllib.loads((repo / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
    return {package: repo / folder for package, folder in mapping.items()}


def view_files(patterns: Sequence[str] = ("*.py",), repo: Path = REPO) -> dict[str, Path]:
    """File in the package ("fctkit/edge_runtime/device.py") -> the file in the checkout."""
    files = {}
    for package, folder in package_dirs(repo).items():
        for pattern in patterns:
            for path in sorted(folder.glob(pattern)):
                files["/".join([*package.split("."), path.name])] = path
    return files


def build_view(root: Path, patterns: Sequence[str] = ("*.py",), repo: Path = REPO) -> Path:
    """Lay the symlink view of the files matching ``patterns`` under ``root``; returns ``root``."""
    for name, path in view_files(patterns, repo).items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).symlink_to(path)
    return root

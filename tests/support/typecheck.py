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

import importlib
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run as a script: the checkout's tests/ package
from tests.support.package_view import REPO, build_view, view_files
from tests.support.public_api import defining_module

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

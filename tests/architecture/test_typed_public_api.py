"""The public API is type-checked strictly: every part's package (its ``__init__``) and every module
defining a name one of them exports in ``__all__`` is in the strict ``[[tool.mypy.overrides]]`` of
pyproject.toml (``make lint`` runs mypy with it). A new export from a module not in that list fails
here, with the list to write (``python tests/support/typecheck.py --public-api`` prints it)."""

from __future__ import annotations

import tomllib

from tests.support.package_view import REPO, package_dirs
from tests.support.typecheck import PUBLIC_PACKAGES, public_api_modules

STRICT_OPTIONS = ("disallow_untyped_defs", "disallow_incomplete_defs", "disallow_any_generics", "no_implicit_reexport")


def strict_modules() -> set[str]:
    overrides = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["mypy"]["overrides"]
    return {
        module
        for override in overrides
        if all(override.get(option) is True for option in STRICT_OPTIONS)
        for module in override["module"]
    }


def test_every_module_of_the_public_api_is_checked_strictly():
    missing = sorted(set(public_api_modules()) - strict_modules())
    assert not missing, f"add to the strict [[tool.mypy.overrides]] of pyproject.toml: {missing}"


def test_the_strict_list_names_only_modules_that_exist():
    dirs = package_dirs()
    gone = [
        module
        for module in strict_modules()
        if module not in dirs
        and not (dirs.get(module.rpartition(".")[0], REPO / "?") / f"{module.rpartition('.')[2]}.py").is_file()
    ]
    assert not gone, f"these modules of the strict list no longer exist: {sorted(gone)}"


def test_the_public_packages_are_the_parts_of_the_package_dir():
    assert set(PUBLIC_PACKAGES) <= set(package_dirs())

"""MkDocs hook: the Python API reference, generated from the code at build time.

Two jobs:

1. **Where the source is.** ``pyproject.toml``'s ``package-dir`` maps the top-level folders onto
   one namespace (``fctkit`` -> ``core/``, ``fctkit.trainer`` -> ``trainer/``, ...), which griffe
   (mkdocstrings' static analysis) cannot follow. At each build this hook lays out a view of the
   package made of symlinks, one per source file, in the layout Python sees
   (``tests/support/package_view.py``, as the architecture checks and the type check use it), and
   hands it to mkdocstrings' Python handler as its first search path. It works from a fresh clone, installed or not, editable
   or not.
2. **What is public.** A line ``<!-- api: fctkit.export -->`` in a page becomes that package's
   public API: every name of its ``__all__`` (read by importing the package, so lazily exported
   names count), as a summary table and one mkdocstrings block per name, rendered from the
   module that defines it. A name another part defines and exports is linked there, not
   rendered twice.
"""

from __future__ import annotations

import atexit
import importlib
import inspect
import logging
import re
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Any

from mkdocs.plugins import event_priority

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout, for its tests/support helpers
from tests.support.package_view import build_view
from tests.support.public_api import defining_module

log = logging.getLogger("mkdocs.plugins.fctkit_api")

MARKER = re.compile(r"^<!-- api: (?P<package>fctkit(?:\.\w+)*) -->[ \t]*$", re.MULTILINE)
#: the parts, each with its own page under reference/api/ (the page file name)
PARTS = {
    "fctkit": "core.md",
    "fctkit.trainer": "trainer.md",
    "fctkit.export": "export.md",
    "fctkit.edge_runtime": "edge_runtime.md",
    "fctkit.protos": "protos.md",
    "fctkit.server": "server.md",
}
_VIEWS: list[Path] = []


def _remove_views() -> None:
    while _VIEWS:
        shutil.rmtree(_VIEWS.pop(), ignore_errors=True)


atexit.register(_remove_views)


@event_priority(100)  # before mkdocstrings' on_config, which may create the Python handler already
def on_config(config: Any) -> Any:
    repo = Path(config.config_file_path).resolve().parent
    _remove_views()  # a rebuild under `mkdocs serve` loads the config again: one view at a time
    view = build_view(Path(tempfile.mkdtemp(prefix="fctkit-docs-package-")), ("*.py", "*.pyi"), repo)
    _VIEWS.append(view)
    handlers = config.plugins["mkdocstrings"].config.handlers
    python = handlers.setdefault("python", {})
    python["paths"] = [str(view), *[p for p in python.get("paths", []) if "fctkit-docs-package-" not in str(p)]]
    return config


def on_shutdown() -> None:
    _remove_views()


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if "<!-- api: " not in markdown:
        return markdown
    return MARKER.sub(lambda match: api_markdown(match.group("package"), page.file.src_uri), markdown)


# --- what a package exports and where each name is defined ---------------------------------------


def exported(package: str) -> list[str]:
    return list(importlib.import_module(package).__all__)


def owner(module: str) -> str:
    """The part a module belongs to (the longest part name that prefixes it)."""
    return max((p for p in PARTS if module == p or module.startswith(p + ".")), key=len)


def definition(package: str, name: str) -> tuple[str, str]:
    """(the dotted path of the module that defines ``package.name``, its kind)."""
    obj = getattr(importlib.import_module(package), name)
    module = defining_module(package, name)
    if inspect.ismodule(obj):
        return module, "module"
    if (inspect.isclass(obj) or inspect.isroutine(obj)) and module == getattr(obj, "__module__", None):
        return module, "class" if inspect.isclass(obj) else "function"
    return module, "attribute"


def _summary(obj: Any) -> str:
    doc = inspect.getdoc(obj) if (inspect.isclass(obj) or inspect.isroutine(obj)) else None
    first = (doc or "").strip().split("\n\n")[0].replace("\n", " ")
    first = re.sub(r":[a-z]+:`~?\.?([^`]+)`", r"`\1`", first)
    return first.replace("|", "\\|")


def api_markdown(package: str, src_uri: str) -> str:
    """The summary table and mkdocstrings blocks of ``package``'s public API."""
    if package not in PARTS:
        log.warning("%s: <!-- api: %s --> names no part (%s)", src_uri, package, ", ".join(PARTS))
        return ""
    module_obj = importlib.import_module(package)
    here = Path(src_uri).name
    rows, blocks = [], {"class": [], "function": [], "attribute": [], "module": []}
    for name in exported(package):
        module, kind = definition(package, name)
        path = f"{module}.{name}" if kind != "module" else module
        home = owner(module)
        if home != package and home in PARTS and name in exported(home):
            page = PARTS[home]
            link = f"{page}#{path}" if page != here else f"#{path}"
            rows.append(f"| [`{name}`]({link}) | {kind} | the same object as `{home}.{name}` |")
            continue
        rows.append(f"| [`{name}`](#{path}) | {kind} | {_summary(getattr(module_obj, name))} |")
        blocks[kind].append(f"::: {path}\n    options:\n      heading_level: 3\n")
    titles = {"class": "Classes", "function": "Functions", "attribute": "Constants and types", "module": "Modules"}
    out = [f"Import every name below from `{package}`.", "", "| name | kind | summary |", "|---|---|---|", *rows, ""]
    for kind, title in titles.items():
        if blocks[kind]:
            out += [f"## {title}", "", *blocks[kind]]
    return "\n".join(out)

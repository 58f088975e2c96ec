"""A griffe extension for the API reference: the kit's docstrings name objects with Sphinx roles
(``:class:`Device```, ``:func:`~.tasks.load_task```); Markdown has none, so each becomes inline
code (``Device``, ``load_task``) instead of showing its role."""

from __future__ import annotations

import re
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?:class|func|meth|mod|data|attr|exc|obj|const|ref):`(?P<target>[^`]+)`")


def plain(match: re.Match[str]) -> str:
    target = match.group("target")
    if target.startswith("~"):  # Sphinx's ~ shows the last part only
        target = target[1:].rsplit(".", 1)[-1]
    return f"`{target.lstrip('.')}`"


class RstRoles(griffe.Extension):
    def on_instance(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None:
            obj.docstring.value = ROLE.sub(plain, obj.docstring.value)

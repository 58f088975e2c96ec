"""Checks on the installed environment that must never fail an import, only warn."""

from __future__ import annotations

import warnings
from importlib import metadata

_ONNXRUNTIME_FLAVOURS = ("onnxruntime", "onnxruntime-gpu")


def installed_distributions(names: tuple[str, ...]) -> list[str]:
    found = []
    for name in names:
        try:
            metadata.version(name)
        except metadata.PackageNotFoundError:
            continue
        found.append(name)
    return found


def warn_on_conflicting_onnxruntime() -> None:
    """onnxruntime and onnxruntime-gpu overwrite each other's files: never install both."""
    present = installed_distributions(_ONNXRUNTIME_FLAVOURS)
    if len(present) > 1:
        warnings.warn(
            "both onnxruntime and onnxruntime-gpu are installed; they overwrite each other's "
            "files and the provider you get is unpredictable. Keep one: "
            "`pip uninstall onnxruntime onnxruntime-gpu` then `pip install fctkit[cpu]` or `fctkit[gpu]`.",
            RuntimeWarning,
            stacklevel=2,
        )

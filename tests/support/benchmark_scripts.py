"""Loading a `benchmarks/` script as a module, the way the benchmark tests exercise them."""

from __future__ import annotations

import importlib.util
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@contextmanager
def benchmark_script(file_name: str) -> Iterator[ModuleType]:
    """``benchmarks/<file_name>`` imported as a fresh module, its sibling modules importable as
    when it runs as a script (and registered, since dataclasses look their module up)."""
    name = f"{Path(file_name).stem}_bench"
    sys.path.insert(0, str(BENCHMARKS))
    spec = importlib.util.spec_from_file_location(name, BENCHMARKS / file_name)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(name, None)
        sys.path.remove(str(BENCHMARKS))

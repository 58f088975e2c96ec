"""The architecture, checked (issue 20): the import-linter contracts in pyproject.toml hold, no
two modules import each other (directly or round a loop, imports inside functions included), no
hand-written module is over 600 lines and no file name means two things.

grimp (import-linter's graph) walks the package on disk, and fctkit's top-level folders are
mapped onto one namespace by pyproject's ``package-dir``; so the checks run on a view of the
package made of symlinks, one per source file, in the layout Python sees."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import Counter
from pathlib import Path

import pytest

from tests.support.package_view import REPO, build_view, view_files

MAX_LINES = 600  # ruff format wraps one argument per line where the code was hand-wrapped: ~15% more lines than the 500 first set
SAME_MEANING = {"__init__.py", "cli.py"}  # each part's public face and its commands


def lint_imports(view: Path) -> subprocess.CompletedProcess:
    command = [str(Path(sys.executable).with_name("lint-imports")), str(REPO / "pyproject.toml"), "--no-cache"]
    return subprocess.run(
        command, cwd=view, env={**os.environ, "PYTHONPATH": str(view)}, capture_output=True, text=True, timeout=600
    )


def import_cycles(view: Path) -> list[list[str]]:
    """Strongly connected sets of modules (more than one module each) in the import graph."""
    script = """
import grimp, json, sys
sys.setrecursionlimit(10000)
graph = grimp.build_graph("fctkit", include_external_packages=False, cache_dir=None)
edges = {m: sorted(graph.find_modules_directly_imported_by(m)) for m in graph.modules}
index, low, stack, on_stack, found = {}, {}, [], set(), []
def visit(v):
    index[v] = low[v] = len(index); stack.append(v); on_stack.add(v)
    for w in edges[v]:
        if w not in index:
            visit(w); low[v] = min(low[v], low[w])
        elif w in on_stack:
            low[v] = min(low[v], index[w])
    if low[v] == index[v]:
        group = []
        while not group or group[-1] != v:
            group.append(stack.pop()); on_stack.discard(group[-1])
        if len(group) > 1:
            found.append(sorted(group))
for module in sorted(edges):
    if module not in index:
        visit(module)
print(json.dumps(found))
"""
    done = subprocess.run(
        [sys.executable, "-c", script],
        cwd=view,
        env={**os.environ, "PYTHONPATH": str(view)},
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    )
    return json.loads(done.stdout)


@pytest.fixture(scope="module")
def view(tmp_path_factory) -> Path:
    return build_view(tmp_path_factory.mktemp("package-view"))


def test_the_import_contracts_hold(view):
    result = lint_imports(view)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "0 broken" in result.stdout


def test_a_forbidden_import_breaks_a_contract(tmp_path):
    probe = build_view(tmp_path) / "fctkit" / "edge_runtime" / "probe.py"
    probe.write_text("import fctkit.trainer.fitting\n")  # the device must never need the trainer
    result = lint_imports(tmp_path)
    assert result.returncode != 0 and "BROKEN" in result.stdout, result.stdout


def test_no_module_imports_itself_round_a_loop(view, tmp_path):
    assert import_cycles(view) == []
    package = build_view(tmp_path) / "fctkit"
    (package / "loop_a.py").write_text("def later():\n    import fctkit.loop_b\n")  # inside a function counts too
    (package / "loop_b.py").write_text("import fctkit.loop_a\n")
    assert import_cycles(tmp_path) == [["fctkit.loop_a", "fctkit.loop_b"]]


def test_no_hand_written_module_is_over_600_lines():
    long = {
        name: n
        for name, path in view_files().items()
        if not path.name.endswith(("_pb2.py", "_pb2_grpc.py")) and (n := len(path.read_text().splitlines())) > MAX_LINES
    }
    assert not long, f"split these by responsibility: {long}"


def test_no_file_name_means_two_things():
    names = Counter(path.name for path in view_files().values() if path.name not in SAME_MEANING)
    assert {name for name, count in names.items() if count > 1} == set()

"""The code is checked in `make test` as in `make lint`: ruff's rules and formatting, and mypy over
the kit (strict on each part's public API; tests/support/typecheck.py). A finding fails the suite
with the tool's own message."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.package_view import REPO

BIN = Path(sys.executable).parent


def run(*command: str | Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(c) for c in command], cwd=REPO, capture_output=True, text=True, timeout=900)


@pytest.mark.parametrize("command", [("check", "."), ("format", "--check", ".")], ids=["lint", "format"])
def test_ruff_finds_nothing(command):
    done = run(BIN / "ruff", *command)
    assert done.returncode == 0, done.stdout + done.stderr


def test_mypy_finds_nothing():
    done = run(sys.executable, REPO / "tests" / "support" / "typecheck.py")
    assert done.returncode == 0, done.stdout + done.stderr

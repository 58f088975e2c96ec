"""The files the suite starts first (tests/conftest.py, for two workers to finish together) exist:
a renamed file would silently lose its place."""

from __future__ import annotations

from tests.conftest import LONGEST_FIRST
from tests.support.package_view import REPO


def test_every_file_started_first_exists():
    assert [path for path in LONGEST_FIRST if not (REPO / path).is_file()] == []
    assert len(set(LONGEST_FIRST)) == len(LONGEST_FIRST)

"""The seed the suite trains its models with.

Every test that trains a model and asserts how good it is takes its seed from here, so the
whole suite can be run again under another seed::

    FCTKIT_TEST_SEED=1 make test

(default 0). A verdict that flips with the seed, the thread count or the CPU asserts something
the method does not guarantee: assert what it does, with the margin it really has. Tests of
seeding itself (the same seed gives the same weights) keep their literal seeds.
"""

from __future__ import annotations

import os

try:
    TEST_SEED = int(os.environ.get("FCTKIT_TEST_SEED", "0"))
except ValueError as exc:
    raise SystemExit(f"FCTKIT_TEST_SEED must be an integer, got {os.environ['FCTKIT_TEST_SEED']!r}") from exc


def seed(offset: int = 0) -> int:
    """The suite's seed plus ``offset`` (for a second model in the same test)."""
    return TEST_SEED + offset

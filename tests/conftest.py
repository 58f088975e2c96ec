"""Shared test helpers. Each part keeps its own fixtures in tests/<part>/conftest.py."""

from __future__ import annotations

import os

# One intra-op thread: tests start servers and device subprocesses next to the test process,
# and torch with 2 threads on 2 oversubscribed cores runs many times slower, not faster.
os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("MKL_NUM_THREADS", "1")

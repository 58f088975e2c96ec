"""Shared test helpers. Each part keeps its own fixtures in tests/<part>/conftest.py."""

from __future__ import annotations

import os

# Tests run on 2 cores next to other work: keep torch/BLAS from oversubscribing.
os.environ.setdefault("OMP_NUM_THREADS", "2")
os.environ.setdefault("MKL_NUM_THREADS", "2")

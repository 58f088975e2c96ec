"""Checks on device reports: the ``health`` of an upgrade and the revert from a
withdrawn version (``reverted_from``, ``revert_method``), validated before anything is stored, and
a per-device limit on how often a device may report.

The limit is kept by each replica in memory (a sliding minute per device): a device spread over
``k`` replicas by a load balancer gets at most ``k`` times the limit, which still bounds what one
device can write.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable

from fctkit.errors import RpcStatusError
from fctkit.protos import fleet_pb2

from ..rollout_store import HealthReport
from ..validation import invalid

MAX_UPGRADE_SECONDS = 366 * 86400.0  # an upgrade longer than a year is not a measurement
MAX_COUNT = 1 << 53  # rows beyond any gallery, and the largest integer a double holds exactly
MAX_SAMPLE = 1_000_000
DEFAULT_REPORTS_PER_MINUTE = 120
REVERT_METHODS = ("exact", "backward", "reembedded")


def revert_report(request: fleet_pb2.ReportRequest, withdrawn: Callable[[int], bool]) -> tuple[int, str] | None:
    """The report's revert, checked: (the withdrawn version it went back from, how), or None when
    ``reverted_from`` is 0; INVALID_ARGUMENT when the method is not one of :data:`REVERT_METHODS`,
    or names a version that ``withdrawn`` says is not withdrawn."""
    version, method = request.reverted_from, request.revert_method
    if version == 0:
        if method:
            raise invalid(
                f"revert_method is {method[:40]!r} with reverted_from 0: name the withdrawn version it went back from"
            )
        return None
    if method not in REVERT_METHODS:
        raise invalid(
            f"revert_method is {method[:40]!r}; one of {', '.join(REVERT_METHODS)} with reverted_from {version}"
        )
    if not withdrawn(version):
        raise invalid(
            f"reverted_from is {version}, which is not withdrawn: a device goes back only from a version "
            "its publishers withdrew (ListVersions carries the withdrawals)"
        )
    return version, method


def health_report(request: fleet_pb2.ReportRequest) -> HealthReport | None:
    """The report's ``health``, checked (None when unset); INVALID_ARGUMENT names the first bad field."""
    if not request.HasField("health"):
        return None
    h = request.health
    if h.version == 0:
        raise invalid("health.version is 0: name the version the gallery was upgraded to")
    for name in ("rows_upgraded", "failures"):
        if getattr(h, name) > MAX_COUNT:
            raise invalid(f"health.{name} is {getattr(h, name)}; at most {MAX_COUNT}")
    if not (math.isfinite(h.seconds) and 0.0 <= h.seconds <= MAX_UPGRADE_SECONDS):
        raise invalid(f"health.seconds is {h.seconds}; from 0 to {MAX_UPGRADE_SECONDS:g} (a year)")
    rows = max(h.rows_upgraded, request.gallery_size)  # a resumed upgrade moves fewer rows than it may sample
    if h.sample_size > min(MAX_SAMPLE, rows):
        raise invalid(
            f"health.sample_size is {h.sample_size}; a sample of the gallery's {rows} rows "
            f"(rows_upgraded or gallery_size, whichever is larger; at most {MAX_SAMPLE})"
        )
    ranges = {
        "mean_cosine": (-1.0, 1.0),
        "p10_cosine": (-1.0, 1.0),
        "recall_at_1": (0.0, 1.0),
        "mean_reciprocal_rank": (0.0, 1.0),
    }
    for name, (low, high) in ranges.items():
        value = getattr(h, name)
        if not (math.isfinite(value) and low <= value <= high):
            raise invalid(f"health.{name} is {value}; from {low:g} to {high:g}")
        if h.sample_size == 0 and value != 0.0:
            raise invalid(f"health.{name} is {value} with sample_size 0: without a sample the measures are unset (0)")
    return HealthReport(
        h.version,
        h.rows_upgraded,
        h.failures,
        h.seconds,
        h.sample_size,
        h.mean_cosine,
        h.p10_cosine,
        h.recall_at_1,
        h.mean_reciprocal_rank,
    )


class ReportLimiter:
    """At most ``per_minute`` reports per device in any 60 seconds (on this replica)."""

    def __init__(self, per_minute: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._per_minute = per_minute
        self._clock = clock
        self._recent: dict[str, deque[float]] = {}

    def admit(self, device_id: str) -> None:
        """Count a report of ``device_id``; RESOURCE_EXHAUSTED when it is one too many."""
        now = self._clock()
        recent = self._recent.setdefault(device_id, deque())
        while recent and recent[0] <= now - 60.0:
            recent.popleft()
        if len(recent) >= self._per_minute:
            wait = 60.0 - (now - recent[0])
            raise RpcStatusError(
                "RESOURCE_EXHAUSTED",
                f"this device sent {len(recent)} reports in the last minute; at most "
                f"{self._per_minute}: report again in {wait:.0f} s (a report every few seconds is plenty)",
            )
        recent.append(now)
        if len(self._recent) > 100_000:  # forget devices that went quiet, so the map stays bounded
            self._recent = {d: q for d, q in self._recent.items() if q and q[-1] > now - 60.0}

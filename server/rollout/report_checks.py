"""Checks on device reports: the ``health`` of an upgrade and the revert from a
withdrawn version (``reverted_from``, ``revert_method``), validated before anything is stored, the
versions a report names (:func:`claimed_versions`, each checked against what the device was
offered), and a per-device limit on how often a device may report.

The limit is counted in the database (:meth:`~..storage.Storage.admit_report`): a device spread
over any number of replicas by a load balancer gets the same ``per_minute`` reports through as
one talking to a single replica.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

from fctkit.errors import RpcStatusError
from fctkit.protos import fleet_pb2

from ..rollout_store import HealthReport
from ..storage import Storage
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
    for name in ("rows_upgraded", "failures", "gallery_rows"):
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
    ranked = max(h.gallery_rows, 1)
    if not (math.isfinite(h.median_rank) and (h.median_rank == 0.0 or 1.0 <= h.median_rank <= ranked)):
        raise invalid(
            f"health.median_rank is {h.median_rank}; a rank from 1 to gallery_rows ({h.gallery_rows}), or 0 (not measured)"
        )
    if h.sample_size == 0 and (h.median_rank or h.gallery_rows):
        raise invalid(
            "health.median_rank and gallery_rows are set with sample_size 0: without a sample they are unset (0)"
        )
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
        h.median_rank,
        h.gallery_rows,
    )


def claimed_versions(request: fleet_pb2.ReportRequest) -> dict[str, int]:
    """The versions a report names (field name -> version), those that are not 0."""
    named = {
        "version": request.version,
        "target_version": request.target_version,
        "health.version": request.health.version,
        "reverted_from": request.reverted_from,
    }
    return {name: version for name, version in named.items() if version}


class ReportLimiter:
    """At most ``per_minute`` reports per device in any 60 seconds, on all replicas together
    (counted in ``storage``)."""

    def __init__(self, storage: Storage, per_minute: int, clock: Callable[[], float] = time.time) -> None:
        self._storage = storage
        self._per_minute = per_minute
        self._clock = clock

    def admit(self, device_id: str) -> None:
        """Count a report of ``device_id``; RESOURCE_EXHAUSTED when it is one too many."""
        wait = self._storage.admit_report(device_id, self._clock(), self._per_minute)
        if wait is not None:
            raise RpcStatusError(
                "RESOURCE_EXHAUSTED",
                f"this device sent {self._per_minute} reports in the last minute, the most it may (counted "
                f"over every server replica): report again in {math.ceil(wait)} s (a report every few "
                "seconds is plenty)",
            )

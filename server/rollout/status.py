"""A rollout's status as ``GetRollout`` answers it: per stage, the devices that entered
the rollout in it and what they reported, and the distribution of their health signal.

A device counts for the stage it entered in: stage 0 when it is in the cohort, else the first
percent stage above its :func:`~.offers.bucket`. Of those (enrolled, not revoked): *offered* is
offered the version now (all of them while the rollout is staged or complete; while it is paused,
halted or withdrawn only those that run it or a later version, as nobody new gets it),
*downloaded* got the bundle (reported upgrading, backfilling or failed towards the version, runs it,
or reported a health for it), *upgraded* runs the version or a later one, *failed* reported a
failed upgrade to it, *reverted* reported going back from it after its withdrawal (counted by
method as well) or reported a health for it but runs an earlier version now. The health of the
devices that sampled one is summarised three ways: their mean cosine, their self-retrieval R@1, and
(a release that records its expectation) each one's measure as a fraction of what the release
expects at the device's gallery size (``expected_shortfall``, named before it became a fraction).

A withdrawn version's state is ``withdrawn`` with the withdrawal's reason and ``revert_to``; one
published to every device (no rollout) and withdrawn shows every device as one stage at 100%.
"""

from __future__ import annotations

import json
import statistics
from collections import Counter
from collections.abc import Callable
from typing import Any

from fctkit.protos import fleet_pb2, registry_pb2
from fctkit.protos.health_expectation import HealthExpectation
from fctkit.protos.manifest import Manifest

from ..guard_votes import bucket
from ..rollout_store import COMPLETE, STAGED, DeviceState, HealthReport, Rollout, Stage
from ..withdrawal_store import StoredWithdrawal

_GOT_BUNDLE = (fleet_pb2.UPGRADE_STATE_UPGRADING, fleet_pb2.UPGRADE_STATE_BACKFILLING, fleet_pb2.UPGRADE_STATE_FAILED)


def percentile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of sorted ``values``, interpolated linearly (numpy's default)."""
    position = q * (len(values) - 1)
    low = int(position)
    high = min(low + 1, len(values) - 1)
    return values[low] + (values[high] - values[low]) * (position - low)


def health_summary(signal: list[float]) -> registry_pb2.HealthSummary:
    if not signal:
        return registry_pb2.HealthSummary()
    ordered = sorted(signal)
    return registry_pb2.HealthSummary(
        devices=len(ordered), median=statistics.median(ordered), min=ordered[0], p10=percentile(ordered, 0.1)
    )


def entry_stage(rollout: Rollout, device_id: str) -> int | None:
    """The stage ``device_id`` entered the rollout in (0: the cohort), or None: it is not in."""
    if device_id in rollout.cohort:
        return 0
    where = bucket(device_id, rollout.version)
    return next((i + 1 for i, stage in enumerate(rollout.stages) if where < stage.percent), None)


def _shortfall(expectation: HealthExpectation | None) -> Callable[[HealthReport], float] | None:
    """A device's measure as a fraction of what the release expects at its gallery size (the
    measure of the release's level), or None: the release records no expectation."""
    if expectation is None:
        return None
    measure = expectation.guard_measure

    def shortfall(h: HealthReport) -> float:
        rows = h.gallery_rows or h.rows_upgraded
        return expectation.ratio(measure, float(getattr(h, measure)), rows)

    return shortfall


def _stage(
    number: int,
    percent: float,
    started_at: str,
    devices: list[DeviceState],
    health: dict[str, HealthReport],
    version: int,
    reverts: dict[str, str],
    offering: bool,
    expectation: HealthExpectation | None,
) -> registry_pb2.RolloutStage:
    sampled = [health[d.device_id] for d in devices if d.device_id in health and health[d.device_id].sample_size > 0]
    shortfall = _shortfall(expectation)
    methods = Counter(reverts[d.device_id] for d in devices if d.device_id in reverts)
    return registry_pb2.RolloutStage(
        stage=number,
        percent=percent,
        started_at=started_at,
        offered=len(devices) if offering else sum(d.version >= version for d in devices),
        downloaded=sum(
            d.version >= version
            or d.device_id in health
            or (d.target_version == version and d.upgrade_state in _GOT_BUNDLE)
            for d in devices
        ),
        upgraded=sum(d.version >= version for d in devices),
        failed=sum(d.target_version == version and d.upgrade_state == fleet_pb2.UPGRADE_STATE_FAILED for d in devices),
        reverted=sum(d.device_id in reverts or (d.device_id in health and d.version < version) for d in devices),
        revert_methods=methods,
        health=health_summary([h.mean_cosine for h in sampled]),
        recall_at_1=health_summary([h.recall_at_1 for h in sampled]),
        median_rank=health_summary([h.median_rank for h in sampled if h.median_rank > 0]),
        mean_reciprocal_rank=health_summary([h.mean_reciprocal_rank for h in sampled]),
        expected_shortfall=health_summary([shortfall(h) for h in sampled] if shortfall else []),
    )


def rollout_status(
    version: int,
    rollout: Rollout | None,
    manifest: Manifest,
    devices: list[DeviceState],
    health: dict[str, HealthReport],
    withdrawal: StoredWithdrawal | None = None,
    reverts: dict[str, str] | None = None,
) -> registry_pb2.RolloutStatus:
    """The status of ``version``'s rollout (None: published to every device, no stages), and of its
    withdrawal (``reverts``: how each device reported going back from it)."""
    gate, expectation = manifest.gate, manifest.health_expectation
    gate_cases = json.dumps(gate.get("cases", {}), sort_keys=True)
    expected = "" if expectation is None else json.dumps(expectation.to_json(), sort_keys=True)
    override = str(gate.get("force_reason") or "") if gate.get("forced") else ""
    reverts = reverts or {}
    withdrawn = (
        {}
        if withdrawal is None
        else {"state": "withdrawn", "withdrawn_reason": withdrawal.reason, "revert_to": withdrawal.revert_to}
    )
    if rollout is None and withdrawal is None:
        return registry_pb2.RolloutStatus(
            version=version,
            state="none",
            percent=100.0,
            gate_cases_json=gate_cases,
            gate_override_reason=override,
            health_expectation_json=expected,
        )
    if rollout is None:  # offered to every device at once: they all entered at one stage
        rollout = Rollout(version, 100.0, "complete", (Stage(100.0, ""),))
    by_stage: dict[int, list[DeviceState]] = {}
    for device in devices:
        stage = entry_stage(rollout, device.device_id)
        if stage is not None:
            by_stage.setdefault(stage, []).append(device)
    offering = withdrawal is None and rollout.state in (STAGED, COMPLETE)
    counted = (health, version, reverts, offering, expectation)
    stages = [_stage(0, 0.0, "", by_stage.get(0, []), *counted)] if rollout.cohort else []
    stages += [
        _stage(i + 1, s.percent, s.started_at, by_stage.get(i + 1, []), *counted) for i, s in enumerate(rollout.stages)
    ]
    fields: dict[str, Any] = {"state": rollout.state, **withdrawn}
    return registry_pb2.RolloutStatus(
        version=version,
        percent=rollout.percent,
        cohort_size=len(rollout.cohort),
        halt_below=rollout.halt_below,
        halt_min_devices=rollout.halt_min_devices,
        guard_measure=rollout.guard_measure if rollout.halt_min_devices else "",
        health_expectation_json=expected,
        halt_reason=rollout.halt_reason,
        stages=stages,
        gate_cases_json=gate_cases,
        gate_override_reason=override,
        updated_at=rollout.updated_at,
        **fields,
    )

"""What an admin's rollout request and the guard do to a rollout, checked.

:func:`changed_rollout` applies one ``SetRolloutRequest`` to a version's stored rollout: start or
widen (never narrow), pause, resume, complete, replace the cohort or the guard, all at once or
none (an :class:`~fctkit.errors.RpcStatusError` says why, and nothing is stored).
:func:`guard_verdict` is the guard: the reason to halt a staged rollout whose reporting owners'
median vote (one vote per owner, tallied as reports arrive: :mod:`..guard_votes`) fell below the
guard's bound, or None. :func:`default_guard` is the guard a staged rollout starts with. :func:`check_confirmable` refuses to confirm a version that no device was offered yet.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable

from fctkit.errors import RpcStatusError
from fctkit.protos import registry_pb2
from fctkit.protos.health_expectation import HealthExpectation

from ..guard_votes import GUARD_MEASURES, GuardTally
from ..rollout_store import COMPLETE, HALTED, PAUSED, STAGED, Rollout, Stage
from ..validation import invalid

DEVICE_ID = re.compile(r"dev-[0-9a-f]{16}")
MAX_COHORT = 10_000
MAX_HALT_MIN_DEVICES = 1_000_000
#: the default guard of a staged rollout whose release records its expectation: halt when the median
#: owner's measure falls this far below what the release expects (by level; benchmarks/upgrade_health_signal.py)
DEFAULT_GUARD_MARGIN = {"class": 0.25, "instance": 0.15}
#: ... once this many owners reported (fewer: a sample's noise could halt a good release)
DEFAULT_GUARD_OWNERS = 5
#: ... or when more than this share of the devices that got it (owners' mean) failed to upgrade
DEFAULT_MAX_FAILURE_RATE = 0.25


def check_percent(percent: float) -> float:
    if not (math.isfinite(percent) and 0.0 <= percent <= 100.0):
        raise invalid(f"percent is {percent}; a rollout covers 0 to 100 percent of the devices")
    return percent


def check_cohort(device_ids: list[str]) -> frozenset[str]:
    """The cohort's ids, well-formed (``dev-`` and 16 hex digits) and at most :data:`MAX_COHORT`."""
    if len(device_ids) > MAX_COHORT:
        raise invalid(f"the cohort names {len(device_ids)} devices; at most {MAX_COHORT}")
    malformed = [d for d in device_ids if not DEVICE_ID.fullmatch(d)]
    if malformed:
        raise invalid(
            f"malformed device id {malformed[0][:80]!r} in the cohort ({len(malformed)} in all): device ids "
            "are dev- and 16 hex digits, as `fctkit admin list-devices` shows them"
        )
    return frozenset(device_ids)


def new_rollout(
    version: int, percent: float, now: str, expectation: HealthExpectation | None = None, *, guarded: bool = True
) -> Rollout:
    """The rollout of a version published staged at ``percent``, with :func:`default_guard` unless
    not ``guarded`` (or the release records no ``expectation``)."""
    rollout = Rollout(version, check_percent(percent), STAGED, (Stage(percent, now),), updated_at=now)
    return dataclasses.replace(rollout, **default_guard(expectation)) if guarded else rollout


def default_guard(expectation: HealthExpectation | None) -> dict:
    """The guard a staged rollout starts with: the release's measure against its own expectation
    (:data:`DEFAULT_GUARD_MARGIN` below it, once :data:`DEFAULT_GUARD_OWNERS` owners reported);
    none for a release that records no expectation (exported before fctkit measured one)."""
    if expectation is None:
        return {}
    return {
        "guard_measure": "expected",
        "halt_below": DEFAULT_GUARD_MARGIN[expectation.level],
        "halt_min_devices": DEFAULT_GUARD_OWNERS,
        "max_failure_rate": DEFAULT_MAX_FAILURE_RATE,
    }


def changed_rollout(
    current: Rollout | None,
    request: registry_pb2.SetRolloutRequest,
    now: str,
    expectation: HealthExpectation | None = None,
) -> Rollout:
    """``current`` with ``request`` applied (``current`` None: the version was published to every
    device; ``expectation``: the release's, which an ``expected`` guard needs)."""
    v = request.version
    if current is None:
        raise RpcStatusError(
            "FAILED_PRECONDITION",
            f"version {v} was published to every device (no staged rollout): "
            "it cannot be taken back to a percent; publish the next version with "
            "`fctkit admin publish BUNDLE --percent P` to stage it",
        )
    rollout = current
    if request.HasField("cohort"):
        rollout = dataclasses.replace(rollout, cohort=check_cohort(list(request.cohort.device_ids)))
    if request.HasField("guard") and request.remove_guard:
        raise invalid("remove_guard and guard together: remove the guard, or set a new one")
    if request.HasField("guard"):
        rollout = dataclasses.replace(rollout, **_guard(request.guard, expectation, v))
    if request.remove_guard:
        rollout = dataclasses.replace(
            rollout, halt_below=0.0, halt_min_devices=0, guard_measure="mean_cosine", max_failure_rate=0.0
        )
    if request.HasField("percent"):
        rollout = _widened(rollout, check_percent(request.percent), now)
    rollout = _acted(rollout, request.action, now)
    return dataclasses.replace(rollout, updated_at=now) if rollout != current else current


_BOUNDS = {
    "mean_cosine": (-1.0, 1.0, "a mean cosine"),
    "recall_at_1": (0.0, 1.0, "an R@1"),
    "expected": (0.0, 1.0, "a margin"),
}


def _guard(guard: registry_pb2.RolloutGuard, expectation: HealthExpectation | None, version: int) -> dict:
    measure = guard.measure or "mean_cosine"
    if measure not in GUARD_MEASURES:
        raise invalid(f"guard.measure is {measure[:40]!r}; one of {', '.join(GUARD_MEASURES)}")
    low, high, what = _BOUNDS[measure]
    if not (math.isfinite(guard.halt_below) and low <= guard.halt_below <= high):
        raise invalid(f"halt_below is {guard.halt_below}; with measure {measure}, {what} from {low:g} to {high:g}")
    if not 1 <= guard.halt_min_devices <= MAX_HALT_MIN_DEVICES:
        raise invalid(
            f"halt_min_devices is {guard.halt_min_devices}; from 1 to {MAX_HALT_MIN_DEVICES} reporting devices"
        )
    if not (math.isfinite(guard.max_failure_rate) and 0.0 <= guard.max_failure_rate < 1.0):
        raise invalid(f"max_failure_rate is {guard.max_failure_rate}; a share from 0 (no bound) to below 1")
    if measure == "expected" and expectation is None:
        raise RpcStatusError(
            "FAILED_PRECONDITION",
            f"version {version}'s manifest records no health expectation (exported before fctkit measured one): "
            "guard it with an absolute bound (measure mean_cosine or recall_at_1); nothing changed",
        )
    return {
        "halt_below": guard.halt_below,
        "halt_min_devices": guard.halt_min_devices,
        "guard_measure": measure,
        "max_failure_rate": guard.max_failure_rate,
    }


def _widened(rollout: Rollout, percent: float, now: str) -> Rollout:
    v = rollout.version
    if rollout.state != STAGED:
        hint = "it is offered to every device already" if rollout.state == COMPLETE else "resume it first (--resume)"
        raise RpcStatusError("FAILED_PRECONDITION", f"the rollout of version {v} is {rollout.state}: {hint}")
    if percent < rollout.percent:
        raise RpcStatusError(
            "FAILED_PRECONDITION",
            f"the rollout of version {v} is at {rollout.percent:g}%: narrowing it to "
            f"{percent:g}% would take the version back from devices that may have it; pause it "
            "(--pause) to offer it to nobody new",
        )
    if percent == rollout.percent:
        return rollout
    return dataclasses.replace(rollout, percent=percent, stages=(*rollout.stages, Stage(percent, now)))


def _acted(rollout: Rollout, action: int, now: str) -> Rollout:
    v, state = rollout.version, rollout.state
    if action == registry_pb2.ROLLOUT_ACTION_UNSPECIFIED:
        return rollout
    if action == registry_pb2.ROLLOUT_ACTION_PAUSE:
        if state in (COMPLETE, HALTED):
            raise RpcStatusError(
                "FAILED_PRECONDITION", f"the rollout of version {v} is {state}: there is nothing to pause"
            )
        return dataclasses.replace(rollout, state=PAUSED)
    if action == registry_pb2.ROLLOUT_ACTION_RESUME:
        if state not in (PAUSED, HALTED):
            raise RpcStatusError(
                "FAILED_PRECONDITION",
                f"the rollout of version {v} is {state}, not paused or halted: there is nothing to resume",
            )
        return dataclasses.replace(rollout, state=STAGED, halt_reason="")
    if action == registry_pb2.ROLLOUT_ACTION_COMPLETE:
        last = () if rollout.percent == 100.0 else (Stage(100.0, now),)  # completing is the last stage: everyone
        return dataclasses.replace(
            rollout, state=COMPLETE, percent=100.0, stages=(*rollout.stages, *last), halt_reason=""
        )
    raise invalid(f"action {action} is not one of PAUSE, RESUME, COMPLETE")


def check_resumable(current: Rollout | None, changed: Rollout, tally: Callable[[], GuardTally]) -> None:
    """FAILED_PRECONDITION when ``changed`` resumes a rollout its guard halted, under the same
    guard, while that guard would halt it again at the very next report (``tally``: its votes now)."""
    if current is None or current.state != HALTED or changed.state != STAGED:
        return
    if _guard_of(current) != _guard_of(changed):
        return  # a new guard (or none): its votes are counted again against the new threshold
    reason = guard_verdict(changed, tally(), "the next report")
    if reason is not None:
        raise RpcStatusError(
            "FAILED_PRECONDITION",
            f"version {changed.version}'s guard would halt it again at the next report ({reason}): resume with "
            "--no-guard, or with a new --halt-below and --halt-min-devices, or pause it; nothing changed",
        )


def _guard_of(rollout: Rollout) -> tuple[float, int, str, float]:
    return rollout.halt_below, rollout.halt_min_devices, rollout.guard_measure, rollout.max_failure_rate


def check_confirmable(version: int, rollout: Rollout | None) -> None:
    """FAILED_PRECONDITION unless ``version`` (its rollout: ``rollout``, None when published to
    every device) was offered to some device: complete, widened above 0%, or with a cohort."""
    if rollout is None or rollout.state == COMPLETE or rollout.percent > 0 or rollout.cohort:
        return
    raise RpcStatusError(
        "FAILED_PRECONDITION",
        f"version {version} is offered to no device yet (its rollout is "
        f"{rollout.state} at 0% without a cohort): there is nothing to confirm before devices run it; "
        f"widen it first (`fctkit admin rollout {version} --percent P`), then confirm; nothing changed",
    )


def guard_verdict(rollout: Rollout, tally: GuardTally, device_id: str, *, confirmed: bool = False) -> str | None:
    """Why the guard halts ``rollout`` now (at ``device_id``'s report), or None: no guard, not
    staged or complete (a complete rollout stays watched until the version is ``confirmed``), or
    both bounds hold — the owners' mean failure rate (when bounded, once ``halt_min_devices`` owners
    got the version) and the median of the owners' health votes (once ``halt_min_devices`` owners
    reported a sampled health).

    One vote per owner (the median ``mean_cosine`` of its devices, kept in :mod:`..guard_votes`),
    rather than one per device or a capped weight: an owner's devices act for one party (one owner
    key, one vault), so ten of them are no more independent witnesses than one, and any weight
    above one per owner lets whoever enrols the most devices decide — three devices of one owner
    outvoted two honest owners. The owner's median keeps its own devices from pulling its vote to
    an extreme, and a fleet of one owner still gets its devices' median."""
    watched = rollout.state == STAGED or (rollout.state == COMPLETE and not confirmed)
    if rollout.halt_min_devices == 0 or not watched:
        return None
    bounded = rollout.max_failure_rate > 0 and tally.failure_owners >= rollout.halt_min_devices
    if bounded and tally.failure_rate > rollout.max_failure_rate:
        return (
            f"failure rate {tally.failure_rate:.4f} (the mean over {tally.failure_owners} owners of their devices' share "
            f"of failed upgrades among those that got it) rose above {rollout.max_failure_rate:g} "
            f"(halted at the report of {device_id})"
        )
    if tally.owners < rollout.halt_min_devices or tally.median_below is None:
        return None
    bound = tally.threshold if rollout.guard_measure == "expected" else rollout.halt_below
    return (
        f"median {tally.signal} {tally.median_below:.4f} of {tally.owners} owners' votes ({tally.devices} reporting "
        f"devices, one vote per owner) fell below {bound:g} (halted at the report of {device_id})"
    )

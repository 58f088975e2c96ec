"""What a device remembers about rollback windows and withdrawals, each kept in the
gallery's authenticated settings (HMAC'd like every setting, :mod:`.gallery.settings`):

- ``rollback`` (:class:`RollbackWindow`): after a forward-mode upgrade to a bundle whose window
  (manifest ``rollback_window_days``, :data:`~fctkit.protos.manifest.DEFAULT_ROLLBACK_WINDOW_DAYS`
  when absent) is not 0, until when every row keeps its vectors from before the upgrade; when
  the server lists the version as confirmed (:func:`confirm_rollback`) the vectors go at once and
  the record stays, saying when, until the window's end;
- ``withdrawn`` (:class:`WithdrawalLog`): the versions whose signed withdrawal the device verified
  (never installed again) and the withdrawals it refused at its last sync, for status;
- ``revert`` (:class:`RevertRecord`): the last revert, sent in every Fleet.Report until the next upgrade.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections.abc import Collection, Iterable, Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from fctkit.errors import DeviceError, GalleryError
from fctkit.protos.manifest import Manifest

from .gallery import Gallery

ROLLBACK_KEY, WITHDRAWN_KEY, REVERT_KEY = "rollback", "withdrawn", "revert"
SECONDS_PER_DAY = 86400.0
METHODS = ("exact", "backward", "reembedded")
LISTED_ITEMS = 100  # item ids a revert record lists of the rows it could not move (it counts them all)


@dataclass(frozen=True)
class RollbackWindow:
    """The rows' vectors of ``previous_version`` are kept until ``until`` (epoch seconds) after the upgrade to ``version``."""

    version: int
    previous_version: int
    until: float
    confirmed_at: float | None = None  # the version was confirmed then: the kept vectors were dropped early

    def is_open(self, now: float | None = None) -> bool:
        """Whether the kept vectors are there (the window has not ended, nor been confirmed)."""
        return self.confirmed_at is None and not self.ended(now)

    def ended(self, now: float | None = None) -> bool:
        return (time.time() if now is None else now) >= self.until


@dataclass(frozen=True)
class RevertRecord:
    """A revert from the withdrawn ``reverted_from`` to ``revert_to``. ``method``: the one way its
    rows went (:data:`METHODS`), or the mix with the rows of each ("exact 58, reembedded 6",
    :func:`method_mix`); ``rows_by_method`` the rows moved each way (empty in records written
    before it was kept). ``rows_not_moved``: how many rows were left in the withdrawn version's
    space (no kept vectors and no original to embed again), ``items_not_moved`` the first
    :data:`LISTED_ITEMS` of their item ids."""

    reverted_from: int
    revert_to: int
    method: str
    reason: str
    reverted_at: float
    rows_moved: int
    rows_not_moved: int = 0
    items_not_moved: list[str] = field(default_factory=list)
    note: str = ""
    rows_by_method: dict[str, int] = field(default_factory=dict)

    @property
    def reported_method(self) -> str:
        """The one method a Fleet.Report carries: the least exact way any of its rows went."""
        used = _methods_used(self.rows_by_method)
        return used[-1] if used else self.method


def method_mix(rows_by_method: Mapping[str, int], tried: str) -> str:
    """A revert's ``method``: the one way its rows went, or the mix with the rows of each in
    :data:`METHODS` order ("exact 58, reembedded 6"); ``tried`` when no row moved."""
    used = _methods_used(rows_by_method)
    if len(used) > 1:
        return ", ".join(f"{m} {rows_by_method[m]}" for m in used)
    return used[0] if used else tried


def _methods_used(rows_by_method: Mapping[str, int]) -> list[str]:
    """The methods that moved rows, most exact first."""
    return [m for m in METHODS if rows_by_method.get(m)]


@dataclass
class WithdrawalLog:
    """``versions``: withdrawn version -> {revert_to, reason, withdrawn_at}; ``refused``: why each
    withdrawal offered at the last sync was refused (nothing else was changed by it)."""

    versions: dict[str, dict[str, Any]] = field(default_factory=dict)
    refused: list[str] = field(default_factory=list)

    def withdrawn(self, version: int) -> bool:
        return str(version) in self.versions


def _read(gallery: Gallery, key: str) -> dict[str, Any] | None:
    text = gallery.meta(key)
    if text is None:
        return None
    try:
        return json.loads(text)
    except ValueError as exc:
        raise GalleryError(
            f"the gallery's {key!r} record is not JSON ({exc}): run `fctkit device repair --dir DIR`"
        ) from exc


def rollback_window(gallery: Gallery) -> RollbackWindow | None:
    record = _read(gallery, ROLLBACK_KEY)
    return None if record is None else RollbackWindow(**record)


def rollback_meta(target: Manifest, leaving_version: int, now: float | None = None) -> dict[str, str | None]:
    """The ``rollback`` setting an upgrade to ``target`` from ``leaving_version`` leaves (None: no window)."""
    days = target.rollback_days
    if days <= 0 or leaving_version <= 0:
        return {ROLLBACK_KEY: None}
    until = (time.time() if now is None else now) + days * SECONDS_PER_DAY
    return {ROLLBACK_KEY: json.dumps(asdict(RollbackWindow(target.version, leaving_version, until)), sort_keys=True)}


def expire_rollback(gallery: Gallery, now: float | None = None) -> bool:
    """Drop the kept vectors and the record once the window closed (one transaction); returns whether it did."""
    window = rollback_window(gallery)
    if window is None or not window.ended(now):
        return False
    gallery.drop_rollback({ROLLBACK_KEY: None})
    return True


def confirm_rollback(
    gallery: Gallery, confirmed_versions: Collection[int], now: float | None = None
) -> RollbackWindow | None:
    """When the version the window was kept for is among ``confirmed_versions`` (the server's
    unsigned word: at worst it makes a later revert inexact), drop the kept vectors and mark the
    record confirmed, in one transaction; returns the confirmed window, or None (nothing done)."""
    window = rollback_window(gallery)
    if window is None or not window.is_open(now) or window.version not in confirmed_versions:
        return None
    confirmed = replace(window, confirmed_at=time.time() if now is None else now)
    gallery.drop_rollback({ROLLBACK_KEY: json.dumps(asdict(confirmed), sort_keys=True)})
    return confirmed


def withdrawal_log(gallery: Gallery) -> WithdrawalLog:
    record = _read(gallery, WITHDRAWN_KEY)
    return WithdrawalLog() if record is None else WithdrawalLog(**record)


def log_meta(log: WithdrawalLog) -> dict[str, str | None]:
    return {WITHDRAWN_KEY: json.dumps(asdict(log), sort_keys=True)}


REBUILT = (
    "the withdrawal record was damaged: repair kept this version withdrawn, conservatively, until a sync's signed "
    "withdrawals say again"
)


def rebuilt_withdrawals(gallery: Gallery, installed_above: Collection[int]) -> str:
    """The ``withdrawn`` setting repair writes when it failed authentication: every version it may
    have named, marked ``rebuilt`` (the next sync keeps those its signed withdrawals name, and
    only those): the versions its unauthenticated text still names, the version the last revert
    left (when that record reads), and ``installed_above``, the installed bundles above the query
    version that no upgrade is heading to (a device keeps such a bundle when it reverted from it)."""
    named = set(installed_above)
    with contextlib.suppress(ValueError, TypeError, KeyError):
        named |= {int(v) for v in json.loads(gallery.settings.stored(WITHDRAWN_KEY) or "")["versions"]}
    with contextlib.suppress(GalleryError, TypeError):
        revert = last_revert(gallery)
        named |= set() if revert is None else {revert.reverted_from}
    entry = {"revert_to": None, "reason": REBUILT, "withdrawn_at": None, "rebuilt": True}
    return json.dumps(asdict(WithdrawalLog({str(v): dict(entry) for v in sorted(named) if v > 0})), sort_keys=True)


def not_withdrawn(gallery: Gallery, versions: Iterable[int]) -> list[int]:
    """``versions`` but the withdrawn ones (a withdrawn version's bundle stays installed, never applied)."""
    log = withdrawal_log(gallery)
    return [v for v in versions if not log.withdrawn(v)]


def refuse_withdrawn(gallery: Gallery, version: int) -> None:
    """A version whose withdrawal this device verified is never installed again."""
    log = withdrawal_log(gallery)
    if log.withdrawn(version):
        reason = log.versions[str(version)]["reason"]
        raise DeviceError(
            f"v{version} was withdrawn by its publishers ({reason!r}): it is not installed again; "
            "install a later version"
        )


def last_revert(gallery: Gallery) -> RevertRecord | None:
    record = _read(gallery, REVERT_KEY)
    return None if record is None else RevertRecord(**record)


def revert_meta(record: RevertRecord | None) -> dict[str, str | None]:
    return {REVERT_KEY: None if record is None else json.dumps(asdict(record), sort_keys=True)}


def revert_report_fields(gallery: Gallery) -> dict[str, Any]:
    """``reverted_from`` and ``revert_method`` for every Fleet.Report until the next upgrade (a mix
    reports its least exact method: the server counts each device once, by one of :data:`METHODS`)."""
    record = last_revert(gallery)
    return {} if record is None else {"reverted_from": record.reverted_from, "revert_method": record.reported_method}


def _state(window: RollbackWindow, now: float | None) -> str:
    return "confirmed" if window.confirmed_at is not None else "open" if window.is_open(now) else "ended"


def withdrawal_status(gallery: Gallery, now: float | None = None) -> dict[str, Any]:
    """What ``fctkit device status`` shows: the rollback window, the withdrawn versions, the
    refused withdrawals and the last revert (versions, reason, method, when, rows not moved)."""
    window, log, revert = rollback_window(gallery), withdrawal_log(gallery), last_revert(gallery)
    return {
        "rollback_window": None
        if window is None
        else {
            **asdict(window),
            "open": window.is_open(now),
            "state": _state(window, now),
            "rows_kept": gallery.extras.count("rollback_embedding"),
        },
        "withdrawn_versions": {f"v{v}": entry for v, entry in sorted(log.versions.items(), key=lambda e: int(e[0]))},
        "withdrawals_refused": log.refused,
        "last_revert": None if revert is None else asdict(revert),
    }

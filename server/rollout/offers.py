"""Which versions each device is offered under staged rollouts.

A device is *in* the rollout of version V when its id is in V's cohort or when
:func:`bucket` (SHA-256 of the version and the device id, mapped to [0, 100)) is below the
rollout's percent: widening keeps every device that was in. V is *offered* to a device when V has
no rollout, when the rollout is complete, when the device already runs V or later, or when the
rollout is staged and the device is in it (a paused or halted rollout offers V to nobody new). A
device is offered the versions before the first one not offered to it: a later version never lets
it skip one it was not offered.

:class:`Rollouts` keeps every rollout in memory, reloaded when another replica announces a change
(``rollout:V``) and whenever a version newer than the ones it read is published (a publish stores
its rollout in the same transaction, so a catalog that shows V never meets V without its rollout).

A withdrawn version (:class:`~.withdrawals.Withdrawals`, kept here as ``Rollouts.withdrawals``) is
offered to no device and holds none back: a device is offered the versions after it as if it
had never been published (their own rollouts apply).

What a device runs counts only as the server recorded it: a version a device claims (in a
Report, or as the ``from_version`` of a PlanUpgrade) is taken only when :meth:`Rollouts.was_offered`
says the server offered it to that device at some time (:meth:`Rollouts.check_claim` refuses the
others with PERMISSION_DENIED and logs them), so a claim never widens what the device is offered.

The confirmed versions (an admin said "it is good": devices on them drop the vectors kept for a
revert) are kept here too, reloaded with the rollouts (a confirmation is announced as ``rollout:V``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable

from fctkit.errors import RpcStatusError

from ..guard_votes import bucket
from ..jsonlog import log_event
from ..rollout_store import COMPLETE, STAGED, Rollout
from ..storage import Storage
from .withdrawals import Withdrawals


def in_rollout(rollout: Rollout, device_id: str) -> bool:
    return device_id in rollout.cohort or bucket(device_id, rollout.version) < rollout.percent


def offered(rollout: Rollout, device_id: str, device_version: int) -> bool:
    """Whether the rollout's version is offered to the device (which runs ``device_version``)."""
    if rollout.state == COMPLETE or device_version >= rollout.version:
        return True
    return rollout.state == STAGED and in_rollout(rollout, device_id)


class Rollouts:
    """Every rollout, in memory; ``on_change`` runs after each change (watchers wake up)."""

    def __init__(self, storage: Storage, on_change: Callable[[], None] = lambda: None) -> None:
        self._storage = storage
        self._on_change = on_change
        self._by_version: dict[int, Rollout] = {}
        self._read_through = 0
        self._confirmed: dict[int, str] = {}
        self.withdrawals = Withdrawals(storage, on_change)
        self.reload()

    def reload(self) -> None:
        """Read every rollout again (another replica changed one); watchers wake up only when something changed."""
        self._read_through = self._storage.latest_version()  # first: a version at most this one has its rollout stored
        by_version, confirmed = self._storage.rollouts(), self._storage.confirmations()
        changed = (by_version, confirmed) != (self._by_version, self._confirmed)
        self._by_version, self._confirmed = by_version, confirmed
        if changed:
            self._on_change()

    def get(self, version: int) -> Rollout | None:
        return self._by_version.get(version)

    def change(self, version: int, change: Callable[[Rollout | None], Rollout | None]) -> Rollout | None:
        """Apply ``change`` to the stored rollout (see :meth:`RolloutStore.change`) and take the result in."""
        changed = self._storage.change_rollout(version, change)
        self._put(version, changed)
        return changed

    def confirm(self, version: int, now: str, check: Callable[[Rollout | None], None]) -> str:
        """Store ``version`` as confirmed (see :meth:`RolloutStore.confirm`); returns when it was confirmed."""
        confirmed_at = self._storage.confirm_version(version, now, check)
        self._confirmed[version] = confirmed_at
        return confirmed_at

    def is_confirmed(self, version: int) -> bool:
        return version in self._confirmed

    def failure_watched(self, device_id: str) -> list[int]:
        """The versions whose guard bounds the failure rate, still watched (staged, or complete and
        not confirmed), whose rollout ``device_id`` is in: its reports move their failure votes."""
        return [
            v
            for v, r in self._by_version.items()
            if r.max_failure_rate > 0
            and r.halt_min_devices > 0
            and (r.state == STAGED or (r.state == COMPLETE and v not in self._confirmed))
            and in_rollout(r, device_id)
        ]

    def confirmed_versions(self) -> list[int]:
        """The confirmed versions that are not withdrawn (a withdrawal overrides a confirmation: a
        device on the version keeps its vectors to revert exactly), increasing."""
        withdrawn = self.withdrawals.versions
        return [v for v in sorted(self._confirmed) if v not in withdrawn]

    def published(self, rollout: Rollout) -> None:
        """A version was just published here with ``rollout``."""
        self._put(rollout.version, rollout)

    def _put(self, version: int, rollout: Rollout | None) -> None:
        if rollout is not None and rollout != self._by_version.get(version):
            self._by_version[version] = rollout
            self._on_change()

    def cap(self, device_id: str, latest: int, claimed_version: int = 0) -> int | None:
        """The first version not offered to ``device_id`` (it is offered the versions before it);
        None: every version. ``latest``: the newest version the caller lists;
        ``claimed_version``: a version the device says it runs, already checked by :meth:`check_claim`
        (its report may lag)."""
        self._read_up_to(latest)
        withdrawn = self.withdrawals.versions
        held = sorted(
            v for v, r in self._by_version.items() if r.state != COMPLETE and v <= latest and v not in withdrawn
        )
        if not held:
            return None
        device_version = max(self._storage.device_version(device_id), claimed_version)
        return next((v for v in held if not offered(self._by_version[v], device_id, device_version)), None)

    def was_offered(self, device_id: str, version: int, reached: int) -> bool:
        """Whether ``version`` was offered to ``device_id`` at some time, by the server's own records.
        ``reached``: the highest version the device's accepted reports ran or set out for (offered to
        it when they were accepted). A rollout at or below ``version`` held it back unless the device
        is in the rollout's stages (the cohort, or a bucket below its percent: it was offered the
        version when its stage started, whatever the rollout's state now) or reached its version;
        a withdrawn version below ``version`` holds nothing back, and a withdrawn ``version`` itself
        counts as reached only when the device runs or targets it."""
        self._read_up_to(version)
        withdrawn = self.withdrawals.versions

        def let_through(rollout: Rollout) -> bool:
            v = rollout.version
            return in_rollout(rollout, device_id) or v == reached or (v < reached and v not in withdrawn)

        return all(
            let_through(r)
            for v, r in self._by_version.items()
            if r.state != COMPLETE and v <= version and (v == version or v not in withdrawn)
        )

    def check_claim(self, device_id: str, version: int, field: str) -> None:
        """PERMISSION_DENIED (and a ``version claim refused`` log line) when the device claims, in
        ``field``, a ``version`` the server never offered to it (:meth:`was_offered`; read again from
        storage first, in case another replica changed a rollout or withdrew a version a moment ago)."""
        reached = self._storage.device_reach(device_id)
        if self.was_offered(device_id, version, reached):
            return
        self.reload()
        self.withdrawals.reload()
        if self.was_offered(device_id, version, reached):
            return
        log_event("version claim refused", logging.WARNING, device_id=device_id, field=field, version=version)
        raise RpcStatusError(
            "PERMISSION_DENIED",
            f"{field} is {version}, a version this server never offered to this device (a staged rollout "
            "it is not in holds it back): a device reports and plans only from versions it was offered; "
            "nothing was recorded",
        )

    def _read_up_to(self, version: int) -> None:
        """Read the rollouts again when ``version`` is newer than what this replica read (its rollout, if
        any, was stored with it)."""
        if version > self._read_through:
            self.reload()

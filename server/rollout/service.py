"""The Registry's rollout RPCs (admin only): ``SetRollout`` changes a version's staged
rollout (never a withdrawn version's), ``GetRollout`` reports it (with its withdrawal and its
confirmation, if any), ``ConfirmVersion`` confirms a version offered to devices and not withdrawn.
Mixed into :class:`~..registry.RegistryService`, whose catalog, storage and
:class:`~.offers.Rollouts` they use. The status each answers with counts every device in the
rollout: it is read off the event loop (:class:`~..status_reads.StatusReads`)."""

from __future__ import annotations

from typing import Any

from fctkit.errors import RpcStatusError
from fctkit.protos import registry_pb2

from ..rollout_store import COMPLETE, DeviceState, Rollout
from ..status_reads import StatusReads
from ..storage import Storage
from ..validation import timestamp, version_field
from .changes import changed_rollout, check_cohort, check_confirmable, check_resumable
from .offers import Rollouts
from .status import rollout_status


class RolloutRpcs:
    """``SetRollout`` and ``GetRollout`` over the service's ``_catalog``, ``_storage`` and ``_rollouts``."""

    _catalog: Any  # the registry's Catalog
    _storage: Storage
    _rollouts: Rollouts
    _status_reads: StatusReads

    async def SetRollout(self, request: registry_pb2.SetRolloutRequest, context) -> registry_pb2.RolloutStatus:
        version = self._catalog.get(version_field(request.version, "version")).version
        if self._rollouts.withdrawals.withdrawn(version):
            raise RpcStatusError(
                "FAILED_PRECONDITION",
                f"version {version} was withdrawn: its rollout can no longer "
                "change; publish a fixed release as the next version",
            )
        if request.HasField("cohort"):
            cohort = check_cohort(list(request.cohort.device_ids))
            unknown = sorted(cohort - self._storage.enrolled_devices(sorted(cohort)))
            if unknown:
                raise RpcStatusError(
                    "NOT_FOUND",
                    f"the cohort names {len(unknown)} device(s) not enrolled or revoked, e.g. "
                    f"{unknown[0]!r}: see `fctkit admin list-devices`; nothing changed",
                )
        now = timestamp()

        def change(current: Rollout | None) -> Rollout:
            changed = changed_rollout(current, request, now, self._catalog.get(version).manifest.health_expectation)
            check_resumable(current, changed, lambda: self._storage.guard_tally(version))
            return changed

        self._rollouts.change(version, change)
        return await self.counted_status(version)

    async def ConfirmVersion(self, request: registry_pb2.ConfirmVersionRequest, context) -> registry_pb2.RolloutStatus:
        version = self._catalog.get(version_field(request.version, "version")).version
        if self._rollouts.withdrawals.withdrawn(version):
            raise RpcStatusError(
                "FAILED_PRECONDITION",
                f"version {version} was withdrawn: it cannot be confirmed; "
                "its devices go back to the version its withdrawal names; nothing changed",
            )
        self._rollouts.confirm(version, timestamp(), lambda rollout: check_confirmable(version, rollout))
        return await self.counted_status(version)

    async def GetRollout(self, request: registry_pb2.GetRolloutRequest, context) -> registry_pb2.RolloutStatus:
        return await self.counted_status(self._catalog.get(version_field(request.version, "version")).version)

    async def counted_status(self, version: int) -> registry_pb2.RolloutStatus:
        """``version``'s rollout status, counted off the event loop."""
        return await self._status_reads.run(lambda storage: self.status_of(storage, version))

    def rollout_statuses(self, storage: Storage) -> list[registry_pb2.RolloutStatus]:
        """The status of every rollout still under way (what the metrics' rollout gauges show): a
        complete rollout whose version was confirmed drops out, so a scrape does not count the
        fleet once more for every release that ever had a rollout."""
        rollouts, confirmed = storage.rollouts(), storage.confirmations()
        under_way = {
            v: r
            for v, r in sorted(rollouts.items())
            if v <= self._catalog.latest and not (r.state == COMPLETE and v in confirmed)
        }
        devices = storage.rollout_devices() if under_way else []
        return [self.status_of(storage, v, r, devices) for v, r in under_way.items()]

    def status_of(
        self, storage: Storage, version: int, rollout: Rollout | None = None, devices: list[DeviceState] | None = None
    ) -> registry_pb2.RolloutStatus:
        """``version``'s rollout status read from ``storage`` (on the status reads' worker)."""
        rollout = rollout or storage.rollouts().get(version)
        withdrawal = storage.withdrawals().get(version)
        status = rollout_status(
            version,
            rollout,
            self._catalog.get(version).manifest,
            storage.rollout_devices() if devices is None else devices,
            storage.health_reports(version),
            withdrawal,
            storage.device_reverts(version) if withdrawal else {},
        )
        status.confirmed_at = storage.confirmations().get(version, "")
        if rollout is not None and rollout.max_failure_rate > 0:
            failures = storage.failure_tally(version)
            status.max_failure_rate = rollout.max_failure_rate
            status.failure_rate, status.failure_owners = failures.rate, failures.owners
        return status

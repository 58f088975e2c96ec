"""The admin's rollout calls of :class:`~fctkit.protos.client.FctkitClient`: change a
version's staged rollout, read its status, confirm a version, withdraw a release. A mixin: the client supplies
``_unary`` and the Registry stub."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

from . import registry_pb2

ROLLOUT_ACTIONS = {
    "pause": registry_pb2.ROLLOUT_ACTION_PAUSE,
    "resume": registry_pb2.ROLLOUT_ACTION_RESUME,
    "complete": registry_pb2.ROLLOUT_ACTION_COMPLETE,
}


class RolloutCalls:
    """``set_rollout``, ``rollout_status``, ``confirm_version`` and ``withdraw`` (admin token)."""

    registry: Any
    _unary: Callable[..., Any]

    def set_rollout(
        self,
        version: int,
        *,
        percent: float | None = None,
        action: str | None = None,
        cohort: Sequence[str] | None = None,
        halt_below: float | None = None,
        halt_min_devices: int = 0,
        remove_guard: bool = False,
        guard_measure: str = "",
        max_failure_rate: float = 0.0,
    ) -> registry_pb2.RolloutStatus:
        """Admin: widen (``percent``), ``action`` (pause, resume or complete), replace the cohort
        (``cohort``: device ids) or the guard (``halt_below`` with ``halt_min_devices`` and
        ``guard_measure``, see ``RolloutGuard``; or ``remove_guard``) of ``version``'s rollout, all
        at once or nothing; returns its status."""
        request = registry_pb2.SetRolloutRequest(
            version=version,
            percent=percent,
            action=ROLLOUT_ACTIONS[action] if action else registry_pb2.ROLLOUT_ACTION_UNSPECIFIED,
            remove_guard=remove_guard,
        )
        if cohort is not None:
            request.cohort.device_ids.extend(cohort)
            request.cohort.SetInParent()
        if halt_below is not None:
            request.guard.CopyFrom(
                registry_pb2.RolloutGuard(
                    halt_below=halt_below,
                    halt_min_devices=halt_min_devices,
                    measure=guard_measure,
                    max_failure_rate=max_failure_rate,
                )
            )
        return self._unary(self.registry.SetRollout, request, retry=False)

    def rollout_status(self, version: int) -> registry_pb2.RolloutStatus:
        """Admin: ``version``'s rollout: state, stages and what the devices reported per stage."""
        return self._unary(self.registry.GetRollout, registry_pb2.GetRolloutRequest(version=version))

    def confirm_version(self, version: int) -> registry_pb2.RolloutStatus:
        """Admin: confirm ``version`` (devices running it drop the vectors kept for a revert); returns its status."""
        return self._unary(self.registry.ConfirmVersion, registry_pb2.ConfirmVersionRequest(version=version))

    def withdraw(self, withdrawal: bytes) -> registry_pb2.WithdrawResponse:
        """Admin: publish a signed ``withdrawal.<V>.json`` (`fctkit keys withdraw`): V is offered to
        no device from now on, and devices that installed it go back to its ``revert_to``."""
        return self._unary(self.registry.Withdraw, registry_pb2.WithdrawRequest(withdrawal=withdrawal), retry=False)

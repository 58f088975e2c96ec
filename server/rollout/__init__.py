"""Staged rollouts and signed withdrawals on the server.

Which versions a device is offered (:mod:`.offers`, over the withdrawn versions of
:mod:`.withdrawals`), the admin's rollout and withdrawal RPCs (:mod:`.service`,
:mod:`.withdraw_service`) with the changes and status they apply and answer (:mod:`.changes`,
:mod:`.status`), the checks on devices' health and revert reports (:mod:`.report_checks`), and the
``fctkit admin rollout …`` / ``withdraw`` commands (:mod:`.cli`, a client of those RPCs). The rows
they keep are in the storage layer (``rollout_store``, ``withdrawal_store``).
"""

from ..guard_votes import bucket
from .offers import Rollouts, in_rollout
from .withdrawals import Withdrawals

__all__ = ["Rollouts", "Withdrawals", "bucket", "in_rollout"]

"""The Registry's ``Withdraw`` RPC (admin only): publish a signed ``withdrawal.<V>.json``.

The document is parsed size-limited and verified exactly as a device will verify it: under the
publisher threshold of the latest root, or under the ``--publisher-key`` of a server started
without a root. The server cannot withdraw anything on its own: it only stores and hands out
what the publishers signed. The version must be published, its ``revert_to`` 0 or a published
version below it and not withdrawn itself; the same bytes again change nothing, another
withdrawal of a withdrawn version is ALREADY_EXISTS. Mixed into :class:`~..registry.RegistryService`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from fctkit.errors import BundleError, RpcStatusError, TrustError
from fctkit.protos import registry_pb2
from fctkit.protos.trust import Signed, Withdrawal, parse_withdrawal, verify_withdrawal

from ..jsonlog import log_event
from ..root_of_trust import ReleaseRules
from ..validation import invalid, timestamp
from ..withdrawal_store import StoredWithdrawal
from .offers import Rollouts


def checked_withdrawal(data: bytes, rules: ReleaseRules) -> Signed[Withdrawal]:
    """``data`` parsed (size-limited: at most 16 KiB) and verified under ``rules``; INVALID_ARGUMENT says why not."""
    try:
        return verify_withdrawal(rules.release_trust(), parse_withdrawal(data, "withdrawal"))
    except (BundleError, TrustError) as exc:
        raise invalid(
            f"withdrawal refused: {exc}; it must carry the signatures of the publishers "
            f"({rules.description}): co-sign it with `fctkit keys sign withdrawal.V.json --key KEY`"
        ) from exc


class WithdrawRpcs:
    """``Withdraw`` over the service's ``_catalog``, ``_rules``, ``_rollouts`` and ``_catch_up``."""

    _catalog: Any  # the registry's Catalog
    _rules: ReleaseRules
    _rollouts: Rollouts
    _catch_up: Callable[[], None]  # takes in releases published on other replicas

    async def Withdraw(self, request: registry_pb2.WithdrawRequest, context) -> registry_pb2.WithdrawResponse:
        signed = checked_withdrawal(request.withdrawal, self._rules)
        body = signed.body
        self._catch_up()
        self._catalog.get(body.version)  # NOT_FOUND unless published
        if body.revert_to:
            try:
                self._catalog.get(body.revert_to)
            except RpcStatusError:
                raise invalid(
                    f"the withdrawal of v{body.version} reverts to v{body.revert_to}, which is not published: "
                    "devices could not go back to it; write one that reverts to a published version"
                ) from None
        stored = StoredWithdrawal(body.version, body.revert_to, body.reason, bytes(request.withdrawal), timestamp())
        if self._rollouts.withdrawals.add(stored):
            log_event(
                "version withdrawn", logging.WARNING, version=body.version, revert_to=body.revert_to, reason=body.reason
            )
        return registry_pb2.WithdrawResponse(version=body.version, revert_to=body.revert_to)

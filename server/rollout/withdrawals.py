"""The withdrawn releases this replica knows of: kept in memory, reloaded when another
replica announces one (``withdrawal:V``) and, for a version not known here yet, read again from
storage before a caller relies on its absence. A withdrawn version is offered to no device; every
ListVersions page carries :meth:`Withdrawals.documents`.
"""

from __future__ import annotations

from collections.abc import Callable

from fctkit.errors import RpcStatusError

from ..storage import Storage
from ..validation import invalid
from ..withdrawal_store import StoredWithdrawal


class Withdrawals:
    """Every published withdrawal, in memory; ``on_change`` runs after a change (watchers wake up)."""

    def __init__(self, storage: Storage, on_change: Callable[[], None] = lambda: None) -> None:
        self._storage = storage
        self._on_change = on_change
        self._by_version: dict[int, StoredWithdrawal] = {}
        self.reload()

    def reload(self) -> None:
        """Read every withdrawal again (another replica stored one)."""
        found = self._storage.withdrawals()
        if found != self._by_version:
            self._by_version = found
            self._on_change()

    @property
    def versions(self) -> frozenset[int]:
        return frozenset(self._by_version)

    def get(self, version: int) -> StoredWithdrawal | None:
        return self._by_version.get(version)

    def documents(self) -> list[bytes]:
        """Every signed withdrawal as published, by increasing version."""
        return [self._by_version[v].document for v in sorted(self._by_version)]

    def withdrawn(self, version: int) -> bool:
        """Whether ``version`` is withdrawn, reading storage again when this replica does not know it yet."""
        if version not in self._by_version:
            self.reload()
        return version in self._by_version

    def add(self, withdrawal: StoredWithdrawal) -> bool:
        """Store ``withdrawal``: True when added, False when these very bytes were stored already.
        ALREADY_EXISTS for another withdrawal of its version, INVALID_ARGUMENT when its
        ``revert_to`` is withdrawn; nothing is stored then."""
        outcome = self._storage.add_withdrawal(withdrawal)
        self.reload()
        v = withdrawal.version
        if outcome.added:
            return True
        if outcome.stored is None:
            raise invalid(
                f"the withdrawal of v{v} reverts to v{withdrawal.revert_to}, which is withdrawn itself: "
                f"write one that reverts to a version still on offer (`fctkit keys withdraw {v} --revert-to V`)"
            )
        if outcome.stored.document == withdrawal.document:
            return False
        raise RpcStatusError(
            "ALREADY_EXISTS",
            f"version {v} was withdrawn already (at {outcome.stored.stored_at}, reverting "
            f"to v{outcome.stored.revert_to}: {outcome.stored.reason!r}); a withdrawal cannot be replaced",
        )

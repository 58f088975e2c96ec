"""Reads whose cost grows with the fleet, off the event loop.

A rollout's status counts every device in the rollout (``GetRollout``, the status ``SetRollout``,
``ConfirmVersion`` and ``WithdrawVersion`` answer with, the metrics' rollout gauges): hundreds of
milliseconds at 100,000 devices, seconds at a million. Run on the event loop, such a read stalls
every other call of the replica for as long as it takes. :class:`StatusReads` runs them on one
worker thread of their own, on a read connection of their own (:meth:`Storage.reader`), so
per-device calls go on while a status is counted:

- at most :data:`MAX_WAITING` reads wait or run at once; one more is refused with
  RESOURCE_EXHAUSTED (backpressure: an admin tool polling in a loop cannot queue up unbounded work);
- a read that takes longer than :data:`TIMEOUT_S` answers DEADLINE_EXCEEDED (the read itself runs to
  its end on the worker; it only reads).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from fctkit.errors import RpcStatusError

from .storage import Storage

T = TypeVar("T")

MAX_WAITING = 8
TIMEOUT_S = 60.0


class StatusReads:
    """``await reads.run(read)``: ``read(storage)`` on the worker thread, with its read connection."""

    def __init__(self, storage: Storage) -> None:
        self._storage = storage
        self._reader: Storage | None = None
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fctkit-status-reads")
        self._waiting = 0

    def _on_worker(self, read: Callable[[Storage], T]) -> T:
        if self._reader is None:  # opened on the worker: the only thread that ever uses it
            self._reader = self._storage.reader()
        return read(self._reader)

    async def run(self, read: Callable[[Storage], T]) -> T:
        """``read``'s result; RESOURCE_EXHAUSTED when :data:`MAX_WAITING` reads are already under
        way, DEADLINE_EXCEEDED after :data:`TIMEOUT_S` seconds."""
        if self._waiting >= MAX_WAITING:
            raise RpcStatusError(
                "RESOURCE_EXHAUSTED",
                f"{MAX_WAITING} rollout status reads are under way on this server already: "
                "ask again in a few seconds (each counts every device in the rollout)",
            )
        self._waiting += 1
        try:
            future = asyncio.get_running_loop().run_in_executor(self._worker, self._on_worker, read)
            return await asyncio.wait_for(future, TIMEOUT_S)
        except TimeoutError:
            raise RpcStatusError(
                "DEADLINE_EXCEEDED",
                f"the rollout status took longer than {TIMEOUT_S:g} s to count on this server; "
                "ask again later (the fleet's metadata database is slow or very large)",
            ) from None
        finally:
            self._waiting -= 1

    def call(self, read: Callable[[Storage], T], timeout_s: float) -> T:
        """``read``'s result from a thread other than the event loop's (the metrics' render);
        TimeoutError after ``timeout_s``."""
        return self._worker.submit(self._on_worker, read).result(timeout=timeout_s)

    def close(self) -> None:
        """Stop the worker once the reads under way end, then close the read connection."""
        self._worker.submit(self._close_reader)
        self._worker.shutdown(wait=False)

    def _close_reader(self) -> None:
        if self._reader is not None and self._reader is not self._storage:
            self._reader.close()
        self._reader = None
